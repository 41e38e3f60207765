"""Host mappings viewed by DLPack tensors (host_mappings.py): freeing a view while another thread makes or frees
DLPack tensors never hangs, and a mapping is unmapped (its callback run) only once nothing views it.

The hang is paddle's: a DLPack deleter runs under paddle's deleter mutex, and if it lets the GIL go (CPython
unmapping an ``mmap``; any Python code), a thread taking the GIL then blocks on that mutex for good. Each case
runs in its own process, bounded in time: a hang fails it instead of the session. The loops below hung within a
second with the training's blocks and the memory tier's slots as they were before host_mappings.py (2026-12-05).
"""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap

import numpy as np
import paddle
import pytest

VIEWER = """
import threading, numpy as np, paddle
stop = False
def viewer():  # makes and frees DLPack tensors: paddle's deleter mutex, taken with the GIL held
    a = np.zeros(16, np.uint8)
    while not stop:
        paddle.utils.dlpack.from_dlpack(a)
t = threading.Thread(target=viewer, daemon=True)
t.start()
"""

CASES = {
    # training's transient blocks, freed with their last tensor (buffer_memory.new_block)
    "blocks": """
from paddle.distributed.fsdp.devices.buffer_memory import GRADIENT, BlockLedger, new_block
ledger = BlockLedger()
for i in range(3000):
    block = new_block(1 << 18, paddle.float32, GRADIENT, ledger, mapped=True)
    view = block._slice(5, 9)
    del block
    del view
assert ledger.live[GRADIENT] == 0, ledger.live
""",
    # a memory-tier copy closed while tensors view it (the persist thread's views), then the views freed
    "slot": """
import os, tempfile
from paddle.distributed.fsdp.memtier.persist import tensor_view
from paddle.distributed.fsdp.memtier.slot import Slot
d = tempfile.mkdtemp(dir=os.environ.get("TMPDIR"))
for i in range(1500):
    slot = Slot.allocate(os.path.join(d, "copy"), 4096, 1 << 16)
    views = [tensor_view(slot.buf[4096 * k : 4096 * (k + 1)], "float32", [1024]) for k in range(4)]
    slot.close()
    del slot
    views.clear()
""",
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_freeing_views_while_another_thread_makes_dlpack_tensors_never_hangs(case, tmp_path):
    script = VIEWER + textwrap.dedent(CASES[case]) + "\nstop = True\nt.join()\nprint('done')\n"
    try:
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180,
                             env={**__import__("os").environ, "TMPDIR": str(tmp_path)})  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail(f"{case}: hung (a DLPack deleter let the GIL go under paddle's deleter mutex)")
    assert out.returncode == 0 and out.stdout.strip().endswith("done"), out.stderr[-3000:]


def test_a_mapping_is_unmapped_once_nothing_views_it():
    from paddle.distributed.fsdp.devices import host_mappings

    host_mappings.release_unviewed()
    unmapped = []
    array = host_mappings.anonymous_array(1 << 16, on_unmap=lambda: unmapped.append(1))
    assert array.dtype == np.uint8 and len(array) == 1 << 16 and not array.any()  # fresh pages read zero
    tensor = paddle.utils.dlpack.from_dlpack(array.view(np.float32))
    array[:4] = np.frombuffer(np.float32(2.5).tobytes(), np.uint8)
    assert float(tensor[0]) == 2.5  # a view, not a copy
    del array
    gc.collect()
    assert host_mappings.release_unviewed() >= 1 and unmapped == []  # the tensor still views it
    del tensor
    gc.collect()
    assert unmapped == []  # freeing the view unmaps nothing by itself (that could be inside paddle's deleter)
    host_mappings.release_unviewed()
    assert unmapped == [1]
    host_mappings.release_unviewed()
    assert unmapped == [1]  # once

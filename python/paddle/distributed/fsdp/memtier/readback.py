"""Reading a memory copy into the model's tensors in ONE pass, its checksums verified on the way.

Why one pass: a restore from memory is bound by memory bandwidth. Hashing the whole copy and then copying it
into the tensors reads every byte from DRAM twice. Here each piece (``PIECE_BYTES``, L2-sized) is copied into
its tensor and hashed *there*, while it is still in the CPU cache; every chunk digest is compared when the
chunk's last piece has landed. So what is verified is what the tensors hold.

The tensors are written before it is known whether the copy is intact (a mismatch is found at the end of a
chunk, after its bytes were copied): restore.py therefore exchanges every rank's verdict after the read and,
when any rank's copy failed, routes every rank to another source (a peer copy, an older step, storage), which
overwrites every tensor, or raises a named error on every rank. Non-tensor state is applied only after a
verdict of "every rank intact".
"""

from __future__ import annotations

import mmap

import numpy as np

from ..checkpoint import checksums, host_memory
from .errors import InvalidMemoryCopyError
from .slot import Slot

PIECE_BYTES = 1 << 20  # copied, then hashed while in L2 (2 MiB per core here); 0.5-2 MiB measured alike
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux >= 5.14


def populate(slot: Slot, offset: int, length: int) -> None:
    """Fill the page tables of ``[offset, offset + length)`` of the mapping in one call (one fault per 4 KiB
    page otherwise); a no-op where the kernel lacks MADV_POPULATE_READ."""
    mm = slot._mm
    if mm is None or length <= 0:
        return
    start = offset // mmap.PAGESIZE * mmap.PAGESIZE
    try:
        mm.madvise(_MADV_POPULATE_READ, start, min(slot.size, offset + length) - start)
    except (OSError, ValueError):
        pass


def _destination(tensor, nbytes: int) -> tuple[np.ndarray, bool]:
    """(uint8 array to read into, whether it is the tensor itself) - a device tensor gets a host buffer."""
    if host_memory.is_host_contiguous(tensor):
        return host_memory.raw_view(tensor, allow_copy=False)[0], True
    return np.empty(nbytes, np.uint8), False


def _to_device(tensor, buf: np.ndarray) -> None:
    import paddle

    view = paddle.utils.dlpack.from_dlpack(buf).view(tensor.dtype).reshape(tensor.shape)
    tensor.copy_(view.to(tensor.place), False)


def read_into(slot: Slot, header: dict, data_off: int, data_len: int, tensors: list) -> None:
    """Copy every record of the mapped copy into ``tensors`` (the state's tensors, in the header's record order;
    the caller checked the layout) and verify every chunk digest of the bytes that landed. InvalidMemoryCopyError
    names the first record whose bytes do not match (the tensors read so far are then written)."""
    data = slot.data(data_off, data_len)
    populate(slot, data_off, data_len)

    def fill(dst: np.ndarray, off: int) -> None:
        np.copyto(dst, data[off : off + len(dst)])

    fill_tensors(header, data_len, tensors, fill, f"memory copy {slot.path}")


def fill_tensors(header: dict, data_len: int, tensors: list, fill, where: str) -> None:
    """The one pass of ``read_into`` over any source: ``fill(dst, off)`` puts the data bytes at ``off`` into the
    uint8 array ``dst``; it is called with increasing offsets (a stream can serve it: wire.py)."""
    records = header["records"]
    if len(records) != len(tensors):
        raise InvalidMemoryCopyError(f"{where}: {len(records)} records, the state has {len(tensors)}")
    algo = header["algo"]
    fn = checksums.digest_function(algo) if algo != checksums.NONE else None
    chunk = int(header["chunk"])
    end = 0
    for (key, _dtype, _shape, off, nbytes, digests), tensor in zip(records, tensors):
        if not nbytes:
            continue
        if off < end or off + nbytes > data_len:
            raise InvalidMemoryCopyError(f"{where}: record {key!r} lies outside the data or overlaps another")
        end = off + nbytes
        dst, in_place = _destination(tensor, nbytes)
        if len(dst) != nbytes:
            raise InvalidMemoryCopyError(f"{where}: record {key!r} has {nbytes} bytes, the tensor {len(dst)}")
        sums = checksums.ChunkDigests(fn, chunk, nbytes) if fn is not None else None
        got: list[int] = []
        for a in range(0, nbytes, PIECE_BYTES):
            b = min(a + PIECE_BYTES, nbytes)
            fill(dst[a:b], off + a)
            if sums is not None:
                got.extend(d for _i, d in sums.feed(memoryview(dst[a:b])))
        if sums is not None and got != list(digests):
            raise InvalidMemoryCopyError(f"{where}: checksum mismatch in record {key!r}")
        if not in_place:
            _to_device(tensor, dst)

"""The storage interface's contract (checkpoint/io/storage.py), run against every backend.

Why: the engine speaks to storage only through ``Storage``; a backend is correct when it passes this one suite.
Backends here: LocalStorage (a real directory, O_DIRECT writes where the file system allows them, buffered ones
too) and MemoryStorage (the in-memory reference). Another backend joins by adding a fixture param.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from memory_storage import MemoryStorage
from paddle.distributed.fsdp.checkpoint import checksums
from paddle.distributed.fsdp.checkpoint.errors import MetadataError
from paddle.distributed.fsdp.checkpoint.io import Storage, StorageError, backend_for, register_backend
from paddle.distributed.fsdp.checkpoint.io.local import LocalStorage


@pytest.fixture(params=["local-direct", "local-buffered", "memory"])
def backend(request, tmp_path):
    """(storage, root location) for each backend."""
    if request.param == "memory":
        return MemoryStorage(), "mem://root"
    return LocalStorage(odirect=request.param == "local-direct", background_delete=False), str(tmp_path / "root")


def _pieces(seed: int) -> list:
    rng = np.random.default_rng(seed)
    sizes = [0, 1, 4095, 4096, 70_000, (5 << 20) + 3]  # empty, unaligned, aligned, past one O_DIRECT slab
    return [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]


def _read_all(storage: Storage, loc: str, name: str) -> bytes:
    h = storage.open_read(loc, name)
    try:
        buf = bytearray(h.size)
        assert h.read_into(0, buf) == h.size
        return bytes(buf)
    finally:
        h.close()


def test_data_object_round_trip_with_checksums(backend):
    storage, root = backend
    final = storage.child(root, "step_1")
    staging = storage.begin(final, "abc")
    pieces = _pieces(0)
    pieces[2] = lambda a=pieces[2]: (a, None)  # a lazily produced piece, as device tensors are
    digest = checksums.digest_function(checksums.default_algorithm(None))
    size, sums = storage.write_object(staging, "0_0.safetensors", b"HEADER", pieces, 4096, digest)
    plain = [p()[0] if callable(p) else p for p in pieces]
    want = b"HEADER" + b"".join(p.tobytes() for p in plain)
    assert size == len(want)
    assert sums == [checksums.chunk_digests(p, 4096, digest) for p in plain]
    assert _read_all(storage, staging, "0_0.safetensors") == want
    h = storage.open_read(staging, "0_0.safetensors")
    try:  # a range in the middle, and a read past the end is short
        buf = bytearray(10)
        assert h.read_into(100, buf) == 10 and bytes(buf) == want[100:110]
        assert h.read_into(size - 4, buf) == 4
    finally:
        h.close()


def test_staging_invisible_until_publish_then_replaces(backend):
    storage, root = backend
    final = storage.child(root, "ckpt")
    first = storage.begin(final, "one")
    storage.put(first, "COMMIT", b"1")
    storage.put(first, "metadata.json", b"old")
    assert storage.list(final) == [] and not storage.exists(final)
    storage.publish(first, final)
    assert storage.get(final, "COMMIT") == b"1" and not storage.exists(first)
    second = storage.begin(final, "two")
    storage.put(second, "COMMIT", b"2")
    assert storage.get(final, "COMMIT") == b"1"  # still the old checkpoint
    storage.publish(second, final)
    # the old checkpoint's objects went with it
    assert storage.list(final) == ["COMMIT"] and storage.get(final, "COMMIT") == b"2"


def test_small_objects_names_listing_and_removal(backend):
    storage, root = backend
    storage.begin(storage.child(root, "x"), "id")  # makes root exist
    storage.put(root, "latest", b"step_1")
    storage.put(root, "latest", b"step_2", durable=False)
    assert storage.get(root, "latest") == b"step_2"
    assert storage.get(root, "missing") is None
    with pytest.raises(FileNotFoundError):
        storage.open_read(root, "missing")
    with pytest.raises(MetadataError):
        storage.get(root, "latest", limit=3)
    for loc in ("step_1", "step_2"):
        s = storage.begin(storage.child(root, loc), "i")
        storage.put(s, "COMMIT", b"c")
        storage.publish(s, storage.child(root, loc))
    assert {"step_1", "step_2"} <= set(storage.children(root))
    assert "latest" in storage.list(root)
    storage.remove(storage.child(root, "step_1"))
    storage.remove(storage.child(root, "never-existed"))
    assert "step_1" not in storage.children(root) and "step_2" in storage.children(root)
    storage.delete(root, "latest")
    storage.delete(root, "latest")
    assert storage.get(root, "latest") is None
    for bad in ("", "a/b"):
        with pytest.raises(StorageError):
            storage.put(root, bad, b"")


def test_put_all_writes_every_object_and_refuses_bad_names(backend):
    storage, root = backend
    staging = storage.begin(storage.child(root, "m"), "id")
    objects = {f"obj{i}": bytes([i]) * (i * 1000) for i in range(6)}
    storage.put_all(staging, objects)
    assert {n: storage.get(staging, n) for n in objects} == objects
    storage.put_all(staging, {"obj1": b"new"})  # replaces, as put does
    assert storage.get(staging, "obj1") == b"new"
    with pytest.raises(StorageError):
        storage.put_all(staging, {"fine": b"", "a/b": b""})


def test_should_stop_gives_up_a_long_write(backend):
    storage, root = backend
    staging = storage.begin(storage.child(root, "c"), "id")
    calls = []

    def stop():
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("peer failed")

    big = [np.zeros(65 << 20, np.uint8), np.zeros(65 << 20, np.uint8)]  # past one 64 MiB slab
    with pytest.raises(RuntimeError, match="peer failed"):
        storage.write_object(staging, "d", b"", big, 1 << 20, None, should_stop=stop)


def test_backend_selection():
    assert isinstance(backend_for("/some/dir"), LocalStorage)
    mem = MemoryStorage()
    assert backend_for("/x", mem) is mem
    with pytest.raises(StorageError, match="no storage backend registered"):
        backend_for("nosuch://bucket/p")
    register_backend("memtest", lambda: mem)
    assert backend_for("memtest://b/p") is mem
    with pytest.raises(StorageError):
        backend_for("/x", object())
    assert os.sep == "/"


def test_a_save_needs_nothing_but_the_interface():
    """The engine's save into MemoryStorage (no file system behind it): every object lands in the backend, the
    metadata names each piece's bytes, and those bytes are the tensors' (a second save replaces the first); loads
    and verify read it back through the interface alone (its handles have no descriptor)."""
    import json

    import paddle
    from paddle.distributed.fsdp.checkpoint import (
        CheckpointOptions,
        CorruptCheckpointError,
        load_full_state_dict,
        load_state_dict,
        save_state_dict,
        verify_checkpoint,
    )
    from paddle.distributed.fsdp.checkpoint.format.versions import loads_metadata

    mem = MemoryStorage()
    opts = CheckpointOptions(storage=mem)
    rng = np.random.default_rng(1)
    for step in (1, 2):
        state = {
            "w": paddle.to_tensor(rng.standard_normal((33, 7)).astype("float32")),
            "b": paddle.to_tensor(rng.integers(0, 9, (5,)).astype("int64")),
        }
        save_state_dict(state, "mem://run/ckpt", options=opts, write_stock_metadata=step == 1)
        names = mem.list("mem://run/ckpt")
        assert {"COMMIT", "metadata.json", "0_0.safetensors", "0_0.safetensors.sums", "index.keys"} <= set(names)
        assert ("0.metadata" in names) == (step == 1)
        assert mem.children("mem://run") == ["ckpt"]  # no staging left
        md = loads_metadata(
            mem.get("mem://run/ckpt", "metadata.json"),
            where="mem",
            fetch=lambda name, off, n: mem.get("mem://run/ckpt", name)[off : off + n],
        )
        assert json.loads(mem.get("mem://run/ckpt", "COMMIT"))["checkpoint_id"] == md.checkpoint_id
        data = mem.get("mem://run/ckpt", "0_0.safetensors")
        for key, tensor in state.items():
            (piece,) = md.tensors[key].pieces
            got = data[piece.offset : piece.offset + piece.nbytes]
            assert got == tensor.numpy().tobytes(), key
        # and back through nothing but the interface: bounded, atomic, one-process and verify all read it
        for atomic in (False, True):
            target = {k: paddle.zeros(v.shape, v.dtype) for k, v in state.items()}
            load_state_dict(target, "mem://run/ckpt", options=opts, atomic=atomic)
            for k, v in state.items():
                assert target[k].numpy().tobytes() == v.numpy().tobytes(), (k, atomic)
        full = load_full_state_dict("mem://run/ckpt", options=opts)
        assert all(full[k].numpy().tobytes() == v.numpy().tobytes() for k, v in state.items())
        assert verify_checkpoint("mem://run/ckpt", options=opts) == []
    # a flipped byte of a data object is found by verify and refused by a load, naming the checksum
    blob = bytearray(mem.get("mem://run/ckpt", "0_0.safetensors"))
    blob[-3] ^= 1
    mem.put("mem://run/ckpt", "0_0.safetensors", bytes(blob))
    assert any("checksum mismatch" in p for p in verify_checkpoint("mem://run/ckpt", options=opts))
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        load_full_state_dict("mem://run/ckpt", options=opts)

"""The byte-plane encoder (format/codecs.py, format/plane_zstd.py) and the readahead of stored files
(decoded_read.py), in one process: a plane the sampler skips is stored raw without running zstd and decodes
bit-exactly; what the encoder writes decodes with the format's reference decoder (written here from
docs/format.md, independent of the module) and the module's; a zoo of dtypes, sizes and values round-trips
bit-exactly, also through the module-API coder used when python-zstandard's cffi backend is missing; a
compressed checkpoint's sequential reads are prefetched and load bit-exactly."""

from __future__ import annotations

import numpy as np
import paddle
import paddle.distributed.fsdp.checkpoint as ck
import pytest
import zstandard
from paddle.distributed.fsdp.checkpoint import decoded_read
from paddle.distributed.fsdp.checkpoint.format import codecs, plane_zstd
from paddle.distributed.fsdp.checkpoint.io.local import LocalStorage

RAW_BIT = 1 << 31


def _where() -> str:
    return "test"


def reference_decode(stored: bytes, width: int, n: int) -> bytes:
    """docs/format.md's stored chunk of ``byteplane-zstd``: ``width`` u32 plane lengths (bit 31: raw), then the
    planes (each a zstd frame, or raw), plane j holding byte j of every element."""
    lens = np.frombuffer(stored[: 4 * width], "<u4")
    out = np.empty(n, np.uint8)
    pos = 4 * width
    for j in range(width):
        ln = int(lens[j]) & ~RAW_BIT
        part = stored[pos : pos + ln]
        pos += ln
        plane = part if lens[j] & RAW_BIT else zstandard.ZstdDecompressor().decompress(part)
        assert len(plane) == n // width
        out[j::width] = np.frombuffer(plane, np.uint8)
    assert pos == len(stored)
    return out.tobytes()


def _roundtrip(raw: bytes, width: int) -> bytes | None:
    """Encode ``raw`` as one chunk; check both decoders restore it bit-exactly; the stored bytes (None: raw)."""
    stored = codecs.encode_byteplanes(memoryview(raw), width)
    if stored is None:
        return None
    stored = bytes(stored)
    assert len(stored) < len(raw)
    used = width if width in codecs.WIDTHS and len(raw) % width == 0 else 1  # (as write_encoded records it)
    out = bytearray(len(raw) + 8)  # guard bytes after the declared size stay untouched
    codecs.decode_chunk(1, used, memoryview(stored), memoryview(out)[: len(raw)], _where)
    assert bytes(out[: len(raw)]) == raw and out[len(raw) :] == bytes(8)
    assert reference_decode(stored, used, len(raw)) == raw
    return stored


def _fp32(n: int, scale: float = 0.02, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)


class _Counting:
    """A plane coder that records the size of every buffer it is asked to fill (then does the real work)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def compress_into(self, src, dst):
        self.calls.append(len(src))
        return self.inner.compress_into(src, dst)


def test_mantissa_planes_skipped_by_the_sampler_are_raw_and_decode(monkeypatch):
    """fp32 ~ N(0, 0.02): the sampler keeps only the sign/exponent plane; the three mantissa planes are stored
    raw (bit 31, their exact bytes) without zstd ever running over a whole one."""
    src = _fp32(65536)
    raw = src.tobytes()
    counting = _Counting(plane_zstd.coder(zstandard))
    monkeypatch.setattr(plane_zstd, "coder", lambda _z: counting)
    stored = _roundtrip(raw, 4)
    plen = len(raw) // 4
    lens = np.frombuffer(stored[:16], "<u4")
    assert [bool(v & RAW_BIT) for v in lens] == [True, True, True, False]
    planes = src.view(np.uint8).reshape(-1, 4)
    pos = 16
    for j in range(3):
        assert int(lens[j]) & ~RAW_BIT == plen
        assert stored[pos : pos + plen] == planes[:, j].tobytes()
        pos += plen
    assert int(lens[3]) < plen * 0.4  # the exponent plane: ~2.9x
    full = [c for c in counting.calls if c == plen]
    assert full == [plen], counting.calls  # one whole plane compressed: the exponent one
    assert all(c <= codecs.SAMPLE_BYTES for c in counting.calls if c != plen)


def test_incompressible_chunk_is_not_split_and_stays_raw(monkeypatch):
    """Random bytes: every plane's sample fails, the chunk is stored raw (None) and no whole plane is
    compressed."""
    raw = np.random.default_rng(1).integers(0, 256, 1 << 18, dtype=np.uint8).tobytes()
    counting = _Counting(plane_zstd.coder(zstandard))
    monkeypatch.setattr(plane_zstd, "coder", lambda _z: counting)
    assert codecs.encode_byteplanes(memoryview(raw), 4) is None
    assert counting.calls and max(counting.calls) <= codecs.SAMPLE_BYTES


def test_sample_spots_see_past_the_start_of_a_chunk():
    """A chunk whose first half is random and second half zeros: the sample from both halves keeps the planes,
    and the stored chunk is about half the size."""
    rng = np.random.default_rng(2)
    raw = rng.integers(0, 256, 1 << 17, dtype=np.uint8).tobytes() + bytes(1 << 17)
    stored = _roundtrip(raw, 4)
    assert stored is not None and len(stored) < 0.6 * len(raw)


def _zoo():
    rng = np.random.default_rng(52)
    f32 = _fp32(70001, seed=3)
    bits = f32.view(np.uint32)
    bf16 = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    special = f32.copy()
    special[::7] = np.nan
    special[1::11] = np.inf
    special[2::13] = -np.inf
    special[3::17] = -0.0
    special[4::19] = np.float32(1e-45)  # subnormal
    return {
        "bf16": bf16,
        "fp16": (rng.standard_normal(50001) * 0.1).astype(np.float16),
        "fp32": f32,
        "fp32-special": special,
        "fp64": rng.standard_normal(30001) * 1e-3,
        "int8": np.clip(rng.standard_normal(90001) * 20, -128, 127).astype(np.int8),
        "uint8": rng.integers(0, 256, 90001, dtype=np.uint8),
        "bool": rng.random(90001) < 0.1,
        "zeros-fp32": np.zeros(40000, np.float32),
        "const-bf16": np.full(40000, 0x3F80, np.uint16),
        "random-u64": rng.integers(0, 1 << 63, 20000, dtype=np.uint64),
        "moment2": (_fp32(60000, 1e-3, seed=4).astype(np.float64) ** 2).astype(np.float32),
    }


@pytest.mark.parametrize("chunk", [1, 7, 1001, 4096, 4098, 65537, 1 << 18])
def test_zoo_of_dtypes_and_chunk_sizes_round_trips_bit_exactly(chunk):
    """Chunks of every zoo array (~24 spread over it, and its partial last one), at chunk sizes that split
    elements (1, 7, 1001, 65537) or not: both decoders restore each; float data with a sign/exponent plane
    shrinks at the default chunk size."""
    for name, arr in _zoo().items():
        raw = memoryview(np.ascontiguousarray(arr)).cast("B")
        starts = list(range(0, len(raw), chunk))
        raw_total = stored_total = 0
        for c in [*starts[:: max(1, len(starts) // 24)], starts[-1]]:
            part = bytes(raw[c : c + chunk])
            stored = _roundtrip(part, arr.itemsize)
            raw_total += len(part)
            stored_total += len(stored) if stored is not None else len(part)
        if chunk == 1 << 18 and name in ("bf16", "fp32", "fp64", "moment2", "zeros-fp32", "const-bf16"):
            assert stored_total < 0.9 * raw_total, name


def test_module_api_coder_writes_the_same_format(monkeypatch):
    """Without the cffi backend (the module API's ZstdCompressor): the same planes raw, frames that both
    decoders read."""
    monkeypatch.setattr(plane_zstd, "_cffi_state", {"lib": None})
    monkeypatch.setattr(plane_zstd, "_local", type(plane_zstd._local)())
    assert isinstance(plane_zstd.coder(zstandard), plane_zstd._ModuleCoder)
    for arr in (_fp32(65536, seed=5), _zoo()["bf16"][:65536]):
        stored = _roundtrip(arr.tobytes(), arr.itemsize)
        lens = np.frombuffer(stored[: 4 * arr.itemsize], "<u4")
        assert [bool(v & RAW_BIT) for v in lens] == [True] * (arr.itemsize - 1) + [False]


class _NoDescriptor:
    """A local file's read handle without ``fileno``: read as an object store's object is (no POSIX fast path)."""

    def __init__(self, inner):
        self.inner, self.size = inner, inner.size

    def read_into(self, offset, buf):
        return self.inner.read_into(offset, buf)

    def close(self):
        self.inner.close()


class _ObjectLikeStorage(LocalStorage):
    """Local directories whose data files read like objects of a store (the readahead is for those)."""

    def open_read(self, location, name):
        return _NoDescriptor(super().open_read(location, name))


def test_sequential_reads_of_a_stored_file_are_prefetched(tmp_path, monkeypatch):
    """A compressed checkpoint of pieces of varied sizes (a readahead shorter than the next read is completed, the
    unused end of a longer one starts the next), loaded with at most 2 open files: most reads find their first
    stored bytes prefetched, no stored byte is fetched twice, and the load is bit-exact."""
    rng = np.random.default_rng(6)
    state = {}
    for i, n in enumerate([300, 5000, 70000, 200000, 9000, 150000, 400000, 1000]):
        state[f"p{i}.w"] = paddle.to_tensor((rng.standard_normal(n) * 0.02).astype(np.float32))
        state[f"p{i}.m"] = paddle.to_tensor((rng.standard_normal(n) * 1e-3).astype(np.float32))
    opts = ck.CheckpointOptions(codec="byteplane-zstd", max_open_files=2, storage=_ObjectLikeStorage())
    ck.save_state_dict(state, str(tmp_path / "c"), chunk_bytes=16 << 10, options=opts)
    claims = {"asked": 0, "held": 0}
    claim = decoded_read.Readahead.claim

    def counted(self, name, start):
        got = claim(self, name, start)
        claims["asked"] += 1
        claims["held"] += got is not None
        return got

    monkeypatch.setattr(decoded_read.Readahead, "claim", counted)
    fetched = []
    stored = decoded_read._stored

    def counted_fetch(files, name, offset, n, handle=None):
        fetched.append(n)
        return stored(files, name, offset, n, handle)

    monkeypatch.setattr(decoded_read, "_stored", counted_fetch)
    targets = {k: paddle.zeros_like(v) for k, v in state.items()}
    ck.load_state_dict(targets, str(tmp_path / "c"), options=opts)
    for k, v in state.items():
        assert targets[k].numpy().tobytes() == v.numpy().tobytes(), k
    data = sum(p.stat().st_size for p in (tmp_path / "c").iterdir() if p.name.endswith(".safetensors"))
    assert sum(fetched) <= data * 1.05, (sum(fetched), data)  # prefetched bytes are used, not fetched again
    assert claims["asked"] >= 8 and claims["held"] >= claims["asked"] - 3, claims  # (tiny reads come last)
    claims.update(asked=0, held=0)  # a local disk (descriptors): the kernel reads ahead, the engine does not
    ck.load_state_dict(targets, str(tmp_path / "c"), options=ck.CheckpointOptions(codec="byteplane-zstd"))
    assert claims["asked"] >= 8 and claims["held"] == 0, claims

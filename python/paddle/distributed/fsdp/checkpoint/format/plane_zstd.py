"""zstd as the entropy coder of one byte plane: the compressor of the ``byteplane-zstd`` codec (codecs.py).

Why not ``zstd -1``: the plane that shrinks is the sign/exponent byte of float data, independent bytes of
~2.5-3 bits where matches are rare and short. zstd-1 spent most of its time searching for them and compressed the
plane less (2.62x against 2.95x on fp32 ~ N(0, 0.02), docs/reports/2026-12-07-codec-speed.md). What pays is the
Huffman coding of the literals, so the match search is made as cheap as zstd allows: the ``fast`` strategy, the
smallest tables, the longest minimum match, and a large step between search positions (``target_length``). That
step alone would turn the Huffman stage off (zstd's rule for fast levels), which the literal compression mode
turns back on; python-zstandard exposes that mode only through its cffi backend. Without the cffi backend the
module API is used with step 1 (Huffman stays on; the search costs ~1.5x more time). Either writes ordinary zstd
frames with the content size: every decoder reads them, and the stored format does not depend on which was used.

The cffi coder also compresses straight into the caller's buffer, bounded by it: a plane that would not shrink
stops early and costs no copy.
"""

from __future__ import annotations

import logging
import threading

import numpy as np

logger = logging.getLogger(__name__)

WINDOW_LOG = 17  # a plane of at most 128 KiB is one zstd block (a smaller window makes smaller blocks: slower)
SEARCH_STEP = 256  # target_length of the fast strategy: positions skipped between match searches
_local = threading.local()
_cffi_state: dict = {}
_cffi_lock = threading.Lock()


class _CffiCoder:
    """ZSTD_compress2 on a context of its own (one per thread), literals Huffman-coded."""

    def __init__(self, ffi, lib):
        self.ffi, self.lib = ffi, lib
        cctx = lib.ZSTD_createCCtx()
        if cctx == ffi.NULL:
            raise MemoryError("ZSTD_createCCtx")
        self.cctx = ffi.gc(cctx, lib.ZSTD_freeCCtx)
        for param, value in (
            (lib.ZSTD_c_strategy, 1),  # ZSTD_fast
            (lib.ZSTD_c_windowLog, WINDOW_LOG),
            (lib.ZSTD_c_hashLog, 6),
            (lib.ZSTD_c_chainLog, 6),
            (lib.ZSTD_c_searchLog, 1),
            (lib.ZSTD_c_minMatch, 7),
            (lib.ZSTD_c_targetLength, SEARCH_STEP),
            (lib.ZSTD_c_literalCompressionMode, lib.ZSTD_ps_enable),
            (lib.ZSTD_c_checksumFlag, 0),
            (lib.ZSTD_c_contentSizeFlag, 1),
        ):
            r = lib.ZSTD_CCtx_setParameter(self.cctx, param, value)
            if lib.ZSTD_isError(r):
                raise RuntimeError(f"zstd parameter {param}: {self.ffi.string(lib.ZSTD_getErrorName(r))!r}")

    def compress_into(self, src: np.ndarray, dst: np.ndarray) -> int:
        """Compress ``src`` into ``dst``; the frame's length, or 0 when it does not fit in ``len(dst)`` bytes."""
        ffi, lib = self.ffi, self.lib
        r = lib.ZSTD_compress2(
            self.cctx, ffi.from_buffer(dst, require_writable=True), len(dst), ffi.from_buffer(src), len(src)
        )
        if lib.ZSTD_isError(r):
            if lib.ZSTD_getErrorCode(r) == lib.ZSTD_error_dstSize_tooSmall:
                return 0
            raise RuntimeError(f"zstd: {ffi.string(lib.ZSTD_getErrorName(r))!r}")
        return int(r)


class _ModuleCoder:
    """python-zstandard's ZstdCompressor (either backend) with the same search, step 1 (see the module doc)."""

    def __init__(self, zstandard):
        params = zstandard.ZstdCompressionParameters(
            strategy=zstandard.STRATEGY_FAST,
            window_log=WINDOW_LOG,
            hash_log=zstandard.HASHLOG_MIN,
            chain_log=zstandard.CHAINLOG_MIN,
            search_log=zstandard.SEARCHLOG_MIN,
            min_match=zstandard.MINMATCH_MAX,
            target_length=0,
            write_checksum=False,
            write_content_size=True,
        )
        self.c = zstandard.ZstdCompressor(compression_params=params)

    def compress_into(self, src: np.ndarray, dst: np.ndarray) -> int:
        z = self.c.compress(src)
        if len(z) > len(dst):
            return 0
        dst[: len(z)] = np.frombuffer(z, np.uint8)
        return len(z)


def _cffi_backend(zstandard):
    """``(ffi, lib)`` of python-zstandard's cffi backend when it imports and its frames round-trip through the
    module's own decoder (checked once per process), else None."""
    with _cffi_lock:
        if "lib" in _cffi_state:
            return _cffi_state["lib"]
        got = None
        try:
            from zstandard import backend_cffi

            ffi, lib = backend_cffi.ffi, backend_cffi.lib
            probe = np.frombuffer(np.random.default_rng(0).standard_normal(4096).astype(np.float32).tobytes(), np.uint8)
            plane = np.ascontiguousarray(probe[3::4])
            dst = np.empty(len(plane), np.uint8)
            n = _CffiCoder(ffi, lib).compress_into(plane, dst)
            frame = dst[:n].tobytes()
            ok = (
                0 < n < len(plane)
                and zstandard.frame_content_size(frame) == len(plane)
                and zstandard.ZstdDecompressor().decompress(frame) == plane.tobytes()
            )
            got = (ffi, lib) if ok else None
        except Exception as e:  # noqa: BLE001 - any failure: the module API, which always works
            logger.debug("zstd cffi backend not used: %s", e)
        if got is None:
            logger.info("zstd cffi backend unavailable: byte planes are compressed through the module API (slower)")
        _cffi_state["lib"] = got
        return got


def coder(zstandard):
    """This thread's plane coder (``zstandard``: the imported module)."""
    c = getattr(_local, "coder", None)
    if c is None:
        backend = _cffi_backend(zstandard)
        c = _local.coder = _CffiCoder(*backend) if backend is not None else _ModuleCoder(zstandard)
    return c

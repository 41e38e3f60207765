"""Reading boxes of a key out of saved pieces (box or flattened), in numpy, with a coverage check.

Tensor data is handled as numpy arrays of the element's storage type (``bfloat16`` as ``uint16``, float8 as
``uint8``): copying needs no arithmetic, so bit patterns pass through unchanged. ``PieceData`` reads a piece's
elements (a safetensors byte range with ``pread``, or an entry of a restricted-unpickled ``.distcp`` file);
``assemble_box`` copies the overlap of every piece with a requested box into one array.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

from ..errors import CorruptCheckpointError
from ..format.derived import cast_bits
from ..format.metadata import numel, storage_dtype
from ..format.strict_json import open_regular
from .errors import StockIncompleteCheckpointError
from .index import Piece, PieceIndex
from .unpickler import load_distcp


class PieceData:
    """Reads the elements of pieces of one index; keeps the last ``.distcp`` file unpickled (stock writes one
    file per rank, and its pieces are read one after another)."""

    def __init__(self, index: PieceIndex):
        self.index = index
        self._distcp_name: str | None = None
        self._distcp: dict[str, np.ndarray] = {}

    def visible(self, file: str) -> bool:
        return os.path.isfile(os.path.join(self.index.root, file))

    def read(self, key: str, piece: Piece) -> np.ndarray:
        """The piece's elements, 1-D, in storage order, as the key's storage type."""
        dtype = self.index.tensors[key].dtype
        stored = self.index.derived_from.get(key)
        if stored is not None:  # our format 4's derived weight: its master's elements, cast round to nearest even
            return cast_bits(self._read(key, piece, stored), dtype).view(storage_dtype(dtype))
        return self._read(key, piece, dtype)

    def _read(self, key: str, piece: Piece, dtype: str) -> np.ndarray:
        st = storage_dtype(dtype)
        path = os.path.join(self.index.root, piece.file)
        if piece.byte_offset is not None:
            nbytes = piece.numel * st.itemsize
            with os.fdopen(open_regular(path), "rb") as f:  # a FIFO / device in place of a data file: named error
                self._check_size(f.fileno(), path, key, piece.byte_offset, nbytes)  # before allocating
                buf = bytearray(nbytes)
                got = f.readinto(memoryview(buf)) if f.seek(piece.byte_offset) == piece.byte_offset else 0
            if got != nbytes:
                raise CorruptCheckpointError(f"{path}: truncated (piece of {key!r} needs {nbytes} bytes)")
            return np.frombuffer(buf, dtype=st)
        if self._distcp_name != piece.file:
            self._distcp = {}
            self._distcp = load_distcp(path)
            self._distcp_name = piece.file
        arr = self._distcp.get(piece.name)
        if arr is None:
            raise StockIncompleteCheckpointError(f"{path}: has no tensor {piece.name!r} that the metadata places there")
        if arr.size != piece.numel or arr.dtype.itemsize != st.itemsize:
            raise CorruptCheckpointError(
                f"{path}: tensor {piece.name!r} holds {arr.size} x {arr.dtype} elements, the metadata says "
                f"{piece.numel} x {dtype}"
            )
        return np.ascontiguousarray(arr).reshape(-1).view(st)

    @staticmethod
    def _check_size(fd: int, path: str, key: str, offset: int, nbytes: int) -> None:
        """Refuse a piece the file is too short for, so a declared size never decides an allocation."""
        if os.fstat(fd).st_size < offset + nbytes:
            raise CorruptCheckpointError(f"{path}: truncated (piece of {key!r} needs bytes up to {offset + nbytes})")

    def check(self, key: str, piece: Piece, block_bytes: int = 16 << 20) -> int:
        """Read the piece's bytes once, in bounded blocks (memory: one block, not the piece); returns its bytes.
        Raises CorruptCheckpointError when they cannot all be read."""
        if piece.byte_offset is None:  # a .distcp piece: its file is unpickled whole (bounded by the file's size)
            arr = self.read(key, piece)
            return arr.nbytes
        stored = self.index.derived_from.get(key, self.index.tensors[key].dtype)  # (a derived weight: its master's)
        nbytes = piece.numel * storage_dtype(stored).itemsize
        path = os.path.join(self.index.root, piece.file)
        fd = open_regular(path)
        try:
            self._check_size(fd, path, key, piece.byte_offset, nbytes)
            done = 0
            while done < nbytes:
                got = len(os.pread(fd, min(block_bytes, nbytes - done), piece.byte_offset + done))
                if not got:
                    raise CorruptCheckpointError(f"{path}: truncated (piece of {key!r} needs {nbytes} bytes)")
                done += got
        finally:
            os.close(fd)
        return nbytes

    def close(self) -> None:
        self._distcp_name, self._distcp = None, {}


def _overlap(a_off, a_shape, b_off, b_shape):
    lo = [max(x, y) for x, y in zip(a_off, b_off)]
    hi = [min(x + s, y + t) for x, s, y, t in zip(a_off, a_shape, b_off, b_shape)]
    if any(h <= low for low, h in zip(lo, hi)):
        return None
    return lo, hi


def _slices(lo, hi, origin):
    return tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, origin))


def piece_as_box(piece: Piece, data: np.ndarray) -> tuple[tuple, tuple, np.ndarray, np.ndarray | None]:
    """(box offset, box shape, array of that box, mask of valid elements or None) for a piece: a flattened piece
    becomes the rows of its box it touches, with a mask of the elements it actually holds."""
    if piece.flat_range is None:
        return piece.box_offset, piece.box_shape, data.reshape(piece.box_shape), None
    a, b = piece.flat_range
    shape = piece.box_shape
    if not shape:
        return (), (), data.reshape(()), None
    row = numel(shape[1:])
    if row == 0 or b <= a:
        return piece.box_offset, tuple(0 for _ in shape), data[:0].reshape((0, *shape[1:])), None
    r0, r1 = a // row, -(-b // row)
    flat = np.zeros((r1 - r0) * row, dtype=data.dtype)
    mask = np.zeros((r1 - r0) * row, dtype=bool)
    flat[a - r0 * row : b - r0 * row] = data
    mask[a - r0 * row : b - r0 * row] = True
    sub_shape = (r1 - r0, *shape[1:])
    off = (piece.box_offset[0] + r0, *piece.box_offset[1:])
    return off, sub_shape, flat.reshape(sub_shape), mask.reshape(sub_shape)


def assemble_box(
    key: str,
    index: PieceIndex,
    offset: tuple[int, ...],
    shape: tuple[int, ...],
    fetch: Callable[[str, Piece], np.ndarray],
) -> np.ndarray:
    """The box ``offset``/``shape`` of ``key`` from its saved pieces; raises if any element is not covered."""
    entry = index.tensors[key]
    out = np.zeros(shape, dtype=storage_dtype(entry.dtype))
    covered = np.zeros(shape, dtype=bool)
    for piece in entry.pieces:
        if _overlap(offset, shape, piece.box_offset, piece.box_shape) is None and shape:
            continue
        p_off, p_shape, p_arr, p_mask = piece_as_box(piece, fetch(key, piece))
        if not shape:  # 0-d tensor
            out[()] = p_arr[()]
            covered[()] = True
            continue
        ov = _overlap(offset, shape, p_off, p_shape)
        if ov is None:
            continue
        dst, src = _slices(*ov, offset), _slices(*ov, p_off)
        if p_mask is None:
            out[dst] = p_arr[src]
            covered[dst] = True
        else:
            m = p_mask[src]
            np.copyto(out[dst], p_arr[src], where=m)
            covered[dst] |= m
    if not covered.all():
        missing = int(covered.size - np.count_nonzero(covered))
        raise CorruptCheckpointError(
            f"{index.root}: key {key!r}: the saved pieces leave {missing} of {covered.size} requested elements "
            f"(box offset {list(offset)} shape {list(shape)}) uncovered"
        )
    return out


def pieces_overlapping(index: PieceIndex, key: str, offset: tuple, shape: tuple) -> list[Piece]:
    return [p for p in index.tensors[key].pieces if not shape or _overlap(offset, shape, p.box_offset, p.box_shape)]

"""What a format-2/3 reader fetches beside the index: the chunk checksums of a data file (its ``<file>.sums``
sidecar, read by blocks when first needed) and the count of every metadata byte read (the scale figures).

Pure: reads go through ``fetch(name, offset, length) -> bytes`` (directory.index_fetch).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..errors import CorruptCheckpointError

SUMS_BLOCK = 8192  # checksums fetched at once from a sidecar (64 KiB): one read for a 2 GiB range at 256 KiB chunks

Fetch = Callable[[str, int, int], bytes]  # (object name, offset, length) -> exactly those bytes


class CountedFetch:
    """``fetch`` that counts what it read: bytes, calls and the objects it opened (the scale figures)."""

    def __init__(self, fetch: Fetch):
        self.inner = fetch
        self.bytes = 0
        self.calls = 0
        self.objects: set[str] = set()
        self.by_object: dict[str, int] = {}  # bytes read of each object

    def __call__(self, name: str, offset: int, length: int) -> bytes:
        data = self.inner(name, offset, length)
        self.bytes += len(data)
        self.calls += 1
        self.objects.add(name)
        self.by_object[name] = self.by_object.get(name, 0) + len(data)
        return data


class SidecarSums:
    """The chunk checksums of one data file, fetched by blocks of SUMS_BLOCK when first needed."""

    def __init__(self, fetch: Fetch, name: str, count: int):
        self.fetch, self.name, self.count = fetch, name, count
        self.blocks: dict[int, np.ndarray] = {}

    def block(self, b: int) -> np.ndarray:
        block = self.blocks.get(b)
        if block is None:
            n = min(SUMS_BLOCK, self.count - b * SUMS_BLOCK)
            raw = self.fetch(self.name, b * SUMS_BLOCK * 8, n * 8)
            if len(raw) != n * 8:
                raise CorruptCheckpointError(f"checksum sidecar {self.name} ends early (truncated)")
            block = self.blocks[b] = np.frombuffer(raw, "<u8")
        return block

    def get(self, i: int) -> int:
        return int(self.block(i // SUMS_BLOCK)[i % SUMS_BLOCK])

    def slice(self, first: int, n: int) -> list[int]:
        """Checksums ``[first, first + n)`` as ints (the blocks they are in fetched once)."""
        if n <= 0:
            return []
        b0, b1 = first // SUMS_BLOCK, (first + n - 1) // SUMS_BLOCK
        parts = np.concatenate([self.block(b) for b in range(b0, b1 + 1)])
        a = first - b0 * SUMS_BLOCK
        return parts[a : a + n].tolist()

    def view(self, first: int, n: int) -> PieceSums:
        return PieceSums(self, first, n)


class PieceSums:
    """One piece's checksums (a sequence of ints) inside its file's sidecar."""

    __slots__ = ("sidecar", "first", "n", "_list")

    def __init__(self, sidecar: SidecarSums, first: int, n: int):
        self.sidecar, self.first, self.n = sidecar, first, n
        self._list: list[int] | None = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, ci: int) -> int:
        lst = self._list
        if lst is None:  # the piece's checksums at once (8 bytes per chunk: 0.003% of its bytes at 256 KiB)
            lst = self._list = self.sidecar.slice(self.first, self.n)
        if ci < 0:
            raise IndexError(ci)
        return lst[ci]

    def __iter__(self):
        return (self[i] for i in range(self.n))

"""Per-rank values (format 3): each saving rank's own JSON values in an object of its own, read by rank.

Why: ``per_rank_values`` (the RNG state of the one-call API: ~19 KB a rank) used to be a list over the world in
``metadata.json``'s values: 157 MB at 8192 ranks, gathered on the coordinator and parsed by every loading rank.
Now each rank writes its own, and a loading rank reads only its own entry::

    <rank>.values    written by that rank (nothing gathered): compact JSON
                     {"checkpoint_id": ..., "rank": r, "values": {key: value}}
    index.ranks      written by the coordinator from the hand-overs (O(1) bytes a rank): one RANK_ROW per saving
                     rank, its object's size and SHA-256; the SHA-256 of the whole table is in metadata.json
    metadata.json    "rank_values": {"keys": [...], "rows": world, "sha256": <of index.ranks>}

A loading rank reads its row of ``index.ranks`` (40 bytes) and its object, and checks the object against the row
(size, SHA-256) and against the checkpoint (id, rank): what it reads does not depend on the world. A damaged row
fails its object's check; ``verify_checkpoint`` checks the table whole (``table_problems``) and every object.

In a loaded checkpoint a per-rank key's value is a :class:`RankValueList`: a read-only sequence by saving rank
whose entries are read when first asked for (``list(v)`` reads them all). Format 1 and the format-2 checkpoints
written before this kept plain lists in ``values``; readers accept both (a ``Sequence`` of entries).

Pure: the caller passes ``fetch(name, offset, length) -> bytes`` (directory.index_fetch) for the I/O.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..errors import CheckpointError, CorruptCheckpointError, MetadataError

TABLE_FILE = "index.ranks"
SUFFIX = ".values"
MAX_ENTRY_BYTES = 64 << 20  # one rank's values object (an RNG state is ~19 KB): a damaged size is refused, not read
RANK_ROW = np.dtype([("nbytes", "<u8"), ("sha256", "S32")])

Fetch = Callable[[str, int, int], bytes]


def object_name(rank: int) -> str:
    """The values object of saving rank ``rank``."""
    if type(rank) is not int or rank < 0:
        raise ValueError(f"rank must be a non-negative int, got {rank!r}")
    return f"{rank}{SUFFIX}"


def encode_entry(checkpoint_id: str, rank: int, values: dict) -> bytes:
    """The bytes of rank ``rank``'s values object (``values``: key -> JSON value, checked by the save)."""
    if type(values) is not dict:
        raise TypeError(f"values must be a dict, got {type(values).__name__}")
    d = {"checkpoint_id": checkpoint_id, "rank": rank, "values": values}
    return json.dumps(d, separators=(",", ":"), allow_nan=False).encode()


def entry_receipt(blob: bytes) -> list:
    """What a rank hands over for its values object: ``[size, sha256 hex]`` (O(1) bytes)."""
    return [len(blob), hashlib.sha256(blob).hexdigest()]


def encode_table(receipts: list[list]) -> bytes:
    """``index.ranks``: one RANK_ROW per saving rank (by rank) from the ranks' receipts; ValueError naming the
    first rank whose receipt is missing or malformed."""
    rows = np.zeros(len(receipts), RANK_ROW)
    for r, got in enumerate(receipts):
        ok = type(got) is list and len(got) == 2 and type(got[0]) is int and 0 <= got[0] <= MAX_ENTRY_BYTES
        if not ok or type(got[1]) is not str or len(got[1]) != 64 or set(got[1]) - set("0123456789abcdef"):
            raise ValueError(f"rank {r} handed over no receipt of a per-rank values object")
        rows[r] = (got[0], bytes.fromhex(got[1]))
    return rows.tobytes()


def header_field(keys: list[str], table: bytes) -> dict:
    """The ``rank_values`` field of metadata.json for the table ``table`` of the per-rank ``keys``."""
    return {"keys": list(keys), "rows": len(table) // RANK_ROW.itemsize, "sha256": hashlib.sha256(table).hexdigest()}


def decode_field(d: Any, world: int, where: str) -> dict:
    """The checked ``rank_values`` field of a parsed metadata.json (one row per saving rank)."""
    if type(d) is not dict:
        raise MetadataError(f"{where}: field rank_values must be an object")
    keys, rows, sha = d.get("keys"), d.get("rows"), d.get("sha256")
    if type(keys) is not list or set(map(type, keys)) - {str} or len(set(keys)) != len(keys):
        raise MetadataError(f"{where}: field rank_values.keys must be a list of distinct strings")
    if type(rows) is not int or rows != world:
        raise MetadataError(f"{where}: field rank_values.rows must be the world size {world}")
    if type(sha) is not str or len(sha) != 64:
        raise MetadataError(f"{where}: field rank_values.sha256 must be a SHA-256 hex digest")
    return {"keys": keys, "rows": rows, "sha256": sha}


class RankValues:
    """The per-rank values of one checkpoint, read by saving rank through ``fetch`` (each entry once)."""

    def __init__(self, fetch: Fetch, where: str, checkpoint_id: str, field: dict):
        self.fetch, self.where, self.checkpoint_id = fetch, where, checkpoint_id
        self.keys, self.world, self.sha256 = field["keys"], field["rows"], field["sha256"]
        self.entries: dict[int, dict] = {}

    def _fail(self, rank: int, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self.where}: the values object of rank {rank} ({object_name(rank)}) {what}")

    def entry(self, rank: int, row: np.void | None = None) -> dict:
        """Saving rank ``rank``'s values (key -> value; a key it gave none for is absent), checked."""
        got = self.entries.get(rank)
        if got is not None:
            return got
        if not 0 <= rank < self.world:
            raise IndexError(f"rank {rank} is outside the {self.world} ranks that saved")
        if row is None:
            raw = self.fetch(TABLE_FILE, rank * RANK_ROW.itemsize, RANK_ROW.itemsize)
            if len(raw) != RANK_ROW.itemsize:
                raise CorruptCheckpointError(f"{self.where}: {TABLE_FILE} ends early (truncated)")
            row = np.frombuffer(raw, RANK_ROW)[0]
        nbytes = int(row["nbytes"])
        if nbytes > MAX_ENTRY_BYTES:
            raise self._fail(rank, f"is declared {nbytes} bytes, over the {MAX_ENTRY_BYTES} cap (damaged)")
        try:
            blob = self.fetch(object_name(rank), 0, nbytes + 1)
        except CorruptCheckpointError as e:
            if isinstance(e.__cause__, FileNotFoundError):
                raise self._fail(rank, "is missing") from e
            raise
        if len(blob) != nbytes or hashlib.sha256(blob).digest() != bytes(row["sha256"]).ljust(32, b"\0"):
            raise self._fail(rank, "does not match its size and SHA-256 in index.ranks (damaged)")
        from .strict_json import loads_strict

        d = loads_strict(blob, f"{self.where}: {object_name(rank)}")
        if type(d) is not dict or d.get("checkpoint_id") != self.checkpoint_id or d.get("rank") != rank:
            raise self._fail(rank, "belongs to another checkpoint or rank")
        if type(d.get("values")) is not dict:
            raise self._fail(rank, "has no values object")
        self.entries[rank] = d["values"]
        return d["values"]

    def table(self) -> np.ndarray:
        """Every row (verify), checked against the SHA-256 in metadata.json."""
        n = self.world * RANK_ROW.itemsize
        raw = self.fetch(TABLE_FILE, 0, n + 1)
        if len(raw) != n or hashlib.sha256(raw).hexdigest() != self.sha256:
            raise CorruptCheckpointError(f"{self.where}: {TABLE_FILE} does not match its SHA-256 in metadata.json")
        return np.frombuffer(raw, RANK_ROW)

    def problems(self) -> list[str]:
        """Every row and every rank's object checked (verify_checkpoint); one line per problem."""
        try:
            rows = self.table()
        except (CheckpointError, OSError) as e:
            return [f"{type(e).__name__}: {e}"]
        out = []
        for r in range(self.world):
            try:
                self.entry(r, rows[r])
            except (CheckpointError, OSError) as e:  # (a missing object: CorruptCheckpointError from the fetch)
                out.append(f"{type(e).__name__}: {e}")
        return out

    def lists(self) -> dict[str, RankValueList]:
        """key -> its RankValueList (what ``CheckpointMetadata.values`` holds for the per-rank keys)."""
        return {k: RankValueList(self, k) for k in self.keys}


class RankValueList(Sequence):
    """One per-rank key's values by saving rank; entry ``r`` is read (and checked) when first asked for."""

    def __init__(self, source: RankValues, key: str):
        self.source, self.key = source, key

    def __len__(self) -> int:
        return self.source.world

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[r] for r in range(*i.indices(len(self)))]
        if type(i) is not int:
            raise TypeError(f"rank indices must be int, got {type(i).__name__}")
        r = i + len(self) if i < 0 else i
        if not 0 <= r < len(self):
            raise IndexError(f"rank {i} is outside the {len(self)} ranks that saved")
        return self.source.entry(r).get(self.key)

    def __eq__(self, other) -> bool:
        if isinstance(other, (list, RankValueList)):
            return len(other) == len(self) and list(self) == list(other)
        return NotImplemented

    __hash__ = None  # a mutable-looking sequence (as the list it stands for)

    def __repr__(self) -> str:
        return f"RankValueList({self.key!r}, {len(self)} ranks)"


def plain(value: Any) -> Any:
    """``value`` with a RankValueList read whole into a list (JSON writers, format-1 conversion)."""
    return list(value) if isinstance(value, RankValueList) else value

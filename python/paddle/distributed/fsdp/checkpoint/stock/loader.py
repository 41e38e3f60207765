"""Loading an indexed checkpoint (stock paddle's, a Hugging Face directory, or ours with ``aoa_config``).

Collective, all-or-nothing, CPU-only arithmetic, never unpickling beyond the restricted set:

1. targets from the state dict (``targets.py``), the keys they read (stock's master-weight name compatibility
   when ``mw_name_compatibility``), and what to copy (``aoa.py`` when ``aoa_config`` is given). Keys the
   checkpoint lacks are left untouched with a warning, as stock does. Shape / dtype disagreements and bad
   statements are errors on every rank (``coordination.gather_errors``).
2. every rank reads the pieces overlapping what it needs. Pieces in files this rank cannot see (ranks given
   node-local directories) are read by a rank that sees them and sent over one object all-gather.
3. all ranks agree that reading worked, then every target is assigned (``paddle.assign`` into the caller's
   tensor, or into the DistTensor's local value). Nothing is written before step 3.

Memory: a rank holds the boxes it loads (one staging copy) and, for stock's pickled ``.distcp`` files, one whole
data file at a time (stock's own loader holds them all).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from ..coordination import Comm, gather_errors
from ..errors import DtypeMismatchError, ShapeMismatchError
from ..format.metadata import storage_dtype
from .aoa import Assignment, plan_aoa, postprocess, target_shard_info
from .boxes import PieceData, assemble_box, pieces_overlapping
from .cpu_tensor import to_paddle
from .errors import StockIncompleteCheckpointError, StockMissingKeyError
from .index import Piece, PieceIndex
from .targets import Target, flatten_state_dict, make_target, mw_compatible_key

logger = logging.getLogger(__name__)


def _piece_id(key: str, p: Piece) -> tuple:
    return (key, p.file, p.name, p.box_offset, p.flat_range)


def _plain_plan(index: PieceIndex, targets: list[Target], mw: bool) -> tuple[dict, list[str], BaseException | None]:
    plan: dict[str, list[Assignment]] = {}
    missing: list[str] = []
    for t in targets:
        src = t.key
        if src not in index.tensors and mw:
            alt = mw_compatible_key(src)
            if alt is not None and alt in index.tensors:
                logger.info("master weight name compatibility: loading %s from %s", t.key, alt)
                src = alt
        entry = index.tensors.get(src)
        if entry is None:
            missing.append(t.key)
            continue
        if tuple(entry.shape) != tuple(t.shape):
            return (
                plan,
                missing,
                ShapeMismatchError(
                    f"key {t.key!r}: shape {list(t.shape)} requested, {list(entry.shape)} in the checkpoint {index.root}"
                ),
            )
        if entry.dtype != t.dtype:
            return (
                plan,
                missing,
                DtypeMismatchError(
                    f"key {t.key!r}: dtype {t.dtype} requested, {entry.dtype} in the checkpoint {index.root} (stock "
                    f"paddle converts only through an aoa_config cast statement)"
                ),
            )
        off, shape = t.read_box()
        plan[t.key] = [Assignment(src, off, shape, (0,) * len(shape))]
    return plan, missing, None


def _fetch_remote(group: Comm, index: PieceIndex, data: PieceData, wanted: dict[tuple, Piece]) -> dict[tuple, Any]:
    """Collective: pieces this rank needs but cannot see, read by the lowest rank that sees each file."""
    all_files = sorted(index.files())
    mine = [f for f in all_files if data.visible(f)]
    missing = sorted(pid for pid, p in wanted.items() if not data.visible(p.file))
    gathered = group.all_gather_object((mine, missing))
    if not any(g[1] for g in gathered):
        return {}
    sees: dict[str, int] = {}
    for r, (files, _) in enumerate(gathered):
        for f in files:
            sees.setdefault(f, r)
    requested = {pid for _, miss in gathered for pid in miss}
    err, serve = None, {}
    try:
        unseen = sorted({pid[1] for pid in requested if pid[1] not in sees})
        if unseen:
            raise StockIncompleteCheckpointError(f"{index.root}: no rank can read data file(s) {unseen}")
        for pid in sorted(requested):
            if sees[pid[1]] == group.rank:
                key = pid[0]
                piece = next(p for p in index.tensors[key].pieces if _piece_id(key, p) == pid)
                serve[pid] = data.read(key, piece)
    except Exception as e:
        err = e
    gather_errors(group, err)
    received: dict[tuple, Any] = {}
    for served in group.all_gather_object(serve):
        received.update(served)
    return {pid: received[pid] for pid in missing}


def load_indexed(
    state_dict: dict,
    index: PieceIndex,
    process_group=None,
    aoa_config: dict | None = None,
    mw_name_compatibility: bool = True,
) -> list[str]:
    """Load ``index`` into ``state_dict`` in place (collective); returns the target keys the checkpoint lacked."""
    group = Comm(process_group)
    targets, plan, missing = _plan_load(group, state_dict, index, aoa_config, mw_name_compatibility)
    if missing:
        logger.warning("keys %s are not in the checkpoint %s and were left unchanged", sorted(missing), index.root)

    data = PieceData(index)
    wanted: dict[tuple, Piece] = {}
    for items in plan.values():
        for a in items:
            for p in pieces_overlapping(index, a.src_key, a.src_offset, a.src_shape):
                wanted[_piece_id(a.src_key, p)] = p
    remote = _fetch_remote(group, index, data, wanted)

    def fetch(key: str, piece: Piece) -> np.ndarray:
        pid = _piece_id(key, piece)
        return remote[pid] if pid in remote else data.read(key, piece)

    err: BaseException | None = None
    staged: list[tuple[Target, np.ndarray, np.ndarray | None]] = []
    try:
        staged = _stage(targets, plan, index, fetch)
        data.close()
    except Exception as e:
        err = e
    gather_errors(group, err)
    for t, box, covered in staged:
        _write_back(t, box, covered)
    return missing


def _plan_load(group: Comm, state_dict: dict, index: PieceIndex, aoa_config, mw_name_compatibility: bool):
    """``(targets, plan, missing)`` of a load, decided on every rank; an error on any rank is raised on all."""
    err: BaseException | None = None
    targets: list[Target] = []
    plan: dict[str, list[Assignment]] = {}
    missing: list[str] = []
    try:
        for key, val in flatten_state_dict(state_dict).items():
            t = make_target(key, val)
            if t is not None:
                targets.append(t)
    except Exception as e:
        err = e
    infos = group.all_gather_object(target_shard_info(targets)) if aoa_config is not None else []
    if err is None:
        try:
            if aoa_config is not None:
                plan = plan_aoa(aoa_config, index, targets, infos)
                missing = [t.key for t in targets if not plan.get(t.key)]
            else:
                plan, missing, err = _plain_plan(index, targets, mw_name_compatibility)
                if err is None and missing:  # stock raises KeyError here (its resharder), before reading
                    err = StockMissingKeyError(
                        f"keys {sorted(missing)} of the state dict are not in the checkpoint {index.root}; load a "
                        f"state dict of the keys it holds ({len(index.tensors)} keys), or map them with aoa_config"
                    )
        except Exception as e:
            err = e
    gather_errors(group, err)
    return targets, plan, missing


def _stage(targets: list, plan: dict, index: PieceIndex, fetch) -> list:
    """Every planned target's values as a host array (read box), with a coverage mask where aoa left parts
    unmapped (None: all covered)."""
    staged = []
    by_key = {t.key: t for t in targets}
    for key, items in plan.items():
        t = by_key[key]
        off, shape = t.read_box()
        if len(items) == 1 and items[0].postprocess is None and tuple(items[0].src_shape) == tuple(shape):
            a = items[0]
            staged.append((t, assemble_box(a.src_key, index, a.src_offset, a.src_shape, fetch), None))
            continue
        box = np.zeros(shape, dtype=storage_dtype(t.dtype))
        covered = np.zeros(shape, dtype=bool)
        for a in items:
            arr = assemble_box(a.src_key, index, a.src_offset, a.src_shape, fetch)
            arr, dtype = postprocess(arr, index.tensors[a.src_key].dtype, a.postprocess)
            if dtype != t.dtype:
                raise DtypeMismatchError(f"key {key!r}: aoa_config yields {dtype}, the target is {t.dtype}")
            sl = tuple(slice(o, o + s) for o, s in zip(a.dst_offset, arr.shape))
            if box[sl].shape != arr.shape:
                raise ShapeMismatchError(
                    f"key {key!r}: aoa_config places a {list(arr.shape)} block at {list(a.dst_offset)} of a "
                    f"{list(shape)} target"
                )
            box[sl] = arr
            covered[sl] = True
        staged.append((t, box, None if covered.all() else covered))
    return staged


def _write_back(t, box: np.ndarray, covered: np.ndarray | None) -> None:
    """Copy a staged box into its target (its own slice of it); unmapped parts keep their current values."""
    flat = box.reshape(-1)
    fs = t.flat_slice()
    if covered is not None:
        current = np.ascontiguousarray(t.tensor.numpy()).reshape(-1).view(storage_dtype(t.dtype))
        mask = covered.reshape(-1)
        if fs is not None:
            flat, mask = flat[fs], mask[fs]
        flat = np.where(mask, flat, current)
    elif fs is not None:
        flat = flat[fs]
    _assign(t.tensor, to_paddle(flat, t.dtype))


def _assign(dst, src) -> None:
    import paddle

    src = src.reshape(dst.shape)
    if not dst.place.is_cpu_place():
        src = src.to(dst.place)
    paddle.assign(src, output=dst)

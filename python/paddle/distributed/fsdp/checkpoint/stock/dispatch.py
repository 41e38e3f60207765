"""``paddle.distributed.save_state_dict`` / ``load_state_dict`` with the fork installed: stock's signature, stock's
results for every input stock accepts, the FSDP engine where it adds something.

Who does what (the import hook points both functions here):

save
  * this engine (safetensors + metadata.json + COMMIT, atomic, checksummed) when the call needs it: JSON values
    in the state dict, engine options (``chunk_bytes``, ``options``, ...), flattened ``ShardedWeight``s
    (FSDP state; stock cannot load those on CPU) unless ``safetensors=False`` is passed explicitly, and
    ``safetensors=True`` calls with plain tensors / box ``ShardedWeight``s and no ``unique_id`` /
    ``save_replicas``;
  * stock's own ``save_state_dict`` otherwise: the default ``safetensors=False`` (stock's ``.distcp`` pickles, the
    only files stock readers with default arguments and ``merge_sharded_state_dict`` read), semi-auto-parallel
    ``DistTensor``s, ``unique_id`` versions, ``save_replicas``. Stock's save is correct on CPU.
  A call that needs this engine but asks for ``safetensors=False`` (or a ``unique_id`` > 0) is refused with
  :class:`StockFormatError` saying what to pass.
  A URL of a storage backend (``s3://bucket/prefix``) always goes to this engine: stock cannot write URLs (it
  would write a local directory named ``s3:``); an explicit ``safetensors=False``, a ``unique_id`` > 0 or
  ``save_replicas`` on a URL are refused with :class:`StockFormatError`.

load (stock's loader is never used: it unpickles, and its resharding calls ``.cuda()``)
  * this engine for its own checkpoints (DistTensors become boxes of their local values), and for every URL
    (``aoa_config`` or ``unique_id`` > 0 on a URL: StockFormatError);
  * ``loader.py`` for stock checkpoints (``.distcp`` or safetensors, any ``unique_id``; restricted unpickler),
    plain Hugging Face safetensors directories (``safetensors=True``) and any ``aoa_config``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ...keywords import check_keywords, keyword_names
from ..coordination import Comm, gather_errors
from ..errors import NotACheckpointError, UnrepresentableKeyError
from ..format.metadata import COMMIT_FILE, LATEST_FILE, METADATA_FILE
from ..format.reserved import key_problem
from ..paths import local_path, url_scheme
from .errors import (
    CheckpointPathNotADirectoryError,
    CheckpointPathNotFoundError,
    InvalidArgumentError,
    NoCheckpointMetadataError,
    StockFormatError,
)
from .index import index_fork, index_hf, index_stock, stock_versions
from .loader import load_indexed
from .targets import dist_tensor_box, is_dist_tensor

logger = logging.getLogger(__name__)

DERIVE_WEIGHTS_ENV = "PADDLE_FSDP_CKPT_DERIVE_WEIGHTS"  # options.py's switch of derive_weights
FORK_SAVE_OPTIONS = frozenset({"chunk_bytes", "write_stock_metadata", "options"})
FORK_LOAD_OPTIONS = frozenset({"verify_checksums", "strict", "options"})
COMM_METHODS = ("send_recv", "broadcast", "multi_group_broadcast", "grouped_send_recv", "parallel_broadcast")


class _Default:
    """Marks an argument the caller did not pass (``safetensors=False`` passed explicitly means "stock format")."""

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "False"


DEFAULT = _Default()


def _check_options(given: dict, allowed: frozenset, fn: str, stock: Any) -> None:
    """Stock's TypeError for a keyword neither stock's ``stock`` nor this engine takes, with the nearest one. The
    only check of the call: the engine is then entered behind its own keyword check (``run_save`` / ``run_load``)."""
    check_keywords(fn, given, set(keyword_names(stock)) | allowed)


def _is_tensor_like(v: Any) -> bool:
    import paddle
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

    return isinstance(v, (paddle.Tensor, ShardedWeight))


def _holds_tensors(d: dict) -> bool:
    return any(_is_tensor_like(v) or (isinstance(v, dict) and _holds_tensors(v)) for v in d.values())


def flatten_for_engine(state_dict: dict) -> dict:
    """Nested dicts that hold tensors become ``a.b`` keys (stock's naming); dicts of plain values stay values;
    DistTensors become box ShardedWeights of their local value (whole-tensor ones plain tensors)."""
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

    out: dict = {}

    def walk(prefix: str, d: dict) -> None:
        for k, v in d.items():
            key = f"{prefix}{k}"
            if key in out:
                raise _collision(key)
            if isinstance(v, dict) and _holds_tensors(v):
                walk(key + ".", v)
            elif is_dist_tensor(v):
                box = dist_tensor_box(v)
                if box is None:
                    continue
                local, offset, shape = box
                gshape = tuple(int(s) for s in v.shape)
                out[key] = local if shape == gshape else ShardedWeight(key, local, shape, gshape, offset)
            else:
                out[key] = v

    walk("", state_dict)
    return out


def _collision(key: str) -> UnrepresentableKeyError:
    return UnrepresentableKeyError(
        f"key {key!r:.200}: two entries of the state dict have this flat name (nested dicts are stored as "
        f"'outer.inner'): one would silently replace the other; rename one of them"
    )


def check_stock_names(state_dict: dict, safetensors: bool) -> None:
    """Before stock's own save: refuse what its files cannot give back exactly: two entries with one flat name
    (stock's ``flatten_state_dict`` keeps the last one); with ``safetensors`` also a tensor name the safetensors
    header reserves or cannot hold (format/reserved.py)."""
    seen: set[str] = set()

    def walk(prefix: str, d: dict) -> None:
        for k, v in d.items():
            if not isinstance(k, str):
                continue  # stock's own error
            key = f"{prefix}{k}"
            if isinstance(v, dict):
                walk(key + ".", v)
                continue
            if key in seen:
                raise _collision(key)
            seen.add(key)
            problem = key_problem(key, tensor=True) if safetensors and _is_tensor_like(v) else None
            if problem is not None:
                raise UnrepresentableKeyError(f"key {key!r:.200}: cannot be saved: {problem}")

    walk("", state_dict)


def _save_route(state_dict: Any, unique_id, safetensors, save_replicas: bool, fork_options: dict) -> str:
    if not isinstance(state_dict, dict):
        return "stock"  # stock's own error for non-dicts
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

    values = list(flatten_for_engine_probe(state_dict))
    has_json = any(not _is_tensor_like(v) for v in values)
    has_flat = any(isinstance(v, ShardedWeight) and (v.is_flattened or v.flattened_range is not None) for v in values)
    has_dist = any(is_dist_tensor(v) for v in values)
    explicit = not isinstance(safetensors, _Default)
    if has_json or fork_options:
        why = "JSON values in the state dict" if has_json else f"engine options {sorted(fork_options)}"
        if explicit and not safetensors:
            raise StockFormatError(
                f"save_state_dict: {why} need the FSDP checkpoint engine, which writes safetensors only; pass "
                f"safetensors=True (stock paddle reads such checkpoints with load_state_dict(..., safetensors=True)) "
                f"or save only tensors for stock's pickle format"
            )
        if unique_id not in (None, 0) or save_replicas:
            raise StockFormatError(
                f"save_state_dict: {why} need the FSDP checkpoint engine, which keeps one version per directory; drop "
                f"unique_id={unique_id!r} / save_replicas={save_replicas!r} or save only tensors"
            )
        return "fork"
    if has_flat and not explicit and unique_id is None and not save_replicas:
        return "fork"
    if safetensors and not has_dist and unique_id is None and not save_replicas:
        return "fork"
    return "stock"


def _url_route(state_dict: Any, path: str, unique_id, safetensors, save_replicas: bool) -> str:
    """A URL of a storage backend (``s3://``) that stock would serve: stock cannot write URLs at all (it takes
    ``s3://b/run`` for a relative path and writes a local directory named ``s3:``), and only this engine reads
    them back, so the engine's format serves it. Refused by name: what asks for stock's own files or versions."""
    if not isinstance(state_dict, dict):
        return "stock"  # stock's own error, raised before it writes anything
    if not isinstance(safetensors, _Default) and not safetensors:
        raise StockFormatError(
            f"save_state_dict: {path} is a URL; stock's pickle format (safetensors=False) is written to local "
            "directories only (stock itself would write a local directory named 's3:'). Leave safetensors unset "
            "or pass True: the FSDP checkpoint engine then writes the URL, and load_state_dict reads it back"
        )
    if unique_id not in (None, 0) or save_replicas:
        raise StockFormatError(
            f"save_state_dict: {path} is a URL, written by the FSDP checkpoint engine, which keeps one version per "
            f"location; drop unique_id={unique_id!r} / save_replicas={save_replicas!r}"
        )
    return "fork"


def flatten_for_engine_probe(d: dict):
    for v in d.values():
        if isinstance(v, dict) and _holds_tensors(v):
            yield from flatten_for_engine_probe(v)
        else:
            yield v


def _has_device_sync() -> bool:
    import paddle

    return bool(paddle.is_compiled_with_cuda() or paddle.is_compiled_with_xpu())


def stock_save():
    from paddle.distributed.flex_checkpoint.dcp.save_state_dict import save_state_dict as stock

    return stock


def save_state_dict(
    state_dict: dict,
    path: str,
    process_group=None,
    coordinator_rank: int = 0,
    unique_id: int | None = None,
    async_save: bool = False,
    safetensors: bool = DEFAULT,
    save_replicas: bool = False,
    **fork_options: Any,
):
    """Stock's ``save_state_dict`` signature; routed as the module docstring says. Returns the engine's
    SaveHandle for an async save by the engine, else None (as stock)."""
    _check_options(fork_options, FORK_SAVE_OPTIONS, "save_state_dict", save_state_dict)
    route = _save_route(state_dict, unique_id, safetensors, save_replicas, fork_options)
    logger.debug("save_state_dict(%s): %s", path, route)
    if route == "stock" and url_scheme(path) is not None:
        local_path(path)  # a scheme no backend serves: UnsupportedURLError
        route = _url_route(state_dict, path, unique_id, safetensors, save_replicas)
    if route == "stock":
        if async_save and not _has_device_sync():
            # stock's async save starts with paddle.device.synchronize(), which raises TypeError on CPU-only
            # builds: write the same files synchronously instead (the save is complete when this returns)
            logger.info("save_state_dict(%s): async_save on a CPU-only build is done synchronously", path)
            async_save = False
        if isinstance(state_dict, dict):  # anything else: stock's own error
            check_stock_names(state_dict, bool(safetensors))
        return stock_save()(
            state_dict,
            path,
            process_group=process_group,
            coordinator_rank=coordinator_rank,
            unique_id=unique_id,
            async_save=async_save,
            safetensors=bool(safetensors),
            save_replicas=save_replicas,
        )
    from ..save.request import save_request
    from ..save.save import run_save

    flat = flatten_for_engine(state_dict)
    if "options" not in fork_options and DERIVE_WEIGHTS_ENV not in os.environ:
        # stock's door writes every tensor it is given, as stock does (issue #52's derived weights leave out a
        # weight that equals its master cast: a stock reader without the fork would miss it); opt in with
        # options=CheckpointOptions(derive_weights=True) or the environment switch
        fork_options = {**fork_options, "derive_weights": False}
    return run_save(
        save_request(flat, path, process_group, coordinator_rank, None, async_save=async_save, **fork_options)
    )


def classify(path: str, unique_id: int | None, safetensors: bool) -> str:
    """Which reader serves ``path``: "fork" (the engine), "stock", or "hf"; "missing", "file" or "none" (a
    directory without checkpoint metadata) for paths that hold no checkpoint (the engine says why)."""
    root = local_path(path)
    if url_scheme(root) is not None:  # a URL of a storage backend (s3://): only this engine reads those
        return "fork"
    if not os.path.lexists(root):
        return "missing"
    if not os.path.isdir(root):
        return "file"
    names = set(os.listdir(root))
    fork = COMMIT_FILE in names or METADATA_FILE in names or LATEST_FILE in names
    versions = stock_versions(root)
    distcp = {v for v, d in versions.items() if d["metadata"] and d["distcp"]}
    if unique_id is not None:
        return "fork" if fork and unique_id == 0 and 0 not in distcp else "stock"
    if distcp and not safetensors:
        return "stock"
    if fork:
        return "fork"
    if any(d["metadata"] for d in versions.values()):
        return "stock"
    if safetensors and any(n.endswith(".safetensors") for n in names):
        return "hf"
    return "none"  # the engine names what is there (an interrupted save, nothing)


NO_CHECKPOINT = {
    "missing": CheckpointPathNotFoundError,
    "file": CheckpointPathNotADirectoryError,
    "none": NoCheckpointMetadataError,
}


def _engine_load(state_dict, path, process_group, coordinator_rank, fork_options: dict):
    from ..load import run_load as engine_load

    flat = flatten_for_engine(state_dict) if isinstance(state_dict, dict) else state_dict
    same = isinstance(state_dict, dict) and flat.keys() == state_dict.keys()
    target = state_dict if same and all(flat[k] is state_dict[k] for k in flat) else flat
    report = engine_load(target, path, process_group, coordinator_rank, **fork_options)
    if target is not state_dict:  # JSON values loaded into the flattened view go back to the caller's dict
        for k in report.loaded_keys if report is not None else []:
            if k in state_dict and not _is_tensor_like(state_dict[k]) and not isinstance(state_dict[k], dict):
                state_dict[k] = target[k]
    return report if fork_options else None  # stock returns None; engine options ask for the engine's report


def load_state_dict(
    state_dict: dict,
    path: str,
    process_group=None,
    coordinator_rank: int = 0,
    unique_id: int | None = None,
    offload: bool = False,
    mw_name_compatibility: bool = True,
    aoa_config: dict | None = None,
    safetensors: bool = False,
    worker_groups: list | None = None,
    comm_method: str = "broadcast",
    **fork_options: Any,
):
    """Stock's ``load_state_dict`` signature; in place, all-or-nothing, on CPU as on GPU. ``offload``,
    ``worker_groups`` and ``comm_method`` choose how stock moves data between devices and ranks; this loader
    reads on the host and exchanges only what a rank cannot read itself, so they do not change the result.
    Returns None, as stock; the engine's ``LoadReport`` when an engine option (``strict``, ``verify_checksums``,
    ``options``) is passed."""
    _check_options(fork_options, FORK_LOAD_OPTIONS, "load_state_dict", load_state_dict)
    if comm_method not in COMM_METHODS:
        raise InvalidArgumentError(
            f"Invalid communication method '{comm_method}'. Please choose from {list(COMM_METHODS)}."
        )
    group = Comm(process_group)
    kind = classify(path, unique_id, bool(safetensors))
    kinds = group.all_gather_object(kind)
    if len(set(kinds)) > 1:
        raise NotACheckpointError(
            f"load of {path}: the ranks see different kinds of checkpoint there ({dict(enumerate(kinds))}); give "
            f"every rank a directory holding the same checkpoint"
        )
    if kind in NO_CHECKPOINT:
        try:
            return _engine_load(state_dict, path, process_group, coordinator_rank, fork_options)
        except NotACheckpointError as e:  # raised as stock would: FileNotFoundError, NotADirectoryError, assert
            raise NO_CHECKPOINT[kind](str(e)) from None
    if url_scheme(path) is not None and (aoa_config is not None or unique_id not in (None, 0)):
        raise StockFormatError(
            f"load_state_dict: {path} is a URL, a checkpoint of the FSDP checkpoint engine (one version per "
            f"location); aoa_config and unique_id > 0 apply to stock's local checkpoints only"
        )
    if kind == "fork" and aoa_config is None:
        return _engine_load(state_dict, path, process_group, coordinator_rank, fork_options)
    if fork_options:
        raise StockFormatError(
            f"load_state_dict: options {sorted(fork_options)} apply to this engine's checkpoints; {path} is read by "
            f"the stock-format loader"
        )
    err, index = None, None
    try:
        root = os.path.abspath(os.fspath(path))
        index = (
            index_fork(root) if kind == "fork" else index_stock(root, unique_id) if kind == "stock" else index_hf(root)
        )
    except Exception as e:
        err = e
    gather_errors(group, err)
    load_indexed(state_dict, index, process_group, aoa_config, mw_name_compatibility)
    return None

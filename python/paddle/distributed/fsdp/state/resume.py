"""One-call checkpointing of a FullyShardFusion model: tensors, optimizer, LR scheduler, RNG, user state.

Built on the storage engine in ``checkpoint/``. WHAT is saved and how it is applied is decided by the owner of
the resume state, resume_state.py (tensors, and small JSON values under the reserved keys of
``checkpoint/format/reserved.py``: optimizer class and non-tensor state, every rank's random generator state, a
GradScaler, stateful objects such as the data sampler, an EMA, the caller's ``extra_state``); this module is the
disk and object-store door: saving, loading with its checks, retries and fallback.

Numbered checkpoints (``checkpoint/manager.py``)::

    fsdp.save_checkpoint(root, optimizer=opt, step=1200, keep_last=3)   # root/step_00001200, then `latest`
    result = fsdp.load_checkpoint(root, optimizer=opt)                  # loads what root/latest names
    result.step, result.path, result.report                             # result is the extra_state dict

A loss scaler (``paddle.amp.GradScaler``) is saved and restored with ``grad_scaler=scaler`` on both calls
(state/grad_scaler.py: scale bit-exact, counters, settings); its numpy state does not fit ``extra_state``.

``latest`` moves only after the new checkpoint is committed, and older checkpoints are removed only after that.

Loads are all-or-nothing and refuse, on every rank together and before any tensor is written: a path that is
not a (committed) checkpoint, an optimizer of another class than the saved one (OptimizerMismatchError), and
with ``strict=True`` a checkpoint of another model: keys it lacks (MissingKeyError), keys the model does not
have (UnexpectedKeyError), other shapes or dtypes (ShapeMismatchError / DtypeMismatchError); each error names
the key. ``strict=False`` loads the matching subset and returns the rest in ``result.report`` (also logged).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from ..checkpoint import CheckpointManager, CheckpointOptions, LoadReport, lossy
from ..checkpoint.coordination import Comm, gather_errors, stage_error
from ..checkpoint.directory import open_checkpoint
from ..checkpoint.errors import LoadFailedError, PartiallyLoadedError, UnexpectedKeyError
from ..checkpoint.format.reserved import BUFFERS_KEY, EXTRA_KEY, FROZEN_BASE_KEY, RESERVED_PREFIX
from ..checkpoint.gc_pause import gc_paused
from ..checkpoint.io.backends import backend_for
from ..checkpoint.lineage import Lineage
from ..checkpoint.load import run_load
from ..checkpoint.load_checks import named_read_error
from ..checkpoint.manager import (
    is_checkpoint_root,
    parse_step,
    resolve_checkpoint_collective,
    retry_removed,
    step_dir_name,
)
from ..checkpoint.paths import local_path
from ..checkpoint.save.request import save_request
from ..checkpoint.save.save import run_save
from ..checkpoint.selection import survey
from . import frozen_base, replicas, resume_state
from .apply import apply_on_every_rank
from .buffers import persistable_buffers, warn_if_buffers_differ
from .records import refresh_master_weights
from .resume_state import ResumeObjects

logger = logging.getLogger(__name__)

HF_FORMAT_NAMES = {"hf", "huggingface", "hugging_face", "hf_safetensors", "transformers"}


class LoadResult(dict):
    """What :func:`load_checkpoint` returns: the saved ``extra_state`` (this dict itself, so
    ``extra = fsdp.load_checkpoint(...)`` keeps working) plus what the load did.

    Attributes:
        report: the engine's LoadReport (loaded, missing, mismatched and unexpected keys; bytes read; host
            memory held).
        path: the checkpoint directory that was loaded (for a root: the one ``latest`` named, or the older one
            the load fell back to).
        step: its step when it is a CheckpointManager directory (``step_<N>``), else None.
        fallback_from: ``[(checkpoint, error)]`` for the newer checkpoints of a root that failed mid-load before
            this one loaded (empty normally).
    """

    def __init__(self, extra_state: dict, report: LoadReport, path: str) -> None:
        super().__init__(extra_state)
        self.report = report
        self.path = path
        self.step = parse_step(os.path.basename(path))
        self.fallback_from: list[tuple[str, str]] = []


@gc_paused()  # the state dict of every piece: many small objects, no cycles (checkpoint/gc_pause.py)
def save_checkpoint(
    fsdp,
    path: str,
    optimizer=None,
    extra_state: dict | None = None,
    *,
    step: int | None = None,
    keep_last: int | None = None,
    format: str = "fsdp",
    async_save: bool = False,
    options: CheckpointOptions | None = None,
    grad_scaler=None,
    stateful: dict | None = None,
    ema=None,
    lineage: Lineage | None = None,
    save_frozen: bool | None = None,
    derive_weights: bool | None = None,
    quantize_moments: str | None = None,
):
    """Save everything needed to resume bit-exactly (unless ``quantize_moments``). Collective: every rank of the group calls it.

    With ``step``, ``path`` is a checkpoint root: the checkpoint goes to ``path/step_<step>``, ``path/latest``
    names it once it is committed, and with ``keep_last=K`` only the K newest steps are kept (removed after
    the commit). ``options``: the engine's CheckpointOptions (None: from the environment). Returns the engine's
    SaveHandle when ``async_save`` (call ``wait()`` before relying on the files; ``latest`` and pruning happen in
    the background too). An async save does not stall training: it returns after capturing RNG, LR scheduler,
    ``extra_state`` and non-trainable tensors; parameters and optimizer state are copied during the next
    forward/backward, and the next ``optimizer.step()`` waits for that copy by itself (see
    checkpoint/snapshot_guard.py for what else waits). ``quantize_moments="int8"|"int4"`` (default: the
    options' ``quantize_moments``, PADDLE_FSDP_CKPT_QUANTIZE_MOMENTS, else exact; ``"none"``: exact whatever they say) stores Adam's moments lossily, ~4x resp. ~8x
    smaller (checkpoint/lossy.py); loading such a checkpoint warns that the resume is not bit-exact. ``grad_scaler``: a ``paddle.amp.GradScaler`` whose state
    (loss scale, counters, settings) is saved too (state/grad_scaler.py). ``stateful``: ``{name: object}`` of
    objects with ``state_dict()``/``set_state_dict()`` (a data sampler, fsdp/sampler.py), saved per rank
    (state/stateful.py). ``ema``: a ShardedEMA (``fsdp.ema(coef)``, state/ema.py) saved with the weights.
    ``lineage``: the run this checkpoint belongs to (checkpoint/lineage.py), written in its commit record, which is
    what rotation and resume compare (None: with ``step``, the run this process resumed from the root, else its own
    run there, checkpoint/root_runs.py; without ``step``, none). What a
    checkpoint holds is decided in one place: state/resume_state.py. ``derive_weights`` (None: the options'
    default, True): bf16/fp16 weights equal to their fp32 master weight cast are not stored, loads derive them
    (issue #52; checkpoint/save/derive.py).
    """
    if str(format).lower() in HF_FORMAT_NAMES:
        raise ValueError(
            "save_checkpoint writes sharded FSDP checkpoints only: Hugging Face safetensors need whole "
            "parameters, which no rank holds. Save normally, then convert offline with "
            "`paddle-fsdp-ckpt to-hf CKPT_DIR OUT_DIR`."
        )
    if str(format).lower() != "fsdp":
        raise ValueError(f"unknown checkpoint format {format!r} (supported: 'fsdp')")
    objs = ResumeObjects(fsdp, optimizer, grad_scaler, stateful, ema, extra_state, with_frozen_base=save_frozen)
    manager = None
    if step is not None:
        step_dir_name(step)  # validates before any collective
        manager = CheckpointManager(path, keep_last=keep_last, process_group=fsdp._checkpoint_group)
    elif keep_last is not None:
        raise ValueError("keep_last needs step=: numbered checkpoints live in a root as step_<N> directories")
    state, per_rank, deferred, failed = _capture(objs, async_save)
    state, deferred, failed = _quantize(fsdp, state, deferred, failed, quantize_moments, options)
    save_options = dict(
        async_save=async_save,
        deferred_keys=deferred,
        per_rank_values=per_rank,
        options=options,
        derive_weights=derive_weights,
    )
    # the engine's requests directly: this function's keywords are its door's (FullyShardFusion.save_checkpoint);
    # what the capture raised on this rank goes to the save's first exchange, which every rank raises alike
    if manager is not None:
        return run_save(manager.save_request(step, state, save_options, lineage, caller_error=failed))
    record = lineage.record if lineage is not None else None
    return run_save(
        save_request(state, path, fsdp._checkpoint_group, 0, None, caller_error=failed, lineage=record, **save_options)
    )


def _quantize(fsdp, state: dict, deferred, failed, mode, options):
    """The lossy-moments transform (checkpoint/lossy.py), collective on every rank alike; what fails goes to the
    save's first exchange like a capture error. ``mode`` None: the options' (PADDLE_FSDP_CKPT_QUANTIZE_MOMENTS)."""
    try:
        options = options if options is not None else CheckpointOptions.from_env()
        if mode is None:
            mode = None if options.quantize_moments == "none" else options.quantize_moments
        mode = lossy.check_mode(mode)
    except Exception as e:  # noqa: BLE001 - alike on every rank; reported by the save's exchange
        return state, deferred, failed or e
    if mode is None:
        return state, deferred, failed
    try:
        state, quantized = lossy.quantize_state(
            state, mode, Comm(fsdp._checkpoint_group), threads=options.codec_threads
        )
    except Exception as e:  # noqa: BLE001 - as above
        return state, deferred, failed or e
    if deferred is not None:  # the codes are fresh tensors taken now: nothing of a quantized key is deferred
        gone = set(quantized)
        deferred = [k for k in deferred if k not in gone]
    return state, deferred, failed


def _capture(objs: ResumeObjects, async_save: bool):
    """This rank's state to save (resume_state.build: user code runs here, the stateful objects' ``state_dict()``,
    the EMA), then the comparison of the buffers across ranks (a collective every rank joins, also one whose
    capture failed). Returns ``(state, per_rank_keys, deferred_keys, error)``; never raises: a rank failing
    alone here would leave the others waiting in the save's exchange (issue #50)."""
    state: dict = {}
    per_rank: tuple = ()
    deferred = None
    failed: BaseException | None = None
    try:  # collective, once per run (every rank alike: the same model): the reference the capture writes
        if objs.references_frozen_base:
            frozen_base.fingerprint(objs.fsdp)
    except Exception as e:  # noqa: BLE001 - reported to every rank by the save's exchange
        failed = e
    try:
        built = resume_state.build(objs)
        state, per_rank = built.state_dict(), built.per_rank_keys
        deferred = [key for key in built.tensors if key in built.deferred] if async_save else None
    except Exception as e:  # noqa: BLE001 - reported to every rank by the save's exchange
        failed = failed or e
    try:
        warn_if_buffers_differ(objs.fsdp, objs.buffers)
    except Exception as e:  # noqa: BLE001 - as above
        failed = failed or e
    return state, per_rank, deferred, failed


def _foreign_keys(metadata, fsdp) -> list[str]:
    """Checkpoint keys that belong to no parameter of this model (optimizer state ``<param key>.<name>`` and
    reserved ``__fsdp__.*`` values belong; a TENSOR under the reserved prefix, saved before saves refused them,
    does not)."""
    model_keys = {key for key, _param, _buffer, _index in fsdp.managed_parameters()}
    model_keys.update(persistable_buffers(fsdp.model))
    model_keys.update(getattr(fsdp, "_expert_keys", ()))  # under EP: the experts other EP ranks hold
    out = []
    for key in list(metadata.tensors) + list(metadata.values):
        if key in model_keys or (key.startswith(RESERVED_PREFIX) and key in metadata.values):
            continue
        head = key
        while "." in head:  # "blocks.0.mix.weight.moment1" -> "blocks.0.mix.weight"
            head = head.rsplit(".", 1)[0]
            if head in model_keys:
                break
        else:
            out.append(key)
    return sorted(out)


def _precheck(objs: ResumeObjects, resolved: str, metadata, strict: bool) -> tuple[list[str], Callable[[], None]]:
    """Everything a load must refuse before any tensor is written (this rank; ``_load_once`` exchanges the verdict):
    keys of another model, and every item of non-tensor state decoded and validated by the owner of the resume
    state (state/resume_state.py: optimizer class and global state with the LR scheduler, this rank's RNG,
    GradScaler, stateful objects, EMA, ``extra_state``). Returns the foreign keys and the function applying the
    decoded state (only user code can fail in it: ``_load_once`` agrees on that outcome too)."""
    fsdp = objs.fsdp
    foreign = _foreign_keys(metadata, fsdp)
    if foreign and strict:
        raise UnexpectedKeyError(
            f"checkpoint {resolved} holds {len(foreign)} key(s) this model does not have (a checkpoint of another "
            f"model?): {foreign[:5]}{' ...' if len(foreign) > 5 else ''}; pass strict=False to load the rest"
        )
    saved = resume_state.Saved(metadata.values, fsdp._checkpoint_rank, resume_state.checkpoint_world(fsdp))
    return foreign, resume_state.decode(objs, saved, strict, f"checkpoint {resolved}")


@gc_paused()
def load_checkpoint(
    fsdp,
    path: str,
    optimizer=None,
    *,
    strict: bool = True,
    verify_checksums: bool = True,
    atomic: bool = False,
    max_host_bytes: int | None = None,
    options: CheckpointOptions | None = None,
    grad_scaler=None,
    stateful: dict | None = None,
    ema=None,
    model_only: bool = False,
    exact: bool = False,
) -> LoadResult:
    """Restore what :func:`save_checkpoint` wrote into ``fsdp``'s model and ``optimizer``, in place.

    ``path`` is a checkpoint directory or a root written with ``step=`` (its ``latest`` checkpoint is loaded).
    All-or-nothing: every key, shape, dtype, coverage and checksum, and every piece of non-tensor state
    (optimizer class and global state, LR scheduler class and fields with their types, RNG, ``extra_state``) is
    decoded and checked on every rank, and the verdict exchanged, before anything is written; on failure every
    rank raises the same named error and every model and optimizer tensor is bit-identical to before (an
    optimizer without state yet gets its freshly initialised accumulators, as its first step would create them).
    For a root, a load that loses a race with ``keep_last`` rotation retries with what ``latest`` names now.

    The data is then read straight into the tensors with bounded host memory (``max_host_bytes``, default
    ``max(64 MiB, 2%)`` of the rank's state); data found corrupt while reading stops the load on every rank with
    PartiallyLoadedError (tensors partly written). Given a root, the load then falls back to the newest older
    committed checkpoint (logged, listed in ``result.fallback_from``), which overwrites every tensor again;
    ``atomic=True`` instead keeps an undo copy of the rank's state and restores it on any failure.
    Returns a :class:`LoadResult`: the saved ``extra_state`` dict, with ``.report``, ``.path``, ``.step`` and
    ``.fallback_from``. ``grad_scaler``: a ``paddle.amp.GradScaler`` to restore (saved with ``grad_scaler=``;
    with ``strict``, a checkpoint without its state is refused, state/grad_scaler.py). ``stateful``: the objects
    saved with ``stateful=``, restored with ``set_state_dict`` (state/stateful.py); ``ema``: the ShardedEMA saved
    with ``ema=`` (resharded like the weights at another world size).

    Saved state left unrequested (the checkpoint holds optimizer, GradScaler, EMA or stateful state and the
    call did not pass that object) is listed in ``result.report.left_unrequested`` and logged as ONE warning per
    load naming the parts, unless ``model_only=True`` says that is intended (then no other object may be given).

    A checkpoint saved with ``quantize_moments`` resumes close to, not bit-identical with, the run: its load
    warns (``LossyCheckpointWarning``) when it restores the optimizer; ``exact=True`` refuses it instead
    (``LossyCheckpointError``, before anything is written).
    """
    if type(model_only) is not bool:
        raise TypeError(f"model_only must be a bool, got {model_only!r}")
    if model_only and any(o for o in (optimizer, grad_scaler, stateful, ema)):
        raise ValueError("model_only=True loads the model alone: pass no optimizer, grad_scaler, stateful or ema")
    objs = ResumeObjects(fsdp, optimizer, grad_scaler, stateful, ema)  # TypeError for a wrong object, first
    root = local_path(path)  # a local directory, or a URL of a storage backend (s3://)
    skipped: list[tuple[str, str]] = []
    target = path
    while True:
        try:
            result = _load_retrying(objs, target, strict, verify_checksums, atomic, max_host_bytes, options, exact)
        except PartiallyLoadedError as e:
            failed = getattr(e, "checkpoint", None)
            # decided alike on every rank (a rank that cannot list the root must not give up alone while its
            # peers fall back: their next collective would meet nobody)
            older = _agreed(fsdp, e, lambda f=failed: _older_checkpoint(root, f) if f not in (None, root) else None)
            if older is None:
                raise
            skipped.append((failed, str(e)))
            logger.warning("load_checkpoint(%s): %s failed mid-load (%s); falling back to %s", root, failed, e, older)
            target = older
            continue
        result.fallback_from = skipped
        left = result.report.left_unrequested
        if left and not model_only:
            logger.warning(
                "load_checkpoint(%s): the checkpoint also holds %s state, not restored because no object was given "
                "for it (pass %s to restore it, or model_only=True to load the model alone without this warning)",
                result.path,
                ", ".join(left),
                " / ".join(_HOW_TO_PASS.get(part.split("[")[0], part) for part in left),
            )
        return result


_HOW_TO_PASS = {"optimizer": "optimizer=", "grad_scaler": "grad_scaler=", "ema": "ema=", "stateful": "stateful="}


def _agreed(fsdp, failure: BaseException, decide: Callable[[], Any]) -> Any:
    """What ``decide()`` answers on every rank of the checkpoint group, if they all answer alike; else (or
    when it raised on some rank) ``failure``, the error being handled, is raised on every rank with why."""
    answer, err = None, None
    try:
        answer = decide()
    except Exception as e:  # noqa: BLE001 - whatever fails must reach the exchange below
        err = e
    try:
        answers = gather_errors(Comm(fsdp._checkpoint_group), err, answer)
    except Exception as e:  # noqa: BLE001 - the same class on every rank: the error being handled
        raise type(failure)(f"{type(e).__name__}: {e}; while deciding what to do after: {failure}") from e
    if len(set(map(repr, answers))) > 1:
        raise type(failure)(f"the ranks see the checkpoint root differently ({answers}) after: {failure}")
    return answer


def _older_checkpoint(root: str, failed: str) -> str | None:
    """The newest complete ``step_*`` checkpoint of ``root`` with a lower step than ``failed``, of ``failed``'s run
    (checkpoint/selection.py: never a leftover of another run, never a torn copy; None: there is none)."""
    if os.path.dirname(failed) != root:
        return None
    step = parse_step(os.path.basename(failed))
    if step is None:
        return None
    found = survey(root, parse_step, backend_for(root))
    run = next((f.lineage() for f in found if f.name == os.path.basename(failed)), Lineage(None))
    older = [f for f in found if f.complete and f.step < step and run.owns(f)]
    return max(older, key=lambda f: f.order()).location if older else None


def _load_retrying(objs, path, strict, verify_checksums, atomic, max_host_bytes, options, exact=False) -> LoadResult:
    """One load of ``path``, retried when ``keep_last`` rotation removed the checkpoint being read (for a root:
    checkpoint/manager.py ``retry_removed``)."""
    return retry_removed(
        lambda: _load_once(objs, path, strict, verify_checksums, atomic, max_host_bytes, options, exact),
        f"load_checkpoint({path})",
        lambda e: _agreed(objs.fsdp, e, lambda: is_checkpoint_root(path)),
    )


def _targets(objs: ResumeObjects, metadata) -> tuple[dict, Any, Any, BaseException | None]:
    """What the engine loads into on this rank (optimizer state created first), after the precheck's verdict:
    ``(requested, split, error)``. Never raises: what fails goes to the engine's first exchange (``error``)."""
    fsdp = objs.fsdp
    try:
        if objs.optimizer is not None:
            fsdp.init_optimizer_state(objs.optimizer)
        state = resume_state.load_targets(objs)
        for key in resume_state.requested_values(objs, metadata.values):
            state[key] = None  # requested: the engine reports them missing like any key (extra_state is returned)
        pending = lossy.swap_targets(state, metadata.quant)  # quantized moments: their codes and scales instead
        replicate_group = fsdp.group_layout.replicate_group
        degree = fsdp.group_layout.replicate_degree
        split = replicas.split_for_replicas(state, metadata, degree) if replicate_group else None
        # the dict the engine fills: under HSDP a replica's part, which holds the JSON values (extra_state) too
        requested = replicas.my_part(state, split, replicate_group.rank) if split else state
        return requested, split, pending, None
    except Exception as e:  # noqa: BLE001 - every rank must hear of it
        return {EXTRA_KEY: None}, None, None, e


def _load_once(
    objs: ResumeObjects,
    path: str,
    strict: bool,
    verify_checksums: bool,
    atomic: bool,
    max_host_bytes,
    options,
    exact: bool = False,
) -> LoadResult:
    """Open the checkpoint once, refuse on every rank together what the engine cannot see (keys of another model,
    the non-tensor state: ``_precheck``), then have the engine load from that same opened checkpoint, then apply
    the non-tensor state and agree on that outcome too. Each stage's failure on one rank reaches every rank as the
    same named error naming it (issue #50)."""
    fsdp, optimizer = objs.fsdp, objs.optimizer
    comm = Comm(fsdp._checkpoint_group)
    err: BaseException | None = None
    checkpoint = foreign = apply = None
    resolved = resolve_checkpoint_collective(path, comm)  # one rank examines the root; every rank its answer
    try:
        # refused here, before the optimizer's state is even created; the engine loads from this same opened
        # checkpoint (its metadata read once) and still compares the checkpoint id every rank read
        checkpoint = open_checkpoint(resolved)
        objs.with_frozen_base = frozen_base.holds_base(checkpoint.metadata.values.get(FROZEN_BASE_KEY))
        foreign, apply = _precheck(objs, resolved, checkpoint.metadata, strict)
        if optimizer is not None:  # lossy moments: refused under exact=True (alike on every rank), else a warning
            lossy.warn_lossy(resolved, checkpoint.metadata.quant, exact)
    except Exception as e:  # noqa: BLE001 - whatever fails here must reach the exchange below
        # an OSError reading storage: CorruptCheckpointError; user code, a storage layer: LoadFailedError
        err = stage_error(named_read_error(path, e), f"load of {path} failed", comm.rank, LoadFailedError)
    # every rank fails together: a rank raising alone would leave the others waiting in the load's collective
    gather_errors(comm, err)
    if not objs.with_frozen_base:  # the checkpoint references its base: alike on every rank (the same checkpoint)
        frozen_base.fingerprint(fsdp)  # collective, once per run; then every rank decides alike
        frozen_base.check(fsdp, checkpoint.metadata.values.get(FROZEN_BASE_KEY), f"checkpoint {resolved}")
    requested, split, pending, failed = _targets(objs, checkpoint.metadata)
    try:
        report = run_load(
            requested,
            checkpoint,
            fsdp._checkpoint_group,
            strict=strict,
            verify_checksums=verify_checksums,
            atomic=atomic,
            max_host_bytes=max_host_bytes,
            options=options,
            caller_error=failed,  # reported by the engine's first exchange: nothing is read on any rank
        )
    except PartiallyLoadedError as e:
        e.checkpoint = resolved  # which checkpoint failed, for the fallback
        raise
    if split is not None:  # HSDP: each replica read its part; the parts are exchanged over the replicate group
        window = replicas.window_for(max_host_bytes)
        replicate_group = fsdp.group_layout.replicate_group
        report.loaded_keys.extend(replicas.broadcast_parts(split, set(report.loaded_keys), replicate_group, window))
    if pending:  # quantized moments: their codes and scales were read; the moments are written from them
        pending.finish(report.loaded_keys, (options or CheckpointOptions.from_env()).codec_threads)

    def apply_and_refresh() -> None:
        apply()  # validated on every rank; only user code (a stateful object's setter) can still raise
        if optimizer is not None:  # a parameter loaded without its master weight: the master follows the parameter
            refreshed = refresh_master_weights(fsdp, optimizer, report.loaded_keys)
            if refreshed:
                logger.info("load_checkpoint(%s): master weights re-cast from the loaded parameters %s", resolved,
                            refreshed)  # fmt: skip

    apply_on_every_rank(comm, apply_and_refresh, f"load of {resolved}")
    saved = resume_state.Saved(checkpoint.metadata.values, fsdp._checkpoint_rank, resume_state.checkpoint_world(fsdp))
    report.left_unrequested = resume_state.left_unrequested(objs, saved)
    if objs.with_frozen_base and objs.frozen_base_keys:  # the base was loaded: a later fingerprint is computed anew
        frozen_base.forget(fsdp)
    # the list of buffer keys is for the tools (to-hf); the buffers themselves were loaded as model state
    report.unexpected_keys = [k for k in report.unexpected_keys if k != BUFFERS_KEY]
    if not strict:
        problems = {
            "missing": [k for k in report.missing_keys if not k.startswith(RESERVED_PREFIX)],
            "mismatched": {k: v for k, v in report.mismatched_keys.items() if not k.startswith(RESERVED_PREFIX)},
            "not in the model": foreign,
        }
        if any(problems.values()):
            logger.warning(
                "load_checkpoint(%s, strict=False) skipped keys: %s",
                resolved,
                "; ".join(f"{what}: {keys}" for what, keys in problems.items() if keys),
            )
    extra = requested[EXTRA_KEY]
    return LoadResult(extra if isinstance(extra, dict) else {}, report, resolved)

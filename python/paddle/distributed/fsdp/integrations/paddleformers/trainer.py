"""``FSDPTrainer``: PaddleFormers 1.2.0's ``Trainer`` with the model sharded by FullyShardFusion and its checkpoints,
resumes and Hugging Face exports done by this package (docs/trainer.md).

Why a subclass (PaddleFormers has no FSDP hook, and callbacks run after the Trainer saved and cannot wrap the model
before the optimizer is built), and what each override does:

* ``__init__``: refuses what cannot work (Trainer sharding, tensor/pipeline parallel, auto parallel, ZCC, O2, a
  passed optimizer), makes every rank start from rank 0's weights (as ``DataParallel`` does), then shards the model
  in place, so ``create_optimizer`` sees the sharded parameters.
* ``_wrap_model``: no ``DataParallel`` / fleet wrapper: FSDP reduces gradients itself.
* ``_save_checkpoint``: ``checkpoint-N`` through ``FullyShardFusion.save_checkpoint`` (model, optimizer, LR scheduler,
  RNG, GradScaler and the Trainer state in one commit; async with ``use_async_save``; ``ckpt_quant_stage`` O1/O2 as
  int8/int4 moments: quant_stage.py), then rotation
  (``_rotate_checkpoints`` / ``_sorted_checkpoints``: only this run's complete checkpoints, checkpoints.py).
* ``train``: ``resume_from_checkpoint=True`` means the *complete* ``checkpoint-N`` committed last; the run carries on
  its lineage (checkpoint/lineage.py), which every save records and rotation compares (checkpoints.py).
* ``_load_from_checkpoint`` / ``_load_optimizer_and_scheduler`` / ``_load_flex_checkpoint``: the Trainer calls one of
  them (by load format) after building the optimizer; each loads our checkpoint once.
* ``_inner_training_loop`` / ``_load_rng_state``: the Trainer reads its state file from the resume path and
  restores RNG after skipping the consumed batches: the state from the checkpoint's ``extra_state``, each rank's
  RNG from its own per-rank ``stateful`` value (trainer_state.py).
* ``fsdp_memory_tier``: saves to host memory, every K-th to ``checkpoint-N``; resume from the newer (memory_saves.py).
* ``_maybe_log_save_evaluate``: ``save_hf_steps`` exports through ``to-hf`` instead of stock ``save_pretrained``.
* ``save_model``: HF weights + config + tokenizer; a LoRA model's adapter (hf_export.py).

The class is composed at first use (``fsdp_trainer_class``) from :class:`FSDPTrainerMixin` and the installed
``Trainer``, so importing this module needs no PaddleFormers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile

import paddle
import paddle.distributed as dist

from ...checkpoint.lineage import Lineage
from ...fully_shard_fusion import FullyShardFusion
from . import checkpoints, hf_export, memory_saves, quant_stage
from . import trainer_state as saved_state
from .compat import PaddleFormersVersionError, UnsupportedTrainingArgumentError, require_paddleformers

logger = logging.getLogger(__name__)

_CLASS = None
_MEMORY = "<fsdp memory tier or newest committed checkpoint>"  # resume_from_checkpoint=True with the memory tier


def fsdp_trainer_class():
    """``FSDPTrainer``: the mixin over the installed ``paddleformers.trainer.Trainer`` (PaddleFormersVersionError if
    PaddleFormers is missing or another version)."""
    global _CLASS
    if _CLASS is None:
        trainer_mod = require_paddleformers()
        from paddleformers.utils.env import PREFIX_CHECKPOINT_DIR

        if PREFIX_CHECKPOINT_DIR != checkpoints.PREFIX:
            raise PaddleFormersVersionError(
                f"checkpoint directories are named {PREFIX_CHECKPOINT_DIR}-N, not {checkpoints.PREFIX}-N"
            )
        _CLASS = type("FSDPTrainer", (FSDPTrainerMixin, trainer_mod.Trainer), {"__module__": __name__})
    return _CLASS


def default_unit_layers(model: paddle.nn.Layer) -> list[str]:
    """Class names of the blocks of every ``LayerList`` in ``model`` (the decoder layers of a causal LM)."""
    names: list[str] = []
    for layer in model.sublayers(include_self=True):
        if isinstance(layer, paddle.nn.LayerList):
            for block in layer:
                if type(block).__name__ not in names:
                    names.append(type(block).__name__)
    return names


@contextlib.contextmanager
def _synchronize_on_cpu():
    """PaddleFormers 1.2.0 calls ``paddle.device.synchronize()`` before each step with gradient accumulation, which
    raises TypeError on a CPU-only paddle (the stock Trainer cannot accumulate on CPU). There is nothing to wait for
    on a CPU: while this Trainer trains on one, that call returns. Restored afterwards; other devices untouched."""
    if paddle.device.get_device() != "cpu":
        yield
        return
    original = paddle.device.synchronize

    def synchronize(device=None):
        if device is None or str(device).startswith("cpu"):
            return None
        return original(device)

    paddle.device.synchronize = synchronize
    try:
        yield
    finally:
        paddle.device.synchronize = original


@contextlib.contextmanager
def _no_local_copy_of_url(training_args):
    """The Trainer's ``__init__`` runs ``os.makedirs(args.output_dir)``, which for ``s3://bucket/run`` would make a
    local ``s3:/bucket/run`` tree: checkpoints go to the object store, so ``__init__`` sees an existing local
    directory instead (every rank of a node at once: creating then removing the tree would race)."""
    url = getattr(training_args, "output_dir", None)
    if not (isinstance(url, str) and "://" in url):
        yield
        return
    training_args.output_dir = tempfile.gettempdir()
    try:
        yield
    finally:
        training_args.output_dir = url


def _refusals(args, model, optimizer) -> list[str]:
    """What FSDPTrainer cannot do with these arguments, each with what to use instead."""
    problems = []
    if model is None:
        problems.append("model=None: FSDPTrainer shards the model it is given")
    if optimizer is not None:
        problems.append(
            "optimizers=(...): the optimizer must be built over the sharded parameters; let the Trainer build it (optim=, learning_rate=, ...)"
        )
    if args.sharding:
        problems.append(
            f'sharding={" ".join(map(str, args.sharding))!r}: FSDPTrainer shards the model itself; set sharding=""'
        )
    for name in (
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "sep_parallel_size",
        "context_parallel_size",
    ):
        if (getattr(args, name, 1) or 1) > 1:
            problems.append(f"{name}={getattr(args, name)}: FSDPTrainer is data parallel only (FSDP/HSDP)")
    for name in ("enable_auto_parallel", "enable_zero_cost_checkpoint", "to_static", "load_best_model_at_end"):
        if getattr(args, name, False):
            problems.append(f"{name}=True is not supported by FSDPTrainer")
    if (args.fp16 or args.bf16) and args.fp16_opt_level == "O2":
        problems.append(
            'fp16_opt_level="O2" casts the parameters; use O1 (and compute_dtype="bfloat16" for low-precision gathers)'
        )
    if "unified_checkpoint" in (args.save_checkpoint_format, args.load_checkpoint_format):
        problems.append("unified_checkpoint: FSDPTrainer writes its own sharded checkpoints")
    return problems


class FSDPTrainerMixin:
    """The overrides of FSDPTrainer (see the module docstring); composed with ``Trainer`` by ``fsdp_trainer_class``.

    FSDP options (keywords, besides every ``Trainer`` argument):
        fsdp_unit_layers: class names of the sublayers gathered as one unit (default: the blocks of the model's
            ``LayerList``s, e.g. ``LlamaDecoderLayer``).
        compute_dtype, reduce_dtype, prefetch_depth: as ``FullyShardFusion``'s.
        replicate_group, shard_group: HSDP groups (``topology.hybrid_groups``; with gloo create them before the
            ``TrainingArguments``, whose construction runs ``fleet.init``).
        hf_preset: the ``to-hf`` preset of ``save_model`` / ``save_hf_steps`` (default: chosen by architecture).
        fsdp_memory_tier: ``dict(persist_every=K, memory_root=..., ...)``: saves to host memory, every K-th one to
            ``checkpoint-N`` (memory_saves.py).
        moe_layers_name, expert_parallel_group, expert_shard_group: expert parallelism, as ``FullyShardFusion``'s.
        save_frozen_base: ``checkpoint-N`` holds the frozen parameters' tensors too (True) or never (False); None:
            a frozen base larger than the trainable parameters (LoRA) is referenced (its source and fingerprint,
            checked at resume), smaller frozen parameters are written (state/frozen_base.py).
        hf_merge_adapter: exports of an adapter model also hold the merged model (base + scale * A @ B) in
            ``<export>/merged``.
    """

    def __init__(
        self,
        *args,
        fsdp_unit_layers: list[str] | None = None,
        compute_dtype: str | None = None,
        reduce_dtype: str | None = None,
        prefetch_depth: int | None = None,
        replicate_group=None,
        shard_group=None,
        hf_preset: str | None = None,
        fsdp_memory_tier: dict | None = None,
        moe_layers_name: list[str] | None = None,
        expert_parallel_group=None,
        expert_shard_group=None,
        save_frozen_base: bool | None = None,
        hf_merge_adapter: bool = False,
        **kwargs,
    ) -> None:
        memory_options = memory_saves.check_options(fsdp_memory_tier)  # before anything is built
        training_args = kwargs.get("args", args[2] if len(args) > 2 else None)
        with _no_local_copy_of_url(training_args):
            super().__init__(*args, **kwargs)
        problems = _refusals(self.args, self.model, self.optimizer)
        if problems:
            raise UnsupportedTrainingArgumentError("FSDPTrainer: " + "; ".join(problems))
        self._fsdp_quantize = quant_stage.quantize_moments_for(self.args)  # before anything is built
        if (
            dist.is_initialized()
            and dist.get_world_size() > 1
            and not any(p._is_initialized() is False for p in self.model.parameters())
        ):
            from paddle.distributed.parallel import sync_params_buffers

            sync_params_buffers(self.model, src_rank=0, is_model_parallel=False)  # as DataParallel: rank 0's weights
        units = fsdp_unit_layers if fsdp_unit_layers is not None else default_unit_layers(self.model)
        self.fsdp = FullyShardFusion(
            self.model,
            fsdp_unit_layers=units,
            compute_dtype=compute_dtype,
            reduce_dtype=reduce_dtype,
            prefetch_depth=prefetch_depth,
            replicate_group=replicate_group,
            shard_group=shard_group,
            moe_layers_name=moe_layers_name,
            expert_parallel_group=expert_parallel_group,
            expert_shard_group=expert_shard_group,
        )
        self.model_wrapped = self.model
        self.hf_preset = hf_preset
        self.save_frozen_base = save_frozen_base
        self.hf_merge_adapter = bool(hf_merge_adapter)
        # a run must not die at its first export (save_hf_steps, or save_model at its end)
        if (getattr(self.args, "save_hf_steps", -1) or -1) > 0 or self.hf_merge_adapter:
            hf_export.check_exportable(self.fsdp, self.model, hf_preset, merged=self.hf_merge_adapter)
        self._fsdp_pending = None  # the async save in flight
        checkpoints.make_root_durable(self.args.output_dir)
        self._fsdp_loaded = None  # (path, extra_state) of the checkpoint this train() resumed from
        self._fsdp_memory = memory_options  # fsdp_memory_tier, checked (memory_saves.py); None: no memory tier
        self._fsdp_tier = None  # the MemoryTier, built at the first save or memory resume
        self._fsdp_memory_step = None  # the step of a state held in memory only (saved or resumed), else None
        self._fsdp_lineage = None  # this run (checkpoint/lineage.py): set by train(), recorded by every save
        self._fsdp_warned: set[str] = set()  # leftovers rotation already named
        self._rng = saved_state.RankRandomState(self.args.world_size)
        self._stateful = {saved_state.RankRandomState.NAME: self._rng}  # per-rank values of every checkpoint
        logger.info("FSDPTrainer: %d ranks, units %s", self.fsdp.world_size, units)

    # ---- wrapping -----------------------------------------------------------------------------------------
    def _wrap_model(self, model, training=True):
        return model

    # ---- saving -------------------------------------------------------------------------------------------
    @property
    def _grad_scaler(self):
        return self.scaler if getattr(self, "do_grad_scaling", False) else None

    def _save_checkpoint(self, model, metrics=None, persist: bool = False):
        self._finish_pending_save()
        self._track_best(metrics)
        path = checkpoints.checkpoint_dir(self.args.output_dir, self.state.global_step)
        extra = saved_state.capture(self.state)
        step = self.state.global_step
        to_memory = self._fsdp_memory is not None and not persist
        if to_memory and self._fsdp_tier is not None and self._fsdp_tier.disabled_reason is not None:
            to_memory = False  # the tier lacked space on some rank (logged by it): every save goes to checkpoint-N
        if to_memory and not memory_saves.persists(self._fsdp_memory, step, self.args.save_steps):
            self.memory_tier().save(step, extra_state=extra)
            self._fsdp_memory_step = step
            logger.info("FSDPTrainer: step %d saved to the memory tier", step)
            return
        self._fsdp_memory_step = None
        handle = self.fsdp.save_checkpoint(
            path,
            optimizer=self.optimizer,
            extra_state=extra,
            async_save=bool(self.args.use_async_save),
            grad_scaler=self._grad_scaler,
            stateful=self._stateful,
            lineage=self._lineage(),
            save_frozen=self.save_frozen_base,
            quantize_moments=self._fsdp_quantize,
        )
        logger.info("FSDPTrainer: %s checkpoint %s", "saving (async)" if handle is not None else "saved", path)
        if handle is not None:
            self._fsdp_pending = handle
        else:
            self._rotate()

    def memory_tier(self):
        """The MemoryTier of ``fsdp_memory_tier`` (built on first use; collective then); None without it."""
        if self._fsdp_memory is not None and self._fsdp_tier is None:
            if self.optimizer is None:
                raise RuntimeError("FSDPTrainer: the optimizer must exist before the memory tier is used")
            self._fsdp_tier = memory_saves.build(
                self._fsdp_memory, self.fsdp, self.optimizer, self.args.output_dir, self._grad_scaler, self._stateful
            )
        return self._fsdp_tier

    def _finish_pending_save(self) -> None:
        """Wait for the async save in flight (its errors raise here), then rotate."""
        if self._fsdp_tier is not None:
            self._fsdp_tier.wait()
        if self._fsdp_pending is not None:
            handle, self._fsdp_pending = self._fsdp_pending, None
            handle.wait()
            self._rotate()

    def _lineage(self) -> Lineage:
        if self._fsdp_lineage is None:  # a save outside train(): a run of its own
            self._fsdp_lineage = Lineage.fresh()
        return self._fsdp_lineage

    def _rotate_checkpoints(self, use_mtime=False, output_dir=None) -> None:
        """Stock's rotation (by name or mtime, whatever exists) would delete this run's newest: ours instead."""
        self._rotate(output_dir)

    def _sorted_checkpoints(self, output_dir=None, checkpoint_prefix=checkpoints.PREFIX, use_mtime=False) -> list[str]:
        """This run's complete ``checkpoint-N``, oldest first (stock's lists every ``checkpoint-N``)."""
        found = checkpoints.checkpoints_found(output_dir or self.args.output_dir)
        mine = [f for f in found if f.complete and self._lineage().owns(f)]
        return [f.location for f in sorted(mine, key=lambda f: f.order())]

    def _rotate(self, output_dir=None) -> None:
        if self.args.should_save:  # one process per job removes
            checkpoints.rotate(
                output_dir or self.args.output_dir,
                self.args.save_total_limit,
                self._lineage(),
                (self.state.best_model_checkpoint,),
                self._fsdp_warned,
            )

    def _track_best(self, metrics) -> None:
        name = self.args.metric_for_best_model
        if not metrics or name is None:
            return
        key = name if name.startswith("eval_") else f"eval_{name}"
        if key not in metrics:
            return
        value = metrics[key]
        better = (lambda a, b: a > b) if self.args.greater_is_better else (lambda a, b: a < b)
        if self.state.best_metric is None or better(value, self.state.best_metric):
            self.state.best_metric = value
            self.state.best_model_checkpoint = checkpoints.checkpoint_dir(self.args.output_dir, self.state.global_step)

    # ---- resuming -----------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint=None, ignore_keys_for_eval=None):
        if resume_from_checkpoint is True and self._fsdp_memory is not None:
            resume_from_checkpoint = _MEMORY  # decided in _restore, once the optimizer exists
        elif resume_from_checkpoint is True:
            newest = checkpoints.newest_complete(self.args.output_dir)
            if newest is None:
                raise ValueError(
                    f"No complete checkpoint-N in output directory ({self.args.output_dir}) to resume from"
                )
            resume_from_checkpoint = newest.location
        elif resume_from_checkpoint is False or resume_from_checkpoint == "":
            resume_from_checkpoint = None
        self._fsdp_lineage = self._lineage_of(resume_from_checkpoint)
        self._fsdp_loaded = None
        try:
            output = super().train(
                resume_from_checkpoint=resume_from_checkpoint, ignore_keys_for_eval=ignore_keys_for_eval
            )
        finally:
            self._finish_pending_save()
        self._end_memory_tier()
        return output

    def _lineage_of(self, resume_from) -> Lineage:
        """The lineage of a run that resumes from ``resume_from`` (a fresh one for None; with the memory tier the
        newest complete ``checkpoint-N``'s, the run the memory copies continue)."""
        from_memory = resume_from == _MEMORY
        return checkpoints.run_lineage(self.args.output_dir, None if from_memory else resume_from, from_memory)

    def _end_memory_tier(self) -> None:
        """A clean end of ``train()``: a memory save newer than the newest ``checkpoint-N`` is written as one (the
        state at the end), then this rank's memory copies are removed (collective)."""
        tier, self._fsdp_tier = self._fsdp_tier, None
        if tier is None:
            return
        tier.wait()
        if self._fsdp_memory_step is not None:  # the same on every rank: set by the collective saves and restore
            self._save_checkpoint(self.model, persist=True)
            self._finish_pending_save()
        self._fsdp_memory_step = None
        tier.close(remove=True)

    def _restore(self, path) -> None:
        """Load checkpoint ``path`` into the sharded model, optimizer, LR scheduler, RNG and GradScaler (once)."""
        if path is None or (self._fsdp_loaded is not None and self._fsdp_loaded[0] == path):
            return
        if self.optimizer is None:
            raise RuntimeError("FSDPTrainer: the optimizer must exist before a checkpoint is loaded")
        if path == _MEMORY:
            self._fsdp_loaded = (path, self._restore_newest())
            return
        result = self.fsdp.load_checkpoint(
            path, optimizer=self.optimizer, grad_scaler=self._grad_scaler, stateful=self._stateful
        )
        self._fsdp_loaded = (path, saved_state.check(dict(result), f"checkpoint {path}"))
        logger.info("FSDPTrainer: resumed from %s", path)

    def _restore_newest(self) -> dict:
        """``resume_from_checkpoint=True`` with the memory tier: the newest of the tier's common memory step and the
        newest committed ``checkpoint-N`` (collective); its ``extra_state``."""
        tier = self.memory_tier()
        restored = tier.restore()
        newest = checkpoints.newest_complete(self.args.output_dir)
        found = [(newest.step, newest.location)] if newest is not None else []
        if restored is not None and (not found or restored.step > found[-1][0]):
            logger.info("FSDPTrainer: resumed from the memory tier, step %d (%s)", restored.step, restored.sources)
            self._fsdp_memory_step = restored.step
            return saved_state.check(dict(restored), f"memory tier step {restored.step}")
        if not found:
            raise ValueError(
                f"No complete checkpoint-N in output directory ({self.args.output_dir}) and no memory copy to resume from"
            )
        result = self.fsdp.load_checkpoint(
            found[-1][1], optimizer=self.optimizer, grad_scaler=self._grad_scaler, stateful=self._stateful
        )
        logger.info("FSDPTrainer: resumed from %s (memory tier: step %s)", found[-1][1], restored and restored.step)
        return saved_state.check(dict(result), f"checkpoint {found[-1][1]}")

    def _load_from_checkpoint(self, resume_from_checkpoint=None):
        self._restore(resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint):
        self._restore(checkpoint)

    def _load_flex_checkpoint(self, resume_from_checkpoint):
        self._restore(resume_from_checkpoint)

    def _inner_training_loop(self, args, model, train_dataloader, len_dataloader, max_steps, num_train_epochs, num_update_steps_per_epoch, num_train_samples, resume_from_checkpoint, ignore_keys_for_eval):  # fmt: skip
        # the Trainer reads TRAINER_STATE_NAME from the resume path: give it a local file with the saved state
        with tempfile.TemporaryDirectory(prefix="fsdp-trainer-resume-") as view, _synchronize_on_cpu():
            if resume_from_checkpoint is not None:
                self._restore(resume_from_checkpoint)
                with open(os.path.join(view, "trainer_state.json"), "w", encoding="utf-8") as f:
                    f.write(saved_state.trainer_state_json(self._fsdp_loaded[1]))
                resume_from_checkpoint = view
            return super()._inner_training_loop(
                args, model, train_dataloader, len_dataloader, max_steps, num_train_epochs,
                num_update_steps_per_epoch, num_train_samples, resume_from_checkpoint, ignore_keys_for_eval,
            )  # fmt: skip

    def _load_rng_state(self, checkpoint):
        if checkpoint is None or self._fsdp_loaded is None:
            return
        self._rng.restore()

    # ---- Hugging Face exports -----------------------------------------------------------------------------
    def _maybe_log_save_evaluate(self, tr_loss, model, epoch, ignore_keys_for_eval, **kwargs):
        export = bool(self.control.should_save_hf)
        self.control.should_save_hf = False  # stock's save_pretrained gathers through .cuda()
        super()._maybe_log_save_evaluate(tr_loss, model, epoch, ignore_keys_for_eval, **kwargs)
        if export:
            from paddleformers.utils.env import PREFIX_HF_CHECKPOINT_DIR

            out = os.path.join(self.args.output_dir, f"{PREFIX_HF_CHECKPOINT_DIR}-{self.state.global_step}")
            self._export_hf(out)
            self.control = self.callback_handler.on_save_hf(self.args, self.state, self.control)
            if self.args.should_save:
                hf_export.rotate_exports(self.args.output_dir, PREFIX_HF_CHECKPOINT_DIR, self.args.save_hf_total_limit)

    def _export_hf(self, out_dir: str) -> None:
        self._finish_pending_save()  # a checkpoint of this step is then committed and can be reused
        source = checkpoints.checkpoint_dir(self.args.output_dir, self.state.global_step)
        if not checkpoints.is_committed(source) or "://" in source:
            source = None
        tokenizer = self.tokenizer if self.args.save_tokenizer else None
        hf_export.export(
            self.fsdp, self.model, out_dir, preset=self.hf_preset, tokenizer=tokenizer, source=source,
            merged=self.hf_merge_adapter,
        )  # fmt: skip

    def save_model(self, output_dir=None, merge_tensor_parallel=False, last_fc_to_hf=False):
        """Hugging Face weights, config and tokenizer of the (sharded) model in ``output_dir`` (collective)."""
        self._export_hf(output_dir or self.args.output_dir)

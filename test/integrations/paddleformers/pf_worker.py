"""One FSDPTrainer run of the example's tiny Llama, configured by a JSON argument; reports losses and state.

Run by the tests under ``paddle.distributed.launch``. Options (all optional): ``output_dir``, ``max_steps``,
``global_batch`` (split over the ranks, so runs at different world sizes see the same samples per step),
``save_steps``, ``save_total_limit``, ``save_hf_steps``, ``save_hf_total_limit``, ``resume`` (True or a path), ``kill_after_save`` (kill -9
every rank right after the checkpoint of that step), ``async_save``, ``accumulation``, ``max_grad_norm``,
``stock`` ("dp": the stock Trainer, for comparisons), ``bf16``, ``eval`` (evaluate every ``save_steps``),
``hsdp`` (replicas: HSDP over ``topology.hybrid_groups``), ``memory_tier`` (``fsdp_memory_tier``), ``lora`` (the
model wrapped in PaddleFormers' ``LoRAModel``, r=4 on q/v, only the adapters trainable), ``save_frozen_base``,
``hf_preset``, ``hf_merge_adapter`` (FSDPTrainer's keywords).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "test" / "collective" / "fsdp")]

import fault_storage  # noqa: E402
import paddle.distributed as dist  # noqa: E402
from launch_util import report  # noqa: E402
from paddle.distributed.fsdp.integrations.paddleformers import FSDPTrainer  # noqa: E402
from paddleformers.trainer import Trainer, TrainerCallback, TrainingArguments  # noqa: E402
from trainer_fsdp import CountingDataset, lora_llama, make_tokenizer, tiny_llama  # noqa: E402


class Record(TrainerCallback):
    def __init__(self, kill_after_save: int | None):
        self.losses: dict[int, float] = {}
        self.eval_losses: dict[int, float] = {}
        self.kill_after_save = kill_after_save
        self.trainer = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses[state.global_step] = logs["loss"]
        if logs and "eval_loss" in logs:
            self.eval_losses[state.global_step] = logs["eval_loss"]

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.kill_after_save:
            tier = getattr(self.trainer, "memory_tier", lambda: None)()
            if tier is not None:
                tier.wait()  # the memory copy (and its peer copy) complete: the crash comes after the save
            os.kill(os.getpid(), signal.SIGKILL)


def _groups_in_step():
    """Every run at 3+ ranks: paddle 3.3.1's gloo ``new_group`` lets a member connect before its peer listens
    ("Connection refused", or a pair TIMEOUT, in TrainingArguments' fleet.init; seen at 3 ranks under load for the
    stock and the FSDP Trainer alike: those groups are paddle's, made before FSDPTrainer exists). The project's
    documented workaround (docs/expert-parallel.md): fleet's groups made inside ``barrier_after_new_group``, which
    probes each new group and makes it again when it did not come up."""
    from paddle.distributed.fsdp import barrier_after_new_group

    return barrier_after_new_group(reuse_identical=True)


def _training_arguments(cfg: dict, batch: int, world: int):
    return TrainingArguments(
        output_dir=cfg["output_dir"],
        max_steps=cfg.get("max_steps", 6),
        per_device_train_batch_size=batch // world // cfg.get("accumulation", 1),
        gradient_accumulation_steps=cfg.get("accumulation", 1),
        learning_rate=3e-3,
        weight_decay=0.01,
        max_grad_norm=cfg.get("max_grad_norm", 1.0),
        logging_steps=1,
        save_steps=cfg.get("save_steps", 3),
        save_total_limit=cfg.get("save_total_limit"),
        save_hf_steps=cfg.get("save_hf_steps", -1),
        save_hf_total_limit=cfg.get("save_hf_total_limit"),
        use_async_save=cfg.get("async_save", False),
        bf16=cfg.get("bf16", False),
        evaluation_strategy="steps" if cfg.get("eval") else "no",
        eval_steps=cfg.get("save_steps", 3),
        sharding="",
        amp_master_grad=False,
        device="cpu",
        report_to="none",
        disable_tqdm=True,
        seed=42,
    )


def main() -> None:
    cfg = json.loads(sys.argv[1])
    world = dist.get_world_size() if "PADDLE_TRAINER_ID" in os.environ else 1
    groups = {}
    if cfg.get("hsdp"):  # before TrainingArguments: its fleet.init breaks gloo's new_group afterwards
        from paddle.distributed.fsdp.comm.topology import hybrid_groups

        dist.init_parallel_env()
        groups["replicate_group"], groups["shard_group"] = hybrid_groups(cfg["hsdp"])
    batch = cfg.get("global_batch", 6)
    assert batch % world == 0, (batch, world)
    with _groups_in_step() if world > 2 else contextlib.nullcontext():
        args = _training_arguments(cfg, batch, world)
    record = Record(cfg.get("kill_after_save"))
    kwargs = dict(
        model=lora_llama() if cfg.get("lora") else tiny_llama(),
        args=args,
        train_dataset=CountingDataset(cfg.get("samples", 96)),
        eval_dataset=CountingDataset(12, seed=1) if cfg.get("eval") else None,
        tokenizer=make_tokenizer(),
        callbacks=[record],
    )
    if cfg.get("memory_tier"):
        groups["fsdp_memory_tier"] = cfg["memory_tier"]
    for key in ("save_frozen_base", "hf_preset", "hf_merge_adapter"):
        if key in cfg:
            groups[key] = cfg[key]
    trainer = Trainer(**kwargs) if cfg.get("stock") else FSDPTrainer(**kwargs, **groups)
    record.trainer = trainer
    trainer.train(resume_from_checkpoint=cfg.get("resume"))
    if cfg.get("save_model"):
        trainer.save_model(cfg["save_model"])
    report(
        {
            "losses": {str(k): v for k, v in sorted(record.losses.items())},
            "eval_losses": {str(k): v for k, v in sorted(record.eval_losses.items())},
            "global_step": trainer.state.global_step,
        }
    )


if __name__ == "__main__":
    fault_storage.install()  # the crash a test arms (PADDLE_FSDP_CKPT_FAULT)
    main()

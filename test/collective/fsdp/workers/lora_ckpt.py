"""Checkpoints of a frozen-base (LoRA-style) model: what they hold, resumes, refusals (issue #51).

Modes (argv[1]):
  train ROOT STEPS SAVE_AT [KILL_AT]  train STEPS steps, saving ROOT/step_<k> (keep_last=2) after every step from
                                     SAVE_AT on; rank 1 kills itself (SIGKILL) before step KILL_AT's optimizer step
  resume ROOT STEPS                  load ROOT's latest into a fresh model (same base) and train up to STEPS
  memtier ROOT STEPS [KILL_AT]       the same training saving to the memory tier (ROOT/memory) after every step;
                                     restores from it first; rank 1 kills itself as in train
  cases ROOT                         in-process checks: contents, refusals, save_frozen, a base loaded separately
  hsdp ROOT                          the HSDP case (4 ranks: 2 replicas x 2 shards)
Each rank reports its losses, the trainable parameters' values and bytes digest, and the case outcomes.

Several modes in one launch (a launch's start-up costs more than most modes): separate them with ``+``, e.g.
``train R1 6 99 + train R2 3 3 + cases R3``; the report is then ``{"phases": [report of each mode, in order]}``.
A mode that raises ends the launch, as alone (its ranks would otherwise wait on each other's collectives); the
``cases`` mode reports each case's outcome by name, as alone.
"""

from __future__ import annotations

import os
import signal
import sys

import _paths  # noqa: F401  (puts launch_util on sys.path)
import numpy as np
import paddle
import paddle.distributed as dist
import xxhash
from launch_util import report, run_cases
from lora_models import adapter_batches, frozen_keys, make_adapter_model
from models import local_part
from paddle.distributed.fsdp import FullyShardFusion
from paddle.distributed.fsdp.checkpoint.directory import open_checkpoint
from paddle.distributed.fsdp.checkpoint.errors import FrozenBaseMismatchError
from paddle.distributed.fsdp.checkpoint.format.reserved import FROZEN_BASE_KEY
from paddle.distributed.fsdp.tools import to_hf
from paddle.distributed.fsdp.tools.errors import ToolError

ROWS, SEED = 12, 11


def build(seed: int = SEED):
    model = make_adapter_model(seed)
    fsdp = FullyShardFusion(model, fsdp_unit_layers=["AdapterBlock"])
    opt = paddle.optimizer.AdamW(0.02, weight_decay=0.1, parameters=model.parameters())
    return model, fsdp, opt


def step(model, opt, batch, rank: int, world: int, kill: bool = False) -> float:
    ids, labels = batch
    loss = model(paddle.to_tensor(local_part(ids, rank, world)), paddle.to_tensor(local_part(labels, rank, world)))
    loss.backward()
    if kill and rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    opt.step()
    opt.clear_grad()
    value = loss.detach().reshape([1])
    if world > 1:
        dist.all_reduce(value)
    return float(value.numpy()[0]) / world


def trainable_state(fsdp, model) -> dict:
    full = fsdp.full_parameters()
    frozen = frozen_keys(model)
    values = {k: full[k].numpy() for k in sorted(full) if k not in frozen}
    digest = xxhash.xxh3_64()
    for key, arr in values.items():
        digest.update(key.encode())
        digest.update(np.ascontiguousarray(arr).tobytes())
    return {"digest": digest.hexdigest(), "values": {k: v.ravel().tolist() for k, v in values.items()}}


def mode_train(root: str, steps: int, save_at: int, kill_at: int, rank: int, world: int) -> dict:
    model, fsdp, opt = build()
    losses = []
    for k, batch in enumerate(adapter_batches(steps, ROWS), start=1):
        losses.append(step(model, opt, batch, rank, world, kill=k == kill_at))
        if k >= save_at:
            fsdp.save_checkpoint(root, optimizer=opt, step=k, keep_last=2, extra_state={"losses": losses})
    return {"losses": losses, **trainable_state(fsdp, model)}


def mode_resume(root: str, steps: int, rank: int, world: int) -> dict:
    model, fsdp, opt = build()
    extra = fsdp.load_checkpoint(root, optimizer=opt)
    losses = list(extra["losses"])
    for batch in adapter_batches(steps, ROWS)[extra.step :]:
        losses.append(step(model, opt, batch, rank, world))
    return {"losses": losses, "resumed_at": extra.step, **trainable_state(fsdp, model)}


def mode_memtier(root: str, steps: int, kill_at: int, rank: int, world: int) -> dict:
    model, fsdp, opt = build()
    tier = fsdp.memory_tier(
        opt,
        durable_root=os.path.join(root, "durable"),
        memory_root=os.path.join(root, "memory"),
        job_id="lora",
        persist_every=1000,  # never within the run: a resume can only come from memory
        peer_timeout_s=20.0,
    )
    restored = tier.restored
    losses = list(restored["losses"]) if restored is not None else []
    batches = adapter_batches(steps, ROWS)
    for k in range(tier.start_step + 1, steps + 1):
        losses.append(step(model, opt, batches[k - 1], rank, world, kill=k == kill_at))
        tier.save(k, extra_state={"losses": losses})
    tier.wait()
    out = {"losses": losses, "resumed_at": tier.start_step, "sources": restored.sources if restored else None}
    tier.close()
    return {**out, **trainable_state(fsdp, model)}


def _trained(rank: int, world: int, steps: int = 2):
    model, fsdp, opt = build()
    for batch in adapter_batches(steps, ROWS):
        step(model, opt, batch, rank, world)
    return model, fsdp, opt


def _case_contents(root: str, figures: dict):
    def case(rank: int, world: int) -> None:
        """Default save: no frozen tensor, every trainable one and its optimizer state, and the base reference."""
        model, fsdp, opt = _trained(rank, world)
        path = os.path.join(root, "contents")
        fsdp.save_checkpoint(path, optimizer=opt)
        meta = open_checkpoint(path).metadata
        frozen, trainable = frozen_keys(model), set(dict(model.named_parameters())) - frozen_keys(model)
        assert not frozen & set(meta.tensors), f"frozen tensors written: {sorted(frozen & set(meta.tensors))[:4]}"
        assert trainable <= set(meta.tensors), f"trainable missing: {sorted(trainable - set(meta.tensors))}"
        moments = {k for k in meta.tensors if k.rsplit(".", 1)[0] in trainable}
        assert moments, "no optimizer state of the adapters"
        ref = meta.values[FROZEN_BASE_KEY]
        assert ref["saved"] is False and ref["parameters"] == len(frozen), ref
        base_bytes = sum(
            int(np.prod(p.shape)) * 4 for n, p in make_adapter_model(SEED).named_parameters() if n in frozen
        )
        assert ref["bytes"] == base_bytes, (ref, base_bytes)
        figures["fingerprint"] = ref["fingerprint"]
        handle = fsdp.save_checkpoint(os.path.join(root, "contents_async"), optimizer=opt, async_save=True)
        handle.wait()  # an async save holds the same: no frozen tensor, the same reference
        async_meta = open_checkpoint(os.path.join(root, "contents_async")).metadata
        assert sorted(async_meta.tensors) == sorted(meta.tensors) and async_meta.values[FROZEN_BASE_KEY] == ref
        if rank == 0:  # no whole model to convert, and no adapter recorded (not a LoRAModel): refused by name
            try:
                to_hf(path, os.path.join(root, "contents_hf"))
            except ToolError as e:
                assert "save_frozen=True" in str(e) and f"{len(frozen)} frozen" in str(e), e
            else:
                raise AssertionError("to-hf converted a checkpoint without its frozen base")
        figures["tensor_keys"] = sorted(meta.tensors)
        # with the base: every parameter, and a model with another base gets this one's back
        full = os.path.join(root, "with_base")
        fsdp.save_checkpoint(full, optimizer=opt, save_frozen=True)
        meta = open_checkpoint(full).metadata
        assert frozen <= set(meta.tensors) and FROZEN_BASE_KEY not in meta.values
        other_model, other, other_opt = build(seed=SEED + 100)
        other.load_checkpoint(full, optimizer=other_opt)
        want, got = fsdp.full_parameters(), other.full_parameters()
        for key in want:
            assert np.array_equal(want[key].numpy(), got[key].numpy()), key
        other.save_checkpoint(os.path.join(root, "after_base_load"), optimizer=other_opt)  # fingerprint recomputed
        again = open_checkpoint(os.path.join(root, "after_base_load")).metadata.values[FROZEN_BASE_KEY]
        assert again["fingerprint"] == ref["fingerprint"], (again, ref)

    return case


def _case_refusal(root: str):
    def case(rank: int, world: int) -> None:
        """Another base: FrozenBaseMismatchError on every rank, before anything is written."""
        _model, fsdp, opt = _trained(rank, world)
        path = os.path.join(root, "refusal")
        fsdp.save_checkpoint(path, optimizer=opt)
        other_model, other, other_opt = build(seed=SEED + 1)
        before = {k: v.numpy().copy() for k, v in other.full_parameters().items()}
        try:
            other.load_checkpoint(path, optimizer=other_opt)
        except FrozenBaseMismatchError as e:
            assert "fingerprint" in str(e), e
        else:
            raise AssertionError("a checkpoint of another base loaded")
        after = other.full_parameters()
        for key, value in before.items():
            assert np.array_equal(value, after[key].numpy()), f"refused load changed {key}"
        # one base parameter differing in one element is another base too
        model3, fsdp3, opt3 = build()
        with fsdp3.summon_full_params(writeback=True), paddle.no_grad():
            w = model3.blocks[1].down.weight
            w[0, 0] = w[0, 0] + 1.0
        try:
            fsdp3.load_checkpoint(path, optimizer=opt3)
        except FrozenBaseMismatchError:
            pass
        else:
            raise AssertionError("a base differing in one element was accepted")
        # more trainable parameters than at save: another set of frozen parameters, refused by name
        model5 = make_adapter_model(SEED)
        for p in model5.parameters():
            p.stop_gradient = False
        try:
            FullyShardFusion(model5, fsdp_unit_layers=["AdapterBlock"]).load_checkpoint(path, strict=False)
        except FrozenBaseMismatchError as e:
            assert "no frozen parameters" in str(e), e
        else:
            raise AssertionError("a model without frozen parameters loaded a checkpoint without its base")
        model4 = make_adapter_model(SEED)
        model4.head.bias.stop_gradient = False
        fsdp4 = FullyShardFusion(model4, fsdp_unit_layers=["AdapterBlock"])
        try:
            fsdp4.load_checkpoint(path, strict=False)
        except FrozenBaseMismatchError as e:
            assert "parameters" in str(e), e
        else:
            raise AssertionError("a model freezing fewer parameters was accepted")

    return case


def _case_separate_base(root: str):
    def case(rank: int, world: int) -> None:
        """The model's base loaded separately (from whole weights, as from_pretrained would) before wrapping,
        then the adapter checkpoint: the trained model comes back."""
        model, fsdp, opt = _trained(rank, world)
        path = os.path.join(root, "separate")
        fsdp.save_checkpoint(path, optimizer=opt)
        base = {k: v for k, v in make_adapter_model(SEED).state_dict().items() if k in frozen_keys(model)}
        fresh = make_adapter_model(SEED + 7)  # random base and adapters
        fresh.set_state_dict(base)
        wrapped = FullyShardFusion(fresh, fsdp_unit_layers=["AdapterBlock"])
        wrapped.load_checkpoint(path)
        want, got = fsdp.full_parameters(), wrapped.full_parameters()
        for key in want:
            assert np.array_equal(want[key].numpy(), got[key].numpy()), key

    return case


def _case_hsdp(root: str, figures: dict):
    def case(rank: int, world: int) -> None:
        """HSDP (2 replicas of world/2 shards): the frozen base holds no gradient and no optimizer state; the
        checkpoint holds the adapters, their optimizer state, the resume state and the base reference (the same
        fingerprint as FSDP's); a fresh HSDP model resumed from it continues bit for bit."""
        from paddle.distributed.fsdp.comm.topology import hybrid_groups

        replicate, shard = hybrid_groups(2)

        def build_hsdp():
            model = make_adapter_model(SEED)
            fsdp = FullyShardFusion(
                model, fsdp_unit_layers=["AdapterBlock"], replicate_group=replicate, shard_group=shard
            )
            return model, fsdp, paddle.optimizer.AdamW(0.02, weight_decay=0.1, parameters=model.parameters())

        batches = adapter_batches(4, ROWS)
        model, fsdp, opt = build_hsdp()
        frozen = frozen_keys(model)
        losses = [step(model, opt, b, rank, world) for b in batches[:2]]
        for key, param, buffer, _i in fsdp.managed_parameters():
            if key in frozen:
                assert not buffer.layout.trainable and param.grad is None, key
                assert buffer.main_grad is None and buffer.full_grad is None, key
        states = fsdp.optimizer_sharded_state_dict(opt)
        owners = {k for k in states if not k.startswith("__") for f in frozen if k.startswith(f + ".")}
        assert not owners, f"frozen parameters got optimizer state under HSDP: {sorted(owners)[:4]}"
        path = os.path.join(root, "hsdp")
        fsdp.save_checkpoint(path, optimizer=opt, extra_state={"losses": losses})
        meta = open_checkpoint(path).metadata
        trainable = set(dict(model.named_parameters())) - frozen
        assert not frozen & set(meta.tensors) and trainable <= set(meta.tensors), sorted(meta.tensors)
        assert {k for k in meta.tensors if k.rsplit(".", 1)[0] in trainable}, "no optimizer state of the adapters"
        ref = meta.values[FROZEN_BASE_KEY]
        assert ref["saved"] is False and ref["parameters"] == len(frozen), ref
        figures["fingerprint"] = ref["fingerprint"]  # (the test compares it with FSDP's)
        want = [step(model, opt, b, rank, world) for b in batches[2:]]
        want_state = trainable_state(fsdp, model)
        model2, fsdp2, opt2 = build_hsdp()
        extra = fsdp2.load_checkpoint(path, optimizer=opt2)
        assert extra["losses"] == losses
        got = [step(model2, opt2, b, rank, world) for b in batches[2:]]
        assert got == want, (got, want)
        assert trainable_state(fsdp2, model2)["digest"] == want_state["digest"]

    return case


def run_mode(argv: list[str], rank: int, world: int) -> dict:
    """One mode (``argv``: the mode and its arguments, as in the module docstring) -> this rank's report."""
    mode, root = argv[0], argv[1]
    if mode == "train":
        kill_at = int(argv[4]) if len(argv) > 4 else 0
        return mode_train(root, int(argv[2]), int(argv[3]), kill_at, rank, world)
    if mode == "resume":
        return mode_resume(root, int(argv[2]), rank, world)
    if mode == "memtier":
        kill_at = int(argv[3]) if len(argv) > 3 else 0
        return mode_memtier(root, int(argv[2]), kill_at, rank, world)
    figures: dict = {}
    cases = {
        "contents": _case_contents(root, figures),
        "refusal": _case_refusal(root),
        "separate_base": _case_separate_base(root),
    }
    if mode == "hsdp":
        cases = {"hsdp": _case_hsdp(root, figures)}
    return {**run_cases(cases, rank, world), "figures": figures}


def main() -> None:
    if dist.get_world_size() > 1:
        dist.init_parallel_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    phases, current = [], []
    for arg in sys.argv[1:]:
        if arg == "+":
            phases.append(current)
            current = []
        else:
            current.append(arg)
    phases.append(current)
    if len(phases) == 1:
        report(run_mode(phases[0], rank, world))
        return
    report({"phases": [run_mode(argv, rank, world) for argv in phases]})


if __name__ == "__main__":
    main()

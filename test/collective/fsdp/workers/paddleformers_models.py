"""PaddleFormers' own Qwen3ForCausalLM and Qwen3MoeForCausalLM (tiny random configs, nothing downloaded).

Usage:
  paddleformers_models.py train WORKDIR   (2 ranks) per model: FSDP vs one process after 3 steps of AdamW +
      global-norm clipping + warmup/cosine LR; checkpoint; 3 more steps (reference); a fresh model from another
      seed loads the checkpoint and repeats them: every record bit-exact. Then save_pretrained inside
      summon_full_params on rank 0, from_pretrained unwrapped: identical logits.
  paddleformers_models.py load WORKDIR    (any world size) loads the 2-rank checkpoint: parameters bit-exact,
      then one more step close to the 2-rank run's own next step.
Each rank reports {case: "ok" | traceback}.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback

import _paths  # noqa: F401  (puts launch_util on sys.path)
import numpy as np
import paddle
import paddle.distributed as dist
from launch_util import report
from paddle.distributed.fsdp import FullyShardFusion

logging.getLogger("paddleformers").setLevel(logging.WARNING)

VOCAB, SEQ, BATCH = 64, 8, 6  # BATCH: divisible by 1, 2 and 3 ranks
MODELS = ["qwen3", "qwen3_moe"]


def build(kind: str, seed: int):
    from paddleformers.transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    paddle.seed(seed)
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**common)), "Qwen3DecoderLayer", Qwen3ForCausalLM
    config = Qwen3MoeConfig(
        moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, **common
    )
    return Qwen3MoeForCausalLM(config), "Qwen3MoeDecoderLayer", Qwen3MoeForCausalLM


def optimizer(model):
    lr = paddle.optimizer.lr.LinearWarmup(
        paddle.optimizer.lr.CosineAnnealingDecay(1e-2, T_max=10), warmup_steps=2, start_lr=1e-3, end_lr=1e-2
    )
    return paddle.optimizer.AdamW(
        lr, parameters=model.parameters(), weight_decay=0.1, grad_clip=paddle.nn.ClipGradByGlobalNorm(0.5)
    )


def batch(step: int) -> np.ndarray:
    return np.random.default_rng(100 + step).integers(0, VOCAB, (BATCH, SEQ))


def train(model, opt, steps, rank: int, world: int) -> None:
    for step in steps:
        ids = batch(step)
        per = BATCH // world
        x = paddle.to_tensor(ids[rank * per : (rank + 1) * per])
        loss = model(input_ids=x, labels=x)[0]
        loss.backward()
        opt.step()
        opt.clear_grad()
        opt._learning_rate.step()


def records(fsdp, opt) -> dict:
    state = fsdp.sharded_state_dict()
    state.update(fsdp.optimizer_sharded_state_dict(opt))
    out = {}
    for key, value in state.items():
        tensor = getattr(value, "local_tensor", value)
        out[key] = np.array(tensor.numpy())
    return out


def assert_close_to(full: dict, reference) -> None:
    """Max error relative to the tensor's largest value below 1e-5 (fp32, other summation order)."""
    for key, value in reference.named_parameters():
        want = value.numpy()
        err = np.abs(full[key].numpy() - want).max() / max(np.abs(want).max(), 1e-12)
        assert err < 1e-5, f"{key}: relative error {err}"


def case_train(kind: str, rank: int, world: int, workdir: str) -> None:
    model, unit, model_class = build(kind, seed=1)
    reference, _, _ = build(kind, seed=1)
    fsdp = FullyShardFusion(model, fsdp_unit_layers=[unit])
    assert repr(model) == repr(reference), "print(model) differs from the unwrapped model's"
    opt, ref_opt = optimizer(model), optimizer(reference)
    train(model, opt, range(3), rank, world)
    train(reference, ref_opt, range(3), 0, 1)
    assert_close_to(fsdp.full_parameters(), reference)
    path = os.path.join(workdir, f"{kind}_ckpt")
    fsdp.save_checkpoint(path, optimizer=opt, extra_state={"step": 3})
    full_at_save = fsdp.full_state_dict(rank0_only=True)
    if rank == 0:
        np.savez(os.path.join(workdir, f"{kind}_at_save.npz"), **{k: v.numpy() for k, v in full_at_save.items()})
    train(model, opt, range(3, 6), rank, world)
    expected = records(fsdp, opt)
    next_full = fsdp.full_state_dict(rank0_only=True)
    if rank == 0:
        one_more = {k: v.numpy() for k, v in next_full.items()}
    # resume: another seed, load, the same three steps -> every record bit-exact
    fresh, _, _ = build(kind, seed=77)
    fresh_fsdp = FullyShardFusion(fresh, fsdp_unit_layers=[unit])
    fresh_opt = optimizer(fresh)
    result = fresh_fsdp.load_checkpoint(path, optimizer=fresh_opt)
    assert result["step"] == 3
    train(fresh, fresh_opt, range(3, 6), rank, world)
    got = records(fresh_fsdp, fresh_opt)
    assert sorted(got) == sorted(expected), sorted(set(got) ^ set(expected))
    for key in expected:
        np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
    # the 2-rank run's next step after the checkpoint, for the loads on other world sizes
    if rank == 0:
        np.savez(os.path.join(workdir, f"{kind}_after_6.npz"), **one_more)
    # save_pretrained inside summon_full_params on rank 0 -> from_pretrained unwrapped, identical logits
    out_dir = os.path.join(workdir, f"{kind}_pretrained")
    x = paddle.to_tensor(batch(9))
    with fsdp.summon_full_params(rank0_only=True):
        if rank == 0:
            model.save_pretrained(out_dir)
            with paddle.no_grad():
                wrapped_logits = model(input_ids=x)[0].numpy()
    if rank == 0:
        loaded = model_class.from_pretrained(out_dir)
        with paddle.no_grad():
            logits = loaded(input_ids=x)[0].numpy()
        np.testing.assert_array_equal(logits, wrapped_logits)


def case_load(kind: str, rank: int, world: int, workdir: str) -> None:
    model, unit, _ = build(kind, seed=5)
    fsdp = FullyShardFusion(model, fsdp_unit_layers=[unit])
    opt = optimizer(model)
    result = fsdp.load_checkpoint(os.path.join(workdir, f"{kind}_ckpt"), optimizer=opt)
    assert result["step"] == 3
    full = fsdp.full_state_dict(rank0_only=False)
    saved = np.load(os.path.join(workdir, f"{kind}_at_save.npz"))
    assert sorted(full) == sorted(saved.files)
    for key in saved.files:
        np.testing.assert_array_equal(full[key].numpy(), saved[key], err_msg=key)
    train(model, opt, range(3, 6), rank, world)
    after = np.load(os.path.join(workdir, f"{kind}_after_6.npz"))
    full = fsdp.full_state_dict(rank0_only=False)
    for key in after.files:
        want = after[key]
        err = np.abs(full[key].numpy() - want).max() / max(np.abs(want).max(), 1e-12)
        assert err < 1e-5, f"{key}: relative error {err} after 3 steps on {world} rank(s)"


def main() -> None:
    mode, workdir = sys.argv[1], sys.argv[2]
    if dist.get_world_size() > 1:
        dist.init_parallel_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    case = case_train if mode == "train" else case_load
    out = {}
    for kind in MODELS:
        try:
            case(kind, rank, world, workdir)
            out[kind] = "ok"
        except Exception:  # noqa: BLE001 - reported per case
            out[kind] = traceback.format_exc()
        report(out)
        if world > 1:
            dist.barrier()


if __name__ == "__main__":
    main()

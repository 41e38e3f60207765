"""Loss drift after resuming from quantized moments, on PaddleFormers' Qwen3ForCausalLM (tiny random config).

One process: train ``K`` steps (AdamW, fp32: CPU paddle has no bf16 AdamW kernel), save exactly and with
``quantize_moments=<mode>``, train ``N`` more steps uninterrupted (the reference), then a fresh model (another seed)
loads each checkpoint and trains the same ``N`` steps on the same batches. An exact resume repeats the reference's
losses bit for bit; a lossy one drifts by what the moments' quantization changed. Used by
test_lossy_moments.py (the bound) and run directly for the report's figures::

    python lossy_drift.py --modes int8 int4 --k 20 --steps 100 --out drift.json
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
import warnings

import numpy as np
import paddle

logger = logging.getLogger("lossy_drift")
VOCAB, SEQ, BATCH = 128, 16, 4


def build(seed: int, lr: float, layers: int = 2):
    from paddle.distributed.fsdp import FullyShardFusion
    from paddleformers.transformers import Qwen3Config, Qwen3ForCausalLM

    paddle.seed(seed)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model = Qwen3ForCausalLM(config)
    fsdp = FullyShardFusion(model, fsdp_unit_layers=["Qwen3DecoderLayer"])
    opt = paddle.optimizer.AdamW(lr, parameters=model.parameters(), weight_decay=0.01)
    return model, fsdp, opt


def batch(step: int) -> paddle.Tensor:
    # a learnable stream: each sequence counts up from a random start (mod VOCAB), so the loss keeps falling
    rng = np.random.default_rng(1000 + step)
    starts = rng.integers(0, VOCAB, (BATCH, 1))
    return paddle.to_tensor((starts + np.arange(SEQ)) % VOCAB)


def train(model, opt, steps) -> list[float]:
    losses = []
    for step in steps:
        x = batch(step)
        loss = model(input_ids=x, labels=x)[0]
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses


def drift(
    modes=("int8",),
    k: int = 20,
    steps: int = 100,
    lr: float = 3e-3,
    workdir: str | None = None,
    uninterrupted: bool = True,
    layers: int = 2,
) -> dict:
    """``{"reference": losses, "exact": losses, mode: losses, ...}`` of the ``steps`` steps after step ``k``;
    without ``uninterrupted`` the reference is the exact resume (one run fewer: the test's budget)."""
    workdir = workdir or tempfile.mkdtemp(prefix="lossy_drift_")
    model, fsdp, opt = build(1, lr, layers)
    train(model, opt, range(k))
    fsdp.save_checkpoint(f"{workdir}/exact", optimizer=opt)
    for mode in modes:
        fsdp.save_checkpoint(f"{workdir}/{mode}", optimizer=opt, quantize_moments=mode)
    after = range(k, k + steps)
    out = {"reference": train(model, opt, after)} if uninterrupted else {}
    for name in ("exact", *modes):
        model, fsdp, opt = build(2, lr, layers)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # LossyCheckpointWarning: expected here
            fsdp.load_checkpoint(f"{workdir}/{name}", optimizer=opt)
        out[name] = train(model, opt, after)
    if not uninterrupted:
        out["reference"] = out.pop("exact")
    return out


def summary(curves: dict) -> dict:
    ref = np.asarray(curves["reference"])
    return {
        name: {
            "max_abs_diff": float(np.abs(np.asarray(c) - ref).max()),
            "final_abs_diff": float(abs(c[-1] - ref[-1])),
            "first_abs_diff": float(abs(c[0] - ref[0])),
            "mean_abs_diff": float(np.abs(np.asarray(c) - ref).mean()),
        }
        for name, c in curves.items()
        if name != "reference"
    } | {"reference": {"first": float(ref[0]), "last": float(ref[-1])}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", nargs="+", default=["int8", "int4"])
    p.add_argument("--k", type=int, default=20, help="steps before the save")
    p.add_argument("--steps", type=int, default=100, help="steps after the resume")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--out", help="write curves and summary as JSON here")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("paddleformers").setLevel(logging.WARNING)
    t0 = time.perf_counter()
    curves = drift(tuple(a.modes), a.k, a.steps, a.lr)
    result = {"k": a.k, "steps": a.steps, "lr": a.lr, "summary": summary(curves), "curves": curves}
    logger.info("%s (%.1f s)", json.dumps(result["summary"], indent=1), time.perf_counter() - t0)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()

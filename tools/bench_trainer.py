"""Trainer steps/s and peak RSS per rank: FSDPTrainer vs the stock PaddleFormers Trainer (data parallel, sharding
stage 1) on the same tiny Llama, 2 ranks on CPU (gloo). Needs the ``paddleformers`` extra.

    python tools/bench_trainer.py --steps 30 --hidden 256 --layers 4 --out /tmp/bench-trainer.json

Each mode is one ``paddle.distributed.launch`` of this script (``--worker MODE``), run one after the other in the
same invocation, so the ratios compare runs of one machine state. Steps/s is measured over the steps after
``--warmup`` (between the Trainer's ``on_step_end`` callbacks); peak RSS is each rank's ``ru_maxrss`` at the end.
Stock sharding stage 1 needs ``split_param=False`` and ``max_grad_norm=0`` on CPU in PaddleFormers 1.2.0, so every
mode runs without clipping. Results are printed as a table and written as JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("fsdp", "stock-dp", "stock-stage1")
logger = logging.getLogger("bench_trainer")


def _worker(mode: str, opts: argparse.Namespace) -> None:
    import numpy as np
    import paddle
    from paddle.distributed.fsdp.integrations.paddleformers import FSDPTrainer
    from paddleformers.trainer import Trainer, TrainerCallback, TrainingArguments
    from paddleformers.transformers.llama.configuration import LlamaConfig
    from paddleformers.transformers.llama.modeling import LlamaForCausalLM

    class Tokens(paddle.io.Dataset):
        def __init__(self, n: int):
            self.data = np.random.RandomState(0).randint(0, opts.vocab, size=(n, opts.seq + 1)).astype("int64")

        def __len__(self):
            return len(self.data)

        def __getitem__(self, i):
            return {"input_ids": self.data[i, :-1], "labels": self.data[i, 1:]}

    class Clock(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter())

    config = LlamaConfig(
        vocab_size=opts.vocab,
        hidden_size=opts.hidden,
        intermediate_size=opts.hidden * 2,
        num_hidden_layers=opts.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=opts.seq,
        tie_word_embeddings=False,
        dtype="float32",
        fuse_rms_norm=False,
    )
    paddle.seed(0)
    model = LlamaForCausalLM(config)
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="bench-trainer-"),
        max_steps=opts.steps,
        per_device_train_batch_size=opts.batch,
        learning_rate=1e-3,
        max_grad_norm=0.0,
        logging_steps=10**6,
        save_strategy="no",
        sharding="stage1" if mode == "stock-stage1" else "",
        split_param=False,
        amp_master_grad=False,
        device="cpu",
        report_to="none",
        disable_tqdm=True,
        seed=42,
    )
    clock = Clock()
    kwargs = dict(model=model, args=args, train_dataset=Tokens(opts.steps * opts.batch * 2), callbacks=[clock])
    trainer = FSDPTrainer(**kwargs) if mode == "fsdp" else Trainer(**kwargs)
    trainer.train()
    measured = clock.times[opts.warmup :]
    rate = (len(measured) - 1) / (measured[-1] - measured[0]) if len(measured) > 1 else float("nan")
    rank = int(os.environ.get("PADDLE_TRAINER_ID", "0"))
    result = {"mode": mode, "rank": rank, "steps_per_s": rate, "peak_rss_mib": _peak_rss_mib()}
    Path(opts.results, f"{mode}.{rank}.json").write_text(json.dumps(result))


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _launch(mode: str, opts: argparse.Namespace, results: str) -> list[dict]:
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(opts.nproc)]
    cmd += ["--log_dir", os.path.join(results, f"log-{mode}"), __file__, "--worker", mode, "--results", results]
    for name in ("steps", "warmup", "hidden", "layers", "vocab", "seq", "batch"):
        cmd += [f"--{name}", str(getattr(opts, name))]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=opts.timeout)
    if proc.returncode != 0:
        raise SystemExit(f"bench_trainer: mode {mode} failed (exit {proc.returncode}); logs in {results}/log-{mode}")
    return [json.loads(Path(results, f"{mode}.{r}.json").read_text()) for r in range(opts.nproc)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {MODES}")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the rate")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="per-device batch")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--results", help=argparse.SUPPRESS)
    opts = p.parse_args()
    if opts.worker:
        _worker(opts.worker, opts)
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-trainer-") as results:
        modes = [m for m in opts.modes.split(",") if m]
        for i, mode in enumerate(modes, 1):
            logger.info("[%d/%d] %s: %d ranks x %d steps ...", i, len(modes), mode, opts.nproc, opts.steps)
            ranks = _launch(mode, opts, results)
            rows.append(
                {
                    "mode": mode,
                    "steps_per_s": min(r["steps_per_s"] for r in ranks),
                    "peak_rss_mib": [round(r["peak_rss_mib"], 1) for r in ranks],
                }
            )
    base = next((r["steps_per_s"] for r in rows if r["mode"] == "stock-dp"), None)
    print(f"{'mode':<14} {'steps/s':>8} {'vs DP':>6}  peak RSS per rank (MiB)")
    for r in rows:
        ratio = f"{r['steps_per_s'] / base:.2f}" if base else "-"
        print(f"{r['mode']:<14} {r['steps_per_s']:>8.2f} {ratio:>6}  {r['peak_rss_mib']}")
    if opts.out:
        Path(opts.out).write_text(json.dumps({"config": vars(opts), "results": rows}, indent=2))


if __name__ == "__main__":
    main()

"""tools/train_bench/lora.py, the LoRA case of the training benchmark (issue #51), run small in real processes.

The figures at size (>= 50M base) are in docs/performance.md; here, at d=64, what holds at any size: the three
contenders train to the same losses bit for bit, FullyShardFusion's checkpoint holds the adapter's bytes (plus
headers and metadata) and no frozen base, the stock ones the whole model, and the table renders.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
BENCH = ROOT / "tools" / "train_bench" / "lora.py"


def test_lora_bench_small(tmp_path):
    docs = tmp_path / "performance.md"
    docs.write_text("# guide\n")
    cli = [sys.executable, str(BENCH), "--d", "64", "--layers", "2", "--heads", "4", "--steps", "1", "--batch", "2",
           "--dir", str(tmp_path / "work"), "--json", str(tmp_path / "r.json"), "--write-docs", str(docs)]  # fmt: skip
    done = subprocess.run(cli, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((tmp_path / "r.json").read_text())
    runs = {r["contender"]: r for r in results["runs"]}
    assert set(runs) == {"fsdp", "dp", "stage1"} and all("ranks" in r for r in runs.values()), runs
    for rank in (0, 1):  # same data, same model, same optimizer: the same losses on every contender
        assert len({tuple(r["ranks"][rank]["losses"]) for r in runs.values()}) == 1
    adapter = 2 * 4 * 2 * 64 * 8 * 4 * 3  # layers x q/k/v/o x (A + B) x d x r x fp32 x (param + 2 AdamW moments)
    fsdp, dp = runs["fsdp"]["ranks"][0], runs["dp"]["ranks"][0]
    assert adapter <= fsdp["ckpt_data_bytes"] <= 1.1 * adapter + 16 * 1024, (fsdp["ckpt_data_bytes"], adapter)
    model = fsdp["parameters"] * 4
    assert dp["ckpt_data_bytes"] >= model and runs["stage1"]["ranks"][0]["ckpt_data_bytes"] >= model
    text = docs.read_text()
    assert text.startswith("# guide\n") and "train_bench_lora:begin" in text and "**FullyShardFusion**" in text

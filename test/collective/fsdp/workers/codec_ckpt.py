"""Compressed checkpoints (chunk codecs) against raw ones, on N saving and M loading ranks.

Usage:
  codec_ckpt.py save WORKDIR           on N ranks: train a bf16 model with fp32 master AdamW 2 steps, then save
                                       the same state raw and byteplane-zstd (save_checkpoint, the codec chosen
                                       by options and by PADDLE_FSDP_CKPT_CODEC), and its records with 1 KiB
                                       checksum chunks (so that a resharded load reads parts of chunks); then
                                       codec auto with ranks whose measurements disagree (case auto-agree).
  codec_ckpt.py load WORKDIR SRC_N...  on M ranks: per source, load the raw and the compressed checkpoint into
                                       fresh models and compare every record bit for bit.
Each rank reports {case: "ok" | traceback}.
"""

from __future__ import annotations

import os
import sys
import traceback

import _paths  # noqa: F401  (puts launch_util on sys.path)
import numpy as np
import paddle
import paddle.distributed as dist
import paddle.distributed.fsdp.checkpoint as ck
from launch_util import report
from master_adamw import MasterAdamW
from models import Bf16MLP, global_batches
from paddle.distributed.fsdp import FullyShardFusion
from paddle.distributed.fsdp.checkpoint.options import CheckpointOptions
from training import records, train

RAW = CheckpointOptions(codec="raw")
ZSTD = CheckpointOptions(codec="byteplane-zstd", codec_threads=2)


def build(seed: int):
    paddle.seed(seed)
    model = Bf16MLP()
    fsdp = FullyShardFusion(model)
    opt = MasterAdamW(0.01, parameters=model.parameters(), weight_decay=0.1, multi_precision=True)
    return model, fsdp, opt


def snapshot(fsdp, opt) -> dict:
    out = {}
    for key, value in records(fsdp, opt).items():
        t = value.local_tensor if hasattr(value, "local_tensor") else value
        out[key] = np.array(t.numpy()).tobytes()
    return out


def save(workdir: str, rank: int, world: int) -> dict:
    results = {}
    try:
        model, fsdp, opt = build(7)
        train(model, opt, global_batches(2, 12), rank, world)
        base = os.path.join(workdir, f"n{world}")
        fsdp.save_checkpoint(f"{base}-raw", optimizer=opt, options=RAW)
        fsdp.save_checkpoint(f"{base}-zstd", optimizer=opt, options=ZSTD)
        os.environ["PADDLE_FSDP_CKPT_CODEC"] = "byteplane-zstd"  # the switch, read at call time
        try:
            fsdp.save_checkpoint(f"{base}-env", optimizer=opt)
        finally:
            del os.environ["PADDLE_FSDP_CKPT_CODEC"]
        state = records(fsdp, opt)
        ck.save_state_dict(state, f"{base}-small-raw", chunk_bytes=1024, options=RAW)
        ck.save_state_dict(state, f"{base}-small-zstd", chunk_bytes=1024, options=ZSTD)
        results["save"] = "ok"
    except Exception:
        results["save"] = traceback.format_exc()
    try:
        ranks_disagree(fsdp, opt, base, rank, world)
        results["auto-agree"] = "ok"
    except Exception:
        results["auto-agree"] = traceback.format_exc()
    return results


def ranks_disagree(fsdp, opt, base: str, rank: int, world: int) -> None:
    """Codec auto where each rank's own measurement says otherwise (the encoder posed fast on one rank, slow on
    the others, against one disk rate): every rank takes the coordinator's choice, every file says it, and the
    checkpoint loads bit for bit."""
    from paddle.distributed.fsdp.checkpoint import codec_choice
    from paddle.distributed.fsdp.checkpoint.io.local import LocalStorage

    saved = snapshot(fsdp, opt)
    auto = CheckpointOptions(codec="auto")
    disk = codec_choice.Write("raw", 1 << 30, 1 << 30, 1.0, 1.0)  # a disk of 1 GB/s measured
    cases = [(0, "byteplane-zstd")] + ([(world - 1, "raw")] if world > 1 else [])  # (the fast rank, the codec)
    for fast_rank, expected in cases:
        path = os.path.join(f"{base}-auto-fast{fast_rank}", "ck")  # a root of its own: only ``disk`` measured
        codec_choice.record_write(codec_choice.storage_root(LocalStorage(), path), disk)
        codec_choice.set_encode_rate(1e13 if rank == fast_rank else 1e3)
        fsdp.save_checkpoint(path, optimizer=opt, options=auto)
        md = ck.read_metadata(path)
        want = {} if expected == "raw" else dict.fromkeys(md.files, expected)
        assert len(md.files) == world and md.codecs == want, (fast_rank, md.codecs)
        _model, fsdp2, opt2 = build(99)
        fsdp2.load_checkpoint(path, optimizer=opt2)
        got = snapshot(fsdp2, opt2)
        assert sorted(got) == sorted(saved) and all(got[k] == saved[k] for k in saved), path
    codec_choice.set_encode_rate(None)


def load_pair(workdir: str, source: str, low_level: bool) -> None:
    got = []
    for i, codec in enumerate(("raw", "zstd")):
        path = os.path.join(workdir, f"n{source}-small-{codec}" if low_level else f"n{source}-{codec}")
        model, fsdp, opt = build(90 + i)  # another start each time: a record left unloaded would differ
        if low_level:
            fsdp.init_optimizer_state(opt)
            state = records(fsdp, opt)
            ck.load_state_dict(state, path)
        else:
            fsdp.load_checkpoint(path, optimizer=opt)
        got.append(snapshot(fsdp, opt))
    raw, zstd = got
    assert sorted(raw) == sorted(zstd) and raw, "different keys"
    for key in raw:
        assert raw[key] == zstd[key], f"{key}: compressed load differs from the raw one"


def main() -> None:
    phase, workdir = sys.argv[1:3]
    world = dist.get_world_size()
    if world > 1:
        dist.init_parallel_env()
    rank = dist.get_rank()
    if phase == "save":
        report(save(workdir, rank, world))
        return
    results = {}
    for source in sys.argv[3:]:
        for low_level in (False, True):
            case = f"{source}->{world}{'-small' if low_level else ''}"
            try:
                load_pair(workdir, source, low_level)
                results[case] = "ok"
            except Exception:
                results[case] = traceback.format_exc()
    report(results)


if __name__ == "__main__":
    main()

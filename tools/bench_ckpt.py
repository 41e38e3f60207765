#!/usr/bin/env python3
"""Checkpoint benchmark: the FSDP engine against raw I/O, the all-gather way and PyTorch DCP (issue 6).

Usage (one invocation measures everything on the same state)::

    python -m paddle.distributed.launch --nproc_per_node 2 tools/bench_ckpt.py --json bench.json
    python tools/bench_ckpt.py --world 2 --size-gib 1 --json bench.json     # launches itself
    python tools/bench_ckpt.py --bytes --json bytes.json   # bytes per parameter per save mode (ckpt_bench/bytes.py)
    python tools/bench_ckpt.py --bytes --io                # + save / cold load vs raw I/O, local and S3, RSS, goals

The state is a model of ``Linear(dim, dim)`` blocks sized so that parameters + AdamW moments come to
``--size-gib`` in all (fp32: 12 bytes per parameter), wrapped in ``FullyShardFusion`` (one FSDP unit per
block); the AdamW state is created with ``fsdp.init_optimizer_state`` and filled with random values. Every
phase is repeated ``--repeats`` times (round robin, fresh directories); the table shows medians.

Phases, each timed from a barrier to the slowest rank's end (GB = 1e9 bytes of state):

(a) ``raw write+fsync``: every rank writes its own state bytes from tensor memory to one file, 64 MiB
    writes, one fsync; ``raw write+fsync, O_DIRECT``: the same bytes copied into one reused 4 MiB buffer and
    written with O_DIRECT (the faster of the two is the limit for saves);
(b) ``save sync`` / ``save async``: ``fsdp.save_checkpoint``; async reports the time the caller is blocked
    and the total until ``wait()``; blocked time is compared with a host memcpy of the rank's state (into a
    preallocated buffer, measured right before each async save; a copy into fresh memory is reported as
    well); ``async overlap`` runs a matmul loop while the save persists in the background and reports its
    speed relative to an idle run;
(c) ``all_gather + paddle.save``: parameters gathered with ``fsdp.full_parameters()``, AdamW moments with
    one padded ``all_gather`` per parameter, rank 0 writes one ``paddle.save`` file and fsyncs it;
(d) ``load``: ``fsdp.load_checkpoint`` into zeroed targets, every time the FIRST load of a FRESH process (a child
    ``paddle.distributed.launch`` of this script in ``--mode load-only``; no buffer left by an earlier save or
    load), round robin over: same world with the page cache dropped (``same``), same world with the files in
    the page cache (``warm``), ``--load-world`` ranks (``changed``), same world with ``atomic=True`` (the undo
    copy); each verifies an order-independent checksum of the loaded state and reports the engine's own
    host-memory account (``LoadReport.peak_host_bytes``) next to the peak RSS;
(e) ``raw read``: in the same fresh process right before its load and again right after it (the figure is the
    mean of the two: a steady drift of the disk during the process cancels out), the checkpoint's data files
    read by the same ranks (equal contiguous shares, 16 MiB preads) into resident memory of the share's size
    (what a load fills) and into one reused 16 MiB buffer (the I/O alone), page cache dropped before each; the
    faster of the two is the limit of a cold load (ratios are also shown per process, load and raw read side by
    side); for ``warm``, a plain read of the same shares with the files in the page cache;
(f) ``torch DCP``: if torch is importable, FSDP2 (``fully_shard`` per Linear) with the same sizes on gloo,
    ``torch.distributed.checkpoint.save`` (fsync on); ``load`` + ``set_state_dict``, same and changed world,
    each the first load of a fresh set of processes spawned by this script, page cache dropped, one of each in
    every round of (d) so that both sides see the same stretch of the disk's speed;
(g) ``training loop`` (``ckpt_bench/train_loop.py``, ``--no-train`` skips it): K steps of the same model with
    an async checkpoint every M steps against the same loop without checkpoints, for paddle FSDP and for
    torch FSDP2 + DCP ``async_save`` (``DefaultStager``, ``staging_completion`` before the step), with the
    benchmark's world and with 1 rank (a core free): extra wall time per checkpoint, also as a ratio to a
    memcpy of the rank's state;
(h) ``many small keys`` (``ckpt_bench/many_keys.py``, ``--keys N``, 0 skips it): a save and a load of N small
    flat records per rank (the bookkeeping of a mixture of experts' ~10^5 keys), in microseconds per key.

Page cache: ``/proc/sys/vm/drop_caches`` is used when writable, else ``posix_fadvise(DONTNEED)`` on every
file before each read phase; the resident fraction is checked with ``mincore`` and reported. The virtual
disk of a VM may still be cached by the host, so cold-read figures are noisy.

Memory: each rank's extra peak RSS over its RSS before the phase (``VmHWM`` after resetting it via
``/proc/self/clear_refs``; a sampling thread where that is not allowed; freed heap memory is returned with
``malloc_trim`` first, so reused heap pages count), during sync save, async save and load, compared with
its state bytes. The engine's per-phase timings (its public ``CheckpointOptions.trace_hook``) are recorded in-process
(``--no-trace`` turns that off). The load average at the start is printed: other jobs on the machine make
every figure noisy. Results: a table on stdout (markdown), ``--json`` for everything (per-rank times too).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

from ckpt_bench.common import LOG, clean_env, launch_cmd, setup_logging
from ckpt_bench.phases import run_full, run_load_only
from ckpt_bench.torch_dcp import run_torch_worker


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--size-gib", type=float, default=1.0, help="params + AdamW state in all (GiB, default 1)")
    p.add_argument("--dim", type=int, default=2048, help="Linear(dim, dim) per block (default 2048)")
    p.add_argument(
        "--world",
        type=int,
        default=None,
        help="ranks; when started without paddle.distributed.launch the script launches itself "
        "with this many (default 2); under launch it must match --nproc_per_node",
    )
    p.add_argument(
        "--load-world", type=int, default=None, help="ranks of the changed-world load (default: world + 1; 0 skips it)"
    )
    p.add_argument("--repeats", type=int, default=3, help="repetitions of every phase (default 3)")
    p.add_argument("--dir", default=None, help="work directory for the files (default: a temp dir in /tmp)")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("--json", default=None, help="write all results to this JSON file")
    p.add_argument("--no-torch", action="store_true", help="skip PyTorch DCP even if torch is importable")
    p.add_argument("--no-gather", action="store_true", help="skip the all_gather + paddle.save phase")
    p.add_argument(
        "--gather-repeats",
        type=int,
        default=None,
        help="repetitions of the slow all_gather + paddle.save phase (default: --repeats)",
    )
    p.add_argument("--no-trace", dest="trace", action="store_false", help="do not record engine phase timings")
    p.add_argument("--no-overlap", dest="overlap", action="store_false", help="skip the async overlap probe")
    p.add_argument(
        "--no-train", dest="train", action="store_false", help="skip the training-loop phase (ckpt_bench/train_loop.py)"
    )
    p.add_argument("--train-steps", type=int, default=30, help="training-loop phase: steps per loop (default 30)")
    p.add_argument(
        "--train-size-gib", type=float, default=None, help="training-loop phase: state size (default: --size-gib)"
    )
    p.add_argument("--train-every", type=int, default=10, help="training-loop phase: checkpoint every N steps")
    p.add_argument("--train-repeats", type=int, default=2, help="training-loop phase: loops of each kind")
    p.add_argument(
        "--keys",
        type=int,
        default=20000,
        help="many-keys phase: small tensors saved and loaded to time the per-key bookkeeping (0 skips it)",
    )
    p.add_argument(
        "--hsdp-replicas",
        type=int,
        default=2,
        help="HSDP phase: replicas (bytes written/read per rank against plain FSDP; runs when the world is a "
        "multiple with 2+ shards each, e.g. --world 4; 0 skips it)",
    )
    p.add_argument("--hsdp-dim", type=int, default=512, help="HSDP phase: Linear(dim, dim) per block (default 512)")
    p.add_argument("--seed", type=int, default=2024)
    # internal modes
    p.add_argument("--mode", default="full", choices=["full", "load-only", "torch-worker"], help=argparse.SUPPRESS)
    p.add_argument("--ckpt", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--expect-checksum", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--torch-rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--torch-world", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--torch-port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--torch-task", default="save", choices=["save", "load", "many-keys"], help=argparse.SUPPRESS)
    p.add_argument("--cache", default="cold", choices=["cold", "warm"], help=argparse.SUPPRESS)
    p.add_argument("--atomic", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--no-verify", dest="verify", action="store_false", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--bytes"]:  # bytes per parameter per save mode (ckpt_bench/bytes.py; its own options follow)
        from ckpt_bench import bytes as bytes_bench

        sys.exit(bytes_bench.main(argv[1:]))
    args = parse_args(argv)
    if args.mode == "torch-worker":
        run_torch_worker(args)
        return
    launched = "PADDLE_TRAINER_ID" in os.environ or "PADDLE_TRAINERS_NUM" in os.environ
    if not launched:
        world = args.world or 2
        setup_logging(0)
        log_dir = tempfile.mkdtemp(prefix="bench_ckpt_log_")
        cmd = launch_cmd(world, log_dir, list(argv if argv is not None else sys.argv[1:]))
        LOG.info("launching: %s (worker logs in %s)", " ".join(cmd), log_dir)
        rc = subprocess.call(cmd, env=clean_env())
        if rc == 0:
            shutil.rmtree(log_dir, ignore_errors=True)
        else:
            LOG.error("benchmark failed (exit %d); worker logs in %s", rc, log_dir)
        sys.exit(rc)
    if args.mode == "load-only":
        run_load_only(args)
    else:
        run_full(args)


if __name__ == "__main__":
    main()

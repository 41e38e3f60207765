"""``paddle-fsdp-ckpt flush-memory``: the memory tier's newest checkpoint written to storage (memtier/flush.py)."""

from __future__ import annotations

import argparse

EXIT_OK = 0


def add_flush_memory(sub, common: argparse.ArgumentParser) -> None:
    """Register the subcommand on the CLI's subparsers."""
    p = sub.add_parser(
        "flush-memory",
        parents=[common],
        help="write the newest memory-tier checkpoint to storage (after a crash)",
        description="Write the newest step that EVERY rank of a memory-tier job (MemoryTier) has in the given\n"
        "memory roots (own or peer copies, every checksum verified) to DURABLE_ROOT/step_<N> as a committed\n"
        "checkpoint (loadable at any world size), then point DURABLE_ROOT/latest at it. Nothing is written\n"
        "when storage already has that step or a newer one. Run it on a node after the job crashed, before\n"
        "the restart; give the roots of every node you can reach (a node's root holds its ranks' copies and\n"
        "its partner node's).\n\n"
        "Only copies that name DURABLE_ROOT's memory-tier id (its memtier-id object) are used; a job whose\n"
        "tier is still running (its rank lock held) is refused; roots others may write to, symlinks and FIFOs\n"
        "are refused or skipped; each record is verified in a private buffer before it is written\n"
        "(docs/memory-tier-trust.md). Exit 2 names what is wrong.",
        epilog="examples:\n"
        "  paddle-fsdp-ckpt flush-memory ckpt/ --memory-root /dev/shm/paddle-fsdp-memtier\n"
        "  paddle-fsdp-ckpt flush-memory ckpt/ --memory-root /mnt/node0-shm --memory-root /mnt/node1-shm --job run7\n"
        "  paddle-fsdp-ckpt flush-memory s3://bucket/run7/ckpt --memory-root /dev/shm/paddle-fsdp-memtier",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "durable_root", metavar="DURABLE_ROOT", help="the job's checkpoint root (durable_root): a path or s3://..."
    )
    p.add_argument(
        "--memory-root",
        action="append",
        metavar="DIR",
        help="memory root to read (repeatable; default: $PADDLE_FSDP_MEMTIER_ROOT or /dev/shm/paddle-fsdp-memtier)",
    )
    p.add_argument("--job", metavar="JOB_ID", help="the job's id (needed when the roots hold several jobs)")
    p.add_argument("--step", type=int, metavar="N", help="flush step N instead of the newest")
    p.add_argument("--keep-last", type=int, metavar="K", help="then keep only the K newest checkpoints")
    p.set_defaults(func=cmd_flush_memory)


def cmd_flush_memory(args) -> int:
    from .. import env_switches
    from ..memtier.flush import flush_memory
    from ..memtier.manager import ROOT_ENV
    from .progress import Progress, human_bytes

    roots = args.memory_root or [env_switches.read(ROOT_ENV)]
    with Progress(0, "flush-memory", enabled=False if getattr(args, "no_progress", False) else None) as bar:
        res = flush_memory(roots, args.durable_root, job=args.job, step=args.step, keep_last=args.keep_last,
                           on_bytes=bar.update, on_total=lambda n: setattr(bar, "total", n))  # fmt: skip
    if res.path is None:
        print(f"job {res.job}: storage {args.durable_root} already has step {res.step} or newer; nothing written")
    else:
        print(f"flushed job {res.job} step {res.step} (world {res.world}, {human_bytes(res.nbytes)}) to {res.path}")
    return EXIT_OK

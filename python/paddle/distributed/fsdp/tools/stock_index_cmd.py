"""``paddle-fsdp-ckpt stock-index``: write stock paddle's ``0.metadata`` for a checkpoint saved without it.

Why: ``0.metadata`` (stock_compat.py) lists every piece of every rank, so a save that writes it makes the
coordinator lay out every rank's file and pickle the whole index (docs/reports/scale-2026-12-03-s3.md: seconds and
hundreds of MB at thousands of ranks). Saves at that scale pass ``write_stock_metadata=False``; this command
writes the same index later, in one process, from the checkpoint's own index, for a stock reader that needs it.
The checkpoint is not otherwise changed (its commit record does not cover ``0.metadata``: the engine never
reads it).
"""

from __future__ import annotations

import argparse

EXIT_OK = 0


def add_stock_index(sub, common: argparse.ArgumentParser) -> None:
    """Register the subcommand on the CLI's subparsers."""
    p = sub.add_parser(
        "stock-index",
        parents=[common],
        help="write stock paddle's 0.metadata for a checkpoint saved without it",
        description="Write 0.metadata (stock paddle's pickled index, for dist.load_state_dict with\n"
        "safetensors=True) into a committed checkpoint saved with write_stock_metadata=False, from its own\n"
        "index, in one process. Nothing else in the checkpoint changes.",
        epilog="example:\n  paddle-fsdp-ckpt stock-index ckpt/step_00001000",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("ckpt", metavar="CKPT", help="checkpoint directory")
    p.add_argument("--force", action="store_true", help="write it even if the checkpoint has one already")
    p.set_defaults(func=cmd_stock_index)


def cmd_stock_index(args) -> int:
    from ..checkpoint import read_metadata
    from ..checkpoint.io.backends import backend_for
    from ..checkpoint.paths import local_path
    from ..checkpoint.stock_compat import STOCK_METADATA_FILE, stock_metadata_bytes
    from .progress import human_bytes

    path = local_path(args.ckpt)
    md = read_metadata(path)
    if md.codecs:
        from ..checkpoint.errors import ToolError

        raise ToolError(
            f"{path}: its data files are stored compressed ({', '.join(sorted(set(md.codecs.values())))}); stock "
            f"paddle reads raw safetensors files only (save with CheckpointOptions(codec='raw') for stock readers)"
        )
    storage = backend_for(path)
    if STOCK_METADATA_FILE in storage.list(path) and not args.force:
        print(f"{path} has {STOCK_METADATA_FILE} already (--force rewrites it)")
        return EXIT_OK
    md.prefetch(list(md.tensors))
    blob = stock_metadata_bytes(md)
    storage.put(path, STOCK_METADATA_FILE, blob)
    print(f"wrote {path}/{STOCK_METADATA_FILE}: {len(md.tensors)} keys, {human_bytes(len(blob))}")
    return EXIT_OK

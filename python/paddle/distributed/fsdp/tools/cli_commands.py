"""The commands of ``paddle-fsdp-ckpt``: each takes the parsed arguments, calls the library function behind it,
prints its summary and returns the exit code (the parser is ``cli_parser.py``, the entry point ``cli.py``)."""

from __future__ import annotations

import json
import sys

PROG = "paddle-fsdp-ckpt"

EXIT_OK, EXIT_PROBLEMS, EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
EXIT_REMOVED = 4  # the checkpoint was removed (another job's keep_last rotation) while it was read: run again


def one_line(text: object) -> str:
    """``text`` with every run of whitespace (newlines too) turned into one space: a message fit for one line."""
    return " ".join(str(text).split())


def _progress(args) -> bool | None:
    return False if getattr(args, "no_progress", False) else None


def cmd_inspect(args) -> int:
    from .inspect_cmd import format_text, inspect_checkpoint
    from .stock_cmd import format_foreign, inspect_foreign, is_foreign

    if is_foreign(args.ckpt):  # stock paddle / plain safetensors directory
        info = inspect_foreign(args.ckpt)
        print(json.dumps(info, indent=2) if args.json else format_foreign(info), flush=True)
        return EXIT_OK
    info = inspect_checkpoint(args.ckpt)
    print(json.dumps(info, indent=2) if args.json else format_text(info), flush=True)
    return EXIT_OK


def cmd_verify(args) -> int:
    from .progress import human_bytes
    from .stock_cmd import is_foreign, verify_foreign
    from .verify_cmd import verify

    foreign = is_foreign(args.ckpt)  # stock paddle / plain safetensors directory (no checksums to check)
    if foreign:
        problems, summary = verify_foreign(args.ckpt, progress=_progress(args))
    else:
        problems, summary = verify(args.ckpt, progress=_progress(args))
    if args.json:
        print(json.dumps({"path": args.ckpt, "ok": not problems, "problems": problems}, indent=2))
    elif not problems and foreign:
        print(
            f"OK: {summary['path']}: {summary['tensors']} tensors fully covered, {summary['files']} data file(s), "
            f"every piece readable; no checksums to check ({summary['checksum']})"
        )
    elif not problems:
        print(
            f"OK: {summary['path']}: {summary['tensors']} tensors ({human_bytes(summary['tensor_bytes'])}) fully "
            f"covered, {summary['files']} data file(s) ({human_bytes(summary['file_bytes'])} on disk), checksums "
            f"({summary['checksum']}) match"
            + (f"; {summary['derived']} weights derived from their master weights" if summary.get("derived") else "")
        )
    else:
        for p in problems:
            print(f"PROBLEM: {p}")
    if problems:
        print(
            f"{PROG} verify: {args.ckpt} is NOT sound: {len(problems)} problem(s); first: {one_line(problems[0])}",
            file=sys.stderr,
        )
        return EXIT_PROBLEMS
    return EXIT_OK


def cmd_to_hf(args) -> int:
    from .errors import ToolError
    from .progress import human_bytes
    from .rules import load_rules
    from .to_hf_cmd import to_hf

    if args.preset and args.rules:
        raise ToolError("give either --preset or --rules, not both")
    if args.base and not args.merge_adapter:
        raise ToolError("--base is the frozen base to merge with: give it with --merge-adapter")
    rules = load_rules(args.rules)
    if args.merge_adapter:
        return _merge_adapter(args, rules)
    s = to_hf(
        args.ckpt,
        args.out,
        max_shard_size=args.max_shard_size,
        dtype=args.dtype,
        rules=rules,
        include_optimizer=args.include_optimizer,
        include_buffers=args.include_buffers,
        progress=_progress(args),
        preset=args.preset,
        config=args.config,
        allow_unmapped=args.allow_unmapped,
        ema=args.ema,
    )
    if s.get("adapter"):  # a checkpoint that references its frozen base: its LoRA adapter (adapter_export.py)
        base = f"; base: {s['base']}" if s.get("base") else ""
        print(f"wrote the LoRA adapter ({s['tensors']} tensors, {human_bytes(s['total_size'])}) to {s['out']}{base}")
        for layout, why in s.get("skipped", {}).items():
            print(f"{PROG} to-hf: the {layout} layout was not written: {why}", file=sys.stderr)
        return EXIT_OK
    print(
        f"wrote {s['tensors']} tensors ({human_bytes(s['total_size'])}, {s['transposed']} transposed, "
        f"{s['split']} split from fused keys) in {len(s['files'])} file(s) to {s['out']}"
    )
    return EXIT_OK


def _merge_adapter(args, rules) -> int:
    """``to-hf --merge-adapter``: the code of the Trainer's ``hf_merge_adapter=True`` (tools/adapter_merge.py)."""
    from .adapter_merge import export_merged
    from .errors import ToolError
    from .from_hf_cmd import from_hf
    from .progress import human_bytes
    from .to_hf_cmd import to_hf

    if args.include_optimizer or args.ema:
        raise ToolError("--merge-adapter writes the merged weights only (no --include-optimizer, no --ema)")

    def convert(ckpt, out, **kwargs):
        options = {"max_shard_size": args.max_shard_size, "dtype": args.dtype, "include_buffers": args.include_buffers}
        options.update(rules=rules, allow_unmapped=args.allow_unmapped, progress=_progress(args))
        return to_hf(ckpt, out, **options, **kwargs)

    s = export_merged(
        args.ckpt, args.out, convert=convert, base=args.base, from_hf=from_hf, preset=args.preset, config=args.config
    )
    print(
        f"wrote the merged model ({s['merged']} adapted weights; {s['tensors']} tensors, "
        f"{human_bytes(s['total_size'])}) to {s['out']}; frozen base from {s['base']}"
    )
    return EXIT_OK


def cmd_from_hf(args) -> int:
    from .errors import ToolError
    from .from_hf_cmd import from_hf
    from .progress import human_bytes
    from .rules import load_rules

    if args.preset and args.rules:
        raise ToolError("give either --preset or --rules, not both")
    rules = load_rules(args.rules) if args.rules else None
    s = from_hf(
        args.hf,
        args.out,
        rules=rules,
        dtype=args.dtype,
        progress=_progress(args),
        preset=args.preset,
        config=args.config,
        allow_unmapped=args.allow_unmapped,
    )
    print(
        f"wrote checkpoint {s['out']}: {s['tensors']} tensors ({human_bytes(s['total_size'])}, "
        f"{s['transposed']} transposed, {s['merged']} merged into fused keys) in {s['files']} data file(s)"
    )
    return EXIT_OK


def cmd_import_stock(args) -> int:
    from .progress import human_bytes
    from .stock_cmd import import_stock

    s = import_stock(args.src, args.out, unique_id=args.unique_id, progress=_progress(args))
    print(
        f"wrote checkpoint {s['out']}: {s['tensors']} tensors ({human_bytes(s['total_size'])}) in {s['files']} "
        f"data file(s) ({human_bytes(s['file_bytes'])} on disk)"
    )
    return EXIT_OK


def cmd_diff(args) -> int:
    from .diff_cmd import diff, format_text
    from .hf_format import parse_size

    report = diff(
        args.a,
        args.b,
        window_bytes=parse_size(args.window),
        atol=args.atol,
        rtol=args.rtol,
        keys=args.key,
        progress=_progress(args),
        only=args.only,
    )
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(format_text(report, show_equal=args.show_equal))
    return EXIT_OK if report.identical else EXIT_PROBLEMS

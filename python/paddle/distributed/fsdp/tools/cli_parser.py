"""The argparse parser of ``paddle-fsdp-ckpt`` and its help texts (the commands are ``cli_commands.py``)."""

from __future__ import annotations

import argparse
import math

from .cli_commands import PROG, cmd_diff, cmd_from_hf, cmd_import_stock, cmd_inspect, cmd_to_hf, cmd_verify


def _rules_help(rename: str, transpose: str, direction: str) -> str:
    return f"""\
rules file (JSON), {direction}:
  {{"rename":    {rename},
   "transpose": {transpose}}}
  rename: every [regex, replacement] is applied in order with re.sub (Python syntax: group 1 is \\1,
  written "\\\\1" inside JSON);
  transpose: a 2-D tensor whose SOURCE name (before renaming) matches any regex is transposed
  (Paddle Linear weights are [in, out]; Hugging Face/torch use [out, in]). Keys starting with "_" are ignored.
"""


TO_HF_EPILOG = (
    _rules_help(
        r'[["^blocks\\.(\\d+)\\.", "model.layers.\\1."], ["^embed\\.weight$", "model.embed_tokens.weight"]]',
        r'["^blocks\\.\\d+\\.(mix|up|down)\\.weight$"]',
        "checkpoint key -> Hugging Face name",
    )
    + """
presets (--preset NAME --config config.json), for PaddleFormers models: names, Linear transposes and
fused keys split into Hugging Face's (qkv_proj -> q/k/v_proj, interleaved per kv head as PaddleFormers
computes it; up_gate_proj / gate_up_fused_proj -> gate_proj, up_proj), sizes from the config, every shape
checked. The export is refused (exit 2, naming the keys) if a checkpoint key is not mapped or a parameter
of the architecture is missing (--allow-unmapped skips them); config.json is copied into OUT.
  PRESETS

--rules (or neither) with --config: the export's names and shapes are checked against the architecture of
the config's model_type as a preset's are, refused (exit 2) unless --allow-unmapped; without --config (or
for a model_type no preset knows) a warning says that nothing was checked.

LoRA checkpoints (a PaddleFormers LoRAModel; saved without their frozen base by default): to-hf writes
the adapter in PaddleFormers' layout (lora_config.json + lora_model_state.pdparams) and in peft's
(adapter_config.json + adapter_model.safetensors). --merge-adapter writes the merged model instead (each
adapted weight W + scale * A @ B, in W's dtype; the base model's names, so use the base's --preset and
--config), what the Trainer's hf_merge_adapter=True writes. Its frozen base: the checkpoint's own (saved
with save_frozen=True), else --base DIR, else the source the checkpoint records; DIR is a checkpoint of
this engine or a Hugging Face directory. The base's fingerprint is checked before anything is written: a
different base is refused (exit 2, FrozenBaseMismatchError naming what differs).

The exact mapping is recorded in model.safetensors.index.json (metadata.paddle_fsdp), so from-hf can
invert it without rules. Output is written to OUT.tmp-<id> and renamed to OUT when complete; OUT must
not exist (or be empty).

examples:
  paddle-fsdp-ckpt to-hf ckpt/step1000 hf_out --dtype bf16 --max-shard-size 2GB --rules to_hf.json
  paddle-fsdp-ckpt to-hf ckpt/step1000 hf_out --preset qwen3-fused --config qwen3/config.json
  paddle-fsdp-ckpt to-hf out/checkpoint-300 merged --merge-adapter --base llama-base --preset llama-pf1 \
      --config llama-base/config.json
"""
)

FROM_HF_EPILOG = (
    _rules_help(
        r'[["^model\\.layers\\.(\\d+)\\.", "blocks.\\1."], ["^model\\.embed_tokens\\.weight$", "embed.weight"]]',
        r'["^model\\.layers\\.\\d+\\.(mix|up|down)\\.weight$"]',
        "Hugging Face name -> checkpoint key (transpose regexes match Hugging Face names)",
    )
    + """
presets (--preset NAME): the inverse of to-hf's: Hugging Face names -> checkpoint keys, transposes, and
merges into fused keys (q/k/v_proj -> qkv_proj, gate/up_proj -> up_gate_proj) for the -fused presets.
Sizes come from HF_DIR/config.json (or --config); refused (exit 2) if a parameter of the architecture is
missing or a tensor unmapped, unless --allow-unmapped.
  PRESETS

Without --rules or --preset, a preset or name map recorded by to-hf is used; with neither, names are kept.
Every tensor is stored whole, so load_checkpoint / dist.load_state_dict read just their slice on any
number of ranks. No random state is included, and no optimizer state unless the input came from
`to-hf --include-optimizer`: load with fsdp.load_checkpoint(path) (no optimizer=).

example:
  paddle-fsdp-ckpt from-hf hf_model ckpt/init --rules from_hf.json --dtype fp32
  paddle-fsdp-ckpt from-hf Qwen3-0.6B ckpt/init --preset qwen3-fused
"""
)


def _common() -> argparse.ArgumentParser:
    # defaults are SUPPRESS so the options work both before and after the subcommand
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "-v", "--verbose", action="count", default=argparse.SUPPRESS, help="log more (-v: info, -vv: debug)"
    )
    common.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show the traceback of an internal error"
    )
    common.add_argument(
        "--no-progress",
        action="store_true",
        default=argparse.SUPPRESS,
        help="never draw the progress bar (it is drawn only when stderr is a terminal)",
    )
    return common


def build_parser() -> argparse.ArgumentParser:
    common = _common()
    parser = argparse.ArgumentParser(
        prog=PROG,
        parents=[common],
        description="Inspect, verify and convert sharded FSDP checkpoints (paddle.distributed.fsdp).",
        epilog="Run `%(prog)s COMMAND --help` for the options of a command. Exit codes: 0 ok, 1 verify found "
        "problems / diff found differences, 2 bad input, 3 internal error.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser(
        "inspect",
        parents=[common],
        help="list keys, global shapes, dtypes, pieces and bytes",
        description="List a checkpoint's tensors (key, role, dtype, global shape, number of pieces, "
        "bytes), files and JSON values. Reads the metadata only.",
    )
    p.add_argument("ckpt", metavar="CKPT", help="checkpoint directory")
    p.add_argument("--json", action="store_true", help="print one JSON object (for machines)")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser(
        "verify",
        parents=[common],
        help="prove a checkpoint complete and intact",
        description="Check that every element of every tensor is covered exactly once, that every "
        "referenced file is present with the expected size, and every checksum. "
        "Exit 0 when sound, 1 with the named problems otherwise.",
    )
    p.add_argument("ckpt", metavar="CKPT", help="checkpoint directory")
    p.add_argument("--json", action="store_true", help='print {"path", "ok", "problems"} as JSON')
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser(
        "to-hf",
        parents=[common],
        help="write model weights as Hugging Face safetensors",
        description="Write the model weights (optimizer state with --include-optimizer) as sharded\n"
        "safetensors model-0000i-of-0000n.safetensors + model.safetensors.index.json,\n"
        "streaming tensor by tensor (peak memory about the largest tensor).",
        epilog=TO_HF_EPILOG.replace("  PRESETS", _preset_table()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("ckpt", metavar="CKPT", help="checkpoint directory")
    p.add_argument("out", metavar="OUT", help="output directory (must not exist, or be empty)")
    p.add_argument(
        "--max-shard-size",
        default="5GB",
        metavar="SIZE",
        help="largest shard, in tensor bytes: 5GB (default), 500MB, 2GiB or a byte count",
    )
    p.add_argument("--dtype", metavar="{bf16,fp16,fp32}", help="cast floating tensors (default: keep dtypes)")
    p.add_argument("--rules", metavar="FILE", help="rename/transpose rules (JSON, see below)")
    p.add_argument(
        "--include-optimizer", action="store_true", help="also write optimizer state, as '<hf param name>.<state>'"
    )
    p.add_argument(
        "--include-buffers",
        action="store_true",
        help="also write the model's persistable buffers (left out by default)",
    )
    p.add_argument(
        "--ema",
        action="store_true",
        help="write the EMA of the weights (saved with ema=) as the model's weights (docs/resume-state.md)",
    )
    p.add_argument(
        "--merge-adapter",
        action="store_true",
        help="LoRA checkpoint: write the merged model (base + scale * B @ A, base dtype) instead of the adapter",
    )
    p.add_argument(
        "--base",
        metavar="DIR",
        help="with --merge-adapter: the frozen base (engine checkpoint or HF directory) when the checkpoint does "
        "not hold it; default: the source it records. Its fingerprint must match (else exit 2)",
    )
    _preset_options(p, "to-hf")
    p.set_defaults(func=cmd_to_hf)

    p = sub.add_parser(
        "from-hf",
        parents=[common],
        help="write a checkpoint from Hugging Face safetensors",
        description="Write a checkpoint from a Hugging Face safetensors model (a directory with\n"
        "model.safetensors.index.json or *.safetensors files, or one .safetensors file)\n"
        "that load_checkpoint / dist.load_state_dict load at any world size.",
        epilog=FROM_HF_EPILOG.replace("  PRESETS", _preset_table()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("hf", metavar="HF_DIR", help="Hugging Face model directory or .safetensors file")
    p.add_argument("out", metavar="OUT", help="output checkpoint directory (must not exist, or be empty)")
    p.add_argument("--rules", metavar="FILE", help="rename/transpose rules, Hugging Face name -> checkpoint key")
    p.add_argument(
        "--dtype",
        metavar="{bf16,fp16,fp32}",
        help="cast floating tensors, e.g. to the model's parameter dtype (default: keep)",
    )
    _preset_options(p, "from-hf")
    p.set_defaults(func=cmd_from_hf)

    p = sub.add_parser(
        "diff",
        parents=[common],
        help="compare two checkpoints key by key (any world sizes)",
        description="Compare checkpoints A and B tensor by tensor, model weights and optimizer state,\n"
        "whatever world sizes wrote them: bit-equal, or the number of differing elements with the\n"
        "largest absolute |b-a| and relative |b-a|/|a| difference; keys missing from B (MISSING) or\n"
        "only in B (EXTRA), other dtype or shape; JSON values (optimizer, scheduler, extra state;\n"
        "not the RNG). Streams windows of each tensor (memory: two windows, never a whole tensor).",
        epilog="Exit codes: 0 identical (or every difference within --atol/--rtol), 1 different, 2 bad input.\n\n"
        "examples:\n"
        "  paddle-fsdp-ckpt diff run_a/step_1000 run_b/step_1000\n"
        "  paddle-fsdp-ckpt diff resumed/step_2000 straight/step_2000 --atol 1e-6 --json > diff.json\n"
        "  paddle-fsdp-ckpt diff ckpt/step_1000 roundtrip_ckpt --only model",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("a", metavar="A", help="checkpoint directory (or a root with numbered checkpoints: its latest)")
    p.add_argument("b", metavar="B", help="checkpoint directory to compare with A")
    p.add_argument("--json", action="store_true", help="print one JSON object: summary, every key, values")
    p.add_argument("--atol", type=_tolerance, default=0.0, help="absolute difference accepted as equal (default 0)")
    p.add_argument("--rtol", type=_tolerance, default=0.0, help="relative difference accepted as equal (default 0)")
    p.add_argument("--key", action="append", metavar="KEY", help="compare only this key (repeatable)")
    p.add_argument(
        "--only",
        type=_parts,
        metavar="PART[,PART]",
        help=f"compare only these parts: {', '.join(DIFF_PARTS)} (model: weights and buffers; e.g. --only model "
        "for a checkpoint against its to-hf -> from-hf round trip, which has no optimizer state)",
    )
    p.add_argument("--show-equal", action="store_true", help="list equal keys too (text output)")
    p.add_argument(
        "--window", default="16MiB", metavar="SIZE", help="bytes read per tensor window and side (default 16MiB)"
    )
    p.set_defaults(func=cmd_diff)

    p = sub.add_parser(
        "import-stock",
        parents=[common],
        help="convert a stock paddle checkpoint (or safetensors directory) into this format",
        description="Convert a checkpoint written by stock paddle's save_state_dict (<id>.metadata + .distcp or\n"
        ".safetensors; the pickled index is read without executing code) or a plain safetensors directory\n"
        "into a checkpoint of this engine (checksums, commit record), streaming one tensor at a time.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("src", metavar="STOCK_CKPT", help="stock checkpoint directory")
    p.add_argument("out", metavar="OUT", help="output checkpoint directory (must not exist, or be empty)")
    p.add_argument("--unique-id", type=_version, default=None, help="version to convert (default: the newest)")
    p.set_defaults(func=cmd_import_stock)

    from .flush_cmd import add_flush_memory  # the memory tier's command (memtier/flush.py)
    from .stock_index_cmd import add_stock_index

    add_flush_memory(sub, common)
    add_stock_index(sub, common)
    return parser


def _tolerance(text: str) -> float:
    """A finite, non-negative tolerance (NaN would make every comparison pass or fail silently)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


DIFF_PARTS = ("model", "optimizer", "values")  # diff_cmd.PARTS (the parser imports nothing beyond the stdlib)


def _parts(text: str) -> list[str]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in parts if p not in DIFF_PARTS]
    if not parts or unknown:
        raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(DIFF_PARTS)} (comma-separated)")
    return parts


def _version(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


def _preset_options(p: argparse.ArgumentParser, command: str) -> None:
    p.add_argument(
        "--preset",
        metavar="NAME",
        help="model family (instead of --rules): names, transposes, fused-key splits; one of: "
        + ", ".join(_preset_names()),
    )
    p.add_argument(
        "--config",
        metavar="CONFIG_JSON",
        help=(
            "Hugging Face config.json: copied into the export, sizes for fused splits, checked against shapes "
            "(required with --preset)"
            if command == "to-hf"
            else "Hugging Face config.json for --preset (default: HF_DIR/config.json)"
        ),
    )
    p.add_argument(
        "--allow-unmapped",
        action="store_true",
        help="convert even if keys are unmapped or parameters of the architecture (--config) are missing (they are "
        "skipped, or with --rules written as they are, and logged); otherwise such a conversion is refused (exit 2)",
    )


def _preset_table() -> str:
    from .presets import preset_help

    return preset_help()


def _preset_names() -> list[str]:
    from .presets import PRESETS

    return list(PRESETS)

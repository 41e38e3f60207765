"""The LoRA exports of a checkpoint (issue #51): ``to-hf --merge-adapter`` and who writes the export files.

argv: ROOT. Every rank trains a PaddleFormers-shaped LoRA model (lora_models.WrappedLoRA) two steps and saves
the checkpoints the cases read: its base before training (``save_frozen=True``, recorded as the base source),
the LoRA checkpoint (base referenced), the same with the base (``save_frozen=True``), and bases that are not
this one (another seed, one element changed, another size). Then rank 0 runs the command line in-process on
them (the others wait); the adapter export through the Trainer's code (integrations/paddleformers/hf_export.py)
runs on every rank with each rank's file writes recorded (an audit hook). Each rank reports the case outcomes.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import sys

import _paths  # noqa: F401  (puts launch_util on sys.path)
import numpy as np
import paddle
import paddle.distributed as dist
from launch_util import report, run_cases
from lora_models import BaseLM, adapter_batches, make_wrapped_lora
from models import local_part
from paddle.distributed.fsdp import FullyShardFusion
from paddle.distributed.fsdp.checkpoint.errors import FrozenBaseMismatchError
from paddle.distributed.fsdp.integrations.paddleformers import hf_export
from paddle.distributed.fsdp.tools import to_hf
from paddle.distributed.fsdp.tools.adapter_base import FrozenBaseMissingError
from paddle.distributed.fsdp.tools.adapter_merge import export_merged
from paddle.distributed.fsdp.tools.cli import main as cli_main

ROWS, SEED, UNITS = 12, 11, ["BaseBlock"]


def wrap(model):
    return FullyShardFusion(model, fsdp_unit_layers=UNITS)


def train(root: str, rank: int, world: int) -> tuple:
    model = make_wrapped_lora(SEED)
    fsdp = wrap(model)
    fsdp.save_checkpoint(os.path.join(root, "base"), save_frozen=True)  # the base as it was loaded (+ adapters)
    with fsdp.summon_full_params():  # the same base as a Hugging Face directory: the base model's own names
        plain = {k[len("model.") :]: v.numpy() for k, v in model.state_dict().items() if ".lora_" not in k}
    if rank == 0:
        from safetensors.numpy import save_file

        os.makedirs(os.path.join(root, "base_hf"))
        save_file(plain, os.path.join(root, "base_hf", "model.safetensors"), metadata={"format": "pt"})
    fsdp.base_source = os.path.join(root, "base")
    opt = paddle.optimizer.AdamW(0.05, parameters=model.parameters())
    for ids, labels in adapter_batches(2, ROWS):
        loss = model(paddle.to_tensor(local_part(ids, rank, world)), paddle.to_tensor(local_part(labels, rank, world)))
        loss.backward()
        opt.step()
        opt.clear_grad()
    fsdp.save_checkpoint(os.path.join(root, "ckpt"), optimizer=opt)
    fsdp.save_checkpoint(os.path.join(root, "whole"), save_frozen=True)
    return model, fsdp


def other_bases(root: str) -> None:
    """Bases the LoRA checkpoint was not trained on (collective saves)."""
    wrap(make_wrapped_lora(SEED + 1)).save_checkpoint(os.path.join(root, "base_other_seed"), save_frozen=True)
    wrap(make_wrapped_lora(SEED, n_blocks=1)).save_checkpoint(os.path.join(root, "base_smaller"), save_frozen=True)
    model = make_wrapped_lora(SEED)
    fsdp = wrap(model)
    with fsdp.summon_full_params(writeback=True), paddle.no_grad():
        w = model.model.blocks[1].down.weight
        w[0, 0] = w[0, 0] + 1.0
    fsdp.save_checkpoint(os.path.join(root, "base_one_off"), save_frozen=True)


def cli(*argv: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = cli_main(list(argv))
    return code, err.getvalue()


def load_hf(out: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    tensors: dict = {}
    for name in sorted(os.listdir(out)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(out, name)))
    return tensors


def merged_logits(out: str, ids: np.ndarray) -> np.ndarray:
    plain = BaseLM(2, lora=False)
    weights = load_hf(out)
    assert sorted(weights) == sorted(plain.state_dict()), (sorted(weights)[:4], sorted(plain.state_dict())[:4])
    plain.set_state_dict({k: paddle.to_tensor(v) for k, v in weights.items()})
    return plain(paddle.to_tensor(ids)).numpy()


def _rank0_cases(root: str, want_logits: np.ndarray, ids: np.ndarray, figures: dict) -> dict:
    ckpt, whole = os.path.join(root, "ckpt"), os.path.join(root, "whole")

    def merged_from_recorded_source() -> None:
        """No --base: the source the reference records; logits equal the adapter model's within 1e-5."""
        out = os.path.join(root, "merged_source")
        code, err = cli("to-hf", ckpt, out, "--merge-adapter")
        assert code == 0, err
        got = merged_logits(out, ids)
        error = float(np.abs(got - want_logits).max())
        figures["merged_logits_max_abs_error"] = error
        assert error <= 1e-5, error

    def same_tensors_whatever_the_base_source() -> None:
        """The checkpoint holding its base (the Trainer's route: export_merged of a save_frozen checkpoint),
        --base DIR (an engine checkpoint of the adapter model; a Hugging Face directory of the base model) and the
        recorded source give bit-equal tensors."""
        routes = {
            "merged_whole": ("to-hf", whole, os.path.join(root, "merged_whole"), "--merge-adapter"),
            "merged_base": ("to-hf", ckpt, os.path.join(root, "merged_base"), "--merge-adapter", "--base", "base"),
            "merged_hf_base": (
                "to-hf",
                ckpt,
                os.path.join(root, "merged_hf_base"),
                "--merge-adapter",
                "--base",
                "base_hf",
            ),
        }
        for name, argv in routes.items():
            argv = tuple(os.path.join(root, a) if a in ("base", "base_hf") else a for a in argv)
            code, err = cli(*argv)
            assert code == 0, (name, err)
        library = os.path.join(root, "merged_library")
        export_merged(whole, library, convert=to_hf)  # the function the Trainer's hf_merge_adapter=True calls
        want = load_hf(os.path.join(root, "merged_source"))
        for name in ("merged_whole", "merged_base", "merged_hf_base", "merged_library"):
            got = load_hf(os.path.join(root, name))
            assert sorted(got) == sorted(want), name
            for key, value in want.items():
                assert got[key].dtype == value.dtype and got[key].tobytes() == value.tobytes(), (name, key)
        adapted = [k for k in want if k.endswith(("q.weight", "v.weight"))]
        assert len(adapted) == 4, adapted

    def wrong_base_refused_before_writing() -> None:
        """Another base (another seed, one element changed, another size): exit 2 naming what differs, nothing
        in OUT and no scratch left beside it."""
        expected = {
            "base_other_seed": "fingerprint",
            "base_one_off": "fingerprint",
            "base_smaller": "frozen parameters",
        }
        for base, words in expected.items():
            parent = os.path.join(root, f"refused_{base}")
            os.makedirs(parent)
            out = os.path.join(parent, "out")
            code, err = cli("to-hf", ckpt, out, "--merge-adapter", "--base", os.path.join(root, base))
            assert code == 2, (base, code, err)
            assert words in err and base in err, (base, err)
            assert os.listdir(parent) == [], (base, os.listdir(parent))
            try:
                export_merged(ckpt, out, convert=to_hf, base=os.path.join(root, base))
            except FrozenBaseMismatchError:
                pass
            else:
                raise AssertionError(f"{base}: the library merged onto another base")

    def missing_base_named() -> None:
        """The recorded source gone and no --base: FrozenBaseMissingError (exit 2 naming --base)."""
        moved = os.path.join(root, "base_moved")
        shutil.move(os.path.join(root, "base"), moved)
        try:
            out = os.path.join(root, "missing", "out")
            try:
                export_merged(ckpt, out, convert=to_hf)
            except FrozenBaseMissingError as e:
                assert "--base" in str(e), e
            else:
                raise AssertionError("merged without a base")
            code, err = cli("to-hf", ckpt, out, "--merge-adapter")
            assert code == 2 and "--base" in err, (code, err)
            assert not os.path.exists(out)
            code, err = cli("to-hf", ckpt, out, "--merge-adapter", "--base", os.path.join(root, "nowhere"))
            assert code == 2 and "no such directory" in err, (code, err)
            code, err = cli("to-hf", ckpt, out, "--merge-adapter", "--base", moved)  # told where it is now
            assert code == 0, err
        finally:
            shutil.move(moved, os.path.join(root, "base"))

    def help_names_the_option() -> None:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert cli_main(["to-hf", "--help"]) == 0
        assert "--merge-adapter" in out.getvalue() and "--base DIR" in out.getvalue(), out.getvalue()[-2000:]

    return {
        "merged_logits": merged_from_recorded_source,
        "merged_bit_equal": same_tensors_whatever_the_base_source,
        "wrong_base": wrong_base_refused_before_writing,
        "missing_base": missing_base_named,
        "help": help_names_the_option,
    }


class WriteRecorder:
    """Every path this process opens for writing or renames something to (``sys.addaudithook``: the events
    ``open`` and ``os.rename``, which os.replace raises too), under ``root``."""

    def __init__(self, root: str) -> None:
        self.root, self.paths, self.on = os.path.abspath(root), set(), False
        sys.addaudithook(self._hook)

    def _hook(self, event: str, args: tuple) -> None:
        if not self.on:
            return
        if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            mode, flags = args[1], args[2] if len(args) > 2 else 0
            writes = (isinstance(mode, str) and any(c in mode for c in "wxa+")) or bool(
                isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
            )
            if writes:
                self._add(args[0])
        elif event == "os.rename":
            self._add(args[1])

    def _add(self, path) -> None:
        path = os.path.abspath(os.fsdecode(path))
        if path.startswith(self.root + os.sep):
            self.paths.add(os.path.relpath(path, self.root))


def main() -> None:
    if dist.get_world_size() > 1:
        dist.init_parallel_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    root = sys.argv[1]
    exports = os.path.join(root, "exports")
    recorder = WriteRecorder(exports)
    model, fsdp = train(root, rank, world)
    other_bases(root)
    ids = adapter_batches(1, 3, seed=5)[0][0]
    with fsdp.summon_full_params():
        want_logits = model.model(paddle.to_tensor(ids)).numpy()
    # the Trainer's adapter export (save_model / save_hf_steps), every rank calling it; writes recorded per rank
    recorder.on = True
    hf_export.export(fsdp, model, os.path.join(exports, "adapter"), preset=None)
    recorder.on = False
    figures: dict = {}
    results: dict = {"written": sorted(recorder.paths), "figures": figures}
    if rank == 0:
        run_cases(_rank0_cases(root, want_logits, ids, figures), results=results)
    dist.barrier() if world > 1 else None
    report(results)


if __name__ == "__main__":
    main()

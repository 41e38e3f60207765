"""Power loss during FSDPTrainer's ``checkpoint-N`` saves and their rotation (``save_total_limit``), #54.

The main suite has no PaddleFormers 1.2.0, so the real ``FSDPTrainerMixin`` (integrations/paddleformers/trainer.py:
``__init__``, ``_save_checkpoint``, rotation, ``train(resume_from_checkpoint=True)``, ``_restore``) runs over
``StandInTrainer``, the few parts of PaddleFormers' Trainer those paths call (its ``__init__`` makes
``output_dir`` with a plain ``os.makedirs``; its ``train`` hands the resume path to ``_load_from_checkpoint``).
The saves are replayed as POSIX-minimal crash states (crash_explore.py) and, where root, /dev/fuse and loop
devices exist, as ext4 block states.

Per state, a fresh Trainer resumes with ``resume_from_checkpoint=True``: the checkpoint it picks is complete and
loads bit for bit as step N-1 or N (model, optimizer, LR, the Trainer state; never older than a save that had
returned, so rotation never leaves the run without a good checkpoint). The next save after a crash removes the
leftovers (staging and ``.trash-*`` directories). Mutations must make some state fail.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import re
import time
from types import SimpleNamespace

import crash_explore
import paddle
import pytest
from memtier_util import state_bytes, train_step
from paddle.distributed.fsdp.integrations.paddleformers import checkpoints
from paddle.distributed.fsdp.integrations.paddleformers.trainer import FSDPTrainerMixin

pytestmark = pytest.mark.power_loss

LEFTOVER = re.compile(r"^\.trash-|\.tmp-")
POSIX_BUDGET, BLOCK_BUDGET = 100, 40
STEPS = {"saved1": 1, "saved2": 2}


@dataclasses.dataclass
class StandInState:
    """The fields of PaddleFormers' ``TrainerState`` these paths read (the mixin saves it as JSON)."""

    global_step: int = 0
    best_metric: float | None = None
    best_model_checkpoint: str | None = None
    log_history: list = dataclasses.field(default_factory=list)


class StandInTrainer:
    """What PaddleFormers 1.2.0's ``Trainer`` does on the paths under test: ``__init__`` keeps the model and
    arguments and makes ``output_dir`` (``os.makedirs``, as stock); ``train`` loads the checkpoint it is given
    through ``_load_from_checkpoint`` (stock's ``_inner_training_loop`` calls it) and returns that path."""

    def __init__(self, model, args):
        self.model, self.args, self.optimizer = model, args, None
        self.state = StandInState()
        os.makedirs(args.output_dir, exist_ok=True)

    def train(self, resume_from_checkpoint=None, ignore_keys_for_eval=None):
        if resume_from_checkpoint is not None:
            self._load_from_checkpoint(resume_from_checkpoint)
        return resume_from_checkpoint


Trainer = type("FSDPTrainer", (FSDPTrainerMixin, StandInTrainer), {})


def _args(output_dir: str, limit: int) -> SimpleNamespace:
    return SimpleNamespace(output_dir=output_dir, save_total_limit=limit, use_async_save=False, should_save=True,
                           world_size=1, sharding=[], fp16=False, bf16=False, fp16_opt_level="O1",
                           save_checkpoint_format=None, load_checkpoint_format=None, metric_for_best_model=None,
                           save_hf_steps=-1)  # fmt: skip


def _trainer(output_dir: str, seed: int, limit: int = 1):
    paddle.seed(seed)
    model = paddle.nn.Sequential(paddle.nn.Linear(64, 64), paddle.nn.ReLU(), paddle.nn.Linear(64, 8))
    trainer = Trainer(model, _args(output_dir, limit))
    lr = paddle.optimizer.lr.StepDecay(0.02, step_size=1, gamma=0.5)
    trainer.optimizer = paddle.optimizer.AdamW(lr, parameters=model.parameters())  # built after sharding, as stock
    return trainer


def _output_dir(base: str) -> str:
    return os.path.join(base, "run", "out")  # two levels the Trainer's makedirs creates


def _trainer_rotation(base: str, rec, mp, async_save: bool = False) -> None:
    """checkpoint-1 and checkpoint-2 with save_total_limit=1 (the second save's rotation removes checkpoint-1)."""
    trainer = _trainer(_output_dir(base), 1)
    trainer.args.use_async_save = async_save
    wants = {}
    for step in (1, 2):
        train_step(trainer.model, trainer.optimizer)
        trainer.state.global_step = step
        trainer._save_checkpoint(trainer.model)
        trainer._finish_pending_save()  # async: the wait, then the rotation (as the next save or train()'s end)
        crash_explore.join_background_deletes()
        wants[step] = (state_bytes(trainer.fsdp, trainer.optimizer), trainer.optimizer.get_lr())
        rec.mark(f"saved{step}")
    with open(os.path.abspath(base) + "-wants.pkl", "wb") as f:
        pickle.dump(wants, f)


def _trainer_rotation_async(base: str, rec, mp) -> None:
    """The same with ``use_async_save``: the files are written by the background thread, rotation after the wait."""
    _trainer_rotation(base, rec, mp, async_save=True)


def check_state(wants_file: str, at_least: int | None, root: str) -> int | None:
    """A fresh Trainer on the state resumes with ``resume_from_checkpoint=True``: the complete checkpoint it picks
    loads bit for bit as a saved step, at least ``at_least``; every ``checkpoint-N`` with a commit record is
    complete (passes verify). Returns the step resumed (None: nothing to resume from)."""
    with open(wants_file, "rb") as f:
        wants = pickle.load(f)
    out = _output_dir(root)
    trainer = _trainer(out, 7)  # other weights than the run's: a tensor the load misses shows
    try:
        picked = trainer.train(resume_from_checkpoint=True)
    except ValueError as e:
        assert at_least is None, f"no checkpoint to resume from after save {at_least} returned: {e}"
        assert "No complete checkpoint-N" in str(e), e
        picked = None
    for name in os.listdir(out) if os.path.isdir(out) else []:
        if not LEFTOVER.search(name) and checkpoints.is_committed(os.path.join(out, name)):
            found = checkpoints.examine_checkpoint(os.path.join(out, name))
            assert found.complete, f"{name} has a commit record but is not complete: {found.describe()}"
            problems = paddle.distributed.fsdp.checkpoint.verify_checkpoint(os.path.join(out, name))
            assert not problems, f"{name} fails verify: {problems[:3]}"
    if picked is None:
        return None
    step = checkpoints.parse_name(os.path.basename(picked))
    assert step in wants and (at_least is None or step >= at_least), (picked, at_least)
    want, lr = wants[step]
    mine = state_bytes(trainer.fsdp, trainer.optimizer)
    assert [k for k in want if mine[k] != want[k]] == [], f"{picked} loaded other bytes than step {step}'s"
    assert trainer.optimizer.get_lr() == lr, (trainer.optimizer.get_lr(), lr)
    assert json.loads(trainer._fsdp_loaded[1]["trainer_state"])["global_step"] == step
    return step


def _checker(base: str):
    wants_file = os.path.abspath(base) + "-wants.pkl"
    return lambda at_least, root: check_state(wants_file, at_least, root)


def _explore(tmp_path, monkeypatch, skip_fsync=None, stop_at_first=False, scenario=_trainer_rotation):
    base = str(tmp_path / "fs")
    os.makedirs(base)
    trace = crash_explore.record(base, monkeypatch, scenario, skip_fsync=skip_fsync)
    n = crash_explore.budget(POSIX_BUDGET)
    t0 = time.monotonic()
    checked, failures = crash_explore.explore_posix(trace, str(tmp_path / "states"), _checker(base), STEPS,
                                                    crash_explore.seed(), n, stop_at_first)  # fmt: skip
    return trace, n, checked, failures, time.monotonic() - t0


@pytest.mark.parametrize("scenario", [_trainer_rotation, _trainer_rotation_async], ids=["sync", "async"])
def test_every_posix_crash_state_of_trainer_saves_resumes(scenario, tmp_path, monkeypatch):
    trace, n, checked, failures, dt = _explore(tmp_path, monkeypatch, scenario=scenario)
    print(f"{scenario.__name__}: {len(trace.ops)} operations, {len(trace.fsyncs)} fsyncs, {checked} "
          f"crash states in {dt:.1f} s")  # fmt: skip
    assert checked >= n
    assert not failures, crash_explore.report(failures)


@pytest.mark.parametrize("mutation", ["rotation_before_commit_durable", "root_last_level_only"])
def test_trainer_mutations_make_a_state_fail(mutation, tmp_path, monkeypatch):
    """rotation_before_commit_durable: checkpoint-2's commit record is not fsynced in its directory, so rotation
    removes checkpoint-1 while checkpoint-2 may still come back without one. root_last_level_only: the Trainer's
    ``output_dir`` made durable in its parent only (the levels above, also new, not)."""
    skip = None
    if mutation == "rotation_before_commit_durable":
        skip = lambda path: os.path.basename(path).startswith("checkpoint-2.tmp-")  # noqa: E731
    else:
        from paddle.distributed.fsdp.checkpoint import writer

        monkeypatch.setattr(checkpoints, "make_root_durable",
                            lambda out: writer.fsync_dir(os.path.dirname(os.path.abspath(out))))  # fmt: skip
    _trace, _n, checked, failures, _dt = _explore(tmp_path, monkeypatch, skip, stop_at_first=True)
    assert failures, f"{mutation}: no failing state among {checked}"
    print(f"{mutation}: failing state after {checked}: {crash_explore.report(failures)}")
    k, lost, err = failures[0]
    assert "no checkpoint to resume from after save" in err, crash_explore.report(failures)
    cause = (lambda x: "checkpoint-2.tmp-" in x and "COMMIT" in x) if skip else (lambda x: x == "mkdir run")
    assert any(cause(x) for x in lost), f"{mutation}: failing for another reason: {crash_explore.report(failures)}"


def test_next_save_removes_what_a_crash_left(tmp_path, monkeypatch):
    """Crash states that hold leftovers (a crashed save's staging, a crashed rotation's ``.trash-*``): a Trainer
    resumed there saves checkpoint-3, and after it the output dir holds no leftover and checkpoint-3 is the one a
    resume picks."""
    base = str(tmp_path / "fs")
    os.makedirs(base)
    trace = crash_explore.record(base, monkeypatch, _trainer_rotation)
    rng, cleaned, kinds = __import__("random").Random(crash_explore.seed()), 0, set()
    for k in range(len(trace.ops) + 1):
        model, _lost = trace.state(k, rng, 1.0)
        tree = model.tree()
        left = {p.split(os.sep)[2] for p in tree if p.count(os.sep) >= 2 and LEFTOVER.search(p.split(os.sep)[2])}
        kind = {("trash" if n.startswith(".trash-") else "staging") for n in left}
        if not left or kind <= kinds:
            continue
        kinds |= kind
        root = str(tmp_path / f"s{k}")
        model.materialize(root)
        trainer = _trainer(_output_dir(root), 7)
        if checkpoints.newest_complete(_output_dir(root)) is not None:
            trainer.train(resume_from_checkpoint=True)
        train_step(trainer.model, trainer.optimizer)
        trainer.state.global_step = 3
        trainer._save_checkpoint(trainer.model)
        crash_explore.join_background_deletes()
        names = sorted(os.listdir(_output_dir(root)))
        assert not [n for n in names if LEFTOVER.search(n)], f"leftovers {sorted(left)} not removed: {names}"
        assert checkpoints.newest_complete(_output_dir(root)).step == 3
        cleaned += 1
    assert kinds == {"trash", "staging"}, f"the trace left no state with both kinds of leftover: {kinds}"
    print(f"leftovers removed by the next save in {cleaned} crash states: {sorted(kinds)}")


@pytest.mark.skipif(crash_explore.block_missing() is not None, reason=str(crash_explore.block_missing()))
def test_every_block_crash_state_of_trainer_saves_resumes_on_ext4(tmp_path):
    work = str(tmp_path)
    recorded = crash_explore.record_block(work, __name__, "_trainer_rotation")
    n = crash_explore.budget(BLOCK_BUDGET)
    checked, failures, dt = crash_explore.explore_block(work, recorded, _checker(os.path.join(work, "mnt")), STEPS,
                                                        crash_explore.seed(), n, stop_at_first=False)  # fmt: skip
    log, start = recorded[0], recorded[1]
    print(f"ext4 trainer: {len(log) - start} block records ({sum(r[0] for r in log[start:])} flushes), {checked} "
          f"crash states in {dt:.0f} s")  # fmt: skip
    assert checked >= n
    assert not failures, crash_explore.report(failures)

"""One rank fails alone, in each stage of a save and of a load, on 2 ranks (issue #50 item 3).

Usage (under paddle.distributed.launch, 2 ranks): ``one_rank.py WORKDIR SEED [CASE_SUBSTRING]`` (only the cases
whose name holds it: a quick look at one case)

Rank 0 and rank 1 save a checkpoint root (step 1: FullyShardFusion, AdamW, three stateful counters), then train on.
Then every case runs once with rank 0 and once with rank 1 as the only failing rank. Save: user code of the state
collection (a stateful object whose ``state_dict()`` is not JSON, holds NaN, or raises, even an exception that
cannot be printed; an optimizer accumulator its class does not declare; an ``extra_state`` that is not JSON), a storage layer (its factory raising, through
``save_checkpoint`` and ``save_state_dict``; its ``begin`` raising), the storage itself (an injected EIO before the
data, a full disk mid-data: fault_storage.py), an async save. Load: a stateful object whose ``set_state_dict``
raises (which objects: drawn with SEED), whose ``check_state_dict`` raises, one the checkpoint lacks, an optimizer
whose accumulator creation raises, a storage layer factory (``load_checkpoint``, ``load_state_dict``,
``CheckpointManager.load_latest``), an EIO reading the data files (memory-bounded and atomic loads).

Each rank reports per case ``{error, message, causes, seconds, check}``: the class and message of what it raised,
the classes of its ``__cause__`` chain, how long the call took, and "ok" or the traceback of the checks of the
state after the failure (a failed save: ``latest`` still names step 1; a failed load: every tensor and stateful
object as before, or, when only applying a stateful object failed, every tensor as saved, every other object
loaded and the failing ones as before).
"""

from __future__ import annotations

import errno
import os
import random
import sys
import time
import traceback

import _paths  # noqa: F401  (puts launch_util on sys.path)
import fault_storage
import numpy as np
import paddle
import paddle.distributed as dist
import paddle.distributed.fsdp.checkpoint as ck
from fault_storage import FaultStorage
from launch_util import report
from models import global_batches, local_part, make_model
from paddle.distributed.fsdp import FullyShardFusion
from paddle.distributed.fsdp.checkpoint.format import codecs
from paddle.distributed.fsdp.checkpoint.io.backends import add_storage_layer, remove_storage_layer
from paddle.distributed.fsdp.checkpoint.options import CheckpointOptions

NAMES = ("a", "b", "c")


class Unprintable(Exception):
    """User code's exception whose message cannot even be printed."""

    def __str__(self) -> str:
        raise RuntimeError("no message")


class Counter:
    """A stateful object (the caller's data position, say) that can be told to misbehave."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.bad_state = None  # what state_dict() returns instead ("tensor", "nan") or "raise"
        self.bad_set = False  # set_state_dict raises
        self.bad_check = False  # check_state_dict raises

    def state_dict(self):
        if self.bad_state == "raise":
            raise RuntimeError("counter state unavailable (injected)")
        if self.bad_state == "unprintable":
            raise Unprintable()
        if self.bad_state == "tensor":
            return {"n": paddle.to_tensor([self.n])}
        if self.bad_state == "nan":
            return {"n": float("nan")}
        return {"n": self.n}

    def check_state_dict(self, state) -> None:
        if self.bad_check:
            raise RuntimeError("counter refuses its state (injected)")

    def set_state_dict(self, state) -> None:
        if self.bad_set:
            raise ValueError("counter cannot take its state (injected)")
        self.n = state["n"]


class AdamW(paddle.optimizer.AdamW):
    """The saved optimizer's class (same name), whose accumulator creation can be told to raise."""

    fail = False
    undeclared = False  # creates an accumulator its class's table does not declare

    def _create_accumulators(self, block, parameters):
        if self.fail:
            raise RuntimeError("accumulator creation failed (injected)")
        super()._create_accumulators(block, parameters)
        if self.undeclared:
            for param in parameters:
                self._add_accumulator("ema", param)


class Exploding:
    """A storage layer whose factory raises (an extension that cannot start on this rank)."""

    def __call__(self, storage):
        raise RuntimeError("metrics layer cannot reach its collector (injected)")


class DenyBegin(FaultStorage):
    """A storage layer whose ``begin`` of a save raises (an extension refusing the save on this rank)."""

    def begin(self, final: str, checkpoint_id: str) -> str:
        raise PermissionError(errno.EACCES, "quota layer refuses the save (injected)")


class DataEIO(FaultStorage):
    """A storage layer whose reads of data files raise EIO (a failing disk under this rank)."""

    def open_read(self, location: str, name: str):
        if name.endswith(".safetensors"):
            raise OSError(errno.EIO, "Input/output error (injected)", name)
        return self.inner.open_read(location, name)


def train(model, opt, seed: int, rank: int) -> None:
    for ids, labels in global_batches(1, 8, seed=seed):
        loss = model(paddle.to_tensor(local_part(ids, rank, 2)), paddle.to_tensor(local_part(labels, rank, 2)))
        loss.backward()
        opt.step()
        opt.clear_grad()


def tensors(fsdp, opt) -> dict:
    """Every tensor this rank holds (parameters, optimizer state) as bytes."""
    state = fsdp.sharded_state_dict()
    state.update(fsdp.optimizer_sharded_state_dict(opt))
    return {k: np.array(getattr(v, "local_tensor", v).numpy()).tobytes() for k, v in state.items()}


def chain(e: BaseException) -> list[str]:
    out, seen = [], set()
    while e.__cause__ is not None and id(e.__cause__) not in seen:
        e = e.__cause__
        seen.add(id(e))
        out.append(type(e).__name__)
    return out


class Run:
    def __init__(self, work: str, seed: int) -> None:
        self.rank = dist.get_rank()
        self.rng = random.Random(seed)
        self.root = os.path.join(work, "root")
        self.model = make_model(3)
        self.fsdp = FullyShardFusion(self.model, fsdp_unit_layers=["Block"])
        self.opt = AdamW(0.01, parameters=self.model.parameters())
        self.fsdp.init_optimizer_state(self.opt)
        train(self.model, self.opt, 1, self.rank)
        self.objs = {name: Counter(10 * self.rank + i) for i, name in enumerate(NAMES)}
        self.fsdp.save_checkpoint(self.root, optimizer=self.opt, step=1, stateful=self.objs)
        self.step1 = ck.latest_checkpoint(self.root)
        self.saved = tensors(self.fsdp, self.opt)
        self.saved_n = {name: obj.n for name, obj in self.objs.items()}
        self.next_step = 2

    def perturb(self, seed: int) -> None:
        """Move every tensor and counter away from the checkpoint, so that a load's writes show."""
        train(self.model, self.opt, seed, self.rank)
        for obj in self.objs.values():
            obj.n += 1000

    def reset_objects(self) -> None:
        for obj in self.objs.values():
            obj.bad_state, obj.bad_set, obj.bad_check = None, False, False


def main() -> None:
    work, seed = sys.argv[1], int(sys.argv[2])
    only = sys.argv[3] if len(sys.argv) > 3 else ""
    dist.init_parallel_env()
    fault_storage.install()
    run = Run(work, seed)
    rank = run.rank
    out: dict = {}

    # ------------------------------------------------------------------ save cases: (setup, call) on the bad rank
    def save(**kw):
        step = run.next_step
        run.next_step += 1
        stateful = kw.pop("stateful", run.objs)
        opt = kw.pop("optimizer", run.opt)
        return run.fsdp.save_checkpoint(run.root, optimizer=opt, step=step, stateful=stateful, **kw)

    added: list = []  # storage layers a case added on the bad rank

    def stateful_state(kind):
        def case(bad):
            name = run.rng.choice(NAMES)  # drawn on every rank: the ranks' draws stay in step
            if bad:
                run.objs[name].bad_state = kind
            return save

        return case

    def undeclared_accumulator(bad):
        opt = AdamW(0.01, parameters=run.model.parameters())
        opt.undeclared = bad
        train(run.model, opt, seed, rank)  # its first step creates its state (init_optimizer_state would refuse)
        return lambda: save(optimizer=opt)

    def extra_not_json(bad):
        return lambda: save(extra_state={"seen": {1, 2}} if bad else {"seen": [1, 2]})

    def layer(factory, door=None):
        def case(bad):
            if bad:
                add_storage_layer(factory)
                added.append(factory)
            if door == "save_state_dict":  # the engine's own door (no root, no resume layer)
                return lambda: ck.save_state_dict(run.fsdp.sharded_state_dict(), os.path.join(work, "plain"))
            return save

        return case

    def fault(spec):
        def case(bad):
            os.environ[fault_storage.ENV] = spec.format(rank=rank) if bad else ""
            fault_storage.reset()
            return save

        return case

    zstd = codecs.CODECS[codecs.BYTEPLANE_ZSTD]
    restore: list = []  # codecs a case replaced on the bad rank

    def encoder_raises(error, async_save=False):
        """A compressed save whose encoder raises ``error`` on one chunk (an encode thread) on the bad rank."""

        def case(bad):
            if bad:
                calls = [0]

                def encode(chunk, width):
                    calls[0] += 1
                    if calls[0] == 3:
                        raise error
                    return zstd.encode(chunk, width)

                codecs.CODECS[zstd.name] = codecs.Codec(zstd.name, zstd.id, encode)
                restore.append(zstd)
            opts = CheckpointOptions(codec=codecs.BYTEPLANE_ZSTD, codec_threads=2)
            if async_save:
                return lambda: save(options=opts, async_save=True).wait()
            return lambda: save(options=opts)

        return case

    def async_not_json(bad):
        if bad:
            run.objs["c"].bad_state = "tensor"
        return lambda: save(async_save=True).wait()

    save_cases = {
        "save:stateful_not_json": stateful_state("tensor"),
        "save:stateful_nan": stateful_state("nan"),
        "save:stateful_raises": stateful_state("raise"),
        "save:stateful_raises_unprintable": stateful_state("unprintable"),
        "save:undeclared_accumulator": undeclared_accumulator,
        "save:extra_state_not_json": extra_not_json,
        "save:layer_factory_raises": layer(Exploding()),
        "save:layer_factory_raises_save_state_dict": layer(Exploding(), "save_state_dict"),
        "save:layer_begin_raises": layer(DenyBegin),
        "save:write_eio": fault("before_data:{rank}:EIO"),
        "save:disk_full": fault("mid_data:{rank}:ENOSPC"),
        "save:async_stateful_not_json": async_not_json,
        "save:encode_raises": encoder_raises(ValueError("chunk 3 cannot be encoded")),
        "save:encode_memoryerror": encoder_raises(MemoryError("encode buffer")),
        "save:async_encode_memoryerror": encoder_raises(MemoryError("encode buffer"), async_save=True),
    }

    def after_save() -> None:
        assert ck.latest_checkpoint(run.root) == run.step1, f"latest moved: {ck.latest_checkpoint(run.root)}"

    # ------------------------------------------------------------------ load cases
    def load(**kw):
        stateful = kw.pop("stateful", run.objs)
        opt = kw.pop("optimizer", run.opt)
        return lambda: run.fsdp.load_checkpoint(run.root, optimizer=opt, stateful=stateful, **kw)

    failing_setters: list[str] = []

    def setter_raises(bad):
        drawn = run.rng.sample(NAMES, run.rng.randint(1, len(NAMES)))
        failing_setters[:] = drawn if bad else []
        for name in failing_setters:
            run.objs[name].bad_set = True
        return load()

    def checker_raises(bad):
        run.objs[run.rng.choice(NAMES)].bad_check = bad
        return load()

    def stateful_unknown(bad):
        extra = {"zzz": Counter(0)} if bad else {}
        return load(stateful={**run.objs, **extra})

    def optimizer_creation_raises(bad):
        opt = AdamW(0.01, parameters=run.model.parameters())
        opt.fail = bad
        return load(optimizer=opt)

    def load_layer(factory, call="load_checkpoint", atomic=False):
        def case(bad):
            if bad:
                add_storage_layer(factory)
                added.append(factory)
            if call == "load_state_dict":
                return lambda: ck.load_state_dict(run.fsdp.sharded_state_dict(), run.step1, atomic=atomic)
            if call == "load_latest":
                manager = ck.CheckpointManager(run.root, process_group=run.fsdp._checkpoint_group)
                return lambda: manager.load_latest(run.fsdp.sharded_state_dict())
            return load(atomic=atomic)

        return case

    load_cases = {
        "load:setter_raises": setter_raises,
        "load:checker_raises": checker_raises,
        "load:stateful_unknown": stateful_unknown,
        "load:optimizer_creation_raises": optimizer_creation_raises,
        "load:layer_factory_raises": load_layer(Exploding()),
        "load:layer_factory_raises_load_state_dict": load_layer(Exploding(), "load_state_dict"),
        "load:layer_factory_raises_load_latest": load_layer(Exploding(), "load_latest"),
        "load:data_eio": load_layer(DataEIO),
        "load:data_eio_atomic": load_layer(DataEIO, atomic=True),
    }

    def after_load(name: str, bad: bool, before: dict, before_n: dict) -> None:
        now, now_n = tensors(run.fsdp, run.opt), {k: o.n for k, o in run.objs.items()}
        if name != "load:setter_raises":  # refused before anything was written: every tensor and object as before
            assert now == before, f"tensors changed by a refused load: {[k for k in now if now[k] != before[k]][:5]}"
            assert now_n == before_n, f"stateful objects changed by a refused load: {now_n} (before {before_n})"
            return
        # applying failed: every tensor as saved; every object loaded but those whose setter raised on this rank
        assert now == run.saved, f"tensors not the checkpoint's: {[k for k in now if now[k] != run.saved[k]][:5]}"
        want = {k: (before_n[k] if bad and k in failing_setters else run.saved_n[k]) for k in NAMES}
        assert now_n == want, (
            f"stateful objects {now_n}, expected {want} (failing here: {failing_setters if bad else []})"
        )

    for name, setup in [*save_cases.items(), *load_cases.items()]:
        if only not in name:
            continue
        for failing in (0, 1):
            case = f"{name}:{failing}"
            bad = rank == failing
            run.perturb(seed + len(out))
            before, before_n = tensors(run.fsdp, run.opt), {k: o.n for k, o in run.objs.items()}
            dist.barrier()
            got: dict = {"error": "none", "message": "", "causes": []}
            try:
                call = setup(bad)
                t0 = time.monotonic()
                try:
                    call()
                except Exception as e:  # noqa: BLE001 - reported by class, message and cause
                    got = {"error": type(e).__name__, "message": str(e), "causes": chain(e)}
                got["seconds"] = round(time.monotonic() - t0, 2)
            finally:
                os.environ[fault_storage.ENV] = ""
                while added:
                    remove_storage_layer(added.pop())
                while restore:
                    codec = restore.pop()
                    codecs.CODECS[codec.name] = codec
                run.reset_objects()
            try:
                after_save() if name.startswith("save:") else after_load(name, bad, before, before_n)
                got["check"] = "ok"
            except Exception:  # noqa: BLE001 - reported
                got["check"] = traceback.format_exc()
            out[case] = got
            dist.barrier()
    report(out)


if __name__ == "__main__":
    main()

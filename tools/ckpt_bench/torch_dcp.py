"""PyTorch DCP on the same state, for comparison: spawned as a separate job of the entry point (``--mode
torch-worker``) so torch never shares a process with paddle; skipped when torch is not installed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

from .common import (
    ENTRY,
    LOG,
    PeakRSS,
    clean_env,
    drop_cache,
    files_under,
    free_port,
    model_shape,
    setup_logging,
    state_args,
)


class TorchDCP:
    """PyTorch DCP on the benchmark state: its saves up front, then its fresh-process loads one round at a time
    (``load_round``), interleaved by the caller with ours so that the disk's drift during the run hits both
    alike; ``finish`` checks what was loaded and runs the many-keys job."""

    def __init__(self, args, world: int, load_world: int, work: str):
        self.args, self.world, self.work = args, world, work
        self.ckpt = os.path.join(work, "torch_dcp")
        LOG.info("---- PyTorch DCP (FSDP2, gloo), %d ranks: saves", world)
        self.out: dict = {"same": spawn_torch(args, world, "save", self.ckpt, work)}
        self.out["version"] = self.out["same"].get("version")
        self.worlds = {"same": world, **({"changed": load_world} if load_world else {})}
        self.loads: dict = {k: [] for k in self.worlds}

    @classmethod
    def start(cls, args, world: int, load_world: int, work: str) -> TorchDCP | None:
        """The torch side with its saves done, or None when torch is not importable."""
        import importlib.util

        if importlib.util.find_spec("torch") is None:
            LOG.info("torch is not importable: PyTorch DCP skipped")
            return None
        return cls(args, world, load_world, work)

    def load_round(self, rep: int) -> None:
        """One fresh-process load per world (the first load of the process, as ours; page cache dropped)."""
        for k, w in self.worlds.items():
            LOG.info("---- PyTorch DCP load, %d ranks, fresh processes (%d/%d)", w, rep + 1, self.args.repeats)
            self.loads[k].append(spawn_torch(self.args, w, "load", self.ckpt, self.work, repeats=1))

    def finish(self) -> dict:
        saved = self.out["same"]["saved_param_sum"]
        for k, runs in self.loads.items():
            d = self.out.setdefault(k, {})
            d["load"] = [r["load"][0] for r in runs]
            d["rss_load"] = [r["rss_load"][0] for r in runs]
            d["load_split"] = [r["load_split"][0] for r in runs]
            sums = [r["param_sum"] for r in runs]
            ok = all(abs(x - saved) <= 1e-9 * max(1.0, abs(saved)) for x in sums)
            d["verified"] = ok
            if not ok:
                LOG.warning("torch DCP %s-world load: parameter sums %r != saved %r", k, sums, saved)
        shutil.rmtree(self.ckpt, ignore_errors=True)
        if self.args.keys > 0:
            LOG.info("---- PyTorch DCP, %d ranks: %d small keys", self.world, self.args.keys)
            self.out["many_keys"] = spawn_torch(
                self.args, self.world, "many-keys", os.path.join(self.work, "torch_many_keys"), self.work
            )
        return self.out


def spawn_torch(args, world: int, task: str, ckpt: str, work: str, repeats: int | None = None) -> dict:
    port = free_port()
    result = os.path.join(work, f"torch_{task}_{world}.json")
    procs = []
    logs = []
    for r in range(world):
        log = open(os.path.join(work, f"torch_{task}_{world}_rank{r}.log"), "w")
        logs.append(log)
        cmd = [
            sys.executable,
            ENTRY,
            "--mode",
            "torch-worker",
            "--torch-rank",
            str(r),
            "--torch-world",
            str(world),
            "--torch-port",
            str(port),
            "--torch-task",
            task,
            "--ckpt",
            ckpt,
            "--result",
            result,
            *state_args(args, repeats),
            "--keys",
            str(args.keys),
        ]
        procs.append(subprocess.Popen(cmd, env=clean_env(), stdout=log, stderr=subprocess.STDOUT))
    codes = [p.wait() for p in procs]
    for log in logs:
        log.close()
    if any(codes) or not os.path.exists(result):
        raise SystemExit(f"torch workers failed ({codes}); see {work}/torch_{task}_{world}_rank*.log")
    with open(result) as f:
        return json.load(f)


def run_torch_worker(args) -> None:
    import torch
    import torch.distributed as tdist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, world = args.torch_rank, args.torch_world
    setup_logging(rank, tag=f"-torch{world}")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.torch_port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    if args.torch_task == "many-keys":
        _many_keys_worker(args, rank, world, mesh)
    dim, n = model_shape(args)
    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(n)])
    for m in model:
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    msd, osd = get_state_dict(model, opt)  # creates the AdamW state (exp_avg, exp_avg_sq, step)
    g = torch.Generator().manual_seed(args.seed + 1 + rank)
    nbytes = 0
    with torch.no_grad():
        for p in model.parameters():
            nbytes += p.to_local().numel() * p.element_size()
        for st in opt.state.values():
            for k, v in st.items():
                loc = v.to_local() if hasattr(v, "to_local") else v
                if k in ("exp_avg", "exp_avg_sq"):
                    loc.copy_(torch.rand(loc.shape, generator=g))
                nbytes += loc.numel() * loc.element_size()
    res: dict = {"world": world, "save": [], "load": [], "load_split": [], "rss_save": [], "rss_load": []}

    def timed(fn):
        tdist.barrier()
        t0 = time.perf_counter()
        r = fn()
        dt = time.perf_counter() - t0
        per = [None] * world
        tdist.all_gather_object(per, dt)
        return r, max(per)

    def gather(obj):
        per = [None] * world
        tdist.all_gather_object(per, obj)
        return per

    def param_sum() -> float:
        with torch.no_grad():
            return sum(gather(sum(float(p.to_local().double().sum()) for p in model.parameters())))

    R = max(1, args.repeats)
    if args.torch_task == "save":
        res["saved_param_sum"] = param_sum()
        for _rep in range(R):
            if rank == 0 and os.path.exists(args.ckpt):
                shutil.rmtree(args.ckpt)
            tdist.barrier()
            with PeakRSS() as pk:
                _, t = timed(lambda: dcp.save({"model": msd, "optim": osd}, checkpoint_id=args.ckpt))
            res["rss_save"].append(gather({"base": pk.base, "peak": pk.peak, "extra": pk.extra}))
            res["save"].append(t)
            if rank == 0:
                drop_cache(files_under(args.ckpt))
            LOG.info("torch DCP save: %.3f s", t)
    # load (task "load", a fresh process): dcp.load into the live state dicts, then set_state_dict (as a resume)
    for _rep in range(R if args.torch_task == "load" else 0):
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().zero_()
            for st in opt.state.values():
                for k in ("exp_avg", "exp_avg_sq"):
                    v = st[k]
                    (v.to_local() if hasattr(v, "to_local") else v).zero_()
        if rank == 0:
            drop_cache(files_under(args.ckpt))
        tdist.barrier()

        def load():
            m2, o2 = get_state_dict(model, opt)
            t0 = time.perf_counter()
            dcp.load({"model": m2, "optim": o2}, checkpoint_id=args.ckpt)
            t1 = time.perf_counter()
            set_state_dict(model, opt, model_state_dict=m2, optim_state_dict=o2)
            return (t1 - t0, time.perf_counter() - t1)

        with PeakRSS() as pk:
            split, t = timed(load)
        res["rss_load"].append(gather({"base": pk.base, "peak": pk.peak, "extra": pk.extra}))
        res["load"].append(t)
        res["load_split"].append(split)
        LOG.info("torch DCP load: %.3f s (dcp.load %.3f, set_state_dict %.3f)", t, *split)
    res["param_sum"] = param_sum()  # after the load; compared with the saved sum by the parent
    res["version"] = torch.__version__
    res["rank_bytes"] = gather(nbytes)
    res["file_bytes"] = sum(os.path.getsize(f) for f in files_under(args.ckpt)) if rank == 0 else None
    _finish_worker(args, rank, res)


def _finish_worker(args, rank: int, res: dict) -> None:
    """Rank 0 writes the result to --result; every rank leaves after a barrier, without the interpreter's exit:
    gloo's teardown at exit sometimes aborts ("terminate called without an active exception") after all work
    is done."""
    import torch.distributed as tdist

    if rank == 0:
        with open(args.result, "w") as f:
            json.dump(res, f)
    tdist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _many_keys_worker(args, rank: int, world: int, mesh) -> None:
    """DCP's side of the many-keys phase (many_keys.py): ``--keys`` DTensors sharded on dim 0, each rank's shard
    ``PIECE_FLOATS`` floats, saved and loaded ``--repeats`` times; result to --result, then exit."""
    import torch
    import torch.distributed as tdist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor, Shard

    from .many_keys import PIECE_FLOATS

    def state(fill: bool) -> dict:
        return {
            f"experts.{i}.weight": DTensor.from_local(
                torch.full((PIECE_FLOATS,), float(i) if fill else 0.0), mesh, [Shard(0)], run_check=False
            )
            for i in range(args.keys)
        }

    def timed(fn) -> float:
        tdist.barrier()
        t0 = time.perf_counter()
        fn()
        per = [None] * world
        tdist.all_gather_object(per, time.perf_counter() - t0)
        return max(per)

    src, dst = state(True), state(False)
    res: dict = {"keys": args.keys, "world": world, "save_s": [], "load_s": []}
    for _rep in range(max(1, args.repeats)):
        if rank == 0 and os.path.exists(args.ckpt):
            shutil.rmtree(args.ckpt)
        tdist.barrier()
        res["save_s"].append(timed(lambda: dcp.save(src, checkpoint_id=args.ckpt)))
        res["load_s"].append(timed(lambda: dcp.load(dst, checkpoint_id=args.ckpt)))
        step = max(1, args.keys // 7)
        if any(float(dst[f"experts.{i}.weight"].to_local()[0]) != float(i) for i in range(0, args.keys, step)):
            raise SystemExit("torch DCP many-keys: the loaded values differ from the saved ones")
    if rank == 0:
        shutil.rmtree(args.ckpt, ignore_errors=True)
    _finish_worker(args, rank, res)

"""First checks on a real GPU (docs/gpu.md): where pinned staging lands, a checkpoint round trip, step times.

    python tools/gpu_first_run.py places
    python -m paddle.distributed.launch --gpus 0,1 tools/gpu_first_run.py roundtrip
    PADDLE_FSDP_CHECK_COLLECTIVE_ORDER=1 python -m paddle.distributed.launch --gpus 0,1 tools/gpu_first_run.py steps
    PADDLE_FSDP_CHECK_COLLECTIVE_ORDER=0 python -m paddle.distributed.launch --gpus 0,1 tools/gpu_first_run.py steps
    python -m paddle.distributed.launch --gpus 0,1 tools/gpu_first_run.py steps --async-save-every 5

Everything also runs on CPU (gloo ranks, pageable staging), which is how it was checked here; on a GPU each
line it prints is one of the facts docs/gpu.md lists as known only by reasoning.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn.functional as F


def places() -> None:
    """Where host staging memory lands (expect Place(gpu_pinned) on a GPU build) and what stock paddle does."""
    from paddle.distributed.fsdp.devices import device

    print("compiled with cuda:", paddle.is_compiled_with_cuda(), "| device:", paddle.device.get_device())
    print("device.host_empty(pinned):", device.host_empty([4], "float32").place)
    x = paddle.arange(12, dtype="float32").reshape([3, 4])
    staged = device.to_host([x])[0]
    print(
        "to_host of a 2-D tensor:",
        staged.place,
        list(staged.shape),
        "equal:",
        np.array_equal(staged.numpy(), x.numpy().ravel()),
    )
    if paddle.is_compiled_with_cuda():
        stock = paddle.empty([4], dtype="float32", device=paddle.CUDAPinnedPlace())
        print("stock paddle.empty(device=CUDAPinnedPlace()):", stock.place, "(review: expect gpu, not pinned)")
        view = paddle.empty([4], device="cpu").pin_memory()._slice(0, 4)
        print("reshape of a pinned view:", view.reshape([2, 2]).place, "(review: expect gpu: ops move pinned inputs)")


class Block(paddle.nn.Layer):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = paddle.nn.LayerNorm(dim)
        self.up = paddle.nn.Linear(dim, 4 * dim)
        self.down = paddle.nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Model(paddle.nn.Layer):
    def __init__(self, dim: int, blocks: int) -> None:
        super().__init__()
        self.blocks = paddle.nn.LayerList([Block(dim) for _ in range(blocks)])
        self.register_buffer("ema", paddle.zeros([dim]))  # a persistable buffer (fingerprinted at every save)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def build(dim: int, blocks: int):
    from paddle.distributed.fsdp import FullyShardFusion

    paddle.seed(7)
    model = Model(dim, blocks)
    fsdp = FullyShardFusion(model, fsdp_unit_layers=["Block"])
    opt = paddle.optimizer.AdamW(3e-4, parameters=model.parameters(), grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0))
    return model, fsdp, opt


def step(model, opt, dim: int, i: int) -> None:
    rng = np.random.default_rng(1000 * i + dist.get_rank())
    model(paddle.to_tensor(rng.standard_normal((8, 64, dim)).astype("float32"))).backward()
    opt.step()
    opt.clear_grad()


def _local(fsdp) -> dict:
    """This rank's pieces (and replicated buffers) as numpy arrays."""
    return {k: getattr(v, "local_tensor", v).numpy().copy() for k, v in fsdp.sharded_state_dict().items()}


def roundtrip(args) -> None:
    """Sync and async checkpoints of a trained model load back bit-exact into a fresh one, on every rank."""
    model, fsdp, opt = build(args.dim, args.blocks)
    for i in range(3):
        step(model, opt, args.dim, i)
    root = args.dir
    want = _local(fsdp)
    fsdp.save_checkpoint(os.path.join(root, "sync"), optimizer=opt)
    handle = fsdp.save_checkpoint(os.path.join(root, "async"), optimizer=opt, async_save=True)
    step(model, opt, args.dim, 3)  # training goes on while the async save runs: it must hold the values above
    handle.wait()
    for kind in ("sync", "async"):
        fresh, fresh_fsdp, fresh_opt = build(args.dim, args.blocks)
        fresh_fsdp.load_checkpoint(os.path.join(root, kind), optimizer=fresh_opt)
        got = _local(fresh_fsdp)
        same = set(got) == set(want) and all(np.array_equal(got[k], v) for k, v in want.items())
        print(f"rank {dist.get_rank()}: {kind} round trip bit-exact: {same}")


def steps(args) -> None:
    """Main-thread step times (ms): plain steps, and the steps right after an async save's call."""
    model, fsdp, opt = build(args.dim, args.blocks)
    root = args.dir
    plain, during, call = [], [], []
    handle = None
    for i in range(args.steps):
        if args.async_save_every and i and i % args.async_save_every == 0:
            if handle is not None:
                handle.wait()
            t0 = time.perf_counter()
            handle = fsdp.save_checkpoint(os.path.join(root, f"s{i}"), optimizer=opt, async_save=True)
            call.append(time.perf_counter() - t0)
        busy = handle is not None and not handle.done()  # the save's background copies/writes run now
        t0 = time.perf_counter()
        step(model, opt, args.dim, i)
        paddle.device.synchronize() if paddle.is_compiled_with_cuda() else None
        (during if busy else plain).append(time.perf_counter() - t0)
    if handle is not None:
        handle.wait()
    order = os.environ.get("PADDLE_FSDP_CHECK_COLLECTIVE_ORDER", "default")
    ms = lambda xs: f"{1e3 * statistics.median(xs):.1f}" if xs else "-"  # noqa: E731
    print(
        f"rank {dist.get_rank()}: order check={order} median step ms: plain {ms(plain[1:])} ({len(plain) - 1}), "
        f"during async save {ms(during)} ({len(during)}), save call {ms(call)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("check", choices=["places", "roundtrip", "steps"])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--async-save-every", type=int, default=0)
    parser.add_argument(
        "--dir",
        default=os.path.join(tempfile.gettempdir(), "fsdp_gpu_first_run"),
        help="checkpoint directory, shared by the ranks (default: %(default)s)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.check == "places":
        places()
        return
    if dist.get_world_size() > 1:
        dist.init_parallel_env()
    {"roundtrip": roundtrip, "steps": steps}[args.check](args)


if __name__ == "__main__":
    main()

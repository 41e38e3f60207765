"""LoRA-style training under FSDP: losses equal one process; frozen parameters hold no gradient, no optimizer state.

Each case runs on every rank and is reported by name (launch_util.worker_main).
"""

from __future__ import annotations

import _paths  # noqa: F401  (puts launch_util on sys.path)
import numpy as np
import paddle
import paddle.distributed as dist
from launch_util import worker_main
from lora_models import adapter_batches, frozen_keys, make_adapter_model
from models import local_part
from paddle.distributed.fsdp import FullyShardFusion

STEPS, ROWS = 4, 12  # 12 rows split evenly over 1, 2 and 3 ranks


def _optimizer(model, clip: bool):
    grad_clip = paddle.nn.ClipGradByGlobalNorm(0.5) if clip else None
    return paddle.optimizer.AdamW(0.02, weight_decay=0.1, grad_clip=grad_clip, parameters=model.parameters())


def _losses(model, opt, rank: int, world: int, probe=None) -> list[float]:
    """The global mean loss of each step (this rank's rows; averaged over ranks)."""
    out = []
    for ids, labels in adapter_batches(STEPS, ROWS):
        loss = model(paddle.to_tensor(local_part(ids, rank, world)), paddle.to_tensor(local_part(labels, rank, world)))
        loss.backward()
        if probe is not None:
            probe()
        opt.step()
        opt.clear_grad()
        value = loss.detach().reshape([1])
        if world > 1:
            dist.all_reduce(value)
        out.append(float(value.numpy()[0]) / world)
    return out


def _parity(units, clip: bool):
    def case(rank: int, world: int, figures: dict) -> None:
        ref = make_adapter_model(11)
        want = _losses(ref, _optimizer(ref, clip), 0, 1)
        model = make_adapter_model(11)
        fsdp = FullyShardFusion(model, fsdp_unit_layers=units)
        got = _losses(model, _optimizer(model, clip), rank, world)
        errors = [abs(g - w) for g, w in zip(got, want)]
        assert max(errors) <= 1e-5, f"losses {got} differ from one process {want}"
        assert len(set(np.round(want, 6))) > 1, f"the adapters did not change the loss: {want}"
        full = fsdp.full_parameters()
        for key, param in ref.named_parameters():
            diff = np.abs(full[key].numpy() - param.numpy()).max()
            if param.stop_gradient:  # the frozen base is untouched, bit for bit
                assert diff == 0, f"frozen {key} changed by {diff}"
            else:
                assert diff <= 1e-5 * max(np.abs(param.numpy()).max(), 1.0), f"{key} differs by {diff}"
        figures[f"losses-{units}-{clip}"] = got

    return case


def frozen_hold_nothing(rank: int, world: int, figures: dict) -> None:
    """After backward, at the step and after clear_grad: no frozen buffer holds a gradient, no frozen parameter a
    ``.grad`` or an optimizer accumulator; the gradient memory is the trainable buffers' only."""
    model = make_adapter_model(5, n_blocks=3)
    frozen = frozen_keys(model)
    fsdp = FullyShardFusion(model, fsdp_unit_layers=["AdapterBlock"])
    opt = _optimizer(model, clip=True)
    buffers = {b.index: b for b in fsdp.buffers}
    frozen_buffers = [b for b in fsdp.buffers if not b.layout.trainable]
    assert frozen_buffers, "the frozen base got no buffer of its own"
    seen = []

    def probe() -> None:
        for key, param, buffer, _index in fsdp.managed_parameters():
            if key in frozen:
                assert not buffer.layout.trainable, f"frozen {key} sits in a trainable buffer {buffer.layout.name}"
                assert param.grad is None, f"frozen {key} has a gradient after backward"
        for b in frozen_buffers:
            assert b.full_grad is None and b.main_grad is None and b._grad_in_param_dtype is None, b.layout.name
            assert not b.has_grad and not b.reduce_pending, b.layout.name
        account = fsdp.memory_account()
        trainable_grad = sum(
            b.main_grad._numel() * b.main_grad.element_size() for b in buffers.values() if b.main_grad is not None
        )
        assert account["gradient_shard"] == trainable_grad, (account, trainable_grad)
        seen.append(account["gradient_shard"])

    _losses(model, opt, rank, world, probe)
    assert len(seen) == STEPS
    trainable_numel = sum(b.layout.shard_numel for b in fsdp.buffers if b.layout.trainable)
    assert max(seen) <= trainable_numel * 4, f"gradient bytes {max(seen)} exceed the trainable shards' fp32 size"
    states = fsdp.optimizer_sharded_state_dict(opt)
    with_state = {k for k in states if not k.startswith("__")}
    owners = {k for k in with_state for f in frozen if k.startswith(f + ".")}
    assert not owners, f"frozen parameters got optimizer state: {sorted(owners)[:5]}"
    assert with_state, "no optimizer state at all (the adapters should have some)"
    for param in model.parameters():
        if param.stop_gradient:
            assert not any(param.name in name for name in _accumulator_names(opt)), param.name
    figures["gradient_shard_bytes"] = max(seen)
    figures["frozen_shard_bytes"] = sum(b.shard._numel() * b.shard.element_size() for b in frozen_buffers)


def _accumulator_names(opt) -> list[str]:
    return [name for per_param in opt._accumulators.values() for name in per_param]


if __name__ == "__main__":
    worker_main(
        {
            "parity_units": _parity(["AdapterBlock"], clip=True),
            "parity_root": _parity(None, clip=False),
            "frozen_hold_nothing": frozen_hold_nothing,
        }
    )

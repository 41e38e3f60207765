"""The training loop and record collection shared by the multi-process test workers."""

from __future__ import annotations

import paddle
from models import local_part


def train(model, opt, batches, rank: int, world: int, micro_batches: int = 1) -> None:
    """The plain loop on this rank's rows of each global batch; LR schedulers step once per step."""
    inner = getattr(opt, "_inner_opt", opt)
    for ids, labels in batches:
        rows = ids.shape[0]
        for k in range(micro_batches):
            part = slice(k * rows // micro_batches, (k + 1) * rows // micro_batches)
            x = paddle.to_tensor(local_part(ids[part], rank, world))
            y = paddle.to_tensor(local_part(labels[part], rank, world))
            (model(x, y) / micro_batches).backward()
        opt.step()
        opt.clear_grad()
        if isinstance(inner._learning_rate, paddle.optimizer.lr.LRScheduler):
            inner._learning_rate.step()


def records(fsdp, opt) -> dict:
    """This rank's model and optimizer records, as a checkpoint would save them."""
    state = fsdp.sharded_state_dict()
    state.update(fsdp.optimizer_sharded_state_dict(opt))
    return state

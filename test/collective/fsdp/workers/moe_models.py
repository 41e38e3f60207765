"""A tiny mixture-of-experts LM for the expert-parallel tests, with a dispatch that runs on gloo.

``MoeLM(ep_group)``: embedding tied to the head, ``BLOCKS`` decoder blocks of attention-free mixing and an MoE
layer (``EXPERTS`` routed experts, top-2 routing, one shared expert). Under expert parallelism (``ep_group`` of
P ranks) each rank keeps ``EXPERTS / P`` consecutive experts; the others are ``None`` in ``experts``, so every
expert's structured name carries its global index (PaddleFormers' MoELayer does the same).

Dispatch: gloo has no all_to_all, so tokens travel by all_gather: each rank gathers the tokens (and the routing
weights) of its EP group, runs its own experts on the rows routed to them, and the partial outputs are summed
over the EP group and each rank keeps its own rows (an all_reduce + slice: gloo has no reduce_scatter either).
Both steps are differentiable (their backward is the other one). Experts with no token are skipped, as in one
process. Every expert is built on every rank from the same seed, then the non-local ones are dropped, so values
do not depend on the EP degree.
"""

from __future__ import annotations

import paddle
import paddle.distributed as dist
import paddle.nn.functional as F
from paddle.autograd import PyLayer

VOCAB, DIM, SEQ, EXPERTS, TOP_K, BLOCKS = 29, 32, 4, 8, 2, 2


def _gather_rows(x: paddle.Tensor, group) -> paddle.Tensor:
    parts: list = []
    dist.all_gather(parts, x, group=group)
    return paddle.concat(parts, axis=0)


def _sum_and_keep_rows(y: paddle.Tensor, group) -> paddle.Tensor:
    y = y.clone()
    dist.all_reduce(y, group=group)
    rows = y.shape[0] // group.nranks
    return y[group.rank * rows : (group.rank + 1) * rows]


class GatherTokens(PyLayer):
    """Forward: the rows of every rank of ``group``, in rank order. Backward: the summed gradient of my rows."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_rows(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _sum_and_keep_rows(grad, ctx.group)


class CombineTokens(PyLayer):
    """Forward: the sum over ``group`` of every rank's partial outputs, my rows. Backward: gather (the transpose)."""

    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        return _sum_and_keep_rows(y, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_rows(grad, ctx.group)


class MoeExpert(paddle.nn.Layer):
    """One expert (also the shared expert's class: only members of an expert list are experts)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = paddle.nn.Linear(dim, 2 * dim, bias_attr=False)
        self.down = paddle.nn.Linear(2 * dim, dim)

    def forward(self, x):
        return self.down(F.silu(self.up(x)))


class MoeLayer(paddle.nn.Layer):
    def __init__(self, dim: int, ep_group=None) -> None:
        super().__init__()
        self.gate = paddle.nn.Linear(dim, EXPERTS, bias_attr=False)
        experts = [MoeExpert(dim) for _ in range(EXPERTS)]
        self.ep_group = ep_group
        ep, me = (ep_group.nranks, ep_group.rank) if ep_group is not None else (1, 0)
        per_rank = EXPERTS // ep
        self.local = range(me * per_rank, (me + 1) * per_rank)
        self.experts = paddle.nn.LayerList([e if i in self.local else None for i, e in enumerate(experts)])
        self.shared_expert = MoeExpert(dim)

    def forward(self, x):
        shape = x.shape
        x = x.reshape([-1, shape[-1]])
        probs = F.softmax(self.gate(x).astype("float64"), axis=-1).astype(x.dtype)
        top_w, top_i = paddle.topk(probs, TOP_K, axis=-1)
        top_w = top_w / top_w.sum(axis=-1, keepdim=True)
        combine = (F.one_hot(top_i, EXPERTS).astype(x.dtype) * top_w.unsqueeze(-1)).sum(axis=1)  # [N, E]
        tokens, weights = x, combine
        if self.ep_group is not None:
            tokens, weights = GatherTokens.apply(x, self.ep_group), GatherTokens.apply(combine, self.ep_group)
        out = paddle.zeros_like(tokens)
        routed = (top_i.numpy() if self.ep_group is None else _gather_rows(top_i, self.ep_group).numpy()).tolist()
        for e in self.local:
            rows = [n for n, chosen in enumerate(routed) if e in chosen]
            if not rows:
                continue  # no token for this expert: no gradient either (as in one process)
            index = paddle.to_tensor(rows, dtype="int64")
            y = self.experts[e](paddle.gather(tokens, index)) * paddle.gather(weights[:, e : e + 1], index)
            out = paddle.index_add(out, index, 0, y)
        if self.ep_group is not None:
            out = CombineTokens.apply(out, self.ep_group)
        return (out + self.shared_expert(x)).reshape(shape)


class MoeDecoderBlock(paddle.nn.Layer):
    def __init__(self, dim: int, ep_group=None) -> None:
        super().__init__()
        self.norm1 = paddle.nn.LayerNorm(dim)
        self.mix = paddle.nn.Linear(dim, dim)
        self.norm2 = paddle.nn.LayerNorm(dim)
        self.mlp = MoeLayer(dim, ep_group)

    def forward(self, x):
        x = x + self.mix(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TiedHead(paddle.nn.Layer):
    """The output projection, registering the embedding's weight too (a tied parameter)."""

    def __init__(self, embedding: paddle.nn.Embedding) -> None:
        super().__init__()
        self.weight = embedding.weight

    def forward(self, h):
        return paddle.matmul(h, self.weight, transpose_y=True)


class MoeLM(paddle.nn.Layer):
    """Embedding tied to the head (a tied parameter), MoE blocks, a final norm; biases and norms exempt from decay."""

    def __init__(self, ep_group=None, dtype: str = "float64") -> None:
        super().__init__()
        self.embed = paddle.nn.Embedding(VOCAB, DIM)
        self.blocks = paddle.nn.LayerList([MoeDecoderBlock(DIM, ep_group) for _ in range(BLOCKS)])
        self.norm = paddle.nn.LayerNorm(DIM)
        self.head = TiedHead(self.embed)
        for name, param in self.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.no_weight_decay = True
        if dtype != "float32":
            self.to(dtype=dtype)

    def forward(self, ids, labels):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.reshape([-1, VOCAB]).astype("float64"), labels.reshape([-1, 1])).mean()


def make_moe(seed: int, ep_group=None, **kwargs) -> MoeLM:
    paddle.seed(seed)
    return MoeLM(ep_group, **kwargs)


def moe_batches(n_steps: int, batch: int, seed: int = 4321):
    """The same global batches on every rank (numpy RNG)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [(rng.integers(0, VOCAB, (batch, SEQ)), rng.integers(0, VOCAB, (batch, SEQ))) for _ in range(n_steps)]

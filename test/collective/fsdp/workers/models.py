"""Small models shared by the multi-process test workers."""

from __future__ import annotations

import paddle
import paddle.nn.functional as F

VOCAB, DIM, SEQ = 37, 16, 6


class Block(paddle.nn.Layer):
    """A transformer-ish block: attention-free mixing, an MLP, LayerNorms, optional dropout."""

    def __init__(self, dim: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm1 = paddle.nn.LayerNorm(dim)
        self.mix = paddle.nn.Linear(dim, dim)
        self.norm2 = paddle.nn.LayerNorm(dim)
        self.up = paddle.nn.Linear(dim, 3 * dim)
        self.down = paddle.nn.Linear(3 * dim, dim)
        self.dropout = paddle.nn.Dropout(dropout) if dropout else None

    def forward(self, x):
        x = x + self.mix(self.norm1(x))
        h = self.down(F.gelu(self.up(self.norm2(x))))
        if self.dropout is not None:
            h = self.dropout(h)
        return x + h


class LMHead(paddle.nn.Layer):
    """Output projection whose weight is the embedding's (registered here too: a tied parameter)."""

    def __init__(self, embedding: paddle.nn.Embedding) -> None:
        super().__init__()
        self.weight = embedding.weight

    def forward(self, h):
        return paddle.matmul(h, self.weight, transpose_y=True)


class TinyLM(paddle.nn.Layer):
    """Embedding tied to the head, a few blocks, a frozen positional table, biases exempt from decay."""

    def __init__(self, n_blocks: int = 3, dropout: float = 0.0, dtype: str = "float32") -> None:
        super().__init__()
        self.embed = paddle.nn.Embedding(VOCAB, DIM)
        self.pos = self.create_parameter([SEQ, DIM], dtype="float32")
        self.pos.stop_gradient = True  # frozen
        self.blocks = paddle.nn.LayerList([Block(DIM, dropout) for _ in range(n_blocks)])
        self.norm = paddle.nn.LayerNorm(DIM)
        self.head = LMHead(self.embed)
        for name, param in self.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.no_weight_decay = True
        if dtype != "float32":
            self.to(dtype=dtype)

    def forward(self, ids, labels):
        h = self.embed(ids) + self.pos.astype(self.embed.weight.dtype)
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.norm(h))
        if logits.dtype not in (paddle.float32, paddle.float64):
            logits = logits.astype("float32")
        return F.cross_entropy(logits.reshape([-1, VOCAB]), labels.reshape([-1, 1])).mean()


def make_model(seed: int, **kwargs) -> TinyLM:
    paddle.seed(seed)
    return TinyLM(**kwargs)


def global_batches(n_steps: int, batch: int, seed: int = 1234):
    """The same global batches on every rank (numpy RNG, independent of paddle's)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [(rng.integers(0, VOCAB, (batch, SEQ)), rng.integers(0, VOCAB, (batch, SEQ))) for _ in range(n_steps)]


def local_part(array, rank: int, world: int):
    per = array.shape[0] // world
    return array[rank * per : (rank + 1) * per]


def decay_fun_for(model: paddle.nn.Layer):
    """An ``apply_decay_param_fun`` exempting the params flagged ``no_weight_decay`` (by param.name)."""
    exempt = {p.name for p in model.parameters() if getattr(p, "no_weight_decay", False)}
    return lambda name: name not in exempt


class Bf16MLP(paddle.nn.Layer):
    """bf16 parameters computed in fp32 (CPU has no bf16 matmul): exercises fp32 master weights."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = self.create_parameter([DIM, 2 * DIM], dtype="bfloat16")
        self.b1 = self.create_parameter([2 * DIM], dtype="bfloat16", is_bias=True)
        self.w2 = self.create_parameter([2 * DIM, VOCAB], dtype="bfloat16")
        self.embed = paddle.nn.Embedding(VOCAB, DIM)

    def forward(self, ids, labels):
        h = self.embed(ids)
        h = F.gelu(paddle.matmul(h, self.w1.astype("float32")) + self.b1.astype("float32"))
        logits = paddle.matmul(h, self.w2.astype("float32"))
        return F.cross_entropy(logits.reshape([-1, VOCAB]), labels.reshape([-1, 1])).mean()


def trained_fsdp(seed: int, steps: int):
    """A FullyShardFusion TinyLM (one unit per Block) and its AdamW after ``steps`` steps on this rank's part of
    the seeded global batches: the same state on every run with the same seed and world."""
    import paddle.distributed as dist
    from paddle.distributed.fsdp import FullyShardFusion

    paddle.seed(seed)
    model = make_model(seed)
    fsdp = FullyShardFusion(model, fsdp_unit_layers=["Block"])
    opt = paddle.optimizer.AdamW(0.01, parameters=model.parameters())
    rank, world = dist.get_rank(), dist.get_world_size()
    for ids, labels in global_batches(steps, 8, seed=seed):
        loss = model(paddle.to_tensor(local_part(ids, rank, world)), paddle.to_tensor(local_part(labels, rank, world)))
        loss.backward()
        opt.step()
        opt.clear_grad()
    return fsdp, opt

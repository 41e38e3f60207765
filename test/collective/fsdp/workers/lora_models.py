"""A small frozen-base model with LoRA-style adapters (plain paddle), shared by the LoRA test workers.

Why plain paddle: the main suite runs without PaddleFormers' LoRA classes; the frozen base (embedding, MLPs,
projections) and the trainable low-rank adapters on the attention-like projections are what matters to FSDP.
"""

from __future__ import annotations

import numpy as np
import paddle
import paddle.nn.functional as F

VOCAB, DIM, SEQ, RANK = 41, 16, 6, 4


class LoRALinear(paddle.nn.Layer):
    """``base(x) + scale * (x @ A) @ B`` with the base frozen; B starts at zero as LoRA does (``b_init`` makes it
    non-zero so the adapters change the output from the first step)."""

    def __init__(self, dim_in: int, dim_out: int, r: int = RANK, alpha: float = 8.0, b_init: float = 0.0) -> None:
        super().__init__()
        self.base = paddle.nn.Linear(dim_in, dim_out)
        for p in self.base.parameters():
            p.stop_gradient = True
        self.lora_A = self.create_parameter([dim_in, r])
        self.lora_B = self.create_parameter([r, dim_out], default_initializer=paddle.nn.initializer.Constant(b_init))
        self.scale = alpha / r

    def forward(self, x):
        return self.base(x) + self.scale * paddle.matmul(paddle.matmul(x, self.lora_A), self.lora_B)


class AdapterBlock(paddle.nn.Layer):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = paddle.nn.LayerNorm(dim)
        self.q = LoRALinear(dim, dim, b_init=0.01)
        self.v = LoRALinear(dim, dim)
        self.up = paddle.nn.Linear(dim, 2 * dim)
        self.down = paddle.nn.Linear(2 * dim, dim)
        for p in [*self.norm.parameters(), *self.up.parameters(), *self.down.parameters()]:
            p.stop_gradient = True

    def forward(self, x):
        h = self.norm(x)
        x = x + F.tanh(self.q(h)) * self.v(h)
        return x + self.down(F.gelu(self.up(x)))


class AdapterLM(paddle.nn.Layer):
    """Frozen embedding, blocks and head; trainable adapters only."""

    def __init__(self, n_blocks: int = 2) -> None:
        super().__init__()
        self.embed = paddle.nn.Embedding(VOCAB, DIM)
        self.embed.weight.stop_gradient = True
        self.blocks = paddle.nn.LayerList([AdapterBlock(DIM) for _ in range(n_blocks)])
        self.head = paddle.nn.Linear(DIM, VOCAB)
        for p in self.head.parameters():
            p.stop_gradient = True

    def forward(self, ids, labels):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        logits = self.head(h)
        return F.cross_entropy(logits.reshape([-1, VOCAB]), labels.reshape([-1, 1])).mean()


def make_adapter_model(seed: int, n_blocks: int = 2) -> AdapterLM:
    paddle.seed(seed)
    return AdapterLM(n_blocks)


def adapter_batches(steps: int, rows: int, seed: int = 3) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        (rng.integers(0, VOCAB, (rows, SEQ)).astype("int64"), rng.integers(0, VOCAB, (rows, SEQ)).astype("int64"))
        for _ in range(steps)
    ]


def frozen_keys(model) -> set[str]:
    return {name for name, p in model.named_parameters() if p.stop_gradient}

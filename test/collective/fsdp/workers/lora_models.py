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


# ---- the layout of PaddleFormers' LoRAModel, in plain paddle: what the exports (adapter, merged model) read -----
class MergeableLoRALinear(paddle.nn.Linear):
    """PaddleFormers' ``LoRALinear`` layout: the frozen ``weight`` ``[in, out]`` and ``bias`` of a Linear plus
    ``lora_A`` ``[in, r]`` and ``lora_B`` ``[r, out]``; output ``x @ W + b + scaling * (x @ A) @ B``."""

    def __init__(self, dim_in: int, dim_out: int, r: int = RANK, alpha: float = 8.0) -> None:
        super().__init__(dim_in, dim_out)
        self.weight.stop_gradient = True
        self.bias.stop_gradient = True
        self.lora_A = self.create_parameter([dim_in, r])
        self.lora_B = self.create_parameter([r, dim_out], default_initializer=paddle.nn.initializer.Constant(0.01))
        self.scaling = alpha / r

    def forward(self, x):
        return super().forward(x) + self.scaling * paddle.matmul(paddle.matmul(x, self.lora_A), self.lora_B)


class BaseBlock(paddle.nn.Layer):
    def __init__(self, dim: int, lora: bool) -> None:
        super().__init__()
        linear = MergeableLoRALinear if lora else paddle.nn.Linear
        self.norm = paddle.nn.LayerNorm(dim)
        self.q, self.v = linear(dim, dim), linear(dim, dim)
        self.up, self.down = paddle.nn.Linear(dim, 2 * dim), paddle.nn.Linear(2 * dim, dim)

    def forward(self, x):
        h = self.norm(x)
        x = x + F.tanh(self.q(h)) * self.v(h)
        return x + self.down(F.gelu(self.up(x)))


class BaseLM(paddle.nn.Layer):
    """The base model (``lora=False``: what a merged export loads into), or the same with LoRA on q and v."""

    def __init__(self, n_blocks: int = 2, lora: bool = False) -> None:
        super().__init__()
        self.embed = paddle.nn.Embedding(VOCAB, DIM)
        self.blocks = paddle.nn.LayerList([BaseBlock(DIM, lora) for _ in range(n_blocks)])
        self.head = paddle.nn.Linear(DIM, VOCAB)

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class LoRAConfigLike:
    """The part of PaddleFormers' ``LoRAConfig`` the engine reads (``to_dict``)."""

    def __init__(self, r: int = RANK, alpha: float = 8.0) -> None:
        self.r, self.lora_alpha = r, alpha

    def to_dict(self) -> dict:
        return {"r": self.r, "lora_alpha": self.lora_alpha, "rslora": False, "lora_dropout": 0.0}


class WrappedLoRA(paddle.nn.Layer):
    """PaddleFormers' ``LoRAModel`` shape: the base model (with LoRA layers) as ``.model``, ``.lora_config``; every
    base parameter frozen, the adapters trainable."""

    def __init__(self, base: BaseLM) -> None:
        super().__init__()
        self.model = base
        self.lora_config = LoRAConfigLike()
        for name, p in base.named_parameters():
            p.stop_gradient = not name.endswith(("lora_A", "lora_B"))

    def forward(self, ids, labels):
        logits = self.model(ids)
        return F.cross_entropy(logits.reshape([-1, VOCAB]), labels.reshape([-1, 1])).mean()


def make_wrapped_lora(seed: int, n_blocks: int = 2) -> WrappedLoRA:
    """One seed, one model (base and adapters)."""
    paddle.seed(seed)
    base = BaseLM(n_blocks, lora=True)
    return WrappedLoRA(base)

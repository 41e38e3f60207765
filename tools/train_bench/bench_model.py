"""The benchmark model and data, identical in paddle and torch: ``L`` pre-norm MLP blocks
``x + Linear(4d, d)(GELU(Linear(d, 4d)(LayerNorm(x))))``, fp32, loss ``mean(out ** 2)``.

Weights are numpy arrays seeded per block and loaded into either framework (paddle's Linear is [in, out],
torch gets the transpose); the batch of (step, rank) comes from a numpy generator seeded by both, so every
contender trains on the same numbers and 2-rank paddle contenders must agree bit for bit.
"""

from __future__ import annotations

import numpy as np

BYTES_FP32 = 4
#: fp32 parameter + fp32 gradient + AdamW's two moments: the state FSDP shards
STATE_COPIES = 4


def block_weights(index: int, d: int) -> dict[str, np.ndarray]:
    """Block ``index``'s weights in paddle's layout ([in, out] for Linear)."""
    rng = np.random.default_rng(1000 + index)
    return {
        "norm.weight": np.ones(d, np.float32),
        "norm.bias": np.zeros(d, np.float32),
        "up.weight": (rng.standard_normal((d, 4 * d)) / np.sqrt(d)).astype(np.float32),
        "up.bias": np.zeros(4 * d, np.float32),
        "down.weight": (rng.standard_normal((4 * d, d)) / np.sqrt(4 * d)).astype(np.float32),
        "down.bias": np.zeros(d, np.float32),
    }


def batch(step: int, rank: int, batch_size: int, seq: int, d: int) -> np.ndarray:
    return np.random.default_rng([step, rank, 7]).standard_normal((batch_size, seq, d)).astype(np.float32)


def parameter_count(d: int, layers: int) -> int:
    per_block = 2 * d + (d * 4 * d + 4 * d) + (4 * d * d + d)
    return layers * per_block


def paddle_model(d: int, layers: int):
    import paddle
    from paddle import nn

    class Block(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(d)
            self.up = nn.Linear(d, 4 * d)
            self.down = nn.Linear(4 * d, d)

        def forward(self, x):
            return x + self.down(nn.functional.gelu(self.up(self.norm(x))))

    class Stack(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.LayerList([Block() for _ in range(layers)])

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return (x * x).mean()

    model = Stack()
    with paddle.no_grad():
        for index, block in enumerate(model.blocks):
            for name, value in block_weights(index, d).items():
                dict(block.named_parameters())[name].set_value(value)
    return model


def torch_model(d: int, layers: int):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(d)
            self.up = nn.Linear(d, 4 * d)
            self.down = nn.Linear(4 * d, d)

        def forward(self, x):
            return x + self.down(nn.functional.gelu(self.up(self.norm(x))))

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([Block() for _ in range(layers)])

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return (x * x).mean()

    model = Stack()
    with torch.no_grad():
        for index, block in enumerate(model.blocks):
            params = dict(block.named_parameters())
            for name, value in block_weights(index, d).items():
                params[name].copy_(torch.from_numpy(value.T.copy() if name in ("up.weight", "down.weight") else value))
    return model

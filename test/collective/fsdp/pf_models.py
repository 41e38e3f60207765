"""Tiny PaddleFormers 0.4.1 causal LMs and their Hugging Face configs, for the preset tests (no download).

One table row per family: the transformers config class (config only: no torch needed), the PaddleFormers config
and model classes, the decoder layer class (the FSDP unit) and the sizes. The HF ``config.json`` is the single
source of the sizes: the PaddleFormers model is built from the same values. Every parameter is then overwritten
with seeded random values (biases and norms included), so a wrong split, order or transpose cannot hide behind
zeros or ones. GQA (4 heads, 2 kv heads) so the per-kv-head interleave of the fused qkv matters.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import numpy as np

warnings.filterwarnings("ignore", message="No ccache found", category=UserWarning)

COMMON = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    hidden_act="silu",
)

FAMILIES = {
    # family: (transformers config class, paddleformers module attr prefix, decoder layer, extra sizes)
    "llama": ("LlamaConfig", "Llama", "LlamaDecoderLayer", {}),
    "qwen2": ("Qwen2Config", "Qwen2", "Qwen2DecoderLayer", {}),
    "qwen3": ("Qwen3Config", "Qwen3", "Qwen3DecoderLayer", {"head_dim": 8}),
    "qwen3-moe": (
        "Qwen3MoeConfig",
        "Qwen3Moe",
        "Qwen3MoeDecoderLayer",
        # layer 1 is a dense MLP layer (mlp_only_layers), layer 0 sparse: both layer kinds are exercised
        {
            "head_dim": 8,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [1],
            "norm_topk_prob": True,
        },
    ),
}
PRESET_NAMES = [f"{f}{s}" for f in FAMILIES for s in ("", "-fused")]


def family_of(preset: str) -> tuple[str, bool]:
    fused = preset.endswith("-fused")
    return (preset[: -len("-fused")] if fused else preset), fused


def hf_config(family: str) -> dict:
    """The Hugging Face config.json content (built by transformers' own config class)."""
    import transformers

    cls_name, prefix, _layer, extra = FAMILIES[family]
    cfg = getattr(transformers, cls_name)(**COMMON, **extra)
    cfg.architectures = [f"{prefix}ForCausalLM"]
    return cfg.to_dict()


def write_hf_config(family: str, path: Path) -> Path:
    path.write_text(json.dumps(hf_config(family), indent=2))
    return path


def paddle_model(family: str, fused: bool, config: dict, seed: int):
    """A PaddleFormers model of ``config``'s sizes (fused or not), every parameter seeded random fp32."""
    import paddle
    import paddleformers.transformers as pft

    _cls, prefix, _layer, extra = FAMILIES[family]
    keys = list(COMMON) + list(extra)
    if family == "qwen3" or family == "qwen3-moe" or family == "llama":
        keys.append("attention_bias")
    kwargs = {k: config[k] for k in keys if k in config}
    cfg = getattr(pft, f"{prefix}Config")(**kwargs)
    cfg.fuse_attention_qkv = fused  # the constructor drops these flags: set them afterwards
    cfg.fuse_attention_ffn = fused
    paddle.seed(seed)
    model = getattr(pft, f"{prefix}ForCausalLM")(cfg)
    model.eval()
    randomize(model, seed)
    return model


def randomize(model, seed: int) -> None:
    import paddle

    rng = np.random.default_rng(seed)
    with paddle.no_grad():
        for _name, p in model.named_parameters():
            value = rng.standard_normal(p.shape).astype(np.float32) * 0.2
            p.set_value(paddle.to_tensor(value))


def input_ids(vocab: int, seed: int = 5) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (2, 9)).astype(np.int64)


def paddle_logits(model, ids: np.ndarray) -> np.ndarray:
    import paddle

    with paddle.no_grad():
        out = model(paddle.to_tensor(ids))
    if hasattr(out, "logits"):
        out = out.logits
    elif isinstance(out, (tuple, list)):
        out = out[0]
    return out.astype("float32").numpy()


def save_single_process(model, path: str | os.PathLike) -> None:
    """The model's state dict as an engine checkpoint, written by this one process (the engine's own save:
    ``dist.save_state_dict`` of plain tensors writes stock paddle's format, as stock does)."""
    from paddle.distributed.fsdp.checkpoint import save_state_dict

    save_state_dict(model.state_dict(), str(path))


def decoder_layer(family: str) -> str:
    return FAMILIES[family][2]

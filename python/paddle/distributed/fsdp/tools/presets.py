"""Model-family presets for ``to-hf`` / ``from-hf``: checkpoint key <-> Hugging Face name rules, as data.

A user names the family (``--preset qwen3-fused``) instead of writing regexes. A preset says two things:

* **the architecture** (:class:`ParamSpec`): every parameter a Hugging Face model of that family has, with its
  shape as a product of config symbols (``("Q", "H")`` = ``[num_attention_heads * head_dim, hidden_size]``),
  per model, per layer, per dense or sparse (MoE) layer, per expert. Expanded against an HF ``config.json`` it
  gives the exact set of names and shapes an export must contain, and an import must find (:func:`expected_params`).
* **the mapping** (:class:`Rule`): a checkpoint key template -> one or more HF name templates (``{i}`` = layer,
  ``{e}`` = expert), whether the tensor is transposed (Paddle ``Linear`` weights are ``[in, out]``, torch's
  ``[out, in]``) and how a fused key is laid out along the HF output axis (:data:`LAYOUTS`).

Fused layouts are PaddleFormers 0.4.1's own, read from its forward code (the forward is what defines them):

* ``qkv`` (``self_attn.qkv_proj``): the output axis is reshaped to ``[num_key_value_heads, (groups + 2) * head_dim]``
  and split as ``[groups * head_dim, head_dim, head_dim]``; i.e. *interleaved per kv head*: for kv head ``h``, the
  ``groups`` query heads ``h*groups .. (h+1)*groups-1``, then key head ``h``, then value head ``h``
  (``qwen2/qwen3/qwen3_moe/llama modeling.py``, ``Attention.forward``, fused branch). The bias follows the weight.
* ``concat`` (``mlp.up_gate_proj`` / Llama's ``mlp.gate_up_fused_proj``): ``[gate | up]`` halves, gate first
  (``nn/mlp.py``: ``gate, x = up_gate_proj(x).chunk(2)``; Llama: ``swiglu(x)`` = ``silu(first half) * second``).

Families and names are those of PaddleFormers 0.4.1 (``LlamaForCausalLM`` keys start with ``llama.``, the Qwen
families with ``model.``; Llama's ``lm_head`` is ``[hidden, vocab]`` and transposed, Qwen's is ``[vocab, hidden]``)
and of ``transformers``' ``Llama/Qwen2/Qwen3/Qwen3Moe ForCausalLM``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from .errors import ToolError

# ------------------------------------------------------------------------------------------------ data types


@dataclass(frozen=True)
class ParamSpec:
    """One Hugging Face parameter of the architecture."""

    name: str  # HF name template ({i} layer, {e} expert)
    shape: tuple[str, ...]  # config symbols or products of them ("Q", "H", "2*I")
    scope: str = "model"  # model | layer | dense | sparse | expert
    when: str | None = None  # config flag that must be true for the parameter to exist
    optional_if: str | None = None  # config flag under which the parameter may be absent (tied lm_head)


@dataclass(frozen=True)
class Rule:
    """Checkpoint key template -> HF name templates; several names = a fused key split along HF axis 0."""

    ckpt: str
    hf: tuple[str, ...]
    transpose: bool = False
    layout: str = "one"  # one | concat | qkv


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    model_types: tuple[str, ...]  # accepted config.json "model_type" values
    params: tuple[ParamSpec, ...]
    rules: tuple[Rule, ...]
    fused: bool
    _compiled: dict = field(default_factory=dict, compare=False, repr=False)

    def ckpt_patterns(self) -> list[tuple[re.Pattern, Rule]]:
        if "ckpt" not in self._compiled:
            self._compiled["ckpt"] = [(template_regex(r.ckpt), r) for r in self.rules]
        return self._compiled["ckpt"]

    def hf_patterns(self) -> list[tuple[re.Pattern, Rule, int]]:
        if "hf" not in self._compiled:
            self._compiled["hf"] = [(template_regex(t), r, j) for r in self.rules for j, t in enumerate(r.hf)]
        return self._compiled["hf"]


LAYOUTS = ("one", "concat", "qkv")


def template_regex(template: str) -> re.Pattern:
    """``model.layers.{i}.mlp`` -> ``^model\\.layers\\.(?P<i>\\d+)\\.mlp$``."""
    out, pos = [], 0
    for m in re.finditer(r"\{(\w+)\}", template):
        out.append(re.escape(template[pos : m.start()]))
        out.append(f"(?P<{m.group(1)}>0|[1-9][0-9]*)")
        pos = m.end()
    out.append(re.escape(template[pos:]))
    return re.compile("^" + "".join(out) + "$")


# ------------------------------------------------------------------------------------------------ families


def _decoder_params(
    qkv_bias: str | None, o_bias: str | None, qk_norm: bool, moe: bool, mlp_bias: str | None
) -> tuple[ParamSpec, ...]:
    """The HF parameters of a Llama-style decoder-only causal LM."""
    a, m = "model.layers.{i}.self_attn", "model.layers.{i}.mlp"
    specs = [
        ParamSpec("model.embed_tokens.weight", ("V", "H")),
        ParamSpec("model.norm.weight", ("H",)),
        ParamSpec("lm_head.weight", ("V", "H"), optional_if="tie_word_embeddings"),
        ParamSpec("model.layers.{i}.input_layernorm.weight", ("H",), "layer"),
        ParamSpec("model.layers.{i}.post_attention_layernorm.weight", ("H",), "layer"),
        ParamSpec(f"{a}.q_proj.weight", ("Q", "H"), "layer"),
        ParamSpec(f"{a}.k_proj.weight", ("K", "H"), "layer"),
        ParamSpec(f"{a}.v_proj.weight", ("K", "H"), "layer"),
        ParamSpec(f"{a}.o_proj.weight", ("H", "Q"), "layer"),
    ]
    if qkv_bias is not None:
        always = None if qkv_bias == "always" else qkv_bias
        specs += [
            ParamSpec(f"{a}.q_proj.bias", ("Q",), "layer", always),
            ParamSpec(f"{a}.k_proj.bias", ("K",), "layer", always),
            ParamSpec(f"{a}.v_proj.bias", ("K",), "layer", always),
        ]
    if o_bias is not None:
        specs.append(ParamSpec(f"{a}.o_proj.bias", ("H",), "layer", o_bias))
    if qk_norm:
        specs += [ParamSpec(f"{a}.q_norm.weight", ("D",), "layer"), ParamSpec(f"{a}.k_norm.weight", ("D",), "layer")]
    specs += [
        ParamSpec(f"{m}.gate_proj.weight", ("I", "H"), "dense"),
        ParamSpec(f"{m}.up_proj.weight", ("I", "H"), "dense"),
        ParamSpec(f"{m}.down_proj.weight", ("H", "I"), "dense"),
    ]
    if mlp_bias is not None:
        specs += [
            ParamSpec(f"{m}.gate_proj.bias", ("I",), "dense", mlp_bias),
            ParamSpec(f"{m}.up_proj.bias", ("I",), "dense", mlp_bias),
            ParamSpec(f"{m}.down_proj.bias", ("H",), "dense", mlp_bias),
        ]
    if moe:
        x = "model.layers.{i}.mlp.experts.{e}"
        specs += [
            ParamSpec(f"{m}.gate.weight", ("E", "H"), "sparse"),
            ParamSpec(f"{x}.gate_proj.weight", ("M", "H"), "expert"),
            ParamSpec(f"{x}.up_proj.weight", ("M", "H"), "expert"),
            ParamSpec(f"{x}.down_proj.weight", ("H", "M"), "expert"),
        ]
    return tuple(specs)


def _mlp_rules(src: str, dst: str, fused_name: str | None, bias: bool) -> list[Rule]:
    """gate/up/down of one MLP (``src`` checkpoint prefix, ``dst`` HF prefix); fused: one ``[gate | up]`` key."""
    rules = [Rule(f"{src}.down_proj.weight", (f"{dst}.down_proj.weight",), True)]
    if bias:
        rules.append(Rule(f"{src}.down_proj.bias", (f"{dst}.down_proj.bias",)))
    if fused_name is None:
        for p in ("gate", "up"):
            rules.append(Rule(f"{src}.{p}_proj.weight", (f"{dst}.{p}_proj.weight",), True))
            if bias:
                rules.append(Rule(f"{src}.{p}_proj.bias", (f"{dst}.{p}_proj.bias",)))
    else:
        gu = (f"{dst}.gate_proj.weight", f"{dst}.up_proj.weight")
        rules.append(Rule(f"{src}.{fused_name}.weight", gu, True, "concat"))
        if bias:
            gub = (f"{dst}.gate_proj.bias", f"{dst}.up_proj.bias")
            rules.append(Rule(f"{src}.{fused_name}.bias", gub, False, "concat"))
    return rules


def _decoder_rules(
    base: str, fused: bool, ffn_fused_name: str, qk_norm: bool, lm_head_transposed: bool, moe: bool
) -> tuple[Rule, ...]:
    """Checkpoint (PaddleFormers) -> HF rules of a decoder-only causal LM whose base model is ``base``."""
    a_src, a_dst = f"{base}.layers.{{i}}.self_attn", "model.layers.{i}.self_attn"
    rules = [
        Rule(f"{base}.embed_tokens.weight", ("model.embed_tokens.weight",)),
        Rule(f"{base}.norm.weight", ("model.norm.weight",)),
        Rule("lm_head.weight", ("lm_head.weight",), lm_head_transposed),
        Rule(f"{base}.layers.{{i}}.input_layernorm.weight", ("model.layers.{i}.input_layernorm.weight",)),
        Rule(
            f"{base}.layers.{{i}}.post_attention_layernorm.weight",
            ("model.layers.{i}.post_attention_layernorm.weight",),
        ),
        Rule(f"{a_src}.o_proj.weight", (f"{a_dst}.o_proj.weight",), True),
        Rule(f"{a_src}.o_proj.bias", (f"{a_dst}.o_proj.bias",)),
    ]
    if fused:
        qkv = tuple(f"{a_dst}.{p}_proj.weight" for p in "qkv")
        rules.append(Rule(f"{a_src}.qkv_proj.weight", qkv, True, "qkv"))
        rules.append(Rule(f"{a_src}.qkv_proj.bias", tuple(f"{a_dst}.{p}_proj.bias" for p in "qkv"), False, "qkv"))
    else:
        for p in "qkv":
            rules.append(Rule(f"{a_src}.{p}_proj.weight", (f"{a_dst}.{p}_proj.weight",), True))
            rules.append(Rule(f"{a_src}.{p}_proj.bias", (f"{a_dst}.{p}_proj.bias",)))
    if qk_norm:
        for p in "qk":
            rules.append(Rule(f"{a_src}.{p}_norm.weight", (f"{a_dst}.{p}_norm.weight",)))
    m_src, m_dst = f"{base}.layers.{{i}}.mlp", "model.layers.{i}.mlp"
    fused_name = ffn_fused_name if fused else None
    rules += _mlp_rules(m_src, m_dst, fused_name, bias=not moe)
    if moe:
        rules.append(Rule(f"{m_src}.gate.weight", (f"{m_dst}.gate.weight",), True))
        rules += _mlp_rules(f"{m_src}.experts.{{e}}", f"{m_dst}.experts.{{e}}", fused_name, bias=False)
    return tuple(rules)


def _family(name: str, fused: bool, **kw: Any) -> Preset:
    desc = kw.pop("description")
    model_types = kw.pop("model_types")
    params = _decoder_params(kw.pop("qkv_bias"), kw.pop("o_bias"), kw["qk_norm"], kw["moe"], kw.pop("mlp_bias"))
    rules = _decoder_rules(fused=fused, **kw)
    fused_note = " (fused qkv_proj and gate/up)" if fused else ""
    return Preset(name + ("-fused" if fused else ""), desc + fused_note, model_types, params, rules, fused)


_FAMILIES = {
    "llama": dict(
        description="PaddleFormers LlamaForCausalLM (llama.*) <-> transformers LlamaForCausalLM",
        model_types=("llama",),
        base="llama",
        ffn_fused_name="gate_up_fused_proj",
        qk_norm=False,
        lm_head_transposed=True,
        moe=False,
        qkv_bias="attention_bias",
        o_bias="attention_bias",
        mlp_bias="mlp_bias",
    ),
    "llama-pf1": dict(
        description="PaddleFormers >= 1.0 LlamaForCausalLM (model.*, lm_head [vocab, hidden]) <-> transformers "
        "LlamaForCausalLM",
        model_types=("llama",),
        base="model",
        ffn_fused_name=None,  # 1.x's Llama has no fused variant
        qk_norm=False,
        lm_head_transposed=False,
        moe=False,
        qkv_bias="attention_bias",
        o_bias="attention_bias",
        mlp_bias="mlp_bias",
    ),
    "qwen2": dict(
        description="PaddleFormers Qwen2ForCausalLM <-> transformers Qwen2ForCausalLM",
        model_types=("qwen2",),
        base="model",
        ffn_fused_name="up_gate_proj",
        qk_norm=False,
        lm_head_transposed=False,
        moe=False,
        qkv_bias="always",
        o_bias=None,
        mlp_bias=None,
    ),
    "qwen3": dict(
        description="PaddleFormers Qwen3ForCausalLM <-> transformers Qwen3ForCausalLM",
        model_types=("qwen3",),
        base="model",
        ffn_fused_name="up_gate_proj",
        qk_norm=True,
        lm_head_transposed=False,
        moe=False,
        qkv_bias="attention_bias",
        o_bias="attention_bias",
        mlp_bias=None,
    ),
    "qwen3-moe": dict(
        description="PaddleFormers Qwen3MoeForCausalLM <-> transformers Qwen3MoeForCausalLM",
        model_types=("qwen3_moe",),
        base="model",
        ffn_fused_name="up_gate_proj",
        qk_norm=True,
        lm_head_transposed=False,
        moe=True,
        qkv_bias="attention_bias",
        o_bias="attention_bias",
        mlp_bias=None,
    ),
}

PRESETS: dict[str, Preset] = {
    p.name: p
    for family, kw in _FAMILIES.items()
    for p in (_family(family, f, **dict(kw)) for f in ((False, True) if kw["ffn_fused_name"] else (False,)))
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ToolError(f"unknown preset {name!r} (choose from {', '.join(PRESETS)})") from None


# ------------------------------------------------------------------------------------------------ config


@dataclass(frozen=True)
class ModelDims:
    """The sizes and flags of an HF ``config.json`` that the presets use."""

    symbols: dict[str, int]  # V H Q K D I M E G(roups) heads kv
    layers: int
    experts: int
    sparse_layers: frozenset[int]
    flags: dict[str, bool]
    model_type: str | None


def _int(cfg: dict, key: str, where: str, default: int | None = None, positive: bool = False) -> int:
    v = cfg.get(key, default)
    if v is None:
        raise ToolError(f"{where}: missing {key!r}, which the preset needs")
    if isinstance(v, bool) or not isinstance(v, int) or v < (1 if positive else 0):
        kind = "a positive" if positive else "a non-negative"
        raise ToolError(f"{where}: {key!r} must be {kind} integer, got {v!r}")
    return v


def model_dims(cfg: Any, where: str = "config") -> ModelDims:
    """Sizes from an HF config dict; refuses missing or inconsistent values (head counts, head_dim)."""
    if not isinstance(cfg, dict):
        raise ToolError(f"{where}: expected a JSON object")
    hidden = _int(cfg, "hidden_size", where, positive=True)
    heads = _int(cfg, "num_attention_heads", where, positive=True)
    kv = _int(cfg, "num_key_value_heads", where, heads, positive=True)
    if heads % kv:
        raise ToolError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise ToolError(f"{where}: no head_dim, and hidden_size {hidden} is not a multiple of {heads} heads")
        head_dim = hidden // heads
    head_dim = _int({"head_dim": head_dim}, "head_dim", where, positive=True)
    layers = _int(cfg, "num_hidden_layers", where)
    experts = _int(cfg, "num_experts", where, 0)
    step = _int(cfg, "decoder_sparse_step", where, 1) or 1
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(x, int) for x in only):
        raise ToolError(f"{where}: mlp_only_layers must be a list of layer indices")
    if layers > MAX_EXPECTED:
        raise ToolError(f"{where}: num_hidden_layers {layers} is not a plausible layer count")
    only_set = set(only)
    sparse = frozenset(i for i in range(layers) if experts > 0 and i not in only_set and (i + 1) % step == 0)
    symbols = {
        "V": _int(cfg, "vocab_size", where, positive=True),
        "H": hidden,
        "Q": heads * head_dim,
        "K": kv * head_dim,
        "D": head_dim,
        "G": heads // kv,
        "heads": heads,
        "kv": kv,
        "I": _int(cfg, "intermediate_size", where, positive=True),
        "M": _int(cfg, "moe_intermediate_size", where, 0),
        "E": experts,
    }
    flags = {k: bool(cfg.get(k, False)) for k in ("tie_word_embeddings", "attention_bias", "mlp_bias")}
    mt = cfg.get("model_type")
    return ModelDims(symbols, layers, experts, sparse, flags, mt if isinstance(mt, str) else None)


def check_model_type(preset: Preset, dims: ModelDims, where: str) -> None:
    if dims.model_type is not None and dims.model_type not in preset.model_types:
        raise ToolError(
            f"{where} has model_type {dims.model_type!r}, but preset {preset.name} is for "
            f"{', '.join(preset.model_types)}"
        )


def eval_dim(expr: str, dims: ModelDims) -> int:
    out = 1
    for factor in expr.split("*"):
        out *= int(factor) if factor.isdigit() else dims.symbols[factor]
    return out


@dataclass(frozen=True)
class ExpectedParam:
    name: str
    shape: tuple[int, ...]
    required: bool


MAX_EXPECTED = 1_000_000  # parameter tensors a config may describe (Qwen3-235B-A22B: ~37k)


def expected_count(preset: Preset, dims: ModelDims) -> int:
    """How many parameters :func:`expected_params` would list, computed without listing them."""

    def n(scope: str) -> int:
        return sum(1 for s in preset.params if s.scope == scope and (s.when is None or dims.flags.get(s.when, False)))

    sparse = len(dims.sparse_layers)
    return (
        n("model")
        + dims.layers * n("layer")
        + (dims.layers - sparse) * n("dense")
        + sparse * (n("sparse") + dims.experts * n("expert"))
    )


def expected_params(
    preset: Preset, dims: ModelDims, limit: int = MAX_EXPECTED, context: str = ""
) -> dict[str, ExpectedParam]:
    """Every HF parameter of the architecture ``dims`` describes, in model order.

    Refuses a config that describes more than ``limit`` parameters (checked before listing any), so a crafted
    ``num_hidden_layers`` cannot make the tool spin or fill memory.
    """
    count = expected_count(preset, dims)
    if count > limit:
        raise ToolError(
            f"the config describes {count} parameter tensors ({dims.layers} layers, {dims.experts} experts), "
            f"more than the {limit} this conversion accepts{context}"
        )
    out: dict[str, ExpectedParam] = {}

    def add(spec: ParamSpec, **binding: int) -> None:
        if spec.when is not None and not dims.flags.get(spec.when, False):
            return
        name = spec.name.format(**binding)
        required = not (spec.optional_if and dims.flags.get(spec.optional_if, False))
        out[name] = ExpectedParam(name, tuple(eval_dim(s, dims) for s in spec.shape), required)

    for spec in preset.params:
        if spec.scope == "model":
            add(spec)
    for i in range(dims.layers):
        sparse = i in dims.sparse_layers
        for spec in preset.params:
            if spec.scope == "layer" or (spec.scope == "dense" and not sparse) or (spec.scope == "sparse" and sparse):
                add(spec, i=i)
            elif spec.scope == "expert" and sparse:
                for e in range(dims.experts):
                    add(spec, i=i, e=e)
    return out


# ------------------------------------------------------------------------------------------------ layouts


def layout_blocks(rule: Rule, dims: ModelDims, rows: list[int]) -> list[tuple[int, int, int]]:
    """The fused HF axis-0 order of ``rule``'s targets: ``[(target index, row start, row stop), ...]``.

    ``rows`` are the targets' row counts (HF axis 0). Raises ToolError if they do not fit the layout.
    """
    n = len(rule.hf)
    if len(rows) != n:  # pragma: no cover - callers pass one count per target
        raise ToolError(f"{rule.ckpt}: {len(rows)} row counts for {n} targets")
    if rule.layout in ("one", "concat"):
        return [(j, 0, rows[j]) for j in range(n)]
    if rule.layout == "qkv":
        kv, g, d = dims.symbols["kv"], dims.symbols["G"], dims.symbols["D"]
        if rows != [kv * g * d, kv * d, kv * d]:
            raise ToolError(f"{rule.ckpt}: q/k/v rows {rows} do not match {kv * g} heads, {kv} kv heads, head_dim {d}")
        blocks = []
        for h in range(kv):
            blocks += [(0, h * g * d, (h + 1) * g * d), (1, h * d, (h + 1) * d), (2, h * d, (h + 1) * d)]
        return blocks
    raise ToolError(f"unknown layout {rule.layout!r}")  # pragma: no cover - presets are data checked by tests


def preset_help() -> str:
    """One line per preset for --help."""
    return "\n".join(f"  {p.name:<18} {p.description}" for p in PRESETS.values())

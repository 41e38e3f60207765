"""Type schemas of the JSON files the tools read: an export's index and its ``paddle_fsdp`` record, config.json.

Why: a field of the wrong JSON type must be a named ToolError (exit 2) before any code uses it; a check at each
use left holes (``"transposed": [["x"]]`` reached ``set()`` and exited 3 with ``TypeError: unhashable type``).
A schema is checked once, right after parsing, and names the field, the type it must have and what it got.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import ToolError


@dataclass(frozen=True)
class Obj:
    """A JSON object: known ``fields`` checked when present (``required`` ones must be); others kept unchecked."""

    fields: dict
    required: tuple[str, ...] = ()


@dataclass(frozen=True)
class ListOf:
    item: Any


@dataclass(frozen=True)
class MapOf:
    """A JSON object whose every value has the type ``value`` (keys are strings in JSON)."""

    value: Any


@dataclass(frozen=True)
class Nullable:
    inner: Any


@dataclass(frozen=True)
class Scalar:
    name: str
    types: tuple = field(default=())

    def accepts(self, v: Any) -> bool:
        return type(v) in self.types


STR = Scalar("a string", (str,))
INT = Scalar("an integer", (int,))  # type() excludes bool
BOOL = Scalar("true or false", (bool,))
NUMBER = Scalar("a number", (int, float))
OBJECT = Scalar("an object", (dict,))


def _describe(spec: Any) -> str:
    if isinstance(spec, Scalar):
        return spec.name
    if isinstance(spec, Obj):
        return "an object"
    if isinstance(spec, ListOf):
        return f"a list of {_plural(spec.item)}"
    if isinstance(spec, MapOf):
        return f"an object mapping names to {_plural(spec.value)}"
    if isinstance(spec, Nullable):
        return f"{_describe(spec.inner)} or null"
    raise TypeError(spec)  # pragma: no cover - schemas are data of this module


def _plural(spec: Any) -> str:
    d = _describe(spec)
    return {"a string": "strings", "an integer": "integers", "an object": "objects"}.get(d, d)


def _json_type(v: Any) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", int: "integer", float: "number"}.get(
        type(v), "null" if v is None else type(v).__name__
    )


def check(value: Any, spec: Any, where: str, path: str = "") -> Any:
    """``value`` when it matches ``spec``; else ToolError naming ``where``, the field and both types."""

    def fail() -> ToolError:
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        name = f"field {path!r}" if path else "the document"
        return ToolError(f"{where}: {name} must be {_describe(spec)}, got {_json_type(value)} {shown}")

    if isinstance(spec, Nullable):
        return None if value is None else check(value, spec.inner, where, path)
    if isinstance(spec, Scalar):
        if not spec.accepts(value):
            raise fail()
        return value
    if isinstance(spec, ListOf):
        if type(value) is not list:
            raise fail()
        for i, v in enumerate(value):
            check(v, spec.item, where, f"{path}[{i}]")
        return value
    if isinstance(spec, MapOf):
        if type(value) is not dict:
            raise fail()
        for k, v in value.items():
            check(v, spec.value, where, f"{path}[{k!r}]")
        return value
    if type(value) is not dict:
        raise fail()
    for name in spec.required:
        if name not in value:
            raise ToolError(f"{where}: missing field {(path + '.' if path else '') + name!r}")
    for name, sub in spec.fields.items():
        if name in value:
            check(value[name], sub, where, f"{path}.{name}" if path else name)
    return value


# the paddle_fsdp record to-hf writes into metadata of model.safetensors.index.json (to_hf_cmd.py)
# ``optimizer`` is the checkpoint value __fsdp__.optimizer (state/resume.py): its global_state is checked against
# the optimizer when a checkpoint made from the export is loaded
OPTIMIZER = Obj({"class": STR, "global_state": OBJECT}, required=("class",))
RECORD = Obj(
    {"version": INT, "names": MapOf(STR), "transposed": ListOf(STR), "preset": STR, "optimizer": OPTIMIZER},
    required=("names",),
)


def index_schema(record_key: str) -> Obj:
    """A Hugging Face safetensors index; ``metadata.<record_key>`` is to-hf's record."""
    return Obj(
        {"weight_map": MapOf(STR), "metadata": Obj({"total_size": NUMBER, record_key: RECORD})},
        required=("weight_map",),
    )


# the fields of a Hugging Face config.json that the presets and the architecture check read (presets.py)
_SIZES = (
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "num_hidden_layers",
    "num_experts",
    "decoder_sparse_step",
    "vocab_size",
    "intermediate_size",
    "moe_intermediate_size",
    "head_dim",
)
CONFIG = Obj(
    {
        **{k: Nullable(INT) for k in _SIZES},
        "mlp_only_layers": Nullable(ListOf(INT)),
        "model_type": Nullable(STR),
        **{k: Nullable(BOOL) for k in ("tie_word_embeddings", "attention_bias", "mlp_bias")},
    }
)

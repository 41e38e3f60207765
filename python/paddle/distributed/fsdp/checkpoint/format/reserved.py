"""Reserved keys: the JSON values the one-call API (``state/resume.py``) stores next to the tensors, and the names
the on-disk formats reserve or cannot represent.

Why here: the tools (inspect, to-hf, from-hf) read and write the same keys, so their names are part of the
on-disk format, not of one of its users. A user key starting with ``RESERVED_PREFIX`` is refused by from-hf.
A tensor key becomes a safetensors header name (data files; stock readers find tensors by it) and a key of
``metadata.json`` and of stock's ``0.metadata`` index; a value key a key of ``metadata.json``. ``key_problem``
says why a key cannot be stored so that every reader gets it back exactly (save refuses it by name).
"""

from __future__ import annotations

RESERVED_PREFIX = "__fsdp__."
OPTIMIZER_KEY = "__fsdp__.optimizer"  # {"class": optimizer class name, "global_state": its non-tensor state}
RNG_KEY = "__fsdp__.rng"  # one entry per saving rank: paddle's generator states (a list, JSON)
EXTRA_KEY = "__fsdp__.extra_state"  # the caller's extra_state dict
GRAD_SCALER_KEY = "__fsdp__.grad_scaler"  # a loss scaler's state (state/grad_scaler.py), when one was given
BUFFERS_KEY = "__fsdp__.buffers"  # keys of the model's persistable buffers (to-hf leaves them out unless asked)
STATEFUL_KEY = "__fsdp__.stateful"  # per rank: {name: state_dict()} of the caller's stateful objects (a data sampler)
EMA_KEY = "__fsdp__.ema"  # {"coef", "updates"} of an EMA of the weights (state/ema.py), when one was given
FROZEN_BASE_KEY = "__fsdp__.frozen_base"  # the frozen parameters: saved or not, their fingerprint, their source
# carried as a value from the save transform (checkpoint/lossy.py) to the writer, which stores it as metadata.json's
# top-level "quant" field (format 4, format/quant.py); never a value on disk
QUANT_KEY = "__fsdp__.quant"
EMA_SUFFIX = ".ema"  # an EMA record is "<param key>.ema", sharded like its parameter (to-hf --ema exports them)

SAFETENSORS_METADATA = "__metadata__"  # the header entry of a safetensors file that holds its str->str metadata
MAX_TENSOR_KEY_CHARS = 1 << 16  # what metadata.json's reader accepts for a piece name (format/schema.py)


def key_problem(key: object, tensor: bool) -> str | None:
    """Why ``key`` cannot be stored as a tensor (``tensor``) or JSON-value key of a checkpoint; None: it can."""
    if not isinstance(key, str):
        return f"keys must be str, got {type(key).__name__}"
    try:
        key.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate: JSON readers other than Python's (safetensors) refuse it
        return f"it is not valid Unicode ({e.reason} at index {e.start}); every file of a checkpoint is UTF-8"
    if not tensor:
        return None
    if key == SAFETENSORS_METADATA:
        return f"{SAFETENSORS_METADATA!r} is reserved by the safetensors format (its header's metadata entry)"
    if len(key) > MAX_TENSOR_KEY_CHARS:
        return f"it is {len(key)} characters long; tensor keys are at most {MAX_TENSOR_KEY_CHARS}"
    return None


def safetensors_name_problem(name: object) -> str | None:
    """Why ``name`` cannot be a tensor name in a safetensors header (tools' outputs); None: it can."""
    return key_problem(name, tensor=True)

"""Reserved keys: the JSON values the one-call API (``state/resume.py``) stores next to the tensors.

Why here: the tools (inspect, to-hf, from-hf) read and write the same keys, so their names are part of the
on-disk format, not of one of its users. A user key starting with ``RESERVED_PREFIX`` is refused by from-hf.
"""

from __future__ import annotations

RESERVED_PREFIX = "__fsdp__."
OPTIMIZER_KEY = "__fsdp__.optimizer"  # {"class": optimizer class name, "global_state": its non-tensor state}
RNG_KEY = "__fsdp__.rng"  # one entry per saving rank: paddle's generator states (a list, JSON)
EXTRA_KEY = "__fsdp__.extra_state"  # the caller's extra_state dict
GRAD_SCALER_KEY = "__fsdp__.grad_scaler"  # a loss scaler's state (state/grad_scaler.py), when one was given
BUFFERS_KEY = "__fsdp__.buffers"  # keys of the model's persistable buffers (to-hf leaves them out unless asked)


def is_reserved(key: str) -> bool:
    return key.startswith(RESERVED_PREFIX)

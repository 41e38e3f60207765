"""A stock piece's storage array as a CPU paddle tensor of its dtype.

Why a module of its own: the loader assigns such tensors into targets and the AOA post-processing (aoa.py) casts
through them (so bfloat16/float16 round exactly as stock's ``paddle.cast``); the loader calls aoa.py, so the
helper both need sits below both.
"""

from __future__ import annotations

import numpy as np


def to_paddle(arr: np.ndarray, dtype: str):
    """A CPU paddle tensor of ``dtype`` holding ``arr`` (its storage-type array)."""
    import paddle

    t = paddle.to_tensor(np.ascontiguousarray(arr), place=paddle.CPUPlace())
    if str(t.dtype).split(".")[-1] != dtype:
        t = t.view(dtype)
    return t

"""Load targets: the tensors of a (possibly nested) state dict, each with the part of its global tensor it holds.

Accepted as stock accepts them: plain ``paddle.Tensor`` (the whole tensor), semi-auto-parallel ``DistTensor``
(its placements on its process mesh give the box; a rank outside the mesh holds nothing), ``ShardedWeight`` (box,
or flattened range of the box). Nested dicts are flattened with ``.`` as stock does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import InvalidStateDictError
from ..format.metadata import numel
from ..host_memory import dtype_name


@dataclass
class Target:
    key: str
    tensor: Any  # the local paddle.Tensor written in place
    shape: tuple[int, ...]  # global shape
    box_offset: tuple[int, ...]
    box_shape: tuple[int, ...]
    flat_range: tuple[int, int] | None
    dtype: str

    def read_box(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The box to read: the whole box, or for a flattened target only the rows its range touches."""
        if self.flat_range is None or not self.box_shape:
            return self.box_offset, self.box_shape
        a, b = self.flat_range
        row = numel(self.box_shape[1:])
        if row == 0 or b <= a:
            return self.box_offset, (0, *self.box_shape[1:])
        r0, r1 = a // row, -(-b // row)
        return (self.box_offset[0] + r0, *self.box_offset[1:]), (r1 - r0, *self.box_shape[1:])

    def flat_slice(self) -> slice | None:
        """Where the target's elements sit in the row-major flattening of ``read_box()``."""
        if self.flat_range is None or not self.box_shape:
            return None
        a, b = self.flat_range
        row = numel(self.box_shape[1:])
        start = (a // row) * row if row else 0
        return slice(a - start, b - start)


def flatten_state_dict(state_dict: dict) -> dict[str, Any]:
    """``{"a": {"b": t}}`` -> ``{"a.b": t}`` (stock's convention); the values are the caller's objects."""
    if not isinstance(state_dict, dict):
        raise InvalidStateDictError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    out: dict[str, Any] = {}

    def walk(prefix: tuple, d: dict) -> None:
        for k, v in d.items():
            if not isinstance(k, str):
                raise InvalidStateDictError(f"state dict keys must be str, got {k!r}")
            if isinstance(v, dict):
                walk((*prefix, k), v)
            else:
                out[".".join((*prefix, k))] = v

    walk((), state_dict)
    return out


def is_dist_tensor(v: Any) -> bool:
    import paddle

    return isinstance(v, paddle.Tensor) and hasattr(v, "is_dist") and v.is_dist()


def dist_tensor_box(v: Any) -> tuple[Any, tuple, tuple] | None:
    """(local tensor, global offset, local shape) of a DistTensor on this rank, None when it holds no part."""
    from paddle.distributed.flex_checkpoint.dcp.utils import compute_local_shape_and_global_offset

    if not v._is_initialized():
        return None
    shape = tuple(int(s) for s in v.shape)
    if not shape:
        return v._local_value(), (), ()
    local_shape, offset = compute_local_shape_and_global_offset(list(shape), v.process_mesh, v.placements)
    if local_shape is None or offset is None:
        return None
    return v._local_value(), tuple(int(x) for x in offset), tuple(int(x) for x in local_shape)


def make_target(key: str, val: Any) -> Target | None:
    import paddle
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

    if isinstance(val, ShardedWeight):
        fr = None
        if val.is_flattened or val.flattened_range is not None:
            r = val.flattened_range
            fr = (int(r.start or 0), int(r.stop)) if isinstance(r, slice) else (int(r[0]), int(r[1]))
        t = val.local_tensor
        return Target(
            key,
            t,
            tuple(int(s) for s in val.global_shape),
            tuple(int(s) for s in val.global_offset),
            tuple(int(s) for s in val.local_shape),
            fr,
            dtype_name(t),
        )
    if is_dist_tensor(val):
        box = dist_tensor_box(val)
        if box is None:
            return None
        local, offset, local_shape = box
        return Target(key, local, tuple(int(s) for s in val.shape), offset, local_shape, None, dtype_name(local))
    if isinstance(val, paddle.Tensor):
        if not val._is_initialized():
            return None
        shape = tuple(int(s) for s in val.shape)
        return Target(key, val, shape, (0,) * len(shape), shape, None, dtype_name(val))
    raise InvalidStateDictError(
        f"key {key!r}: the value should be a dict, paddle.Tensor or ShardedWeight, got {type(val).__name__}"
    )


def mw_compatible_key(key: str) -> str | None:
    """Stock's master-weight name compatibility between dynamic and static semi-auto parallel:
    ``opt.master_weights.w`` <-> ``opt.w_fp32_master_0``."""
    parts = key.split(".")
    if "master_weights" in parts:
        parts.remove("master_weights")
        return ".".join(parts) + "_fp32_master_0"
    if parts[-1].endswith("_fp32_master_0"):
        parts[-1] = parts[-1].replace("_fp32_master_0", "")
        parts.insert(1, "master_weights")
        return ".".join(parts)
    return None

"""The few collectives the stock-compatibility layer needs: object all-gather and "fail together"."""

from __future__ import annotations

from ..errors import InvalidStateDictError, rebuild_remote_error
from . import errors as stock_errors

LOCAL_ERRORS = {
    cls.__name__: cls
    for cls in (
        stock_errors.UnsafePickleError,
        stock_errors.StockVersionNotFoundError,
        stock_errors.StockFormatError,
        stock_errors.DirectoryMismatchError,
    )
}


class Group:
    """Rank, size and object all-gather of ``process_group`` (default: the global group, or one process)."""

    def __init__(self, process_group=None):
        import paddle.distributed as dist

        self.group = process_group
        if process_group is not None:
            self.world, self.rank = int(process_group.nranks), int(process_group.rank)
            if self.rank < 0:
                raise InvalidStateDictError("this process is not a member of the given process_group")
        elif dist.is_initialized() and dist.get_world_size() > 1:
            self.world, self.rank = dist.get_world_size(), dist.get_rank()
        else:
            self.world, self.rank = 1, 0

    def all_gather_object(self, obj) -> list:
        if self.world == 1:
            return [obj]
        import paddle.distributed as dist

        out: list = []
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def fail_together(self, err: BaseException | None) -> None:
        """Collective: raise on every rank if any rank has an error (the own one first, else the lowest rank's)."""
        payload = None if err is None else (type(err).__name__, str(err))
        statuses = self.all_gather_object(payload)
        if err is not None:
            raise err
        for r, st in enumerate(statuses):
            if st is not None:
                cls = LOCAL_ERRORS.get(st[0])
                raise cls(f"rank {r} failed: {st[1]}") if cls else rebuild_remote_error(st[0], st[1], r)

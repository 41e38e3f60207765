"""Peer copies: which rank holds whose memory copy, and moving slot bytes between ranks.

Why another node: a copy in the same node's memory dies with the node. The default partner of a rank is the same
local rank on the next node (ranks of a node are contiguous in paddle's launcher), so losing one node loses no
state as long as its partner node lives. Losing a node and its partner node at once is not covered.

Transport: ``send``/``recv`` pairs on the tier's own two process groups (gloo has no all_to_all), executed by
every rank in one global order of the transfers; each rank takes part only in its own, so pairs on different
nodes run at the same time and the order cannot deadlock; the two directions of a swap run at once. Slot memory is handed to the group zero-copy (DLPack views
of the mapped files), in pieces of at most ``PIECE_BYTES``.
"""

from __future__ import annotations

import os
import threading

import numpy as np

from ..checkpoint.errors import CheckpointError

PIECE_BYTES = 256 << 20


def local_size(world: int) -> int:
    """Ranks per node: the launcher's ``PADDLE_LOCAL_SIZE`` (else one node holds every rank)."""
    try:
        size = int(os.environ.get("PADDLE_LOCAL_SIZE", "0"))
    except ValueError:
        size = 0
    return size if 0 < size <= world and world % size == 0 else world


def default_partners(world: int, per_node: int) -> dict[int, int]:
    """The same local rank on the next node; {} on a single node (no peer copy possible)."""
    if per_node >= world:
        return {}
    return {r: (r + per_node) % world for r in range(world)}


def check_partners(partners: dict[int, int], world: int) -> dict[int, int]:
    """Validate a partner map ``{rank: rank holding its copy}``: every holder holds at most one copy."""
    if not isinstance(partners, dict):
        raise CheckpointError(f"partners must be a dict {{rank: holder}}, got {type(partners).__name__}")
    out = {}
    for src, dst in partners.items():
        if type(src) is not int or type(dst) is not int or not (0 <= src < world and 0 <= dst < world):
            raise CheckpointError(f"partners: {src!r} -> {dst!r} is not a pair of ranks in [0, {world})")
        if src == dst:
            raise CheckpointError(f"partners: rank {src} cannot hold its own peer copy")
        out[src] = dst
    holders = list(out.values())
    if len(set(holders)) != len(holders):
        raise CheckpointError(f"partners: a rank would hold more than one peer copy ({out})")
    return out


def source_of(partners: dict[int, int], rank: int) -> int | None:
    """The rank whose copy ``rank`` holds (None: it holds none)."""
    for src, dst in partners.items():
        if dst == rank:
            return src
    return None


def _tensor(arr: np.ndarray):
    import paddle

    return paddle.utils.dlpack.from_dlpack(arr)


def _run(group, rank: int, transfers: list[tuple[int, int]], send_buf, recv_buf) -> None:
    import paddle.distributed as dist

    for src, dst in transfers:
        if rank == src:
            for i in range(0, len(send_buf), PIECE_BYTES):
                dist.send(_tensor(send_buf[i : i + PIECE_BYTES]), dst=dst, group=group)
        elif rank == dst:
            for i in range(0, len(recv_buf), PIECE_BYTES):
                dist.recv(_tensor(recv_buf[i : i + PIECE_BYTES]), src=src, group=group)


def transfer(groups: tuple, rank: int, transfers: list[tuple[int, int]], send_buf, recv_buf) -> None:
    """Run ``transfers`` ``[(src, dst)]`` (the same list, in the same order, on every rank): ``rank`` sends
    ``send_buf`` for its (rank, dst) entries and receives into ``recv_buf`` for its (src, rank) ones.

    Transfers to a higher rank run on ``groups[0]`` (a helper thread), to a lower rank on ``groups[1]`` (this
    thread), each group's in the global order: a pair of ranks swapping copies sends both ways at once (gloo's
    isend/irecv are not usable in paddle 3.3.1), and neither group's order can deadlock."""
    up = [(s, d) for s, d in transfers if s < d]
    down = [(s, d) for s, d in transfers if s > d]
    errors: list[BaseException] = []

    def run_up() -> None:
        try:
            _run(groups[0], rank, up, send_buf, recv_buf)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    helper = threading.Thread(target=run_up, name="memtier-peer-up", daemon=True)
    helper.start()
    try:
        _run(groups[1], rank, down, send_buf, recv_buf)
    finally:
        helper.join()
    if errors:
        raise errors[0]

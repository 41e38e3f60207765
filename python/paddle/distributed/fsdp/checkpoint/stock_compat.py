"""Write-only compatibility index for stock paddle's ``dist.load_state_dict`` (``0.metadata``).

Stock paddle 3.3.1 finds a checkpoint by a ``*.metadata`` file (a pickle of its ``Metadata`` dataclass, read with
``paddle.load``) and data files named ``<rank>_<unique_id>.safetensors`` whose tensor names are the state-dict
keys. Our data files already have that name and layout (one piece per key per file), so emitting that pickle
index makes a checkpoint of this engine loadable by stock paddle with ``safetensors=True``.

This engine WRITES that pickle for stock readers and NEVER reads it: our loader only parses metadata.json.
Plain JSON values (step counters etc.) have no place in the stock index and are invisible to stock paddle.
"""

from __future__ import annotations

import os

from .format.metadata import STOCK_METADATA_FILE, CheckpointMetadata
from .writer import write_file

__all__ = ["STOCK_METADATA_FILE", "stock_metadata", "stock_metadata_bytes", "write_stock_metadata"]


def stock_metadata(md: CheckpointMetadata):
    from paddle.distributed.flex_checkpoint.dcp.metadata import (
        LocalTensorIndex,
        LocalTensorMetadata,
        Metadata,
    )

    state_dict_metadata: dict = {}
    storage_metadata: dict = {}
    flat_mapping: dict = {}
    for key, tm in md.tensors.items():
        flat_mapping[key] = (key,)
        metas = []
        for p in tm.pieces:
            is_flat = p.flat_range is not None
            fr = tuple(p.flat_range) if is_flat else None
            metas.append(
                LocalTensorMetadata(
                    global_offset=tuple(p.box_offset),
                    local_shape=tuple(p.box_shape),
                    dtype=tm.dtype,
                    global_shape=tuple(tm.shape),
                    is_flattened=is_flat,
                    flattened_range=fr,
                )
            )
            storage_metadata[
                LocalTensorIndex(
                    tensor_key=key,
                    global_offset=tuple(p.box_offset),
                    is_flattened=is_flat,
                    flattened_range=fr,
                    local_shape=tuple(p.box_shape),
                )
            ] = p.file
        state_dict_metadata[key] = metas
    return Metadata(
        state_dict_metadata=state_dict_metadata,
        storage_metadata=storage_metadata,
        flat_mapping=flat_mapping,
    )


def stock_metadata_bytes(md: CheckpointMetadata) -> bytes:
    """The bytes of ``0.metadata`` (paddle.save's pickle of stock's index), for the storage interface."""
    import io

    import paddle

    buf = io.BytesIO()
    paddle.save(stock_metadata(md), buf)
    return buf.getvalue()


def write_stock_metadata(directory: str, md: CheckpointMetadata) -> None:
    """Write ``0.metadata`` (pickle, for stock paddle only) into ``directory`` and fsync it, through the engine's
    writer like every other index object (paddle.save's own file write went around it: #54)."""
    write_file(os.path.join(directory, STOCK_METADATA_FILE), stock_metadata_bytes(md), fsync=True, atomic=False)

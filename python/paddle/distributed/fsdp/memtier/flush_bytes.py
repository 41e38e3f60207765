"""What a flush leaves out or compresses: the bytes a persist of the same copies would have written.

Why here: a persist is a collective save of the copies (persist.py), so the engine decides derived weights and the
chunk codec; a flush writes every rank's file from ONE process (flush.py) and must take the same decisions itself,
from what the copies hold, or a checkpoint written after a crash would be larger than the one written before it.

* The choices: the copy header's ``persist`` field (the tier's options when it wrote the copy, manager.py); a copy
  of an older tier has none, and the flush process's own options (``PADDLE_FSDP_CKPT_*``) apply.
* Derived weights (format 4's ``"derived"``, format/derived.py): the engine's rule (save/derive.py), on the copies'
  verified bytes. Weight ``<k>`` is left out when every copy holding it also holds ``<k>.master_weight`` as a record
  of the same region, the master float32, the weight bfloat16/float16, and every element equals its master cast
  (round to nearest even). One copy where it does not keeps it stored in every file.
* Lossy moments (``quantize_moments`` on the tier): the engine's quantizer (checkpoint/lossy.py) over every rank's
  moments in this one process (``lossy.quantize_ranks``: its exchange is the list of the copies' descriptions), on
  verified private copies of the moment records, one rank's moments in memory at a time; the codes and scales of
  every rank (1/4 of the moments' bytes for int8, 1/8 for int4) are held until their files are written.
"""

from __future__ import annotations

import logging

import numpy as np

from ..checkpoint import lossy
from ..checkpoint.encoded_write import CHOICES
from ..checkpoint.format import derived
from ..checkpoint.format.quant import CODES_SUFFIX, SCALES_SUFFIX
from ..checkpoint.format.reserved import QUANT_KEY
from ..checkpoint.options import CheckpointOptions
from ..checkpoint.records import to_record
from .errors import InvalidMemoryCopyError
from .slot import check_record_bytes

logger = logging.getLogger(__name__)


def persist_choices(header: dict, where: str) -> dict:
    """``{"derive_weights", "codec", "quantize_moments"}`` a persist of this copy writes with: the header's
    ``persist`` field, or the options of this process for a copy that has none. InvalidMemoryCopyError when the
    field is malformed."""
    got = header.get("persist")
    if got is None:
        opts = CheckpointOptions.from_env()
        mode = None if opts.quantize_moments == "none" else opts.quantize_moments
        return {"derive_weights": opts.derive_weights, "codec": opts.codec, "quantize_moments": mode}
    if (
        type(got) is not dict
        or type(got.get("derive_weights")) is not bool
        or got.get("codec") not in CHOICES
        or got.get("quantize_moments") not in (None, "int8", "int4")
    ):
        raise InvalidMemoryCopyError(f"{where}: header field 'persist' is {str(got)[:120]!r}")
    return got


def _private(data: np.ndarray, header: dict, rec: list, where: str) -> np.ndarray:
    """Record ``rec``'s bytes copied out of the mapping and verified there (the decision is on verified bytes)."""
    _key, _dtype, _shape, off, nbytes, _sums = rec
    out = np.array(data[off : off + nbytes], copy=True)
    check_record_bytes(header, rec, out, where)
    return out


def _equal_here(data: np.ndarray, header: dict, pairs: dict, where: str) -> tuple[set[str], set[str]]:
    """``(equal, other)`` weight keys of one copy: derivable here, and held here but not derivable."""
    equal, other = set(), set()
    for key, (rec, desc) in pairs.items():
        if key.endswith(derived.MASTER_SUFFIX) or desc.dtype not in derived.CAST_DTYPES:
            continue
        master = pairs.get(key + derived.MASTER_SUFFIX)
        if master is None:
            other.add(key)  # held without its master: never derived, like the engine's refusal
            continue
        mrec, mdesc = master
        if mdesc.dtype != derived.SOURCE_DTYPE or mdesc.region != desc.region or mdesc.replicated != desc.replicated:
            other.add(key)
            continue
        wbytes, mbytes = _private(data, header, rec, where), _private(data, header, mrec, where)
        if derived.equals_cast(wbytes.view(np.uint16), mbytes.view(np.float32), desc.dtype):
            equal.add(key)
        else:
            other.add(key)
    return equal, other


def derived_keys(copies: list, records_of) -> dict[str, str]:
    """``{weight key: dtype}`` a flush of ``copies`` (``[(slot, header, data_off, data_len)]``, one a rank) leaves
    out: derivable in every copy that holds it (see the module docstring). ``records_of``: persist.records_of."""
    equal: dict[str, str] = {}
    other: set[str] = set()
    for slot, header, doff, dlen in copies:
        where = f"memory copy {slot.path}"
        pairs = {rec[0]: (rec, desc) for rec, desc in records_of(header, where)}
        here, not_here = _equal_here(slot.data(doff, dlen), header, pairs, where)
        equal.update((k, pairs[k][1].dtype) for k in here)
        other |= not_here
    kept = sorted(set(equal) & other)
    if kept:
        logger.info("flush: %d weights not derivable in every copy, stored: %s", len(kept), kept[:5])
    return {k: d for k, d in equal.items() if k not in other}


def derived_field(keys: dict[str, str]) -> dict:
    """Format 4's ``"derived"`` field of ``keys`` (``{}``: none)."""
    return derived.to_field({k: derived.Derived(k, k + derived.MASTER_SUFFIX, d) for k, d in keys.items()})


def quantized_moments(copies: list, records_of, mode: str) -> tuple[list[dict], list[set[str]], dict | None]:
    """``(added, removed, field)`` of quantizing the copies' moments (see the module docstring): per rank the
    records that replace its moments (``{key: (RecordDesc, uint8 bytes)}``: codes and scales) and the moment keys
    they replace; ``field`` the ``"quant"`` value every rank's values carry (None: nothing quantized)."""
    from .persist import sharded_view, tensor_view

    def load_state(r: int) -> dict:
        slot, header, doff, dlen = copies[r]
        where, data, state = f"memory copy {slot.path}", slot.data(doff, dlen), {}
        for rec, desc in records_of(header, where):
            if lossy.moment_name(rec[0]) is not None and desc.dtype in lossy.FLOAT_DTYPES:
                private = _private(data, header, rec, where)
                state[rec[0]] = sharded_view(desc, tensor_view(private, rec[1], rec[2]))
        return state

    added, removed, field = [], [], None
    for out, keys in lossy.quantize_ranks(load_state, len(copies), mode):
        field = out.pop(QUANT_KEY, field)
        mine = {}
        for key in (k + suffix for k in keys for suffix in (CODES_SUFFIX, SCALES_SUFFIX)):
            rec = to_record(key, out[key]) if key in out else None  # (a rank may hold no scale of a key)
            if rec is not None:
                mine[key] = (rec.desc(), np.ascontiguousarray(rec.tensor.numpy()).reshape(-1).view(np.uint8))
        added.append(mine)
        removed.append(set(keys))
    return added, removed, field

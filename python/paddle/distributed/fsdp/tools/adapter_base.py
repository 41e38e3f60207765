"""The frozen base of a LoRA checkpoint, for the tools: found, then checked by its fingerprint before any write.

A LoRA checkpoint normally holds the adapter and a reference to its base (``__fsdp__.frozen_base``,
state/frozen_base.py: the source, how many parameters and bytes, a content fingerprint). To merge the adapter
into the base (``to-hf --merge-adapter``) the base's tensors come from, in this order:

1. the checkpoint itself, when it was saved with ``save_frozen=True`` (nothing to check: it is the base);
2. ``--base DIR``, the caller's;
3. the ``source`` the reference records, when it is a local directory.

DIR is a checkpoint of this engine (the base model's own keys, or the adapter model's: the wrapper's prefix is
added when missing) or a Hugging Face safetensors directory (read through ``from-hf``, with the export's preset
when one is given). Its frozen parameters must be the ones the checkpoint was trained on: the same number, bytes
and fingerprint (the same algorithm, computed here from the whole tensors), else FrozenBaseMismatchError naming
what differs. No base found: FrozenBaseMissingError naming where it looked.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

from ..checkpoint.errors import FrozenBaseMismatchError
from ..checkpoint.format.reserved import FROZEN_BASE_KEY
from ..state.frozen_base import ALGORITHM, combine, digest_entry, holds_base
from .ckpt_io import MODEL, CheckpointReader, buffer_keys, classify_keys
from .errors import ToolError

logger = logging.getLogger(__name__)

_LORA_SUFFIXES = (".lora_A", ".lora_B")


class FrozenBaseMissingError(ToolError):
    """A LoRA checkpoint saved without its frozen base, and no base to merge with: neither ``--base`` nor a local
    directory at the source its reference records."""


@dataclass
class FrozenBase:
    """Where the frozen base's tensors are read: ``path`` (a checkpoint of this engine) and, for each key of the
    adapter model, the key in ``path`` (empty when the LoRA checkpoint holds the base itself)."""

    path: str
    keys: dict[str, str]
    origin: str  # for messages: "the checkpoint", "--base DIR", "the recorded source DIR"


def model_keys(md) -> list[str]:
    """The model weights of a checkpoint (no optimizer state, no listed buffer), in checkpoint order."""
    buffers = buffer_keys(md)
    roles = classify_keys(md)
    return [key for key in md.tensors if roles[key].role == MODEL and key not in buffers]


def locate(
    ckpt_md, base: str | None, scratch: str, from_hf: Callable[..., dict] | None = None, preset: str | None = None
) -> FrozenBase:
    """The frozen base of the LoRA checkpoint whose metadata is ``ckpt_md``, checked (see the module docstring).
    ``scratch``: a directory for a Hugging Face base converted by ``from_hf`` (the caller removes it)."""
    ref = ckpt_md.values.get(FROZEN_BASE_KEY)
    if holds_base(ref):
        if base is not None:
            logger.warning("--base %s ignored: the checkpoint holds its frozen base (saved with save_frozen)", base)
        return FrozenBase("", {}, "the checkpoint")
    source = ref.get("source")
    if base is not None:
        origin, directory = f"--base {base}", base
    elif isinstance(source, str) and os.path.isdir(source):
        origin, directory = f"the recorded source {source}", source
    else:
        raise FrozenBaseMissingError(
            f"the checkpoint holds the adapter only: its {ref.get('parameters')} frozen base parameters were not "
            f"saved, and its recorded base source {source!r} is not a local directory; pass --base DIR (a checkpoint "
            "of the base, or its Hugging Face directory), or save with save_frozen=True"
        )
    if not os.path.isdir(directory):
        raise FrozenBaseMissingError(f"{origin}: no such directory")
    path = _as_checkpoint(directory, scratch, from_hf, preset)
    found = FrozenBase(path, _frozen_keys(ckpt_md, path, ref), origin)
    check(found, ref)
    return found


def _as_checkpoint(directory: str, scratch: str, from_hf, preset: str | None) -> str:
    """``directory`` itself when it is a checkpoint of this engine; a Hugging Face directory converted into one."""
    from .stock_cmd import is_foreign

    if not is_foreign(directory):
        return directory
    if from_hf is None:
        raise ToolError(f"{directory} is a Hugging Face directory; this caller reads engine checkpoints only")
    out = os.path.join(scratch, "base-from-hf")
    from_hf(directory, out, preset=preset, progress=False)
    return out


def _frozen_keys(ckpt_md, path: str, ref: dict) -> dict[str, str]:
    """Adapter-model key -> base-checkpoint key of every frozen parameter the base provides: its weights that are
    not trainable in the LoRA checkpoint (the wrapper's prefix added when the base has the base model's keys)."""
    prefix = (ref.get("adapter") or {}).get("prefix", "")
    with CheckpointReader(path, verify=False) as reader:
        keys = model_keys(reader.md)
    trainable = set(ckpt_md.tensors)
    adapted = [key[: -len(".lora_A")] + ".weight" for key in trainable if key.endswith(".lora_A")]
    as_is, prefixed = set(keys), {prefix + key for key in keys}
    # the base model's own keys or the adapter model's: whichever holds the weights the adapters sit on
    add = bool(prefix) and sum(k in prefixed for k in adapted) > sum(k in as_is for k in adapted)
    mapped = {(prefix + key if add else key): key for key in keys}
    return {k: v for k, v in mapped.items() if k not in trainable and not k.endswith(_LORA_SUFFIXES)}


def check(base: FrozenBase, ref: dict) -> None:
    """FrozenBaseMismatchError unless ``base``'s frozen parameters are those ``ref`` describes."""
    hint = "pass --base with the base the adapter was trained on"
    if len(base.keys) != ref.get("parameters"):
        raise FrozenBaseMismatchError(
            f"{base.origin} provides {len(base.keys)} frozen parameters, the checkpoint was trained on a base of "
            f"{ref.get('parameters')} (keys such as {sorted(base.keys)[:3]}): another model? {hint}"
        )
    if ref.get("fingerprint") is None:
        logger.warning("the checkpoint's frozen base reference has no fingerprint: %s not checked", base.origin)
        return
    if ref.get("algorithm") != ALGORITHM:
        raise FrozenBaseMismatchError(f"frozen base fingerprint algorithm {ref.get('algorithm')!r} is not {ALGORITHM}")
    digests, total = {}, 0
    with CheckpointReader(base.path) as reader:  # checksums verified: a damaged base is not a mismatch
        for key, theirs in base.keys.items():
            tm = reader.md.tensors[theirs]
            raw = reader.read_raw(theirs)
            digests[key] = digest_entry(tm.dtype, tm.shape, raw)
            total += raw.size
    if ref.get("bytes") is not None and total != ref["bytes"]:
        raise FrozenBaseMismatchError(
            f"{base.origin} holds {total} bytes of frozen parameters, the checkpoint's base {ref['bytes']} (another "
            f"dtype or size): {hint}"
        )
    mine = combine(digests)
    if mine != ref["fingerprint"]:
        raise FrozenBaseMismatchError(
            f"{base.origin} has frozen base fingerprint {mine}, the checkpoint was trained on fingerprint "
            f"{ref['fingerprint']} (same {len(base.keys)} parameters and bytes, other values): {hint}"
        )
    logger.info("frozen base from %s: %d parameters, fingerprint %s matches", base.origin, len(base.keys), mine)

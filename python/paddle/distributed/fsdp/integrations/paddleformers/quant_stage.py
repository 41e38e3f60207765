"""PaddleFormers' checkpoint quantization (``TrainingArguments.ckpt_quant_stage``) as this package's lossy moments.

Why a mapping and not PaddleFormers' own code: its stages quantize the unified checkpoint's optimizer files, which
FSDPTrainer does not write; the same intent (O1: 8-bit moments, O2: 4-bit moments) is the engine's
``quantize_moments`` (checkpoint/lossy.py), stored in every checkpoint's metadata so any reader dequantizes them.
"""

from __future__ import annotations

from .compat import UnsupportedTrainingArgumentError

#: ckpt_quant_stage -> save_checkpoint(quantize_moments=...); None: the engine's choice (exact unless
#: PADDLE_FSDP_CKPT_QUANTIZE_MOMENTS says otherwise)
STAGES: dict[str, str | None] = {"O0": None, "O1": "int8", "O2": "int4"}


def quantize_moments_for(args) -> str | None:
    """The ``quantize_moments`` of ``args.ckpt_quant_stage`` (absent: O0); an unknown stage is an
    UnsupportedTrainingArgumentError naming the argument and the stages there are."""
    stage = getattr(args, "ckpt_quant_stage", "O0")
    if not isinstance(stage, str) or stage not in STAGES:
        raise UnsupportedTrainingArgumentError(
            f"FSDPTrainer: ckpt_quant_stage={stage!r:.40} is not a checkpoint quantization stage; expected "
            '"O0" (moments stored exactly), "O1" (int8 moments) or "O2" (int4 moments)'
        )
    return STAGES[stage]

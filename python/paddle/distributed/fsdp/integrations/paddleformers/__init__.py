"""FSDP in the PaddleFormers Trainer: ``FSDPTrainer`` (docs/trainer.md).

PaddleFormers is imported when ``FSDPTrainer`` is first used, not when this package is, so the fork installs and
imports without it; a missing or other version raises :class:`PaddleFormersVersionError` naming the extra to install
(``pip install "paddle-fsdp-fork[paddleformers]"``).
"""

from __future__ import annotations

from .compat import SUPPORTED_VERSION, PaddleFormersVersionError, UnsupportedTrainingArgumentError

__all__ = ["FSDPTrainer", "PaddleFormersVersionError", "UnsupportedTrainingArgumentError", "SUPPORTED_VERSION"]


def __getattr__(name: str):
    if name == "FSDPTrainer":
        from .trainer import fsdp_trainer_class

        return fsdp_trainer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

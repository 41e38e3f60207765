"""Which PaddleFormers this integration works with, and the named errors for what it refuses.

Why a version pin: FSDPTrainer overrides private methods of ``paddleformers.trainer.Trainer`` (there is no FSDP
hook), whose names and call order are those of 1.2.0; another version may call them differently, so it is refused
up front rather than trained wrong.
"""

from __future__ import annotations

SUPPORTED_VERSION = "1.2.0"
INSTALL_HINT = 'pip install "paddle-fsdp-fork[paddleformers]"  (paddleformers==1.2.0, pyarrow<26)'


class PaddleFormersVersionError(ImportError):
    """PaddleFormers is missing, fails to import, or is not the version FSDPTrainer was built against."""


class UnsupportedTrainingArgumentError(ValueError):
    """A TrainingArguments setting (or Trainer argument) FSDPTrainer cannot honour; the message says what to use."""


def require_paddleformers():
    """The ``paddleformers.trainer`` module of a supported PaddleFormers, else PaddleFormersVersionError."""
    try:
        import paddleformers
    except ImportError as e:
        raise PaddleFormersVersionError(
            f"FSDPTrainer needs PaddleFormers {SUPPORTED_VERSION}: {e}. {INSTALL_HINT}"
        ) from e
    version = getattr(paddleformers, "__version__", "unknown")
    if version != SUPPORTED_VERSION:
        raise PaddleFormersVersionError(
            f"FSDPTrainer supports PaddleFormers {SUPPORTED_VERSION}, found {version}. {INSTALL_HINT}"
        )
    try:
        from paddleformers import trainer
    except ImportError as e:  # e.g. pyarrow 26 with numpy 1.26 (fast_dataindex caps numpy)
        raise PaddleFormersVersionError(
            f"paddleformers {version} is installed but its Trainer does not import: {e}. {INSTALL_HINT}"
        ) from e
    return trainer

"""Checkpoint paths at the engine's entry points: a local path, or a refusal of a URL the engine does not serve.

Why: ``os.path.abspath("s3://bucket/run")`` is a valid relative path, so before this check a save to an S3 URL
"succeeded" into a directory named ``s3:`` under the working directory and a load read from there. Every entry
point that takes a path turns it into an absolute local path here; any ``scheme://`` URL is refused with
UnsupportedURLError (the S3 backend, checkpoint/s3/, serves ``s3://`` through the storage interface once the engine
speaks to storage only through it).
"""

from __future__ import annotations

import os
import re

from . import errors
from .errors import CheckpointError

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


class UnsupportedURLError(CheckpointError, ValueError):
    """A checkpoint path is a URL (``scheme://...``) whose scheme this entry point does not serve."""


errors.ERROR_CLASSES[UnsupportedURLError.__name__] = UnsupportedURLError


def url_scheme(path: object) -> str | None:
    """The scheme of a ``scheme://...`` string, None for anything else."""
    if isinstance(path, str):
        m = _URL.match(path)
        return m.group(0)[:-3].lower() if m else None
    return None


def local_path(path: str | os.PathLike) -> str:
    """``path`` as an absolute local path; UnsupportedURLError for a URL, TypeError for a non-path."""
    scheme = url_scheme(path)
    if scheme is not None:
        raise UnsupportedURLError(
            f"checkpoint path {path!r} is a {scheme}:// URL, which this entry point does not serve: it takes a local "
            "(or mounted) directory. Nothing was written or read."
        )
    return os.path.abspath(os.fspath(path))

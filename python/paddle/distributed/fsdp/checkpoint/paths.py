"""Checkpoint locations at the engine's entry points: a local path made absolute, a URL of a served scheme kept,
any other URL refused with a named error.

Why: ``os.path.abspath("s3://bucket/run")`` is a valid relative path, so before this check a save to an S3 URL
"succeeded" into a directory named ``s3:`` under the working directory and a load read from there. Every entry
point that takes a path turns it into a location here; a ``scheme://`` URL passes only when a storage backend
serves that scheme (``io.register_backend``; ``s3://`` is known and loads its backend on first use), else
UnsupportedURLError.
"""

from __future__ import annotations

import os
import re

from . import errors
from .errors import CheckpointError
from .io.backends import served_schemes

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


def local_path(path: str | os.PathLike, chosen: object = None) -> str:
    """``path`` as a location: an absolute local path, or the URL itself when a storage backend serves its scheme
    (any scheme when the caller ``chosen`` a backend: CheckpointOptions.storage); UnsupportedURLError for any other
    URL, TypeError for a non-path."""
    scheme = url_scheme(path)
    if scheme is not None:
        if chosen is not None or scheme in served_schemes():
            # the scheme in lower case, no trailing "/": one name per location
            rest = path.partition("://")[2].rstrip("/")
            return f"{scheme}://{rest}"
        raise UnsupportedURLError(
            f"checkpoint path {path!r} is a {scheme}:// URL, which no storage backend serves (served: "
            f"{', '.join(sorted(served_schemes())) or 'none'}; register one with io.register_backend). "
            "Nothing was written or read."
        )
    return os.path.abspath(os.fspath(path))

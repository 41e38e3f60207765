"""Which backend serves a location: the registry of URL schemes, above the Storage interface and its backends.

``backend_for(location)`` answers with the backend registered for the location's ``scheme://`` (``s3://``: the
S3 backend, checkpoint/s3/, imported with boto3 only when an s3:// location is first used), else the local POSIX
backend (io/local.py). Why a module of its own: the interface (io/storage.py) is what every backend implements,
so it cannot know the backends; the registry knows both.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import S3_EXTRA_HINT, MissingDependencyError
from .local import LOCAL
from .storage import Storage, StorageError

_schemes: dict[str, Callable[[], Storage]] = {}


def _s3_backend() -> Storage:
    """``s3://``: the S3 backend, imported (with boto3) only when an s3:// location is first used; without the
    ``s3`` extra a MissingDependencyError saying what to install."""
    try:
        from ..s3.storage import default_storage
    except ImportError as e:
        raise MissingDependencyError(S3_EXTRA_HINT.format(missing=e.name or e)) from e
    return default_storage()


# schemes served by backends of this package, registered without importing them (their client libraries load on
# first use); register_backend replaces them
_schemes["s3"] = _s3_backend


def served_schemes() -> set[str]:
    """The URL schemes ``backend_for`` serves."""
    return set(_schemes)


def register_backend(scheme: str, factory: Callable[[], Storage]) -> None:
    """Make locations ``<scheme>://...`` use ``factory()``'s backend (a backend module calls this once)."""
    if not scheme.isidentifier():
        raise StorageError(f"backend scheme {scheme!r} must be an identifier")
    _schemes[scheme] = factory


def backend_for(location: str, chosen: Storage | None = None) -> Storage:
    """The backend of ``location``: ``chosen`` (CheckpointOptions.storage) when given, else the one registered for
    its URL scheme, else the local POSIX backend."""
    if chosen is not None:
        if not isinstance(chosen, Storage):
            raise StorageError(f"storage must be a Storage, got {type(chosen).__name__}")
        return chosen
    if not isinstance(location, str):
        raise StorageError(f"a checkpoint location must be a str, got {type(location).__name__}")
    scheme, sep, _rest = location.partition("://")
    if sep:
        factory = _schemes.get(scheme)
        if factory is None:
            raise StorageError(f"no storage backend registered for '{scheme}://' (location {location!r})")
        return factory()
    return LOCAL

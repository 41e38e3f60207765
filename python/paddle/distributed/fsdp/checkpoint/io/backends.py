"""Which backend serves a location: the registry of URL schemes, above the Storage interface and its backends.

``backend_for(location)`` answers with the backend registered for the location's ``scheme://`` (``s3://``: the
S3 backend, checkpoint/s3/, imported with boto3 only when an s3:// location is first used), else the local POSIX
backend (io/local.py). Why a module of its own: the interface (io/storage.py) is what every backend implements,
so it cannot know the backends; the registry knows both.

Layers: ``add_storage_layer(layer)`` wraps every storage the engine resolves (the chosen one of
``CheckpointOptions.storage`` too) as ``layer(storage)``, so code that cannot hand a storage to each save (a
trainer's saves, worker processes, ``CheckpointManager``) can still observe or shape every storage call: metrics,
throttling, logging, injected failures. A layer returns a ``Storage`` that forwards to the one it wraps; it is
applied each time a storage is resolved, so it keeps no per-save state of its own.

What is checked (user code, issue #50): a layer or factory that is not callable is an ``ExtensionError`` at
registration; one that returns something else than a ``Storage`` (or raises) is an ``ExtensionError`` naming
it (``module.qualname``) when a storage is next resolved, before any storage call. Adding the same layer again
is a no-op (it wraps once; one ``remove_storage_layer`` removes it).
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import S3_EXTRA_HINT, CheckpointError, ExtensionError, MissingDependencyError, extension_name
from .local import LOCAL
from .storage import Storage, StorageError

_schemes: dict[str, Callable[[], Storage]] = {}
StorageLayer = Callable[[Storage], Storage]
_layers: list[StorageLayer] = []


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
    if not isinstance(scheme, str) or not scheme.isidentifier():
        raise StorageError(f"backend scheme {scheme!r} must be an identifier")
    if not callable(factory):
        raise ExtensionError(f"the backend factory for '{scheme}://' must be callable, got {factory!r:.100}")
    _schemes[scheme] = factory


def add_storage_layer(layer: StorageLayer) -> None:
    """Wrap every storage resolved from now on (``backend_for``, ``CheckpointOptions.storage_for``) as
    ``layer(storage)``; layers added later wrap the earlier ones. Adding a layer already added does nothing."""
    if not callable(layer):
        raise ExtensionError(f"a storage layer must be callable (storage -> Storage), got {layer!r:.100}")
    if layer not in _layers:
        _layers.append(layer)


def remove_storage_layer(layer: StorageLayer) -> None:
    """Undo ``add_storage_layer(layer)`` (not added: no error)."""
    if layer in _layers:
        _layers.remove(layer)


def layered(storage: Storage) -> Storage:
    """``storage`` wrapped by every added layer (itself when there is none)."""
    for layer in list(_layers):
        storage = _checked("storage layer", layer, storage)
    return storage


def _checked(what: str, extension: Callable, *args: object) -> Storage:
    """``extension(*args)``: a Storage, else an ExtensionError naming the extension."""
    try:
        made = extension(*args)
    except CheckpointError:
        raise
    except Exception as e:
        raise ExtensionError(f"{what} {extension_name(extension)} raised {type(e).__name__}: {e}") from e
    if not isinstance(made, Storage):
        raise ExtensionError(
            f"{what} {extension_name(extension)} returned {type(made).__name__}, not a Storage (io/storage.py)"
        )
    return made


def backend_for(location: str, chosen: Storage | None = None) -> Storage:
    """The backend of ``location``: ``chosen`` (CheckpointOptions.storage) when given, else the one registered for
    its URL scheme, else the local POSIX backend; wrapped by the added layers."""
    return layered(unlayered_backend_for(location, chosen))


def unlayered_backend_for(location: str, chosen: Storage | None = None) -> Storage:
    """``backend_for`` without the layers (CheckpointOptions.storage_for picks among the bare backends first)."""
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
        return _checked(f"the backend factory for '{scheme}://'", factory)
    return LOCAL

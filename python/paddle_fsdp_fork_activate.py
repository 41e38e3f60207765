"""Overlay the FSDP fork onto stock ``paddle.distributed.fsdp`` without touching paddle's files.

The fork's sources are installed as the private top-level package ``paddle_fsdp_fork``. A ``.pth``
file in site-packages imports this module at interpreter start-up and calls :func:`install`, which
puts :class:`ForkFinder` first on ``sys.meta_path``. The finder:

* serves ``paddle.distributed.fsdp`` from the fork's ``__init__.py``, with
  ``__path__ == [fork dir, stock paddle/distributed/fsdp dir]``: fork modules win, and stock
  submodules such as ``fully_shard`` still resolve;
* wraps the loader of ``paddle.distributed`` so that, right after the stock package has executed,
  ``paddle.distributed.save_state_dict`` / ``load_state_dict`` forward to the fork's
  ``paddle.distributed.fsdp.checkpoint`` (imported lazily, at call time, to avoid import cycles:
  stock ``paddle/__init__.py`` imports ``paddle.distributed`` eagerly);
* refuses a direct ``import paddle_fsdp_fork`` so no fork module is ever loaded under two names.

Nothing here imports paddle at start-up: the hook costs microseconds per interpreter and is a no-op
when paddle is not installed. ``pip uninstall paddle-fsdp-fork`` removes the ``.pth``, this module and
the private package, which leaves stock paddle exactly as it was.

Set ``PADDLE_FSDP_FORK_DISABLE=1`` to run stock paddle (no overlay) in a given process.
"""

from __future__ import annotations

# Only cheap modules at import time: this runs in every interpreter start-up (via the .pth).
import os
import sys
import types

TYPE_CHECKING = False  # `typing` costs milliseconds at start-up; type checkers treat this name as usual
if TYPE_CHECKING:
    import importlib.machinery
    import logging
    from collections.abc import Callable, Sequence
    from typing import Any

__all__ = [
    "FORK_PACKAGE",
    "TARGET_PACKAGE",
    "REQUIRED_PADDLE_SERIES",
    "ForkFinder",
    "install",
    "uninstall",
    "is_active",
    "check_paddle_version",
    "ensure_fork_import",
    "fork_dir",
]


def _logger() -> logging.Logger:
    """The module logger, imported lazily (``logging`` alone would double the start-up cost)."""
    import logging

    return logging.getLogger(__name__)


#: Private top-level name under which pip installs the fork's sources.
FORK_PACKAGE = "paddle_fsdp_fork"
#: Public name the fork is imported as.
TARGET_PACKAGE = "paddle.distributed.fsdp"
#: Stock package whose checkpoint entry points are redirected to the fork.
DISTRIBUTED_PACKAGE = "paddle.distributed"
#: The fork is written against this paddle release series (major, minor).
REQUIRED_PADDLE_SERIES = (3, 3)
#: Version string of paddle's source/dev builds, accepted by the version check.
DEV_PADDLE_VERSION = "0.0.0"

DISABLE_ENV = "PADDLE_FSDP_FORK_DISABLE"
SKIP_VERSION_CHECK_ENV = "PADDLE_FSDP_FORK_SKIP_VERSION_CHECK"

#: Attribute set on the checkpoint wrappers so tests and tools can recognise them.
WRAPPER_MARKER = "_paddle_fsdp_fork_wrapper"
_CHECKPOINT_FUNCTIONS = ("save_state_dict", "load_state_dict")


_warned_switches: set = set()  # (variable, value) already warned about: once per process


def _switch(name: str) -> bool:
    """A boolean switch read at start-up, with the spellings of the package's env_switches.py (which cannot be
    imported before the overlay exists; a test checks both agree on every spelling): 1/true/yes/on,
    0/false/no/off, any case; unset or empty is False. Anything else is logged as a warning naming the variable
    and read as False (raising here would break every Python process that starts with the variable set)."""
    word = os.environ.get(name, "").strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word not in ("", "0", "false", "no", "off") and (name, word) not in _warned_switches:
        _warned_switches.add((name, word))
        _logger().warning(
            "%s=%r is not accepted (expected 1/true/yes/on or 0/false/no/off, any case): read as 0",
            name,
            os.environ[name],
        )
    return False


def check_paddle_version(version: str | None = None) -> str:
    """Raise ImportError unless paddle ``version`` (default: the imported paddle's) is 3.3.x.

    The fork replaces internals of one paddle release series; running it on another one fails in
    obscure ways, so refuse early with the fix in the message. Dev builds ("0.0.0") are accepted,
    and ``PADDLE_FSDP_FORK_SKIP_VERSION_CHECK=1`` bypasses the check. Returns the version checked.
    """
    location = ""
    if version is None:
        import paddle  # already imported when called from the fork's import path

        version = str(
            getattr(paddle, "__version__", None)
            or getattr(sys.modules.get("paddle.version"), "full_version", None)
            or "unknown"
        )
        location = f" (imported from {os.path.dirname(getattr(paddle, '__file__', '') or '?')})"
    if _switch(SKIP_VERSION_CHECK_ENV):
        return version
    if version == DEV_PADDLE_VERSION:
        return version
    import re

    match = re.match(r"^\s*(\d+)\.(\d+)", version)
    if match and (int(match.group(1)), int(match.group(2))) == REQUIRED_PADDLE_SERIES:
        return version
    series = ".".join(map(str, REQUIRED_PADDLE_SERIES))
    raise ImportError(
        f"{TARGET_PACKAGE} (paddle-fsdp-fork) requires paddle {series}.x, but paddle "
        f"{version!r} is installed{location}. Install a matching paddle, e.g. "
        f"`pip install 'paddlepaddle=={series}.1'` (CPU; or `pip install \".[cpu]\"` from the fork's "
        f"checkout), or paddlepaddle-gpu {series}.x for GPUs. Set {SKIP_VERSION_CHECK_ENV}=1 to "
        f"bypass this check at your own risk."
    )


def ensure_fork_import(module_name: str) -> None:
    """Guard for the first lines of the fork's ``__init__.py``: call ``ensure_fork_import(__name__)``.

    Refuses to run the fork under its private install name (which would load every fork module a
    second time, as distinct classes) and checks the paddle version.
    """
    if module_name != TARGET_PACKAGE:
        raise ImportError(_private_import_message(module_name))
    check_paddle_version()


def _private_import_message(name: str) -> str:
    return (
        f"{name!r} is the private install location of the paddle FSDP fork; do not import it "
        f"directly. Import {TARGET_PACKAGE!r} instead (e.g. `from {TARGET_PACKAGE} import "
        f"FullyShardFusion`). If that gives stock paddle's module, the fork is not active: "
        f"reinstall it with pip (its .pth file activates it) and check that {DISABLE_ENV} is unset."
    )


class _PatchingLoader:
    """Delegates to the stock loader of ``paddle.distributed``, then redirects the checkpoint API.

    Every other attribute (get_source, get_filename, resource readers...) is forwarded, so
    tracebacks, ``inspect`` and ``importlib.resources`` behave as with the stock loader.
    """

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        create = getattr(self._inner, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: types.ModuleType) -> None:
        self._inner.exec_module(module)
        patch_checkpoint_api(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __repr__(self) -> str:
        return f"<paddle-fsdp-fork patching loader around {self._inner!r}>"


def _make_checkpoint_wrapper(name: str, stock: Callable[..., Any] | None) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        # Imported at call time: paddle.distributed is still initialising when this is installed.
        # stock's signature and results for stock inputs, the fork's engine on top (checkpoint/stock/dispatch.py)
        from paddle.distributed.fsdp.checkpoint import stock as dispatch

        return getattr(dispatch, name)(*args, **kwargs)

    wrapper.__name__ = name
    wrapper.__qualname__ = name
    wrapper.__module__ = DISTRIBUTED_PACKAGE
    wrapper.__doc__ = (
        f"paddle-fsdp-fork: stock's signature, dispatched by `{TARGET_PACKAGE}.checkpoint.stock.{name}`.\n\n"
        f"The stock implementation stays available as `{DISTRIBUTED_PACKAGE}.{name}.__wrapped_stock__`."
    )
    wrapper.__wrapped_stock__ = stock  # type: ignore[attr-defined]
    if stock is not None:
        wrapper.__wrapped__ = stock  # type: ignore[attr-defined]  # inspect.signature shows stock's signature
    setattr(wrapper, WRAPPER_MARKER, True)
    return wrapper


def patch_checkpoint_api(distributed: types.ModuleType) -> None:
    """Replace ``paddle.distributed.{save,load}_state_dict`` with wrappers forwarding to the fork.

    Idempotent (safe on ``importlib.reload``); the stock functions stay reachable as
    ``__wrapped_stock__`` on each wrapper.
    """
    for name in _CHECKPOINT_FUNCTIONS:
        current = distributed.__dict__.get(name)
        if getattr(current, WRAPPER_MARKER, False):
            continue
        if current is None:
            _logger().warning("stock %s has no %s; installing the fork's anyway", distributed.__name__, name)
        setattr(distributed, name, _make_checkpoint_wrapper(name, current))
    _logger().debug("redirected %s.%s to the fork", distributed.__name__, _CHECKPOINT_FUNCTIONS)


class ForkFinder:
    """``sys.meta_path`` finder that overlays the fork onto ``paddle.distributed.fsdp``."""

    def __init__(self) -> None:
        self._fork_spec_cache: importlib.machinery.ModuleSpec | None = None

    # -- helpers -------------------------------------------------------------------------------
    def _other_find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        """Resolve ``fullname`` as if this finder were absent (also bypasses our own guard)."""
        for finder in list(sys.meta_path):
            if finder is self or isinstance(finder, ForkFinder):
                continue
            find_spec = getattr(finder, "find_spec", None)
            if find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                return spec
        return None

    def private_spec(self) -> importlib.machinery.ModuleSpec:
        """Spec of the installed private package (its location), found without importing it."""
        if self._fork_spec_cache is None:
            spec = self._other_find_spec(FORK_PACKAGE, None)
            if spec is None or not spec.origin or not spec.submodule_search_locations:
                raise ImportError(
                    f"paddle-fsdp-fork is activated but its package {FORK_PACKAGE!r} was not found "
                    f"on sys.path; reinstall it (pip install <fork checkout>) or set {DISABLE_ENV}=1."
                )
            self._fork_spec_cache = spec
        return self._fork_spec_cache

    # -- importlib protocol --------------------------------------------------------------------
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname == TARGET_PACKAGE:
            return self._target_spec(path, target)
        if fullname == DISTRIBUTED_PACKAGE:
            return self._distributed_spec(path, target)
        if fullname == FORK_PACKAGE or fullname.startswith(FORK_PACKAGE + "."):
            raise ImportError(_private_import_message(fullname), name=fullname)
        return None

    def _target_spec(
        self, path: Sequence[str] | None, target: types.ModuleType | None
    ) -> importlib.machinery.ModuleSpec:
        check_paddle_version()
        private = self.private_spec()
        fork_root = list(private.submodule_search_locations or [])
        stock = self._other_find_spec(TARGET_PACKAGE, path, target)
        stock_dirs = list(stock.submodule_search_locations or []) if stock is not None else []
        if not stock_dirs:
            _logger().warning("stock %s not found; upstream fully_shard will be unavailable", TARGET_PACKAGE)
        locations = fork_root + [d for d in stock_dirs if d not in fork_root]
        import importlib.util

        spec = importlib.util.spec_from_file_location(
            TARGET_PACKAGE, private.origin, submodule_search_locations=locations
        )
        if spec is None:  # pragma: no cover - only for exotic origins
            raise ImportError(f"cannot build a spec for {TARGET_PACKAGE} from {private.origin}")
        _logger().debug("serving %s from %s (path %s)", TARGET_PACKAGE, private.origin, locations)
        return spec

    def _distributed_spec(
        self, path: Sequence[str] | None, target: types.ModuleType | None
    ) -> importlib.machinery.ModuleSpec | None:
        spec = self._other_find_spec(DISTRIBUTED_PACKAGE, path, target)
        if spec is None or spec.loader is None or isinstance(spec.loader, _PatchingLoader):
            return spec
        spec.loader = _PatchingLoader(spec.loader)  # type: ignore[assignment]
        return spec


_finder: ForkFinder | None = None


def install() -> bool:
    """Activate the overlay (called by the ``.pth`` file at start-up). Never raises.

    Returns True when the finder is in place. Safe to call repeatedly. If ``paddle.distributed`` is
    already imported, its checkpoint API is patched now; an already imported stock
    ``paddle.distributed.fsdp`` cannot be swapped in place and is only reported.
    """
    global _finder
    try:
        if _switch(DISABLE_ENV):
            _logger().debug("%s is set: paddle-fsdp-fork not activated", DISABLE_ENV)
            return False
        if _finder is None:
            _finder = ForkFinder()
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
        distributed = sys.modules.get(DISTRIBUTED_PACKAGE)
        if distributed is not None:
            patch_checkpoint_api(distributed)
        existing = sys.modules.get(TARGET_PACKAGE)
        if existing is not None and not is_active():
            _logger().warning(
                "%s was imported before paddle-fsdp-fork was activated; restart the interpreter",
                TARGET_PACKAGE,
            )
        return True
    except Exception:  # start-up must never break because of this hook
        _logger().exception("paddle-fsdp-fork activation failed; stock paddle is used")
        return False


def uninstall() -> None:
    """Remove the finder (modules already imported stay as they are). Mainly for tests."""
    global _finder
    if _finder is not None and _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    _finder = None


def fork_dir() -> str:
    """Directory holding the fork's installed sources, located without importing them."""
    finder = _finder or ForkFinder()
    return list(finder.private_spec().submodule_search_locations or [])[0]


def is_active() -> bool:
    """True when ``paddle.distributed.fsdp`` (if imported) is the fork's package."""
    module = sys.modules.get(TARGET_PACKAGE)
    if module is None:
        return _finder is not None and _finder in sys.meta_path
    origin = getattr(getattr(module, "__spec__", None), "origin", None)
    try:
        return bool(origin) and os.path.dirname(os.path.realpath(origin)) == os.path.realpath(fork_dir())
    except ImportError:
        return False

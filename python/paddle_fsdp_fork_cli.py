"""The ``paddle-fsdp-ckpt`` console command: ``--help`` and usage errors answered without importing paddle.

Anything imported under ``paddle.`` first runs stock ``paddle/__init__.py`` (several seconds). The parser
(``tools/cli_parser.py``) and what it imports at module level use only the standard library, so this launcher
loads them from the fork's directory under the private root ``_paddle_fsdp_ckpt_parser``, whose packages are
left empty (no ``__init__.py`` runs). Help and usage errors end there. A command line that parses is handed to
``paddle.distributed.fsdp.tools.cli.main``, which parses it again and runs it; the private copies are dropped
first, so no fork module stays loaded under two names.

Outside the user's checkpoint, paddle prints a ccache notice at import; it is filtered unless ``-v`` is given.
"""

from __future__ import annotations

import os
import sys
import warnings

TYPE_CHECKING = False
if TYPE_CHECKING:
    import argparse
    from collections.abc import Sequence

_ROOT = "_paddle_fsdp_ckpt_parser"
#: paddle warns at import that ccache is missing (a note for building C++ extensions, not about a checkpoint)
CCACHE_WARNING = r"No ccache found"


class _BarePackages:
    """Finder for ``_ROOT.*``: directories become empty packages; ``.py`` files load as usual."""

    def __init__(self, fork: str) -> None:
        self.fork = fork

    def find_spec(self, fullname: str, path: object = None, target: object = None):
        if fullname != _ROOT and not fullname.startswith(_ROOT + "."):
            return None
        import importlib.machinery
        import importlib.util

        location = os.path.join(self.fork, *fullname.split(".")[1:])
        if os.path.isdir(location):
            spec = importlib.machinery.ModuleSpec(fullname, None, is_package=True)
            spec.submodule_search_locations = [location]
            return spec
        if os.path.isfile(location + ".py"):
            return importlib.util.spec_from_file_location(fullname, location + ".py")
        return None


def _light_parser() -> argparse.ArgumentParser | None:
    """The fork's parser loaded without paddle, or None when the fork's directory cannot be found."""
    try:
        import paddle_fsdp_fork_activate

        fork = paddle_fsdp_fork_activate.fork_dir()
    except ImportError:
        return None
    import importlib

    finder = _BarePackages(fork)
    sys.meta_path.insert(0, finder)
    try:
        return importlib.import_module(f"{_ROOT}.tools.cli_parser").build_parser()
    finally:
        sys.meta_path.remove(finder)


def _drop_light_modules() -> None:
    for name in [n for n in sys.modules if n == _ROOT or n.startswith(_ROOT + ".")]:
        del sys.modules[name]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``paddle-fsdp-ckpt``; returns the exit code (the console script passes it to sys.exit)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _light_parser()
    verbose = 0
    if parser is not None:
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:  # --help (0) or a usage error (2, message already printed by argparse)
            return int(e.code or 0) if isinstance(e.code, int) or e.code is None else 2
        finally:
            _drop_light_modules()
        verbose = getattr(args, "verbose", 0)
    with warnings.catch_warnings():
        if verbose <= 0:
            warnings.filterwarnings("ignore", message=CCACHE_WARNING, category=UserWarning)
        try:
            from paddle.distributed.fsdp.tools.cli import main as run
        except ImportError as e:  # paddle missing, or the overlay switched off: one line, not a traceback
            print(
                f"paddle-fsdp-ckpt: error: cannot import the FSDP fork's tools ({e}); is paddle installed "
                "(the `cpu` extra) and the fork's import hook on (PADDLE_FSDP_FORK_DISABLE unset)?",
                file=sys.stderr,
            )
            return 2
    return run(argv)


if __name__ == "__main__":
    sys.exit(main())

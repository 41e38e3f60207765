"""``paddle-fsdp-ckpt``: inspect, verify and convert FSDP checkpoints (also ``python -m paddle.distributed.fsdp.tools``).

Exit codes: 0 success; 1 ``verify`` found problems or ``diff`` found differences; 2 bad input or usage (one line on stderr, nothing written);
3 internal error (``--debug`` shows the traceback); 130 interrupted.

This module is the entry point (``main``: logging, exit codes); the parser and its help texts are ``cli_parser.py``,
the commands ``cli_commands.py``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Sequence

from .cli_commands import EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_OK, EXIT_REMOVED, PROG, one_line
from .cli_parser import build_parser

LOGGER_NAME = "paddle.distributed.fsdp"  # the fork's loggers: tools and checkpoint engine
#: loggers of libraries whose INFO lines (e.g. botocore's "Found credentials in environment variables.") say
#: nothing about the user's checkpoint; paddle's root handler would print them. Shown with -v.
QUIET_LOGGERS = ("botocore", "boto3", "s3transfer", "urllib3")


@contextlib.contextmanager
def _log_to_stderr(verbose: int):
    """Route the fork's loggers (tools and checkpoint engine) to stderr as ``paddle-fsdp-ckpt: LEVEL: msg``.

    Paddle installs its own root handler at import; the fork's logger is detached from it for the duration of
    the command and restored afterwards (so calling ``main`` in-process leaves logging as it was). Without ``-v``
    the S3 client's loggers (``QUIET_LOGGERS``) show warnings only.
    """
    level = logging.WARNING if verbose <= 0 else logging.INFO if verbose == 1 else logging.DEBUG
    fork_logger = logging.getLogger(LOGGER_NAME)
    saved = (fork_logger.level, fork_logger.propagate)
    quiet = [logging.getLogger(name) for name in QUIET_LOGGERS] if verbose <= 0 else []
    quiet_levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(max(logger.getEffectiveLevel(), logging.WARNING))
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"{PROG}: %(levelname)s: %(message)s"))
    fork_logger.addHandler(handler)
    fork_logger.setLevel(level)
    fork_logger.propagate = False
    try:
        yield
    finally:
        fork_logger.removeHandler(handler)
        fork_logger.setLevel(saved[0])
        fork_logger.propagate = saved[1]
        for logger, old in zip(quiet, quiet_levels):
            logger.setLevel(old)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the tool with ``argv`` (default ``sys.argv[1:]``); returns the exit code (never calls sys.exit)."""
    parser = build_parser()
    try:
        args = parser.parse_args(None if argv is None else list(argv))
    except SystemExit as e:  # --help (0) or a usage error (2, message already printed by argparse)
        return int(e.code or 0) if isinstance(e.code, int) or e.code is None else EXIT_BAD_INPUT
    from ..checkpoint.errors import CheckpointError, CheckpointRemovedError
    from .errors import ToolError

    try:
        with _log_to_stderr(getattr(args, "verbose", 0)):
            return args.func(args)
    except CheckpointRemovedError as e:  # not bad input, not a damaged checkpoint: it went away; run again
        print(f"{PROG} {args.command}: checkpoint removed while it was read: {one_line(e)}", file=sys.stderr)
        return EXIT_REMOVED
    except (ToolError, CheckpointError) as e:
        print(f"{PROG} {args.command}: error: {one_line(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:  # e.g. `inspect CKPT | head`: the reader went away, not an error
        try:  # keep the interpreter from complaining when it flushes stdout at exit
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        return EXIT_OK
    except OSError as e:
        print(f"{PROG} {args.command}: error: {one_line(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except MemoryError as e:  # a tensor larger than this machine's memory: named, not an internal error
        print(f"{PROG} {args.command}: error: out of memory ({one_line(e) or 'MemoryError'})", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(f"{PROG} {args.command}: interrupted (no output was left behind)", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:  # noqa: BLE001 - a bug: one line unless --debug
        if getattr(args, "debug", False):
            raise
        print(
            f"{PROG} {args.command}: internal error: {type(e).__name__}: {one_line(e)} "
            f"(run with --debug for the traceback)",
            file=sys.stderr,
        )
        return EXIT_INTERNAL

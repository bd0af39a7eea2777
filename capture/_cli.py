"""The command line: a thin layer that builds library objects and formats their results.

Each command group lives in ``capture/commands/<group>.py`` and exposes
``register(subparsers)``; handlers take the parsed ``argparse.Namespace`` and return an exit
code. Errors are mapped to messages and exit codes here, in one place.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from capture import __version__
from capture.errors import EXIT_USAGE, CaptureError

COMMAND_GROUPS = ("core", "trial", "image", "results", "preflight", "exec", "decide")
# Which group defines a command, so that `capture fingerprint` imports only commands/core.py (start-up
# time). A command missing here still works: every group is then imported, as for `capture --help`.
COMMAND_GROUP_OF = {
    "fingerprint": "core", "keygen": "core", "sign": "core", "verify": "core", "diff": "core",
    "trial": "trial", "estimate": "trial", "image": "image", "run": "image",
    "pin": "results", "compare": "results", "show": "results", "export": "results",
    "preflight": "preflight", "exec": "exec", "decide": "decide", "init": "decide",
}


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line plus a hint, exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"error: {message}\nhint: run `{self.prog} --help` for usage\n")
        raise SystemExit(EXIT_USAGE)


def _groups_for(args: list[str] | None) -> tuple[str, ...]:
    """The command groups to import for this command line: the command's own, or all of them."""
    argv = sys.argv[1:] if args is None else args
    command = next((a for a in argv if not a.startswith("-")), None)
    group = COMMAND_GROUP_OF.get(command or "")
    return (group,) if group else COMMAND_GROUPS


def _parser(args: list[str] | None = None, groups: tuple[str, ...] = COMMAND_GROUPS) -> argparse.ArgumentParser:
    parser = _Parser(prog="capture", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--version", action="version", version=f"capture {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for group in groups:
        try:
            module = importlib.import_module(f"capture.commands.{group}")
        except ModuleNotFoundError as exc:
            if exc.name == f"capture.commands.{group}":
                continue
            raise
        module.register(sub)
    return parser


def main(args: list[str] | None = None) -> int:
    parser = _parser(args, _groups_for(args))
    ns = parser.parse_args(args)
    import logging

    level = logging.DEBUG if ns.verbose else getattr(logging, os.environ.get("CAPTURE_LOG_LEVEL", "WARNING").upper(), logging.WARNING)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if not getattr(ns, "func", None):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return int(ns.func(ns) or 0)
    except CaptureError as exc:
        sys.stderr.write(exc.diagnostics() + "\n")
        return exc.exit_code
    except ModuleNotFoundError as exc:
        from capture._extras import missing_extra

        needed = missing_extra(exc, ns.command)
        if needed is None:
            raise
        sys.stderr.write(needed.diagnostics() + "\n")
        return needed.exit_code
    except KeyboardInterrupt as exc:  # Ctrl-C; or SIGTERM/SIGHUP where a command turns them into one (capture.trial.scratch)
        try:
            sys.stderr.write(f"error: {exc.args[0] if exc.args else 'interrupted'}\n")
        except OSError:  # SIGHUP: the terminal may be gone
            pass
        return int(getattr(exc, "exit_code", 130))
    except BrokenPipeError:
        return 0


def run() -> None:
    """The ``capture`` command (and ``python -m capture``): :func:`main`, then leave at once.

    Tearing the interpreter down (freeing every module and object) costs 10-30 ms after a
    fingerprint and changes nothing a user can see, so once ``main`` has returned this flushes
    stdout and stderr, runs the ``atexit`` handlers (logging's flush among them) and ends the
    process with ``os._exit``. Where that could lose work it exits the usual way instead: while
    another non-daemon thread still runs (Python would wait for it), or when a flush fails
    (Python reports that itself).
    """
    code = main()
    import atexit
    import threading

    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        raise SystemExit(code)
    if not _flushed():
        raise SystemExit(code)
    atexit._run_exitfuncs()
    if not _flushed():  # what the handlers wrote
        raise SystemExit(code)
    os._exit(code)


def _flushed() -> bool:
    """Flush stdout and stderr; False when either cannot be (a closed pipe, a full disk)."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        return False
    return True

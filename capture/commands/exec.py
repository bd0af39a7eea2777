"""`capture exec`: run any command under a signed record of the stack and of what it did."""

from __future__ import annotations

import argparse
import sys

from capture.errors import UsageError


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "exec", help="fingerprint, run a command unchanged, record its exit status, time and outputs, sign",
        description="Run CMD unchanged (signals forwarded, exit status passed through) and write a signed "
                    "manifest: the stack before, the command line (credentials redacted), exit status, wall time, "
                    "the hashes of --output paths, and the figures of a capture.Recorder inside CMD. CMD's stdout "
                    "and stderr pass through unchanged; capture's own messages, and the manifest's path, go to "
                    "stderr.")
    p.add_argument("-o", "--manifest", dest="manifest", metavar="FILE",
                   help="write the signed manifest here (default: ./exec-<UTC time>.toml)")
    p.add_argument("--output", action="append", default=[], metavar="PATH",
                   help="a file or folder the command writes; hashed after it ends (repeatable)")
    p.add_argument("--key", metavar="KEYFILE", help="signing key (default: the default key, created on first use)")
    p.add_argument("--principal", metavar="NAME", help="signer identity (default: the key comment)")
    p.add_argument("--no-report", action="store_true", help="no HTML report beside the manifest")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ...", help="the command and its arguments")
    p.set_defaults(func=cmd_exec)


def cmd_exec(ns: argparse.Namespace) -> int:
    from capture.exec import run_exec

    argv = list(ns.cmd)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise UsageError("exec: no command given", "put the command after `--`: capture exec -o run.toml -- python train.py")
    result = run_exec(argv, ns.manifest, ns.output, ns.key, ns.principal, report=not ns.no_report)
    if result.manifest_path is not None:  # stderr: stdout carries the command's own output, unchanged
        sys.stderr.write(f"capture: manifest {result.manifest_path}\n")
        sys.stderr.flush()
    return result.exit_code

"""Nothing left behind: the trial's scratch folder, and what SIGINT, SIGTERM and SIGHUP do to a trial.

A trial writes checkpoints (16 GB and more at 8B), DCP folders and worker files into one scratch
folder, ``.capture-trial-*`` beside the manifest (or inside ``--workdir``), and starts child
processes (preflight all-reduce ranks, the recovery workers, torchrun and its ranks). A rented
machine is stopped with ``timeout``, Ctrl-C or a closed terminal, so:

- :func:`interruptible` turns SIGINT, SIGTERM and SIGHUP into :class:`Interrupted` in the main
  thread. It unwinds the trial like any exception: every stage's ``finally`` stops its children,
  atomic writes drop their temporary files, the scratch folder is removed, a report whose manifest
  was not written is removed. A second signal while that runs is ignored, so the clean-up finishes.
  Then :func:`end_children` kills whatever descendant is still alive (a rank in its own session).
  The command exits 128 + the signal's number (130, 143, 129) with one line on stderr.
- :func:`scratch_folder` / :func:`remove` make and remove the scratch folder.
- :func:`pause_point`: a test-only hook. With ``CAPTURE_TRIAL_TEST_PAUSE=NAME=FILE`` in the
  environment, the process that reaches the point NAME appends ``NAME PID`` to FILE and waits
  for a signal, so a test can interrupt a real trial inside a given stage.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
PAUSE_ENV = "CAPTURE_TRIAL_TEST_PAUSE"
PREFIX = ".capture-trial-"


class Interrupted(KeyboardInterrupt):
    """The trial was stopped by a signal; ``exit_code`` is 128 + its number."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.name = signal.Signals(signum).name
        self.exit_code = 128 + signum
        super().__init__(f"interrupted by {self.name}")


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP raise :class:`Interrupted` in the main thread while inside; after
    an interrupt, any descendant process still alive is ended on the way out. (Outside the main
    thread signals cannot be caught: nothing changes there.)"""
    fired: list[int] = []

    def handler(signum: int, _frame: object) -> None:
        if fired:
            return  # the first one is being handled: let its clean-up finish
        fired.append(signum)
        raise Interrupted(signum)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, handler) for s in SIGNALS}
    try:
        yield
    finally:
        try:
            if fired:
                end_children()
        finally:
            for s, h in previous.items():
                signal.signal(s, h)


def _children_of(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (Linux /proc; empty elsewhere), children first."""
    parent_of: dict[int, int] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # the command name may hold spaces and parentheses: the fields after the last ")"
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 1:
            parent_of[int(name)] = int(fields[1])
    out: list[int] = []
    frontier = [pid]
    while frontier:
        nxt = [child for child, parent in parent_of.items() if parent in frontier and child not in out]
        out += nxt
        frontier = nxt
    return out


def end_children() -> list[int]:
    """Kill every descendant of this process that is still alive and reap the direct children.
    Returns the pids it killed (normally none: each stage stops its own)."""
    pids = _children_of(os.getpid())
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    for pid in pids:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, 0)  # only our own children can be reaped; the rest are their parents' to reap
    return pids


def scratch_folder(near: Path, workdir: Path | None = None) -> Path:
    """A new ``.capture-trial-*`` folder inside ``workdir`` (``--workdir``) or beside the output."""
    folder = Path(workdir) if workdir is not None else Path(near)
    folder.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=PREFIX, dir=folder))


def remove(path: Path, attempts: int = 5) -> None:
    """Remove a scratch folder, again while something (a background checkpoint writer finishing)
    still adds to it."""
    for _ in range(attempts):
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path):
            return
        time.sleep(0.1)


def pause_point(name: str) -> None:
    """Test-only (see the module doc): wait here for a signal when the environment names this point."""
    spec = os.environ.get(PAUSE_ENV)
    if not spec:
        return
    point, _, path = spec.partition("=")
    if point != name or not path:
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"{name} {os.getpid()}\n")
    while True:
        time.sleep(0.05)

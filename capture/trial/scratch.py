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
- :func:`scratch_folder` / :func:`remove` make and remove the scratch folder; what no signal can
  undo (SIGKILL, the kernel's out-of-memory killer) the next trial in the same folder finds and
  removes (:func:`sweep_stale`), and a killed trial's children die with it (capture._parent_death).
- :func:`pause_point`: a test-only hook. With ``CAPTURE_TRIAL_TEST_PAUSE=NAME=FILE`` in the
  environment, the process that reaches the point NAME appends ``NAME PID`` to FILE and waits
  for a signal, so a test can interrupt a real trial inside a given stage.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from capture._safe_read import read_prefix, tree_bytes

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


def _stat_fields(pid: int) -> list[bytes]:
    """The fields of /proc/PID/stat after the command name (state, parent, ...); empty where the
    process is gone or /proc cannot say. The name may hold spaces and parentheses: what follows
    the last ")"."""
    raw = read_prefix(f"/proc/{pid}/stat", 4096)
    return raw[raw.rfind(b")") + 2:].split() if raw else []


def _children_of(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (Linux /proc; empty elsewhere), children first."""
    parent_of: dict[int, int] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for name in entries:
        fields = _stat_fields(int(name)) if name.isdigit() else []
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


def scratch_folder(near: Path, workdir: Path | None = None, say: Callable[[str], None] | None = None) -> Path:
    """A new ``.capture-trial-*`` folder inside ``workdir`` (``--workdir``) or beside the output,
    with its owner recorded (:data:`OWNER`); first the folders there that a dead trial left
    (:func:`sweep_stale`), each named through ``say``."""
    folder = Path(workdir) if workdir is not None else Path(near)
    folder.mkdir(parents=True, exist_ok=True)
    me = _identity(os.getpid())
    for stale in sweep_stale(folder, me):
        if say is not None:
            say(stale.text())
    path = Path(tempfile.mkdtemp(prefix=PREFIX, dir=folder))
    if me is not None:
        with contextlib.suppress(OSError):  # without it the folder is only never swept: not a reason to stop
            (path / OWNER).write_text(json.dumps(me), encoding="utf-8")
    return path


OWNER = "owner.json"
"""In each scratch folder: the trial process that made it, as the kernel knows it (pid, start time
in clock ticks since boot, boot id, pid namespace), so that a later trial can tell a folder whose
trial died without removing it (SIGKILL: the kernel's out-of-memory killer, ``kill -9``) from one
whose trial runs beside it."""


@dataclass(frozen=True)
class Stale:
    path: Path
    size_bytes: int
    pid: int

    def text(self) -> str:
        from capture._escape import printable
        from capture.fmt import bytes_str

        return (f"removed {printable(self.path)[:200]} ({bytes_str(self.size_bytes)}), the scratch folder of trial "
                f"process {self.pid}, which ended without removing it (killed: SIGKILL, or the kernel out of memory)")


def _identity(pid: int) -> dict[str, Any] | None:
    """The process ``pid`` as the kernel knows it (see :data:`OWNER`); None where it is gone, a
    zombie, or /proc cannot say."""
    fields = _stat_fields(pid)
    boot = read_prefix("/proc/sys/kernel/random/boot_id", 4096)
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
    if len(fields) < 20 or fields[0] == b"Z" or not boot:
        return None
    return {"pid": pid, "start": fields[19].decode("ascii", "replace"),
            "boot_id": boot.decode("ascii", "replace").strip(), "pid_namespace": namespace}


def sweep_stale(folder: Path, me: dict[str, Any] | None = None) -> list[Stale]:
    """Remove the scratch folders in ``folder`` whose trial process is gone: on this boot and in
    this pid namespace (elsewhere its pid means nothing here), and no live process with its pid and
    start time. A folder without a readable owner (another version's, a hand-made one), a link, or
    one whose trial is alive is left as it is. On a tmpfs (``--workdir /dev/shm/...``) what a killed
    trial left holds the host's memory until it is removed: a 16 GB checkpoint at 8B. ``me``: this
    process's :func:`_identity`, read when not given."""
    me = me or _identity(os.getpid())
    if me is None:
        return []
    try:
        entries = [e for e in os.scandir(folder) if e.name.startswith(PREFIX) and e.is_dir(follow_symlinks=False)]
    except OSError:
        return []
    out: list[Stale] = []
    for e in entries:
        try:
            owner = json.loads(read_prefix(Path(e.path) / OWNER, 4096, follow_symlinks=False) or b"")
        except ValueError:
            continue
        if not isinstance(owner, dict) or type(owner.get("pid")) is not int or owner["pid"] <= 0:
            continue
        if (owner.get("boot_id"), owner.get("pid_namespace")) != (me["boot_id"], me["pid_namespace"]):
            continue
        alive = _identity(owner["pid"])
        if alive is not None and alive["start"] == owner.get("start"):
            continue
        size = tree_bytes(e.path) or 0
        remove(Path(e.path))
        if not os.path.lexists(e.path):
            out.append(Stale(Path(e.path), size, owner["pid"]))
    return out


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

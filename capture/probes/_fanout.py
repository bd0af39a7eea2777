"""Run independent jobs side by side: in forked children of this process where that is safe,
in threads otherwise. Both give the same results, in the order of the jobs.

Threads share one interpreter lock, so the probes' Python work (listing and reading ~200
dist-info folders, parsing, building tables) runs one probe at a time: on the H200 the
threaded wall time of the probes was 0.82x their serial sum, where their longest probe would
allow ~0.3x. A child forked from this process runs on its own core, does one job and writes
its result back, pickled, through its own pipe; the parent reads each pipe to its end and reaps
the child. A child that dies (a segfault in a vendor library, the OOM killer) costs that job
only: it comes back as an error, not a crashed fingerprint.

Forking is only done where it is safe and pays (:func:`choose`):

- this process has a single OS thread: a lock that another thread holds at the moment of the
  fork (malloc's, a logging handler's, CUDA's) stays held in the child for ever. The kernel's own
  count (``Threads:`` in ``/proc/self/status``) is read, which also counts the native threads of
  OpenMP, CUDA or NCCL that :mod:`threading` cannot see;
- no accelerator framework (torch, jax, tensorflow, cupy) is loaded: its driver state must not
  be duplicated, and a large address space makes every fork slow (a trial and the integrations
  that run inside a training process therefore use threads);
- at least :data:`MIN_CPUS` CPUs are usable: on 2 cores twelve children only compete with each
  other and with the probes' own subprocesses (measured: 206 ms forked against 196 ms threaded,
  median of 15 fingerprints each, interleaved), while on the H200's 16 the same fingerprint went
  from 0.322 s to 0.210 s.

Anywhere else (not Linux, a trial that has imported torch, a test with a thread running) the
jobs run in threads. ``CAPTURE_FANOUT`` (``auto``, ``threads`` or ``fork``) overrides the
choice; ``fork`` still falls back to threads while forking is unsafe.

The parent unpickles only what its own forked child wrote into a pipe that no other process
holds (``os.pipe`` descriptors are not inherited across ``exec``): nothing read from a file or
from another program goes through pickle. A child closes the read ends of its siblings' pipes it
inherited, so each holds its own write end and nothing else.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
from typing import Any, Callable, Sequence

Outcome = tuple[bool, Any]
"""``(True, value)`` or ``(False, exception)``."""

FORK = "fork"
THREADS = "threads"
AUTO = "auto"
MODES = (AUTO, FORK, THREADS)
ENV = "CAPTURE_FANOUT"
MIN_CPUS = 4
"""Fewest usable CPUs on which ``auto`` forks."""
FRAMEWORKS = ("torch", "jax", "tensorflow", "cupy")
"""Modules whose presence in ``sys.modules`` rules forking out."""
_CHILD_FAILED = 70  # EX_SOFTWARE: the child could not even report


def why_not_fork() -> str | None:
    """None where forking is safe; otherwise the reason, in words."""
    if sys.platform != "linux" or not hasattr(os, "fork"):
        return "forking is not used on this platform"
    loaded = [name for name in FRAMEWORKS if name in sys.modules]
    if loaded:
        return f"{loaded[0]} is loaded in this process"
    try:
        with open("/proc/self/status", "rb") as f:
            status = f.read()
    except OSError:
        return "/proc/self/status cannot be read"
    for line in status.splitlines():
        if line.startswith(b"Threads:"):
            count = line.split()[1:2]
            return None if count == [b"1"] else f"this process already runs {b''.join(count).decode() or '?'} threads"
    return "/proc/self/status does not say how many threads run"


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, as ``taskset`` or a container sets it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def choose(mode: str | None = None) -> tuple[str, str]:
    """``(FORK or THREADS, why)`` for ``mode`` (None: ``$CAPTURE_FANOUT``, else ``auto``).

    ``auto`` forks where :func:`why_not_fork` finds nothing against it and at least
    :data:`MIN_CPUS` CPUs are usable; ``fork`` skips the CPU count; ``threads`` never forks."""
    if mode is None:
        mode = os.environ.get(ENV, "").strip().lower() or AUTO
        if mode not in MODES:
            from capture.errors import UsageError

            raise UsageError(f"{ENV}={mode[:40]!r} is not one of {', '.join(MODES)}",
                             f"unset {ENV}, or set it to auto, threads or fork")
    if mode not in MODES:
        raise ValueError(f"unknown fan-out mode {mode!r}")
    if mode == THREADS:
        return THREADS, f"{ENV}=threads"
    why = why_not_fork()
    if why is not None:
        return THREADS, why
    cpus = usable_cpus()
    if mode == AUTO and cpus < MIN_CPUS:
        return THREADS, f"{cpus} usable CPUs (processes pay from {MIN_CPUS})"
    return FORK, f"{cpus} usable CPUs"


def run(jobs: Sequence[Callable[[], Any]], mode: str | None = None) -> tuple[list[Outcome], str, str]:
    """Run every job; return one outcome per job, in order, the mode that ran them, and why."""
    how, why = choose(mode)
    return (_run_forked(jobs) if how == FORK else _run_threads(jobs)), how, why


def _call(job: Callable[[], Any]) -> Outcome:
    try:
        return True, job()
    except Exception as exc:
        return False, exc


def _run_threads(jobs: Sequence[Callable[[], Any]]) -> list[Outcome]:
    from concurrent.futures import ThreadPoolExecutor  # forked runs need no thread machinery

    with ThreadPoolExecutor(max_workers=max(1, len(jobs))) as pool:
        return list(pool.map(_call, jobs))


def _child(job: Callable[[], Any], w: int) -> None:
    """In the forked child: run the job, write the pickled outcome, leave without cleanup.

    ``os._exit`` skips atexit handlers and the flushing of buffers the parent owns; the child's
    own stderr (a probe's progress bar) is flushed first."""
    code = 0
    try:
        if hasattr(signal, "SIGINT"):  # Ctrl-C is the parent's to handle: it reaps us
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        outcome = _call(job)
        try:
            payload = pickle.dumps(outcome, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # an unpicklable result or exception: say so, as text
            what = outcome[1]
            payload = pickle.dumps((False, RuntimeError(
                f"{type(what).__name__}: {what} (not picklable: {type(exc).__name__})")))
        view = memoryview(payload)
        while view:
            view = view[os.write(w, view):]
        sys.stderr.flush()
    except BaseException:
        code = _CHILD_FAILED
    finally:
        os._exit(code)


def _read_all(fd: int) -> bytes:
    chunks: list[bytes] = []
    while True:
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _decode(data: bytes, status: int) -> Outcome:
    if data:
        try:
            outcome = pickle.loads(data)
        except Exception as exc:  # e.g. an exception class whose __init__ takes other arguments
            return False, RuntimeError(f"the probe's result could not be read back: {type(exc).__name__}: {exc}")
        if isinstance(outcome, tuple) and len(outcome) == 2 and isinstance(outcome[0], bool):
            return outcome
    code = os.waitstatus_to_exitcode(status)
    how = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
    return False, RuntimeError(f"the probe's process ended without a result ({how})")


def _run_forked(jobs: Sequence[Callable[[], Any]]) -> list[Outcome]:
    # Whatever the parent has buffered would otherwise be written again by each child.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    children: list[tuple[int, int]] = []
    outcomes: list[Outcome] = []
    leftover: Sequence[Callable[[], Any]] = ()
    try:
        for i, job in enumerate(jobs):
            try:
                r, w = os.pipe()
            except OSError:
                leftover = jobs[i:]
                break
            try:
                pid = os.fork()
            except OSError:  # out of processes or memory: what is left runs in threads
                os.close(r)
                os.close(w)
                leftover = jobs[i:]
                break
            if pid == 0:
                for fd in [r, *(earlier for _, earlier in children)]:  # only its own pipe's write end
                    os.close(fd)
                _child(job, w)
            os.close(w)
            children.append((pid, r))
        rest = _run_threads(leftover) if leftover else []
        for pid, r in children:
            data = _read_all(r)
            _, status = os.waitpid(pid, 0)
            outcomes.append(_decode(data, status))
    except BaseException:
        for pid, _ in children[len(outcomes):]:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        raise
    finally:
        for _, r in children:
            try:
                os.close(r)
            except OSError:
                pass
    return outcomes + rest

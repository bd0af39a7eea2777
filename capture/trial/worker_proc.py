"""The parent's handle on one fresh interpreter of the recovery check (``python -m capture.trial._recover_worker``).

A worker is started early with only the setup (config, device, settings, what to prepare), so its
imports, and where memory allows its build, overlap with other work; it sees no training state
until :meth:`Worker.start_job` sends the job. Two JSON lines in on stdin, a result file out
(see capture.trial._recover_worker). ``env`` is added to its environment, so it is there before
the process initialises CUDA. :meth:`Worker.stop` kills it: the stage calls it in ``finally``,
so an interrupted trial leaves no worker behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

WORKER_MODULE = "capture.trial._recover_worker"


class WorkerFailed(Exception):
    """A worker exited without a result; ``reason`` is its last error line."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Worker:
    def __init__(self, name: str, setup: Mapping[str, Any], workdir: Path, env: Mapping[str, str] | None = None,
                 started: str = "") -> None:
        self.name, self.started = name, started  # started: when, in words, for the manifest
        self.out = workdir / f"{name}.result.json"
        self.err = workdir / f"{name}.stderr.txt"
        self.job_sent_at: float | None = None
        self.go_sent_at: float | None = None  # a worker started before its stage: when the stage let it go on
        self.setup, self.env = dict(setup), dict(env or {})
        environ = dict(os.environ, **self.env)
        package_root = str(Path(__file__).resolve().parents[2])
        environ["PYTHONPATH"] = os.pathsep.join([package_root, *filter(None, [environ.get("PYTHONPATH")])])
        self.spawned_at = time.time()
        with open(self.err, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", WORKER_MODULE], env=environ, stdin=subprocess.PIPE,
                                         stdout=subprocess.DEVNULL, stderr=err)
        self._send(dict(setup, out=str(self.out)))

    def _send(self, message: Mapping[str, Any]) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(message).encode() + b"\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # it died; result() reports why

    def go(self, message: Mapping[str, Any]) -> None:
        """The go-ahead that a worker started before its stage waits for once it has imported."""
        self.go_sent_at = time.time()
        self._send(message)

    def start_job(self, job: Mapping[str, Any]) -> None:
        self.job_sent_at = time.time()
        self._send(job)
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.close()
        except BrokenPipeError:
            pass

    def result(self, timeout_s: float | None) -> dict[str, Any]:
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            raise WorkerFailed(f"the {self.name} process ran past {timeout_s:.0f} s") from None
        result: dict[str, Any] = {}
        if self.out.exists():
            result = json.loads(self.out.read_text())
        if code < 0 and "error" not in result:  # a signal from outside: its last line is not the reason
            raise WorkerFailed(killed_reason(f"the {self.name} process", -code))
        if code != 0 or "error" in result:
            lines = [ln for ln in self.err.read_text(errors="replace").splitlines() if ln.strip()]
            raise WorkerFailed(result.get("error") or (lines[-1] if lines else f"exit status {code}"))
        return result

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass

    def head_start_s(self) -> float | None:
        """Seconds from the spawn until the stage first gave it work (the go-ahead, else the job)."""
        sent = self.go_sent_at if self.go_sent_at is not None else self.job_sent_at
        return sent - self.spawned_at if sent is not None else None

    def job_wait_s(self, result: Mapping[str, Any]) -> float | None:
        """Seconds its job waited for the worker to be ready (0 when it was ready first)."""
        return _waited(result.get("ready_at"), self.job_sent_at)

    def start_s(self, result: Mapping[str, Any]) -> float | None:
        """Seconds from the spawn (from the go-ahead, for one started before its stage) until the
        worker was ready for its job (imports, prewarm, an early build)."""
        ready = result.get("ready_at")
        since = self.go_sent_at if self.go_sent_at is not None else self.spawned_at
        return max(0.0, float(ready) - since) if isinstance(ready, (int, float)) else None

    def go_wait_s(self, result: Mapping[str, Any]) -> float | None:
        """Seconds the go-ahead waited for the worker's imports (0 when they were done first)."""
        return _waited(result.get("imports_done_at"), self.go_sent_at)


def killed_reason(what: str, signum: int) -> str:
    """One line for a process (``what``) ended by signal ``signum``; SIGKILL names the OOM killer,
    which sends it to a process past the host's or the memory cgroup's memory."""
    try:
        sig = signal.Signals(signum).name
    except ValueError:
        sig = f"signal {signum}"
    why = (": most likely the kernel's OOM killer (the host's or the memory cgroup's memory ran out)"
           if signum == signal.SIGKILL else "")
    return f"{what} was killed by {sig}{why}"


def _waited(done_at: Any, sent_at: float | None) -> float | None:
    """How long a message sent at ``sent_at`` waited for the worker's ``done_at`` (wall clock, 0 if it was first)."""
    if not isinstance(done_at, (int, float)) or sent_at is None:
        return None
    return max(0.0, float(done_at) - sent_at)

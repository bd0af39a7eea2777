"""All-reduce bus bandwidth across real processes: NCCL/RCCL on GPUs, gloo on CPUs.

One worker process per rank (``python -m capture.preflight._allreduce_worker``), joined through a
file rendezvous in a temporary folder, so nothing listens on the network. Bus bandwidth follows
nccl-tests (doc/PERFORMANCE.md): ``algbw = bytes / time`` and, for all-reduce,
``busbw = algbw · 2(n−1)/n``, the figure comparable to the link's own bandwidth whatever ``n``.
Every rank checks that its first all-reduce summed to ``n(n+1)/2`` exactly.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from capture import _parent_death as parent_death

TIMEOUT_S = {"quick": 120.0, "full": 300.0}


@dataclass(frozen=True)
class AllReduce:
    world_size: int
    backend: str
    nbytes: int
    iterations: int
    seconds_per_iter: float | None = None
    algbw_bytes_per_s: float | None = None
    busbw_bytes_per_s: float | None = None
    correct: bool = False
    error: str | None = None


def bus_bandwidth(nbytes: int, seconds: float, world_size: int) -> tuple[float, float]:
    """``(algbw, busbw)`` in bytes/s for one all-reduce of ``nbytes`` taking ``seconds``."""
    algbw = nbytes / seconds
    return algbw, algbw * 2 * (world_size - 1) / world_size


def run_allreduce(world_size: int, backend: str, nbytes: int, iterations: int, timeout_s: float,
                  progress=None) -> AllReduce:
    """Start ``world_size`` worker processes and collect their timings (the slowest rank counts)."""
    import capture

    base = AllReduce(world_size, backend, nbytes, iterations)
    root = str(Path(capture.__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if backend == "gloo":
        env.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="capture-preflight-") as tmp:
        procs = []
        for rank in range(world_size):
            out = Path(tmp) / f"rank{rank}.json"
            cmd = [sys.executable, "-m", "capture.preflight._allreduce_worker", "--rank", str(rank), "--world", str(world_size),
                   "--backend", backend, "--init", f"file://{tmp}/rendezvous", "--bytes", str(nbytes),
                   "--iters", str(iterations), "--out", str(out)]
            procs.append((subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                           preexec_fn=parent_death.preexec(signal.SIGKILL, 1)), out))  # none outlives capture
        deadline = time.monotonic() + timeout_s
        errors = []
        for proc, _ in procs:
            try:
                _, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except BaseException as exc:  # a timeout, or the command interrupted: no rank outlives it
                for p, _ in procs:
                    if p.poll() is None:
                        p.kill()
                for p, _ in procs:
                    p.wait()
                if not isinstance(exc, subprocess.TimeoutExpired):
                    raise
                return AllReduce(**{**base.__dict__, "error": f"the {world_size} worker processes did not finish within {timeout_s:.0f} s"})
            if proc.returncode != 0:
                last = [ln for ln in (err or "").splitlines() if ln.strip()]
                errors.append(f"rank exited {proc.returncode}" + (f": {last[-1].strip()[:200]}" if last else ""))
        if errors:
            return AllReduce(**{**base.__dict__, "error": errors[0]})
        results = []
        for _, out in procs:
            try:
                results.append(json.loads(out.read_text()))
            except (OSError, ValueError) as exc:
                return AllReduce(**{**base.__dict__, "error": f"a worker wrote no result ({exc})"})
    seconds = max(r["seconds_per_iter"] for r in results)
    algbw, busbw = bus_bandwidth(nbytes, seconds, world_size)
    correct = all(r["correct"] for r in results)
    return AllReduce(world_size, backend, nbytes, iterations, seconds, algbw, busbw, correct,
                     None if correct else "the all-reduce summed to the wrong value")

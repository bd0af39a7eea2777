"""`capture preflight --quick` wall time, whole command (torch import, CUDA start-up, fingerprint,
signing), against the 20 s budget of issue 12 on one H200.

    python benchmarks/preflight_quick.py [--rounds 3] [--device auto]

Prints each round, the median and the ratio median / 20 s (below 1.0 meets the budget).
Measured on the H200 (2026-12-02): 9.3 s and 9.7 s, 0.47-0.49 of the budget.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BUDGET_S = 20.0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="auto")
    a = p.parse_args()
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.rounds):
            t0 = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "capture", "preflight", "--quick", "--device", a.device,
                                   "-o", str(Path(tmp) / f"p{i}.toml")], capture_output=True, text=True)
            times.append(time.perf_counter() - t0)
            print(f"round {i + 1}: {times[-1]:.2f} s (exit {done.returncode})")
    med = statistics.median(times)
    print(f"median {med:.2f} s; budget {BUDGET_S:.0f} s; ratio {med / BUDGET_S:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

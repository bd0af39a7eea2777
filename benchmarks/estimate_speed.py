"""How long ``capture estimate`` takes, and how many replays its card table costs.

Baseline, named and run side by side: the search this release replaced (bisection from the
line through micro-batches 1 and 2, growing by doubling steps, one bracket per card; adapters
initialised on the CPU before moving to meta). For each shipped example it prints the replays
and the seconds of the card table both ways, and their ratio; then the whole command's wall
time in a fresh process (imports included: torch, transformers and peft take most of it).

    python3 benchmarks/estimate_speed.py [--examples llama-3.1-8b-lora,llama-1b] [--cold N]

Both searches must give the same largest micro-batch for every card; a mismatch exits 1.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def baseline_largest_fitting(curve, usable: int, ceiling: int) -> tuple[int | None, bool]:
    """The replaced search, kept as the baseline."""
    if curve(1) > usable:
        return None, False
    slope = max(1, curve(2) - curve(1))
    guess = max(1, min(ceiling, 1 + (usable - curve(1)) // slope))
    good, bad = 1, None
    if curve(guess) <= usable:
        good = guess
        step = max(1, guess // 8)
        while good < ceiling:
            nxt = min(ceiling, good + step)
            if curve(nxt) <= usable:
                good, step = nxt, step * 2
            else:
                bad = nxt
                break
    else:
        bad = guess
    while bad is not None and bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if curve(mid) <= usable else (good, mid)
    return good, good >= ceiling


def table(plan, catalog, search, ceiling: int = 1024) -> tuple[list[int | None], int, float]:
    from capture.trial import memory
    from capture.trial.estimate import Curve

    t = time.perf_counter()
    curve = Curve(lambda mb: memory.estimate_plan(plan, mb, expandable=False).total_bytes)
    best = [search(curve, int(c.memory_bytes * 0.9), ceiling)[0] for c in catalog.cards]
    return best, len(curve.seen), time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", default="llama-3.1-8b-lora,llama-3.1-8b-qlora,llama-3.1-8b-full,llama-1b")
    ap.add_argument("--cold", type=int, default=3, help="fresh-process runs of the whole command per example")
    args = ap.parse_args()

    from capture.trial import memory
    from capture.trial.config import load_example
    from capture.trial.estimate import largest_fitting
    from capture.trial.fit import load_catalog

    catalog = load_catalog(None)
    bad = 0
    print(f"{'example':<22}{'replays base':>13}{'new':>6}{'s base':>9}{'s new':>8}{'speed-up':>10}  {'cold run (s)':>13}")
    for name in args.examples.split(","):
        plan = memory.plan_for(load_example(name), "cuda")
        b_best, b_n, b_s = table(plan, catalog, baseline_largest_fitting)
        n_best, n_n, n_s = table(plan, catalog, largest_fitting)
        if b_best != n_best:
            print(f"  {name}: the searches disagree: baseline {b_best}, new {n_best}")
            bad = 1
        cold = []
        for _ in range(args.cold):
            t = time.perf_counter()
            subprocess.run([sys.executable, "-m", "capture", "estimate", "--example", name], cwd=ROOT, check=True,
                           capture_output=True)
            cold.append(time.perf_counter() - t)
        print(f"{name:<22}{b_n:>13}{n_n:>6}{b_s:>9.2f}{n_s:>8.2f}{b_s / n_s:>9.1f}x  "
              f"{statistics.median(cold) if cold else float('nan'):>13.2f}")
    print("replays: distinct micro-batches replayed for the catalog's cards (10% headroom, ceiling 1024); "
          "cold run: median wall time of `capture estimate --example NAME` in a fresh process")
    return bad


if __name__ == "__main__":
    sys.exit(main())

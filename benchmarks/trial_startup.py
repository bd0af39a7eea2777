"""Where the trial's start-up goes: import, device context and load, one at a time (issue 16 item 3).

    python benchmarks/trial_startup.py [--example tiny] [--device cuda] [--profile]

Prints each phase in the order the trial runs them (import torch, import transformers and the
model classes, the first device context, building the workload) and the ratio of "load" to the
2 s target; ``--profile`` adds the 25 most expensive calls of the load under cProfile.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TARGET_LOAD_S = 2.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--example", default="tiny")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    phases: list[tuple[str, float]] = []

    t = time.perf_counter()
    import torch

    phases.append(("import torch", time.perf_counter() - t))
    t = time.perf_counter()
    import transformers  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: F401

    phases.append(("import transformers (+ model classes)", time.perf_counter() - t))
    from capture.trial.config import load_example
    from capture.trial.workload import build_workload, resolve_device

    cfg = load_example(args.example).with_overrides(device=args.device)
    device = resolve_device(cfg.device)
    t = time.perf_counter()
    if device.type == "cuda":
        torch.zeros(1, device=device)
        torch.cuda.synchronize(device)
    phases.append(("device context", time.perf_counter() - t))
    prof = cProfile.Profile() if args.profile else None
    t = time.perf_counter()
    if prof:
        prof.enable()
    wl = build_workload(cfg, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if prof:
        prof.disable()
    load_s = time.perf_counter() - t
    phases.append((f"load ({wl.params_total:,} parameters)", load_s))
    t = time.perf_counter()
    wl.train_step()
    phases.append(("first step", time.perf_counter() - t))
    for name, seconds in phases:
        print(f"{name:45s} {seconds:8.3f} s")
    print(f"load / {TARGET_LOAD_S:g} s target: {load_s / TARGET_LOAD_S:.2f}x")
    if prof:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(25)
        print(out.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

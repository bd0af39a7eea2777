"""What capture's step instrumentation costs: the same training steps with and without it.

Baseline, by name: "uninstrumented loop" -- ``workload.train_step_async()`` N times, one
synchronize at the end. Instrumented: the same N steps inside ``capture.trial.recorder.Recorder``
(step-boundary CUDA events or perf_counter marks, data-loader wait timers around ``next()``,
peak-memory reset at the start and allocator + NVML/amdsmi/RSS readings at the end, the one
synchronize and the event read-out included). The two run interleaved, in alternating order, on
one workload; the figure is the median over rounds of (instrumented time / baseline time) - 1.
Target: <= 1%.

    python benchmarks/trial_overhead.py                      # CPU: the tiny example's shape
    python benchmarks/trial_overhead.py --device cuda        # CUDA: the llama-1b shape (H200: ~0.26 s/step)
    python benchmarks/trial_overhead.py --json               # one JSON object on stdout
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

BASELINE = "uninstrumented loop"


def _sync(torch, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--example", help="shape to train (default: tiny on CPU, llama-1b on CUDA)")
    ap.add_argument("--rounds", type=int, default=8, help="interleaved pairs (default 8)")
    ap.add_argument("--steps", type=int, default=10, help="optimizer steps per timed run (default 10)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    import torch

    from capture.trial.config import load_example
    from capture.trial.recorder import Recorder, device_name
    from capture.trial.runner import _quiet_libraries
    from capture.trial.workload import build_workload, resolve_device

    _quiet_libraries()
    device = resolve_device(args.device)
    example = args.example or ("llama-1b" if device.type == "cuda" else "tiny")
    config = load_example(example).with_overrides(device=device.type)
    wl = build_workload(config, device)
    for _ in range(args.warmup):
        wl.train_step_async()
    _sync(torch, device)

    def baseline() -> float:
        _sync(torch, device)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            wl.train_step_async()
        _sync(torch, device)
        return time.perf_counter() - t0

    def instrumented() -> float:
        _sync(torch, device)
        t0 = time.perf_counter()
        with Recorder(device, warmup_steps=0, params_total=wl.params_total, params_trainable=wl.params_trainable,
                      precision=config.precision.dtype, expected_steps=args.steps) as rec:
            batches = rec.batches(wl.loader)
            for _ in range(args.steps):
                loss = wl.train_step_async(batches)
                rec.step(tokens=wl.tokens_per_step, loss=loss)
        return time.perf_counter() - t0  # __exit__ synchronized, read the events and memory

    base_s, inst_s, ratios = [], [], []
    for r in range(args.rounds):
        if r % 2 == 0:
            b, i = baseline(), instrumented()
        else:
            i, b = instrumented(), baseline()
        base_s.append(b)
        inst_s.append(i)
        ratios.append(i / b)
        print(f"round {r + 1}/{args.rounds}: {BASELINE} {b:.4f} s, instrumented {i:.4f} s, ratio {i / b:.4f}",
              file=sys.stderr)
    overhead = statistics.median(ratios) - 1.0
    result = {
        "baseline": BASELINE, "device": str(device), "device_name": device_name(device), "example": example,
        "steps_per_run": args.steps, "rounds": args.rounds, "tokens_per_step": wl.tokens_per_step,
        "baseline_median_s": statistics.median(base_s), "instrumented_median_s": statistics.median(inst_s),
        "median_ratio": statistics.median(ratios), "overhead": overhead, "target_overhead": 0.01,
        "within_target": overhead <= 0.01, "torch": torch.__version__,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{example} on {result['device_name']}: {args.rounds} interleaved rounds of {args.steps} steps")
        print(f"  baseline \"{BASELINE}\": median {result['baseline_median_s']:.4f} s per run")
        print(f"  instrumented (capture Recorder): median {result['instrumented_median_s']:.4f} s per run")
        print(f"  overhead (median of per-round ratios): {overhead:+.2%} (target <= 1%: "
              f"{'met' if result['within_target'] else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

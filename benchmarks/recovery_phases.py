"""The recovery stage's phases, side by side with the path it replaced.

Baseline, by name: "full-state checkpoint, a fresh build per restore (the path before issue 24)"
(capture.trial.recover_steps.BASELINE): the whole model in the checkpoint (a LoRA run's frozen
base included), a fresh build of the workload for every restore (first restore, band
continuations, each sensitivity variant), no second resume. Measured: the stage as it runs now
(recover_steps.PLAN): a LoRA run checkpoints its adapter and verifies its base, each fresh process
builds once (while the reference runs, when memory allows) and reloads the state for every
restore, plus the second resume and the batch hashes; and, to tell the speed of that design from
the cost of the check it adds, the same with one resume only. All run here, one after the other,
on the same config and device (with --rounds 2, a second set in reverse order); the table gives
each sub-phase of ``[trial.recovery.phases]`` for each and the ratios baseline / now.

    python benchmarks/recovery_phases.py --quick                          # CPU: a tiny LoRA GPT-2 (CI)
    python benchmarks/recovery_phases.py CONFIG.toml --device cuda        # a GPU: e.g. an 8B LoRA config
    python benchmarks/recovery_phases.py CONFIG.toml --device cuda --json # one JSON object on stdout

On CUDA the fresh processes may build while the reference trains when the device has the memory
for it: ``--early-builds auto`` (default) measures one training step of the config here first and
decides as the trial does (capture.trial.recover_memory.MemoryBudget); on or off force it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

PHASES = ("reference", "save", "worker_start", "restore_build", "base_verify", "restore", "continuations",
          "second_resume", "sensitivity", "total")


def _budget(config, device):
    """The trial's early-build budget for this config, from one measured training step here."""
    import torch

    from capture.trial import recover, state
    from capture.trial.workload import build_workload

    if device.type != "cuda":
        return None
    torch.cuda.reset_peak_memory_stats(device)
    wl = build_workload(config, device)
    weights = sum(p.numel() * p.element_size() for p in wl.model.parameters())
    wl.train_step()
    state.sync(device)
    peak = torch.cuda.max_memory_reserved(device)
    del wl
    state.release_memory(device)
    total = torch.cuda.get_device_properties(device).total_memory
    return recover.MemoryBudget(int(total), int(peak) + 2**30, int(weights) + 2**30)  # + a context each


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", nargs="?", help="trial config (default: the tiny example as LoRA)")
    ap.add_argument("--quick", action="store_true", help="CPU, tiny shape, no sensitivity pass (CI)")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--method", choices=("full", "lora"), help="override trial.method")
    ap.add_argument("--rounds", type=int, default=1, help="pairs, alternating order (default 1)")
    ap.add_argument("--early-builds", default="auto", choices=("auto", "on", "off"),
                    help="build in the fresh processes while the reference trains (default: by memory)")
    ap.add_argument("--plans", default="baseline,now,one_resume",
                    help="which to run, comma-separated (default: baseline,now,one_resume)")
    ap.add_argument("--workdir", help="scratch folder (default: a temporary folder)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    import dataclasses

    import torch

    from capture.trial import base, recover
    from capture.trial.config import load_config, load_example
    from capture.trial.runner import _quiet_libraries
    from capture.trial.workload import resolve_device

    _quiet_libraries()
    device = resolve_device("cpu" if args.quick else args.device)
    config = load_config(args.config) if args.config else load_example("tiny")
    method = args.method or ("lora" if not args.config else None)
    config = config.with_overrides(device=device.type, method=method)
    if args.quick:
        config = dataclasses.replace(config, recovery=dataclasses.replace(config.recovery, sensitivity=False))
    from capture.trial.workload import import_model_code

    import_model_code(config)  # as the trial has by the time it reaches the recovery stage
    if config.method == "lora":
        import peft  # noqa: F401
    models = None
    spec = base.model_spec(config)
    if spec is not None and config.method == "lora":  # what the trial's fingerprint records, taken once
        from capture.probes import ProbeOptions
        from capture.probes.artifacts import probe_artifact

        models = [probe_artifact(spec, "model", ProbeOptions(progress=False)).to_manifest()]
    budget = _budget(config, device) if args.early_builds == "auto" else None
    now = recover.PLAN
    if args.early_builds != "auto":
        now = dataclasses.replace(now, early_build=args.early_builds == "on")
    plans = {"baseline": recover.BASELINE, "now": now, "one_resume": dataclasses.replace(now, resume_again=False)}
    chosen = [n.strip() for n in args.plans.split(",") if n.strip()]
    if not chosen or set(chosen) - set(plans):
        ap.error(f"--plans: choose from {', '.join(plans)}")
    plans = {n: plans[n] for n in plans if n in chosen}
    runs: dict[str, list[dict]] = {name: [] for name in plans}
    with tempfile.TemporaryDirectory(prefix="recovery-phases-", dir=args.workdir) as tmp:
        for r in range(args.rounds):
            for name in (list(plans) if r % 2 == 0 else list(plans)[::-1]):
                t0 = time.perf_counter()
                table = recover.run_recoverability(config, device, Path(tmp) / f"{name}-{r}", plan=plans[name],
                                                   budget=None if name == "baseline" else budget, models=models)
                table["phases"]["total_s"] = time.perf_counter() - t0
                runs[name].append(table)
                print(f"{name}: {table.get('verdict')}", file=sys.stderr)

    def median(name: str, phase: str) -> float | None:
        vals = sorted(t["phases"][f"{phase}_s"] for t in runs[name] if isinstance(t["phases"].get(f"{phase}_s"), float))
        return vals[len(vals) // 2] if vals else None

    rows = {p: {n: median(n, p) if n in plans else None for n in ("baseline", "now", "one_resume")} for p in PHASES}
    sizes = {n: runs[n][0].get("checkpoint_size_bytes") for n in plans}
    result = {"config": args.config or "example:tiny (lora)", "device": str(device), "method": config.method,
              "baseline": recover.BASELINE_NAME, "phases_s": rows, "checkpoint_size_bytes": sizes,
              "verdicts": {n: runs[n][0].get("verdict") for n in plans},
              "early_build": runs[list(plans)[-1]][0].get("plan", {}).get("early_build"), "rounds": args.rounds,
              "torch": torch.__version__}
    total = rows["total"]
    result["ratio_total"] = {n: total["baseline"] / total[n] if total["baseline"] and total[n] else None
                             for n in ("now", "one_resume")}
    if args.json:
        print(json.dumps(result, indent=1))
        return 0

    def cell(v: float | None) -> str:
        return f"{v:10.2f}" if v is not None else f"{'-':>10s}"

    def ratio(b: float | None, m: float | None) -> str:
        return f"{b / m:7.2f}x" if b and m else f"{'-':>8s}"

    print(f"recovery phases: {result['config']} ({config.method}) on {device}, {args.rounds} round(s), "
          f"early build {result['early_build']}")
    print(f"{'phase':16s} {'baseline':>10s} {'now':>10s} {'ratio':>8s} {'one resume':>10s} {'ratio':>8s}   (seconds)")
    for p, v in rows.items():
        print(f"{p.replace('_', ' '):16s} {cell(v['baseline'])} {cell(v['now'])} {ratio(v['baseline'], v['now'])} "
              f"{cell(v['one_resume'])} {ratio(v['baseline'], v['one_resume'])}")
    print(f"baseline: {recover.BASELINE_NAME}")
    r = result["ratio_total"]
    print("ratio against the baseline (total, baseline / now): "
          + (f"{r['now']:.2f}x" if r["now"] else "-")
          + (f", with one resume only {r['one_resume']:.2f}x" if r["one_resume"] else ""))
    print("checkpoint size: " + ", ".join(f"{n.replace('_', ' ')} {v} bytes" for n, v in sizes.items()))
    print("verdicts: " + ", ".join(f"{n.replace('_', ' ')} {v}" for n, v in result["verdicts"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

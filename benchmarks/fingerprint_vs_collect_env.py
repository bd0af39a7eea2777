"""`capture fingerprint` against the baseline `python -m torch.utils.collect_env`.

Both run as fresh processes of the same interpreter, interleaved (A B A B ...), so that disk
caches and CPU frequency treat them alike. Prints each median, the ratio baseline/capture
(target: >= 20x on a GPU machine, where collect_env took 8.2 s on the H200), and a coverage
table: for every fact collect_env reports, the manifest field that records it.

    python benchmarks/fingerprint_vs_collect_env.py [--rounds 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

BASELINE = "python -m torch.utils.collect_env"

# collect_env line prefix -> manifest field(s) that hold the same fact (any present = covered).
COVERAGE = {
    "PyTorch version": ["framework.version"],
    "Is debug build": ["framework.debug"],
    "CUDA used to build PyTorch": ["framework.cuda_version"],
    "ROCM used to build PyTorch": ["framework.hip_version"],
    "OS": ["host.os"],
    "GCC version": ["toolchain.gcc.version"],
    "Clang version": ["toolchain.clang.version"],
    "CMake version": ["toolchain.cmake.version"],
    "Libc version": ["host.libc"],
    "Python version": ["python.version"],
    "Python platform": ["host.kernel", "host.arch"],
    "Is CUDA available": ["accelerator.count", "framework.loaded.cuda_available"],
    "CUDA runtime version": ["framework.cuda_version", "framework.loaded.cuda_runtime_version"],
    "GPU models and configuration": ["accelerator.model", "nvidia.devices", "amd.devices"],
    "Nvidia driver version": ["nvidia.driver_version", "nvidia.skipped"],
    "cuDNN version": ["framework.cudnn_version", "framework.loaded.cudnn_version"],
    "HIP runtime version": ["framework.hip_version"],
    "MIOpen runtime version": ["framework.miopen_version"],
    "Is XNNPACK available": ["framework.loaded.xnnpack", "framework.loaded.config"],
    "CPU": ["host.cpu_model"],
    "Versions of relevant libraries": ["python.packages"],
}


def _get(data: dict, dotted: str) -> object:
    cur: object = data
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


def run_once(cmd: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", metavar="OUT", help="also write the figures as JSON")
    ap.add_argument("--deep", action="store_true", help="time `capture fingerprint --deep` (imports torch)")
    args = ap.parse_args()

    env = dict(os.environ)
    root = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "m.toml"
        ours = [sys.executable, "-m", "capture", "fingerprint", "-o", str(out)] + (["--deep"] if args.deep else [])
        base = [sys.executable, "-m", "torch.utils.collect_env"]
        run_once(ours, env)  # warm the page cache for both before timing
        run_once(base, env)
        t_ours, t_base = [], []
        for _ in range(args.rounds):
            t_ours.append(run_once(ours, env))
            t_base.append(run_once(base, env))
        manifest = tomllib.loads(out.read_text())
        baseline_text = subprocess.run(base, capture_output=True, text=True, env=env).stdout

    med_ours, med_base = statistics.median(t_ours), statistics.median(t_base)
    print(f"machine: {manifest.get('accelerator', {}).get('model')} x{manifest.get('accelerator', {}).get('count')}, "
          f"{manifest.get('host', {}).get('cpu_model')}")
    print(f"capture fingerprint{' --deep' if args.deep else ''}: median {med_ours:.3f} s over {args.rounds} runs "
          f"({', '.join(f'{t:.2f}' for t in t_ours)})")
    print(f"baseline {BASELINE}: median {med_base:.3f} s ({', '.join(f'{t:.2f}' for t in t_base)})")
    print(f"ratio (baseline / capture): {med_base / med_ours:.1f}x   target >= 20x on the GPU machine")

    # A fact collect_env could not find ("N/A", "Could not collect") needs no field to hold it.
    reported = {k.strip() for k, _, v in (ln.partition(":") for ln in baseline_text.splitlines() if ":" in ln)
                if v.strip() not in ("N/A", "Could not collect", "None", "")}
    print("\ncoverage of what collect_env reports:")
    missing = []
    for fact, fields in COVERAGE.items():
        if fact not in reported and fact not in ("CPU", "Versions of relevant libraries"):
            continue
        hit = next((f for f in fields if _get(manifest, f) is not None), None)
        print(f"  {fact:32s} -> {hit or 'NOT RECORDED'}")
        if hit is None:
            missing.append(fact)
    print(f"superset: {'yes' if not missing else 'no, missing: ' + ', '.join(missing)}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "capture_s": t_ours, "baseline_s": t_base, "median_capture_s": med_ours, "median_baseline_s": med_base,
            "ratio": med_base / med_ours, "missing": missing, "deep": args.deep,
        }, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

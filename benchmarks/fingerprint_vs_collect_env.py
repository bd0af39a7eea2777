"""`capture fingerprint` against the baseline `python -m torch.utils.collect_env`.

Both run as fresh processes of the same interpreter, interleaved (A B A B ...), so that disk
caches and CPU frequency treat them alike. Prints each median, the ratio baseline/capture
(target: >= 20x on a GPU machine, where collect_env took 8.2 s on the H200), and a coverage
table: for every fact collect_env reports, the manifest field that records it.

    python benchmarks/fingerprint_vs_collect_env.py [--rounds 5] [--json OUT]
    python benchmarks/fingerprint_vs_collect_env.py --profile      # where capture's time goes
    python benchmarks/fingerprint_vs_collect_env.py --quick        # CI: one round, ratio printed, not asserted
    python benchmarks/fingerprint_vs_collect_env.py --precompile   # first byte-compile what both import

``--profile`` adds two breakdowns, each from one fresh process: the probes run one at a time
(serially, so their times do not overlap as they do in threads), each split into the import of
its module and its run, beside the CLI's own start-up; and the import-time tree of that process
(``python -X importtime``), the 15 most expensive imports by cumulative time. Every figure is
also printed as a share of capture's own wall time, and the headline as a ratio to the baseline.

Measure with bytecode compiled, as users run it (pip writes ``.pyc`` files on install): an
interpreter run with PYTHONDONTWRITEBYTECODE=1 over packages installed without them compiles every
module it imports on every run, the baseline's torch included. ``--precompile`` byte-compiles, before
timing, every module either command imports (each command is run once in-process to find them,
the probes in threads so that all of them import there) and pip, which collect_env runs as a
subprocess; it prints how many files it compiled, so both figures can be told apart.
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
    # collect_env reads the CUDA runtime version from `nvcc --version`, then falls back on torch's
    "CUDA runtime version": ["toolchain.nvcc.version", "framework.cuda_version"],
    "GPU models and configuration": ["accelerator.model", "nvidia.devices", "amd.devices"],
    "Nvidia driver version": ["nvidia.driver_version", "nvidia.skipped"],
    "cuDNN version": ["framework.cudnn_version", "framework.loaded.cudnn_version"],
    "HIP runtime version": ["framework.hip_version"],
    "MIOpen runtime version": ["framework.miopen_version"],
    "Is XNNPACK available": ["framework.xnnpack", "framework.loaded.xnnpack"],
    "CPU": ["host.cpu_model"],
    "Versions of relevant libraries": ["python.packages"],
}


# Facts whose value can be compared as text: collect_env's value -> the manifest field's, normalised.
def _same_version(theirs: str, ours: object) -> bool:
    return isinstance(ours, str) and (theirs == ours or theirs.startswith(ours) or ours.startswith(theirs))


AGREE = {
    "PyTorch version": _same_version,
    "Is debug build": lambda theirs, ours: theirs == str(ours),
    "CUDA used to build PyTorch": _same_version,
    "CUDA runtime version": _same_version,
    "Nvidia driver version": lambda theirs, ours: theirs == ours,
    "Is XNNPACK available": lambda theirs, ours: theirs == str(ours),
    "CMake version": lambda theirs, ours: isinstance(ours, str) and theirs.endswith(" " + ours),
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


# Runs in a fresh interpreter: the CLI's start-up, then every probe serially (import, then run).
_SERIAL = r"""
import importlib, json, sys, time
t0 = time.perf_counter()
from capture import _cli
t1 = time.perf_counter()
_cli._parser(["fingerprint"], _cli._groups_for(["fingerprint"]))
t2 = time.perf_counter()
from capture.fingerprint import PROBES, _run_probe
from capture.probes import ProbeOptions
from capture import manifest
t3 = time.perf_counter()
out = {"import capture._cli": t1 - t0, "argument parser (fingerprint only)": t2 - t1,
       "import capture.fingerprint + manifest": t3 - t2}
from capture.fingerprint import _table
opts = ProbeOptions(progress=False)
results = {}
for section, module, func in PROBES:
    if section in ("models", "datasets"):
        continue  # none asked for: the fingerprint leaves them out without importing anything
    a = time.perf_counter()
    importlib.import_module("capture.probes." + module)
    b = time.perf_counter()
    results[section] = _run_probe(section, module, func, opts, False)
    c = time.perf_counter()
    out["probe " + section + ": import"] = b - a
    out["probe " + section + ": run"] = c - b
a = time.perf_counter()
tables = {section: _table(result) for section, result in results.items()}
b = time.perf_counter()
body = manifest.dumps({**manifest.new_manifest(), **tables})
c = time.perf_counter()
out["tables (redaction of every string)"] = b - a
out["manifest bytes (TOML)"] = c - b
print(json.dumps(out))
"""


def _profile(env: dict[str, str], capture_s: float) -> dict[str, object]:
    """Serial per-probe breakdown and import-time breakdown, printed and returned."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", _SERIAL], capture_output=True, text=True,
                          env=env, check=True)
    serial = json.loads(done.stdout.strip().splitlines()[-1])
    total = sum(serial.values())
    print(f"\nserial breakdown (one fresh process, probes one at a time; sum {total * 1000:.0f} ms, "
          f"{total / capture_s:.2f}x capture's concurrent wall time of {capture_s * 1000:.0f} ms):")
    for name, secs in sorted(serial.items(), key=lambda kv: -kv[1]):
        print(f"  {name:44s} {secs * 1000:8.1f} ms  {secs / capture_s:6.1%} of capture's wall time")
    imports = []
    for line in done.stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        self_us, cum_us, raw_name = line[len("import time:"):].split("|")
        depth = (len(raw_name) - len(raw_name.lstrip()) - 1) // 2
        name = raw_name.strip()
        imports.append((int(cum_us), int(self_us), depth, name))
    top = sorted(imports, reverse=True)[:15]
    print(f"\nimport-time breakdown (python -X importtime, same process; 15 largest by cumulative time):")
    for cum_us, self_us, depth, name in top:
        print(f"  {'  ' * min(depth, 6)}{name:{44 - 2 * min(depth, 6)}s} cumulative {cum_us / 1000:7.1f} ms "
              f"(self {self_us / 1000:6.1f} ms)  {cum_us / 1e6 / capture_s:6.1%} of capture's wall time")
    return {"serial_s": serial, "imports_top": [{"module": n, "cumulative_s": c / 1e6, "self_s": s_ / 1e6}
                                                 for c, s_, _d, n in top]}


# Runs one command in-process, then byte-compiles every module it imported (argv[1]: which).
_PRECOMPILE = r"""
import contextlib, io, os, py_compile, runpy, sys, tempfile
which = sys.argv[1]
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    if which == "capture":
        os.environ["CAPTURE_FANOUT"] = "threads"
        from capture import _cli
        with tempfile.TemporaryDirectory() as tmp:
            _cli.main(["fingerprint", "-o", os.path.join(tmp, "m.toml")])
    else:
        sys.argv = ["collect_env"]
        runpy.run_module("torch.utils.collect_env", run_name="__main__")
    import pip
    sources = [getattr(m, "__file__", None) for m in list(sys.modules.values())]
done = 0
for src in sources:
    if src and src.endswith(".py") and os.path.isfile(src):
        try:
            py_compile.compile(src, doraise=True)
            done += 1
        except (py_compile.PyCompileError, OSError):
            pass
print(done)
"""


def _precompile(env: dict[str, str]) -> None:
    """Byte-compile what both commands import (see the module's docstring), and pip."""
    counts = []
    for which in ("capture", "collect_env"):
        done = subprocess.run([sys.executable, "-c", _PRECOMPILE, which], capture_output=True, text=True, env=env,
                              timeout=600)
        counts.append(int(done.stdout.strip() or 0) if done.returncode == 0 else 0)
    import pip

    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", os.path.dirname(pip.__file__)],
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, timeout=600)
    print(f"precompiled: {counts[0]} modules capture imports, {counts[1]} modules collect_env imports, and pip")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", metavar="OUT", help="also write the figures as JSON")
    ap.add_argument("--deep", action="store_true", help="time `capture fingerprint --deep` (imports torch)")
    ap.add_argument("--profile", action="store_true", help="also print the serial per-probe and import-time breakdowns")
    ap.add_argument("--quick", action="store_true", help="one round, no warm-up run (CI: the ratio is printed, not asserted)")
    ap.add_argument("--precompile", action="store_true",
                    help="first byte-compile every module either command imports (for interpreters run with "
                         "PYTHONDONTWRITEBYTECODE=1 over packages installed without .pyc files)")
    args = ap.parse_args()
    if args.quick:
        args.rounds = 1

    env = dict(os.environ)
    root = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    if args.precompile:
        _precompile(env)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "m.toml"
        ours = [sys.executable, "-m", "capture", "fingerprint", "-o", str(out)] + (["--deep"] if args.deep else [])
        base = [sys.executable, "-m", "torch.utils.collect_env"]
        if not args.quick:
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
    print(f"ratio against the baseline ({BASELINE} / capture fingerprint): {med_base / med_ours:.1f}x   "
          f"(targets: >= 20x and <= 0.30 s on the H200; >= 10x on the 2-core CPU machine)")

    # A fact collect_env could not find ("N/A", "Could not collect") needs no field to hold it.
    reported = {k.strip() for k, _, v in (ln.partition(":") for ln in baseline_text.splitlines() if ":" in ln)
                if v.strip() not in ("N/A", "Could not collect", "None", "", "No CUDA")}
    values = {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in baseline_text.splitlines() if ":" in ln)}
    print("\ncoverage of what collect_env reports:")
    missing, disagree = [], []
    for fact, fields in COVERAGE.items():
        if fact not in reported and fact not in ("CPU", "Versions of relevant libraries"):
            continue
        hit = next((f for f in fields if _get(manifest, f) is not None), None)
        verdict = ""
        if hit is not None and fact in AGREE and fact in values:
            same = AGREE[fact](values[fact], _get(manifest, hit))
            verdict = f"   ({'same value' if same else 'DIFFERENT'}: {values[fact]!r} / {_get(manifest, hit)!r})"
            if not same:
                disagree.append(fact)
        print(f"  {fact:32s} -> {hit or 'NOT RECORDED'}{verdict}")
        if hit is None:
            missing.append(fact)
    print(f"superset: {'yes' if not missing else 'no, missing: ' + ', '.join(missing)}"
          f"{'; values differ: ' + ', '.join(disagree) if disagree else ''}")
    profile = _profile(env, med_ours) if args.profile else None
    if args.json:
        Path(args.json).write_text(json.dumps({
            "capture_s": t_ours, "baseline_s": t_base, "median_capture_s": med_ours, "median_baseline_s": med_base,
            "ratio": med_base / med_ours, "missing": missing, "disagree": disagree, "precompiled": args.precompile, "deep": args.deep, "baseline": BASELINE,
            "rounds": args.rounds, "profile": profile,
        }, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

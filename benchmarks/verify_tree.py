"""How fast `capture verify DIR` checks a results repository (signature and trust only).

Target: 1,000 manifests in under 10 s on a 2-core machine. Makes N signed manifests the size of
a real fingerprint (this machine's real `capture.fingerprint.collect()`, with the H200 readings
of tests/fixtures/h200/probe.json as accelerator, framework and trial, and the package table
padded with the pip lines of the captured collect_env reports, then with numbered packages, to
--packages entries), files them in the results-repository layout, and times
:func:`capture.verify.tree.verify_paths` against two named baselines:

- "naive": the same checks done file by file with no sharing: `capture.verify.open.open_manifest`
  in a loop with the allowed-signers cache cleared each time (found and parsed for every manifest);
- "ssh-keygen -Y verify": OpenSSH's own verifier, one process per file (measured on a sample and
  scaled up, it is slow).

    python benchmarks/verify_tree.py [-n 1000] [--packages 250] [--repeat 3]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from capture import manifest as mf  # noqa: E402
from capture import signing  # noqa: E402
from capture.fingerprint import collect  # noqa: E402
from capture.probes import ProbeOptions  # noqa: E402
from capture.results.index import render_json
from capture.results.pin import pin_path  # noqa: E402
from capture.verify.tree import verify_paths  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures"
TARGET_N, TARGET_S = 1000, 10.0


def base_manifest(packages: int) -> dict:
    probe = json.loads((FIXTURES / "h200" / "probe.json").read_text())
    m = collect(ProbeOptions(progress=False), kind="trial")
    nvml, torch, run = probe["nvml"], probe["torch"], probe["llama_1b"]
    m["accelerator"] = {"vendor": "nvidia", "model": nvml["name"], "count": 1, "driver_version": nvml["driver"],
                        "runtime": "cuda", "runtime_version": torch["cuda"], "memory_per_device_bytes": nvml["mem_total"]}
    m["nvidia"] = {"driver_version": nvml["driver"], "cuda_driver_version": "13.0", "devices": [{
        "index": 0, "name": nvml["name"], "uuid": nvml["uuid"], "serial": nvml["serial"], "pci_bus_id": nvml["pci_bus"],
        "memory_total_bytes": nvml["mem_total"], "compute_capability": "9.0", "vbios_version": nvml["vbios"],
        "ecc_enabled": True, "mig_enabled": False, "power_limit_w": 700, "visible": True, "cuda_index": 0}]}
    m["framework"] = {"name": "torch", "version": torch["version"], "cuda_version": torch["cuda"],
                      "git_version": torch["git"], "arch_list": torch["arch_list"],
                      "cudnn_version": str(torch["cudnn"]), "nccl_version": torch["nccl"]}
    m["trial"] = {"stats": {"tokens_per_s": run["tok_s"], "step_time_median_s": run["step_med_s"], "mfu": run["mfu"]},
                  "memory": {"measured": {"peak_allocated_bytes": run["max_alloc"], "device_used_bytes": run["nvml_used"]}},
                  "steps": {"step_time_s": [run["step_med_s"]] * 100, "loss": probe["resume_losses"]["full"] * 12}}
    pkgs = m.setdefault("python", {}).setdefault("packages", {})
    for f in FIXTURES.glob("**/*collect_env*.txt"):
        for name, ver in re.findall(r"^\[(?:pip3|conda)\] ([A-Za-z0-9_.-]+)==?\s*([^\s]+)", f.read_text(), re.M):
            pkgs.setdefault(name.lower(), {"version": ver, "source": "index"})
    i = 0
    while len(pkgs) < packages:
        pkgs[f"package-{i:03d}"] = {"version": f"1.{i}.0", "source": "index"}
        i += 1
    return m


def make_tree(root: Path, n: int, packages: int) -> tuple[Path, int]:
    key_path = root / "id_ed25519"
    signing.generate_key(key_path, "bench@lab")
    key = signing.load_private_key(key_path)
    repo = root / "results"
    (repo / ".capture").mkdir(parents=True)
    # a results repository lives in a git work tree; its root's .capture/allowed_signers decides trust
    subprocess.run(["git", "init", "-q", str(repo)], check=True, capture_output=True)
    (repo / ".capture" / "allowed_signers").write_text(f"bench@lab {signing.public_key_line(key)}\n")
    rows = []
    m = base_manifest(packages)
    sizes = []
    for i in range(n):
        m["created_utc"] = f"2026-{1 + i % 12:02d}-{1 + i % 28:02d}T{i % 24:02d}:00:00Z"
        m["trial"]["stats"]["tokens_per_s"] = 64113.2 + i
        body = mf.dumps(m)
        raw = body + signing.make_trailer(body, key, "bench@lab")
        rel = pin_path(m, raw)
        dest = repo / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(raw)
        rows.append({"path": rel, "content_id": Path(rel).stem})
        sizes.append(len(raw))
    (repo / "index.json").write_bytes(render_json(rows))  # what pin writes: verify DIR checks it lists every file
    return repo, int(statistics.median(sizes))


def timed(fn, repeat: int) -> tuple[list[float], list[float]]:
    """Wall seconds and CPU seconds (this process and its finished children) of each run.

    On a busy machine the wall time mostly measures the other work; the CPU time is what this
    work costs, and what its wall time would be on an idle core.
    """
    walls, cpus = [], []
    for _ in range(repeat):
        c0, t0 = os.times(), time.perf_counter()
        fn()
        c1, t1 = os.times(), time.perf_counter()
        walls.append(t1 - t0)
        cpus.append(sum(c1[:4]) - sum(c0[:4]))
    return walls, cpus


def naive(files: list[str]) -> None:
    from capture.verify import open as door
    for f in files:
        door._load_allowed.cache_clear()
        door.open_manifest(f)


def ssh_keygen_per_file(files: list[str], allowed: Path, work: Path) -> None:
    for f in files:
        raw = Path(f).read_bytes()
        body, trailer = mf.split_signed(raw)
        sig = mf.parse_trailer(trailer)
        (work / "sig").write_text(sig["signature"])
        subprocess.run(["ssh-keygen", "-Y", "verify", "-f", str(allowed), "-I", sig["principal"],
                        "-n", signing.NAMESPACE, "-s", str(work / "sig")], input=body, check=True,
                       capture_output=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=TARGET_N, help="manifests to generate (default 1000)")
    ap.add_argument("--packages", type=int, default=250, help="entries in [python.packages] (default 250)")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs of each contender (default 3)")
    ap.add_argument("--parser", choices=("tomllib", "tomli"), default="tomllib",
                    help="TOML parser behind capture.manifest (tomli: the mypyc-compiled build of the same parser)")
    ap.add_argument("--ssh-sample", type=int, default=50, help="files given to ssh-keygen (default 50)")
    args = ap.parse_args()
    if args.parser == "tomli":
        import tomli  # same code as the standard library's tomllib, compiled; an experiment, not the default
        mf.tomllib = tomli
        print(f"parser: tomli {getattr(tomli, '__version__', '')} ({'compiled' if tomli.__file__.endswith('.so') else 'pure Python'})")

    work = Path(tempfile.mkdtemp(prefix="capture-bench-"))
    try:
        t0 = time.perf_counter()
        repo, size = make_tree(work, args.n, args.packages)
        files = sorted(str(p) for p in repo.rglob("*.toml"))
        print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPU(s) (other work slows every figure below)")
        print(f"generated {len(files)} signed manifests, median {size / 1024:.1f} KiB, {args.packages} packages each "
              f"({time.perf_counter() - t0:.1f} s); {os.cpu_count()} CPU(s)")

        sink = io.StringIO()
        codes = []
        w1, c1 = timed(lambda: codes.append(verify_paths([str(repo)], out=sink, jobs=1)), args.repeat)
        print(f"capture verify DIR, one process: wall best {min(w1):.2f} s (median {statistics.median(w1):.2f}), "
              f"CPU {min(c1):.2f} s -> {len(files) / min(w1):,.0f} manifests/s wall, "
              f"{len(files) / min(c1):,.0f} per CPU-second")
        jobs = os.cpu_count() or 1
        wp, cp = timed(lambda: codes.append(verify_paths([str(repo)], out=sink)), args.repeat)
        assert set(codes) == {0}, "benchmark tree did not verify"
        best = min(wp)
        idle = min(cp) / jobs  # what the wall time would be with the cores to ourselves
        print(f"capture verify DIR, default ({jobs} worker processes): wall best {best:.2f} s "
              f"(median {statistics.median(wp):.2f}), CPU {min(cp):.2f} s -> {len(files) / best:,.0f} manifests/s wall; "
              f"on idle cores ~{idle:.2f} s")
        for label, secs in (("measured wall", best), ("idle-core estimate (CPU / cores)", idle)):
            per_1000 = secs * TARGET_N / len(files)
            print(f"target 1,000 manifests in {TARGET_S:.0f} s, {label}: {per_1000:.2f} s per 1,000 -> "
                  f"{TARGET_S / per_1000:.2f}x the target's speed {'(met)' if per_1000 < TARGET_S else '(MISSED)'}")

        wn, cn = timed(lambda: naive(files), args.repeat)
        print(f"baseline naive (open_manifest per file, no shared cache, one process): wall {min(wn):.2f} s, "
              f"CPU {min(cn):.2f} s -> capture is {min(wn) / best:.2f}x faster in wall time, "
              f"{min(cn) / min(c1):.2f}x less CPU in one process")

        sample = files[: args.ssh_sample]
        if shutil.which("ssh-keygen"):
            ws, cs = timed(lambda: ssh_keygen_per_file(sample, repo / ".capture" / "allowed_signers", work), 1)
            est = ws[0] * len(files) / len(sample)
            print(f"baseline ssh-keygen -Y verify per file (signature only, no parse): {ws[0]:.2f} s for {len(sample)} "
                  f"-> ~{est:.1f} s for {len(files)} (scaled) -> capture is {est / best:.1f}x faster")
        else:
            print("baseline ssh-keygen -Y verify: not run (ssh-keygen not found)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The benchmarks run on the CPU in a quick mode (CI): each finishes and prints its figures as a
ratio against its named baseline. The ratios are printed, not asserted: speed goals live in
benchmarks/, not in timed tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
QUICK = {
    "fingerprint_vs_collect_env.py": (["--quick", "--profile"], ("ratio against the baseline", "serial breakdown",
                                                                  "import-time breakdown", "superset:")),
    "trial_overhead.py": (["--rounds", "1", "--steps", "2", "--warmup", "1", "--device", "cpu"],
                          ("baseline", "overhead")),
    "estimate_speed.py": (["--examples", "tiny,llama-1b", "--cold", "0"], ("replays base", "speed-up", "llama-1b")),
    "host_copy.py": (["--gib", "0.25"], ("default s", "read/thp", "read-mmap/default")),
    "tokenize_speed.py": (["--quick"], ("ratio against the baseline", "ids equal")),
    "find_max_batch.py": (["--quick"], ("ratio against the baseline", "capped at 64", "peak resident memory")),
    "recovery_phases.py": (["--quick"], ("ratio against the baseline", "second resume",
                                         "verdicts: baseline bit-exact, now bit-exact, one resume bit-exact")),
}


@pytest.mark.parametrize("script", sorted(QUICK))
def test_benchmark_quick_mode(script: str, tmp_path: Path) -> None:
    args, expected = QUICK[script]
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "cfg"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    for text in expected:
        assert text in done.stdout, (text, done.stdout[-2000:])
    sys.stderr.write(done.stdout)  # the figures, for the CI log


REFERENCE = ROOT / "manifests" / "nvidia-h100-80gb-hbm3-x1" / "2026-12-05"


def _env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "cfg"),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def test_reference_table_reads_the_pinned_runs_through_the_door(tmp_path: Path) -> None:
    from capture.verify.open import open_manifest, load_allowed

    allowed = ROOT / "manifests" / ".capture" / "allowed_signers"
    files = sorted(REFERENCE.glob("*.toml"))
    assert len(files) >= 2
    cmd = [sys.executable, str(ROOT / "benchmarks" / "reference_table.py"), "--allowed-signers", str(allowed)]
    done = subprocess.run([*cmd, *map(str, files)], env=_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = done.stdout.splitlines()[2:]
    assert len(rows) == len(files)
    trust = load_allowed(allowed)
    for f, line in zip(files, rows):
        cells = [c.strip() for c in line.strip("|").split("|")]
        t = open_manifest(f, trust).data["trial"]
        est, used = t["memory"]["estimate"]["total_bytes"], t["memory"]["measured"]["device_used_bytes"]
        assert cells[-1] == f.stem and cells[0] == t["run"]["name"]
        assert cells[5] == f"{(est - used) / used * 100:+.1f} %"
    # a figure changed after signing: refused (exit 4), no table
    forged = tmp_path / files[0].name
    forged.write_bytes(files[0].read_bytes().replace(b"device_used_bytes = ", b"device_used_bytes = 1", 1))
    done = subprocess.run([*cmd, str(forged)], env=_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert done.returncode == 4 and done.stdout == "" and len(done.stderr.splitlines()) <= 2, done.stderr


def test_reference_trials_run_the_settings_in_the_order_named(tmp_path: Path) -> None:
    env = dict(_env(tmp_path), ESTIMATE_ONLY="1", ONLY="lora-chunked-8k lora-nogc",
               CAPTURE=f"{sys.executable} -m capture")
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "reference_trials.sh"), str(tmp_path / "out")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    heads = [ln.split()[1] for ln in done.stdout.splitlines() if ln.startswith("== ")]
    assert heads == ["lora-chunked-8k", "lora-nogc"]
    first, second = done.stdout.split("== lora-nogc")
    assert "fits mb 1" in first and "fits mb 2" in second  # the variants' micro-batches took effect
    assert list((tmp_path / "out").iterdir()) == []  # configs are not results

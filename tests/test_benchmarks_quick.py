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

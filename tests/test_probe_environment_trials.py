"""Issue 10: the environment is recorded as the process found it at start. Two back-to-back real
`capture trial --example tiny` runs (CPU; without the preflight and the recovery stage, ~9 s each
alone) record the same environment table, though torch sets variables of its own
(TORCHINDUCTOR_CACHE_DIR, which it sets in these runs too) inside each process."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

from capture import manifest


def _trial(tmp_path: Path, name: str, env: dict[str, str]) -> dict:
    out = tmp_path / f"{name}.toml"
    args = ["trial", "--example", "tiny", "--no-report", "--no-preflight", "--no-recovery", "-o", str(out),
            "--code", str(tmp_path)]
    done = subprocess.run([sys.executable, "-m", "capture", *args], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return tomllib.loads(manifest.split_signed(out.read_bytes())[0].decode())


def test_back_to_back_tiny_trials_record_the_same_environment(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "CAPTURE_"))}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "cfg")
    env["OMP_NUM_THREADS"] = "2"  # a variable the user did set: recorded in both
    first = _trial(tmp_path, "first", env)
    second = _trial(tmp_path, "second", env)
    assert first["environment"] == second["environment"]
    assert first["environment"]["variables"]["OMP_NUM_THREADS"] == "2"
    assert "TORCHINDUCTOR_CACHE_DIR" not in first["environment"]["variables"]

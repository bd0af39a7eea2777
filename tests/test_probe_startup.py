"""Fingerprint start-up: what only some commands need is not imported, GitPython is not on the
fingerprint path, and --timings says that probes run concurrently (issue 16 items 1 and 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import json, sys
from capture._cli import main
code = main(sys.argv[1:])
print(json.dumps({"code": code, "modules": sorted(sys.modules)}))
"""


def _fingerprint(tmp_path: Path, *args: str) -> tuple[dict, str]:
    # threads: every probe imports in this process, so its sys.modules shows all of them
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "cfg"), "CAPTURE_FANOUT": "threads"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, "fingerprint", "-o", str(tmp_path / "m.toml"),
                           "--code", str(ROOT), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_fingerprint_imports_only_its_own_command_group_and_no_gitpython(tmp_path: Path) -> None:
    result, _ = _fingerprint(tmp_path)
    assert result["code"] == 0
    modules = set(result["modules"])
    assert "capture.commands.core" in modules
    assert not modules & {"capture.commands.trial", "capture.commands.image", "capture.commands.results"}
    assert "git" not in modules  # GitPython: its import alone runs `git version`
    assert not any(m.startswith(("torch", "transformers", "huggingface_hub", "tqdm")) for m in modules)
    if not any(os.path.exists(p) for p in ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg")):
        assert "pynvml" not in modules  # no driver: NVML is not even imported


def test_help_still_lists_every_command() -> None:
    done = subprocess.run([sys.executable, "-m", "capture", "--help"], capture_output=True, text=True, timeout=120)
    for command in ("fingerprint", "verify", "trial", "image", "pin", "compare", "show", "export"):
        assert command in done.stdout


def test_timings_say_probes_run_concurrently(tmp_path: Path) -> None:
    _, stderr = _fingerprint(tmp_path, "--timings")
    assert "probes run concurrently" in stderr
    lines = {line.split()[0]: line for line in stderr.splitlines() if line.strip()}
    for probe in ("nvidia", "python", "code", "environment"):
        assert probe in lines
    assert "sum of probes" in stderr and "wall, probes" in stderr and "wall, total" in stderr

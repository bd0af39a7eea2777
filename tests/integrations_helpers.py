"""Shared by tests/test_integrations_*.py and tests/test_exec*.py: real processes, real keys."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "scripts"
EXAMPLES = ROOT / "examples"


def child_env(home: Path, **extra: str) -> dict[str, str]:
    """An environment for a child process: isolated config folder, no hub access, quiet libraries."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CAPTURE_", "WANDB_", "MLFLOW_"))}
    env.update(XDG_CONFIG_HOME=str(home / "cfg"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
               PYTHONWARNINGS="ignore::DeprecationWarning")
    env.update(extra)
    return env


def torchrun(args: list[str], env: dict[str, str], cwd: Path, nproc: int = 2, timeout: int = 240) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def capture_cli(args: list[str], env: dict[str, str], cwd: Path, timeout: int = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "capture", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def verify(path: Path, home: Path, cwd: Path) -> dict[str, Any]:
    """`capture verify --json` over the manifest with the home's allowed signers; asserts exit 0."""
    import json

    allowed = home / "cfg" / "capture" / "allowed_signers"
    res = capture_cli(["verify", str(path), "--allowed-signers", str(allowed), "--json"], child_env(home), cwd)
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads(res.stdout)


def read_signed(path: Path, home: Path) -> dict[str, Any]:
    """The manifest's data after its signature checks out against the home's allowed signers."""
    from capture import manifest as mf
    from capture import signing

    allowed = signing.AllowedSigners.load(home / "cfg" / "capture" / "allowed_signers")
    _info, body = signing.verify_signed_bytes(path.read_bytes(), allowed, str(path))
    return mf.parse_body(body, str(path))


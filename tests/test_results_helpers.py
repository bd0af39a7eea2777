"""Shared builders for the results tests: real keys, real signed manifests, real git repositories.

The manifests start from a real ``capture.fingerprint.collect()`` of this machine; what cannot
exist here (an H200 and a trial run on it) is filled in from the captured H200 readings in
tests/fixtures/h200/probe.json.
"""

from __future__ import annotations

import copy
import functools
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from capture import manifest as mf
from capture import signing

FIXTURES = Path(__file__).parent / "fixtures"


@functools.lru_cache(maxsize=1)
def _collected() -> dict[str, Any]:
    from capture.fingerprint import collect
    from capture.probes import ProbeOptions

    return collect(ProbeOptions(progress=False), kind="fingerprint")


@functools.lru_cache(maxsize=1)
def h200_probe() -> dict[str, Any]:
    return json.loads((FIXTURES / "h200" / "probe.json").read_text())


def h200_stack() -> dict[str, Any]:
    """The accelerator, nvidia and framework tables of a manifest written on the H200 (values from
    probe.json), copied: a test that changes them must not change the cached probe other tests read."""
    p = copy.deepcopy(h200_probe())
    nvml, torch = p["nvml"], p["torch"]
    return {
        "nvidia": {
            "driver_version": nvml["driver"],
            "cuda_driver_version": f"{nvml['cuda_driver'] // 1000}.{nvml['cuda_driver'] % 1000 // 10}",
            "devices": [{
                "index": 0, "name": nvml["name"], "uuid": nvml["uuid"], "serial": nvml["serial"],
                "pci_bus_id": nvml["pci_bus"], "memory_total_bytes": nvml["mem_total"],
                "compute_capability": f"{nvml['cc'][0]}.{nvml['cc'][1]}", "vbios_version": nvml["vbios"],
                "ecc_enabled": bool(nvml["ecc"][0]), "mig_enabled": bool(nvml["mig"][0]),
                "power_limit_w": nvml["power_limit_mw"] // 1000, "visible": True, "cuda_index": 0,
            }],
        },
        "framework": {
            "name": "torch", "version": torch["version"], "cuda_version": torch["cuda"],
            "git_version": torch["git"], "arch_list": torch["arch_list"],
            "cudnn_version": str(torch["cudnn"]), "nccl_version": torch["nccl"], "source": "torch/version.py",
        },
        "accelerator": {
            "vendor": "nvidia", "model": nvml["name"], "count": 1, "driver_version": nvml["driver"],
            "runtime": "cuda", "runtime_version": torch["cuda"], "memory_per_device_bytes": nvml["mem_total"],
        },
    }


def h200_manifest(kind: str = "trial", created_utc: str = "2026-12-02T10:15:00Z") -> dict[str, Any]:
    """A manifest as `capture trial` on the H200 would write it (values from probe.json)."""
    p = h200_probe()
    run = p["llama_1b"]
    m = copy.deepcopy(_collected())
    m["kind"] = kind
    m["created_utc"] = created_utc
    m.update(h200_stack())
    m["models"] = [{"spec": "meta-llama/Llama-3.2-1B@main", "repo_id": "meta-llama/Llama-3.2-1B", "revision": "main",
                    "commit": "4e20de362430cd3b72f300e6b0f18e50e7166e08", "source": "hf-cache"}]
    if kind == "trial":
        m["trial"] = {
            "run": {"method": "full", "precision": "bf16", "micro_batch_size": run["mb"], "max_seq_len": run["seq"],
                    "params_total": run["params"], "device": "cuda:0"},
            "stats": {"tokens_per_s": run["tok_s"], "step_time_median_s": run["step_med_s"],
                      "step_time_p90_s": run["step_med_s"] * (1 + run["step_cv"]), "mfu": run["mfu"],
                      "step_time_cv": run["step_cv"]},
            "memory": {"measured": {"peak_allocated_bytes": run["max_alloc"], "peak_reserved_bytes": run["max_reserved"],
                                    "device_used_bytes": run["nvml_used"]}},
            "checkpoint": {"duration_s": run["ckpt_write_s"], "size_bytes": run["ckpt_bytes"],
                           "bytes_per_s": run["ckpt_bytes"] / run["ckpt_write_s"], "fsync": True},
            "recovery": {"verdict": "diverged at step 5" if not p["resume_bitexact"] else "bit-exact"},
            "cost": {"wall_total_s": 612.0, "price_per_hour": 3.5, "price_source": "--price-per-hour",
                     "trial_cost": 0.595, "trained_tokens": 3_500_000, "cost_per_million_trained_tokens": 0.17},
        }
    return m


class Signer:
    """A real Ed25519 key made by capture.signing, with its allowed-signers line."""

    def __init__(self, folder: Path, principal: str) -> None:
        self.principal = principal
        self.key = folder / f"{principal.split('@')[0]}_ed25519"
        signing.generate_key(self.key, principal)
        self.public_key = signing.public_key_line(signing.load_private_key(self.key))
        self.fingerprint = signing.fingerprint(self.public_key)

    @property
    def allowed_line(self) -> str:
        return f"{self.principal} {self.public_key}\n"

    def write(self, path: Path, manifest: dict[str, Any]) -> bytes:
        path.parent.mkdir(parents=True, exist_ok=True)
        return signing.write_signed(path, mf.dumps(manifest), self.key, self.principal)


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def make_results_repo(path: Path, *signers: Signer) -> Path:
    """A real results repository: git init, a committer, .capture/allowed_signers committed."""
    path.mkdir(parents=True, exist_ok=True)
    git(path, "init", "-q", "-b", "main")
    git(path, "config", "user.name", "Results Bot")
    git(path, "config", "user.email", "results@example.invalid")
    (path / ".capture").mkdir()
    (path / ".capture" / "allowed_signers").write_text("".join(s.allowed_line for s in signers))
    git(path, "add", ".capture/allowed_signers")
    git(path, "commit", "-q", "-m", "trust signers")
    return path


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, Signer]:
    folder = tmp_path_factory.mktemp("keys")
    return {"alice": Signer(folder, "alice@lab"), "mallory": Signer(folder, "mallory@elsewhere")}

"""What the signing tests share: a manifest body from real H200 readings, a fresh key, allowed-signers files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from capture import manifest, signing

FIXTURES = Path(__file__).parent / "fixtures"


def h200_manifest() -> dict:
    """A manifest body built from the readings of a real H200 (tests/fixtures/h200/probe.json)."""
    probe = json.loads((FIXTURES / "h200" / "probe.json").read_text())
    nvml, torch = probe["nvml"], probe["torch"]
    m = manifest.new_manifest("fingerprint")
    m["created_utc"] = "2025-06-01T12:00:00Z"
    m["accelerator"] = {"vendor": "nvidia", "model": nvml["name"], "count": 1, "driver_version": nvml["driver"],
                        "runtime": "cuda", "runtime_version": "13.0", "memory_per_device_bytes": nvml["mem_total"]}
    m["nvidia"] = {
        "driver_version": nvml["driver"], "cuda_driver_version": "13.0",
        "devices": [{"index": 0, "name": nvml["name"], "uuid": nvml["uuid"], "serial": nvml["serial"],
                     "pci_bus_id": nvml["pci_bus"], "memory_total_bytes": nvml["mem_total"],
                     "compute_capability": "%d.%d" % tuple(nvml["cc"]), "vbios_version": nvml["vbios"],
                     "ecc_enabled": bool(nvml["ecc"][0]), "mig_enabled": bool(nvml["mig"][0]),
                     "power_limit_w": nvml["power_limit_mw"] / 1000, "visible": True, "cuda_index": 0}],
    }
    m["framework"] = {"name": "torch", "version": torch["version"], "cuda_version": torch["cuda"],
                      "git_version": torch["git"], "arch_list": torch["arch_list"], "nccl_version": torch["nccl"]}
    return m


@pytest.fixture
def body() -> bytes:
    return manifest.dumps(h200_manifest())


@pytest.fixture
def key(tmp_path) -> Path:
    path = tmp_path / "id_ed25519"
    signing.generate_key(path, comment="alice@example.com")
    return path


def allowed_file(tmp_path: Path, *lines: str, name: str = "allowed_signers") -> Path:
    p = tmp_path / name
    p.write_text("".join(line + "\n" for line in lines))
    return p


def pub_of(key_path: Path) -> str:
    return " ".join(Path(str(key_path) + ".pub").read_text().split()[:2])

"""The topology probe: NVLink/PCIe/XGMI per pair and CPU/NUMA affinity per GPU, through fake
bindings fed by real ``nvidia-smi topo -m`` / ``rocm-smi --showtopo`` captures, the real no-GPU
path here, and the text fallbacks as real subprocesses."""

from __future__ import annotations

import ctypes
import sys
import tomllib
from itertools import combinations
from pathlib import Path

import pytest

from capture import manifest
from capture.probes import ProbeOptions, Skipped
from capture.probes import topology
from fakes import (H200, REAL, apply_topo, fake_pynvml_from_smi_q, fake_pynvml_h200,
                   gpus_from_rocm_smi_and_rocminfo, gpus_from_showtopo, gpus_from_smi_q,
                   make_fake_amdsmi, make_fake_pynvml, write_tool)

H100_X8_Q = REAL / "nvidia-smi-q-h100-80gb-hbm3-sxm-x8.txt"
H100_X8_TOPO = REAL / "nvidia-smi-topo-m-h100-sxm5-x8-nv18.txt"
ROCM_COLLECT_ENV = REAL / "collect_env-vllm-rocm-mi300x-x8.txt"


def _loads(*names: str) -> bool:
    for name in names:
        try:
            ctypes.CDLL(name)
            return True
        except OSError:
            pass
    return False


def _showtopo_output() -> str:
    """The ``rocm-smi --showtopo`` block exactly as it sits in the collect_env capture."""
    lines = ROCM_COLLECT_ENV.read_text().splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if "ROCm System Management Interface" in line)
    end = next(i for i, line in enumerate(lines) if "End of ROCm SMI Log" in line)
    return "".join(lines[start:end + 1])


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    monkeypatch.setattr(topology, "SYSFS_PCI", tmp_path / "no-sysfs")
    return monkeypatch


def test_no_gpu_here(env: pytest.MonkeyPatch) -> None:
    if _loads("libnvidia-ml.so.1", "/opt/rocm/lib/libamd_smi.so", "libamd_smi.so"):
        pytest.skip("this machine has a GPU library")
    env.delitem(sys.modules, "amdsmi", raising=False)
    result = topology.probe(ProbeOptions())
    assert isinstance(result, Skipped)
    assert result.reason.startswith("no GPU: NVIDIA: NVML: NVML Shared Library Not Found; nvidia-smi not found; AMD: ")
    assert result.reason.endswith("AMD: no AMD GPU driver") and "\n" not in result.reason


# --------------------------------------------------------------------------- NVIDIA / NVML


def test_h200_single_gpu(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    mark = tmp_path / "smi-ran"
    write_tool(tmp_path / "bin", "nvidia-smi", {})
    (tmp_path / "bin" / "nvidia-smi").write_text(f"#!/bin/sh\ntouch {mark}\n")
    env.setenv("PATH", str(tmp_path / "bin"))
    fake = fake_pynvml_h200()
    env.setitem(sys.modules, "pynvml", fake)
    topo = topology.probe(ProbeOptions())
    assert topo.to_manifest() == {
        "source": "nvml", "vendor": "nvidia", "links": [],
        "devices": [{"index": 0, "pci_bus_id": "00000000:00:06.0", "cpu_affinity": "0-15", "numa_node": 0}],
    }
    assert not mark.exists() and fake.initialised == 0


def test_h100_sxm_x8_all_pairs_nv18_through_nvswitch(env: pytest.MonkeyPatch) -> None:
    fake = fake_pynvml_from_smi_q(H100_X8_Q.read_text(), H100_X8_TOPO.read_text(), nvlink_via="switch")
    env.setitem(sys.modules, "pynvml", fake)
    table = topology.probe(ProbeOptions()).to_manifest()
    assert table["source"] == "nvml"
    assert [(link["a"], link["b"]) for link in table["links"]] == list(combinations(range(8), 2))
    assert {(link["kind"], link["nvlink_count"]) for link in table["links"]} == {("NV18", 18)}
    assert [d["cpu_affinity"] for d in table["devices"]] == ["0-103"] * 4 + ["104-207"] * 4
    assert [d["numa_node"] for d in table["devices"]] == [0] * 4 + [1] * 4
    assert "nvmlDeviceGetTopologyCommonAncestor" not in fake.calls  # NVLinked pairs need no PCIe walk
    # the NVML path and the text fallback read the same machine the same way
    text = topology.parse_nvidia_topo_m(H100_X8_TOPO.read_text()).to_manifest()
    strip = [{k: v for k, v in d.items() if k != "pci_bus_id"} for d in table["devices"]]
    assert strip == text["devices"] and table["links"] == text["links"]
    body = manifest.dumps({**manifest.new_manifest(), "topology": table})
    assert tomllib.loads(body.decode())["topology"]["links"][27] == {"a": 6, "b": 7, "kind": "NV18", "nvlink_count": 18}


def _four_gpus(matrix: dict[tuple[int, int], str]) -> dict:
    names = [f"GPU{i}" for i in range(4)]
    full = {(names[a], names[b]): "X" if a == b else matrix.get((min(a, b), max(a, b)), "SYS")
            for a in range(4) for b in range(4)}
    return {"gpus": names, "matrix": full, "cpu": ["0-31", "0-31", "32-63", "32-63"], "numa": [0, 0, 1, 1]}


@pytest.mark.parametrize("token", ["PIX", "PXB", "PHB", "NODE", "SYS"])
def test_pcie_paths_and_direct_nvlink_bridges(env: pytest.MonkeyPatch, token: str) -> None:
    # The A100 x4 capture's GPUs, wired as a constructed board (no topo -m was captured with it):
    # 0-1 joined by a 12-link bridge, the rest over PCIe at `token`.
    system, gpus = gpus_from_smi_q((REAL / "nvidia-smi-q-a100-sxm4-80gb-x4.txt").read_text())
    topo = _four_gpus({(0, 1): "NV12", (2, 3): token})
    levels = apply_topo(gpus, topo, nvlink_via="direct")
    env.setitem(sys.modules, "pynvml", make_fake_pynvml(system, gpus, levels))
    links = {(link["a"], link["b"]): link for link in topology.probe(ProbeOptions()).to_manifest()["links"]}
    assert links[(0, 1)] == {"a": 0, "b": 1, "kind": "NV12", "nvlink_count": 12}
    assert links[(2, 3)] == {"a": 2, "b": 3, "kind": token}
    assert links[(0, 2)]["kind"] == "SYS" and "nvlink_count" not in links[(0, 2)]


def test_missing_affinity_falls_back_to_sysfs(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    system, gpus = gpus_from_smi_q((REAL / "nvidia-smi-q-h100-nvl-x2.txt").read_text())
    env.setitem(sys.modules, "pynvml", make_fake_pynvml(system, gpus))  # NVML refuses affinity
    sysfs = tmp_path / "sysfs"
    (sysfs / "0000:ad:00.0").mkdir(parents=True)
    (sysfs / "0000:ad:00.0" / "local_cpulist").write_text("48-95,144-191\n")
    (sysfs / "0000:ad:00.0" / "numa_node").write_text("1\n")
    (sysfs / "0000:ae:00.0").mkdir()
    (sysfs / "0000:ae:00.0" / "numa_node").write_text("-1\n")  # the platform does not say
    env.setattr(topology, "SYSFS_PCI", sysfs)
    table = topology.probe(ProbeOptions()).to_manifest()
    assert table["devices"] == [
        {"index": 0, "pci_bus_id": "00000000:AD:00.0", "cpu_affinity": "48-95,144-191", "numa_node": 1},
        {"index": 1, "pci_bus_id": "00000000:AE:00.0"},
    ]
    assert table["links"] == [{"a": 0, "b": 1, "kind": "unknown"}]  # NVML gave no PCIe level


def test_cpu_list_formatting() -> None:
    assert topology.cpu_list([0xFFFF]) == "0-15"
    assert topology.cpu_list([0xFFFF_0000_0000_FFFF, 0b101]) == "0-15,48-64,66"
    assert topology.cpu_list([0, 0]) is None


# --------------------------------------------------------------------------- NVIDIA fallback


def test_topo_m_fallback_as_a_subprocess(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    if _loads("libnvidia-ml.so.1"):
        pytest.skip("this machine has an NVIDIA driver")
    write_tool(tmp_path / "bin", "nvidia-smi", {"topo -m": H100_X8_TOPO.read_text()})
    env.setenv("PATH", str(tmp_path / "bin"))
    table = topology.probe(ProbeOptions()).to_manifest()  # the real pynvml fails to load here
    assert table["source"] == "nvidia-smi topo -m"
    assert len(table["links"]) == 28 and {link["kind"] for link in table["links"]} == {"NV18"}
    assert table["devices"][7] == {"index": 7, "cpu_affinity": "104-207", "numa_node": 1}


def test_topo_m_of_the_h200_with_its_escape_codes() -> None:
    topo = topology.parse_nvidia_topo_m((H200 / "topo.txt").read_text())
    assert topo.to_manifest() == {"source": "nvidia-smi topo -m", "vendor": "nvidia", "links": [],
                                  "devices": [{"index": 0, "cpu_affinity": "0-15", "numa_node": 0}]}


def test_unreadable_topo_m_is_a_skip(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    env.setitem(sys.modules, "pynvml", make_fake_pynvml({}, [], init_error=12))
    env.setitem(sys.modules, "amdsmi", make_fake_amdsmi([], init_error=34))
    write_tool(tmp_path / "bin", "nvidia-smi", {"topo -m": "Failed to initialize NVML: Driver/library version mismatch\n"})
    env.setenv("PATH", str(tmp_path / "bin"))
    result = topology.probe(ProbeOptions())
    assert isinstance(result, Skipped) and "no header row with 'CPU Affinity'" in result.reason


# --------------------------------------------------------------------------- AMD


def test_mi300x_x8_xgmi_through_amdsmi(env: pytest.MonkeyPatch) -> None:
    env.setitem(sys.modules, "pynvml", make_fake_pynvml({}, [], init_error=12))
    fake = make_fake_amdsmi(gpus_from_showtopo(ROCM_COLLECT_ENV.read_text()))
    env.setitem(sys.modules, "amdsmi", fake)
    table = topology.probe(ProbeOptions()).to_manifest()
    assert (table["source"], table["vendor"]) == ("amdsmi", "amd")
    assert [d["numa_node"] for d in table["devices"]] == [0] * 4 + [1] * 4
    assert len(table["links"]) == 28
    assert {(link["kind"], link["hops"], link["weight"]) for link in table["links"]} == {("XGMI", 1, 15)}
    assert fake.initialised == 0


def test_amd_cpu_affinity_from_sysfs(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    env.setitem(sys.modules, "pynvml", make_fake_pynvml({}, [], init_error=12))
    _, gpus = gpus_from_rocm_smi_and_rocminfo((REAL / "rocm-smi-a-mi300x-x4.txt").read_text(),
                                              (REAL / "rocminfo-mi300x-x4-gfx942.txt").read_text())
    env.setitem(sys.modules, "amdsmi", make_fake_amdsmi(gpus))
    sysfs = tmp_path / "sysfs"
    (sysfs / "0000:26:00.0").mkdir(parents=True)
    (sysfs / "0000:26:00.0" / "local_cpulist").write_text("0-47\n")
    (sysfs / "0000:26:00.0" / "numa_node").write_text("0\n")
    env.setattr(topology, "SYSFS_PCI", sysfs)
    table = topology.probe(ProbeOptions()).to_manifest()
    assert table["devices"][0] == {"index": 0, "pci_bus_id": "0000:26:00.0", "cpu_affinity": "0-47", "numa_node": 0}
    assert table["devices"][1] == {"index": 1, "pci_bus_id": "0000:46:00.0"}
    assert {link["kind"] for link in table["links"]} == {"unknown"}  # this capture has no topology


def test_showtopo_fallback_as_a_subprocess(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    env.setitem(sys.modules, "pynvml", make_fake_pynvml({}, [], init_error=12))
    env.setitem(sys.modules, "amdsmi", make_fake_amdsmi([], init_error=34))
    write_tool(tmp_path / "bin", "rocm-smi", {"--showtopo": _showtopo_output()})
    env.setenv("PATH", str(tmp_path / "bin"))
    table = topology.probe(ProbeOptions()).to_manifest()
    assert table["source"] == "rocm-smi --showtopo"
    assert table["links"][0] == {"a": 0, "b": 1, "kind": "XGMI", "hops": 1, "weight": 15}
    assert len(table["links"]) == 28 and table["devices"][5] == {"index": 5, "numa_node": 1}


def test_showtopo_without_link_table_is_an_error() -> None:
    with pytest.raises(ValueError, match="Link Type"):
        topology.parse_rocm_smi_showtopo("==== ROCm System Management Interface ====\n")


def test_real_h200_nvml_topology_matches_its_topo_m() -> None:
    """Recorded on a real H200: what NVML gave equals what `nvidia-smi topo -m` printed there."""
    import json

    run = json.loads((H200 / "capture-probes-on-h200.json").read_text())
    nvml = run["topology"]
    assert nvml["source"] == "nvml" and nvml["links"] == []
    text = topology.parse_nvidia_topo_m((H200 / "topo.txt").read_text()).to_manifest()
    assert [{k: v for k, v in d.items() if k != "pci_bus_id"} for d in nvml["devices"]] == text["devices"]
    assert run["topo_fallback"] == text

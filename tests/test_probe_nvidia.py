"""The NVIDIA probe: NVML through a fake ``pynvml`` fed by real captures, the real no-GPU path here,
CUDA_VISIBLE_DEVICES as CUDA reads it, and the ``nvidia-smi -q -x`` fallback as a real subprocess."""

from __future__ import annotations

import ctypes
import json
import shutil
import sys
import tomllib
from dataclasses import replace
from pathlib import Path

import pynvml
import pytest

from capture import manifest
from capture.fingerprint import accelerator_summary
from capture.probes import ProbeOptions, Skipped, as_table
from capture.probes import nvidia
from fakes import (H200, NA, REAL, fake_pynvml_from_smi_q, fake_pynvml_from_smi_xml,
                   fake_pynvml_h200, gpus_from_smi_q, h200_nvml_values, make_fake_pynvml,
                   parse_smi_q_text, write_tool)

H100_X8 = REAL / "nvidia-smi-q-h100-80gb-hbm3-sxm-x8.txt"
A100_X4 = REAL / "nvidia-smi-q-a100-sxm4-80gb-x4.txt"
H100_NVL_X2 = REAL / "nvidia-smi-q-h100-nvl-x2.txt"
MIG_XML = REAL / "nvidia-smi-q-x-a100-sxm4-80gb-mig.xml"


def _nvml_loads_here() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    """No CUDA variables, and a PATH with only a spy ``nvidia-smi`` that records being run."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    return monkeypatch


def _use(monkeypatch: pytest.MonkeyPatch, fake: object) -> object:
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return fake


def _spy_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An nvidia-smi on PATH that leaves a mark when run: NVML must answer without it."""
    mark = tmp_path / "smi-was-run"
    folder = tmp_path / "spy-bin"
    folder.mkdir()
    exe = folder / "nvidia-smi"
    exe.write_text(f"#!/bin/sh\ntouch {mark}\nexit 0\n")
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", str(folder))
    return mark


# --------------------------------------------------------------------------- this machine


def test_no_gpu_here_gives_skipped_with_both_reasons(env: pytest.MonkeyPatch) -> None:
    if _nvml_loads_here():
        pytest.skip("this machine has an NVIDIA driver")
    assert sys.modules.get("pynvml", pynvml) is pynvml  # the real binding, nothing faked
    result = nvidia.probe(ProbeOptions())
    assert isinstance(result, Skipped)
    assert result.reason.startswith("no NVIDIA driver: ")
    assert "NVML Shared Library Not Found" in result.reason
    assert "nvidia-smi not found" in result.reason
    assert as_table(result) == {"skipped": result.reason}


# --------------------------------------------------------------------------- NVML (fake binding)


def test_h200_reports_the_values_nvml_gave_on_the_real_card(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    mark = _spy_smi(tmp_path, env)
    fake = _use(env, fake_pynvml_h200())
    real = h200_nvml_values()
    info = nvidia.probe(ProbeOptions())
    assert isinstance(info, nvidia.NvidiaInfo)
    assert not mark.exists(), "nvidia-smi must not run when NVML answers"
    assert fake.initialised == 0 and fake.calls["nvmlShutdown"] == 1
    table = info.to_manifest()
    assert table["source"] == "nvml"
    assert table["driver_version"] == real["driver"] == "580.159.04"
    assert table["cuda_driver_version"] == "13.0"  # from 13000
    assert "cuda_visible_devices" not in table
    (dev,) = table["devices"]
    assert dev == {
        "index": 0,
        "name": real["name"],
        "uuid": real["uuid"],
        "serial": real["serial"],
        "pci_bus_id": real["pci_bus"],
        "memory_total_bytes": real["mem_total"],
        "compute_capability": "9.0",
        "vbios_version": real["vbios"],
        "ecc_enabled": True,
        "mig_enabled": False,
        "power_limit_w": 700.0,
        "board_part_number": real["board_part"],
        "architecture": "Hopper",
        "visible": True,
        "cuda_index": 0,
    }
    assert accelerator_summary({"nvidia": table}) == {
        "vendor": "nvidia", "model": "NVIDIA H200", "count": 1, "driver_version": "580.159.04",
        "runtime": "cuda", "runtime_version": None, "memory_per_device_bytes": real["mem_total"],
    }


def test_smi_q_text_and_nvml_agree_on_the_h200() -> None:
    """The fake's text parser reads the same numbers NVML gave on the same card."""
    real = h200_nvml_values()
    system, (gpu,) = gpus_from_smi_q((H200 / "nvidia-smi-q.txt").read_text())
    assert system == {"driver": real["driver"], "cuda": real["cuda_driver"]}
    assert gpu.memory_total_bytes == real["mem_total"]  # 143771 MiB
    assert gpu.power_limit_mw == real["power_limit_mw"]
    assert (gpu.uuid, gpu.serial, gpu.vbios, gpu.board_part) == (real["uuid"], real["serial"], real["vbios"], real["board_part"])
    assert (gpu.ecc, gpu.mig, gpu.arch) == (tuple(real["ecc"]), tuple(real["mig"]), real["arch"])


@pytest.mark.parametrize("capture, count, name, driver, cuda, mib, watts", [
    (H100_X8, 8, "NVIDIA H100 80GB HBM3", "565.57.01", "12.7", 81559, 700.0),
    (A100_X4, 4, "NVIDIA A100-SXM4-80GB", "555.42.02", "12.5", 81920, 500.0),
    (H100_NVL_X2, 2, "NVIDIA H100 NVL", "550.54.14", "12.4", 95830, 310.0),
])
def test_real_captures_through_nvml(env: pytest.MonkeyPatch, capture: Path, count: int, name: str,
                                    driver: str, cuda: str, mib: int, watts: float) -> None:
    text = capture.read_text()
    _use(env, fake_pynvml_from_smi_q(text))
    info = nvidia.probe(ProbeOptions())
    table = info.to_manifest()
    assert (table["device_count"], table["driver_version"], table["cuda_driver_version"]) == (count, driver, cuda)
    printed = parse_smi_q_text(text)["gpus"]
    for i, dev in enumerate(table["devices"]):
        assert dev["index"] == i and dev["cuda_index"] == i and dev["visible"] is True
        assert dev["name"] == name
        assert dev["uuid"] == printed[i]["GPU UUID"]
        assert dev["serial"] == printed[i]["Serial Number"]
        assert dev["pci_bus_id"] == printed[i]["PCI"]["Bus Id"]
        assert dev["memory_total_bytes"] == mib * 2**20
        assert dev["power_limit_w"] == watts
        assert dev["mig_enabled"] is False and dev["ecc_enabled"] is True
        assert "compute_capability" not in dev  # nvidia-smi -q does not print it: not invented
        assert "mig_instances" not in dev
    # what the probe returns is what lands in the manifest, and it survives TOML
    body = manifest.dumps({**manifest.new_manifest(), "nvidia": table})
    assert tomllib.loads(body.decode())["nvidia"]["devices"][0]["uuid"] == printed[0]["GPU UUID"]


def test_fields_a_board_does_not_report_are_left_out(env: pytest.MonkeyPatch) -> None:
    # GeForce and some cloud boards answer NotSupported for serial and power limit
    system, gpus = gpus_from_smi_q(H100_X8.read_text())
    gpus[3].serial = NA
    gpus[3].power_limit_mw = NA
    gpus[5].vbios = NA
    _use(env, make_fake_pynvml(system, gpus))
    devices = nvidia.probe(ProbeOptions()).to_manifest()["devices"]
    assert "serial" not in devices[3] and "power_limit_w" not in devices[3]
    assert "vbios_version" not in devices[5]
    assert devices[3]["uuid"] == gpus[3].uuid and devices[5]["serial"] == gpus[5].serial
    assert all("serial" in d for i, d in enumerate(devices) if i != 3)
    body = manifest.dumps({**manifest.new_manifest(), "nvidia": {"devices": devices}}).decode()
    assert '""' not in body and "= 0\n" not in body.replace("index = 0\n", "").replace("cuda_index = 0\n", "")


def test_a_board_that_refuses_everything_still_counts(env: pytest.MonkeyPatch) -> None:
    system, gpus = gpus_from_smi_q(H100_NVL_X2.read_text())
    bare = [type(g)() for g in gpus]  # every field NA: every per-device call raises NotSupported
    fake = _use(env, make_fake_pynvml({"driver": system["driver"]}, bare))
    table = nvidia.probe(ProbeOptions()).to_manifest()
    assert table["devices"] == [{"index": 0, "visible": True, "cuda_index": 0},
                                {"index": 1, "visible": True, "cuda_index": 1}]
    assert "cuda_driver_version" not in table
    assert fake.initialised == 0


def test_nvml_init_failure_without_nvidia_smi_is_skipped(env: pytest.MonkeyPatch) -> None:
    system, gpus = gpus_from_smi_q(H100_X8.read_text())
    fake = _use(env, make_fake_pynvml(system, gpus, init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED))
    result = nvidia.probe(ProbeOptions())
    assert result == Skipped("no NVIDIA driver: NVML: Driver Not Loaded; nvidia-smi not found")
    assert fake.calls == {"nvmlInit": 1}


def test_shutdown_runs_even_when_the_probe_breaks(env: pytest.MonkeyPatch) -> None:
    system, gpus = gpus_from_smi_q(A100_X4.read_text())
    fake = _use(env, make_fake_pynvml(system, gpus))

    def boom() -> int:
        raise RuntimeError("binding bug")
    fake.nvmlDeviceGetCount = boom
    with pytest.raises(RuntimeError):
        nvidia.probe(ProbeOptions())
    assert fake.initialised == 0


# --------------------------------------------------------------------------- CUDA_VISIBLE_DEVICES


H100_UUIDS = [g["GPU UUID"] for g in parse_smi_q_text(H100_X8.read_text())["gpus"]]


def _visible(env: pytest.MonkeyPatch, value: str | None, capture: Path = H100_X8) -> list[tuple[int, int | None]]:
    _use(env, fake_pynvml_from_smi_q(capture.read_text()))
    if value is None:
        env.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        env.setenv("CUDA_VISIBLE_DEVICES", value)
    table = nvidia.probe(ProbeOptions()).to_manifest()
    assert table.get("cuda_visible_devices") == value
    for d in table["devices"]:
        assert ("cuda_index" in d) == d["visible"]
    return [(d["index"], d.get("cuda_index")) for d in table["devices"] if d["visible"]]


@pytest.mark.parametrize("value, expected", [
    (None, [(i, i) for i in range(8)]),
    ("2,0", [(0, 1), (2, 0)]),
    (" 3 , 5 ", [(3, 0), (5, 1)]),
    ("7", [(7, 0)]),
    ("1gpu,2ampere", [(1, 0), (2, 1)]),  # CUDA reads each entry with strtoul
    ("", []),  # set but empty: no device at all
    ("1,9,2", [(1, 0)]),  # index 9 does not exist: the list stops there
    ("1,-1,2", [(1, 0)]),
    ("4,x,5", [(4, 0)]),
    ("0,0", []),  # a repeated device empties the list
    ("1,GPU-b42dd28e", [(1, 0)]),  # a UUID after an index is an invalid index
])
def test_cuda_visible_devices_by_index(env: pytest.MonkeyPatch, value: str | None, expected: list) -> None:
    assert _visible(env, value) == expected


def test_cuda_visible_devices_by_uuid_and_prefix(env: pytest.MonkeyPatch) -> None:
    full = H100_UUIDS[6]
    assert _visible(env, f"{full},{H100_UUIDS[1][:12]}") == [(1, 1), (6, 0)]
    # every uuid starts with "GPU-": too short a prefix is ambiguous, which ends the list
    assert _visible(env, f"{H100_UUIDS[2]},GPU-") == [(2, 0)]
    assert _visible(env, "GPU-00000000") == []
    assert _visible(env, f"{full},{full}") == []
    assert _visible(env, f"{full},3") == [(6, 0)]


def test_mixed_models_get_no_guessed_cuda_index(env: pytest.MonkeyPatch) -> None:
    sys_a, a100 = gpus_from_smi_q(A100_X4.read_text())
    _, nvl = gpus_from_smi_q(H100_NVL_X2.read_text())
    _use(env, make_fake_pynvml(sys_a, a100 + nvl))
    devices = nvidia.probe(ProbeOptions()).to_manifest()["devices"]
    # CUDA orders fastest-first by default: with two models nobody can say which index is which
    assert all(d["visible"] and "cuda_index" not in d for d in devices)
    env.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    table = nvidia.probe(ProbeOptions()).to_manifest()
    assert table["cuda_device_order"] == "PCI_BUS_ID"
    assert [d["cuda_index"] for d in table["devices"]] == list(range(6))


# --------------------------------------------------------------------------- MIG


def test_mig_instances_through_nvml(env: pytest.MonkeyPatch) -> None:
    fake = _use(env, fake_pynvml_from_smi_xml(MIG_XML.read_text()))
    (dev,) = nvidia.probe(ProbeOptions()).to_manifest()["devices"]
    assert dev["mig_enabled"] is True and dev["name"] == "NVIDIA A100-SXM4-80GB"
    assert [(m["gpu_instance_id"], m["compute_instance_id"], m["memory_total_bytes"]) for m in dev["mig_instances"]] == [
        (gi, 0, 19968 * 2**20) for gi in (3, 4, 5, 6)]
    # no capture holds MIG UUIDs or slice counts: left out, not made up
    assert all("uuid" not in m and "gpu_instance_slice_count" not in m for m in dev["mig_instances"])
    assert fake.calls["nvmlDeviceGetGpuInstanceById"] == 4  # tried; NoPermission left the profile out
    # CUDA sees one MIG device per process: the first
    assert dev["visible"] is True and "cuda_index" not in dev
    assert [(m["visible"], m.get("cuda_index")) for m in dev["mig_instances"]] == [
        (True, 0), (False, None), (False, None), (False, None)]


def test_cuda_visible_devices_names_a_mig_device(env: pytest.MonkeyPatch) -> None:
    fake = _use(env, fake_pynvml_from_smi_xml(MIG_XML.read_text()))
    gpu_uuid = fake.gpus[0].uuid
    env.setenv("CUDA_VISIBLE_DEVICES", f"MIG-{gpu_uuid}/5/0")  # the pre-R470 form
    (dev,) = nvidia.probe(ProbeOptions()).to_manifest()["devices"]
    assert [m.get("cuda_index") for m in dev["mig_instances"]] == [None, None, 0, None]
    env.setenv("CUDA_VISIBLE_DEVICES", f"MIG-{gpu_uuid}/7/0")  # no such GPU instance
    (dev,) = nvidia.probe(ProbeOptions()).to_manifest()["devices"]
    assert dev["visible"] is False
    # the GPU index of a MIG-enabled card stands for its MIG devices
    env.setenv("CUDA_VISIBLE_DEVICES", "0")
    (dev,) = nvidia.probe(ProbeOptions()).to_manifest()["devices"]
    assert [m["visible"] for m in dev["mig_instances"]] == [True, False, False, False]


def test_cuda_visible_devices_by_mig_uuid(env: pytest.MonkeyPatch) -> None:
    fake = fake_pynvml_from_smi_xml(MIG_XML.read_text())
    # MIG UUIDs appear in no capture we hold; these have the R470+ shape `MIG-<uuid4>`
    uuids = ["MIG-7f3b0f5e-1c1e-5a4f-9b5e-0e1d6c2b9a01", "MIG-7f3b0f5e-2d2e-5a4f-9b5e-0e1d6c2b9a02",
             "MIG-a83c1d2e-3f3e-5a4f-9b5e-0e1d6c2b9a03", "MIG-b94d2e3f-4a4e-5a4f-9b5e-0e1d6c2b9a04"]
    for m, u in zip(fake.gpus[0].migs, uuids):
        m.uuid = u
    _use(env, fake)
    env.setenv("CUDA_VISIBLE_DEVICES", "MIG-a83c")
    (dev,) = nvidia.probe(ProbeOptions()).to_manifest()["devices"]
    assert [m["uuid"] for m in dev["mig_instances"]] == uuids
    assert [m.get("cuda_index") for m in dev["mig_instances"]] == [None, None, 0, None]
    env.setenv("CUDA_VISIBLE_DEVICES", "MIG-7f3b0f5e")  # matches two: invalid, nothing visible
    (dev,) = nvidia.probe(ProbeOptions()).to_manifest()["devices"]
    assert dev["visible"] is False


# --------------------------------------------------------------------------- nvidia-smi fallback


def test_fallback_parses_nvidia_smi_xml_with_mig(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    if _nvml_loads_here():
        pytest.skip("this machine has an NVIDIA driver")
    bin_dir = tmp_path / "bin"
    write_tool(bin_dir, "nvidia-smi", {"-q -x": MIG_XML.read_text()})
    env.setenv("PATH", str(bin_dir))
    env.setenv("CUDA_VISIBLE_DEVICES", "0")
    info = nvidia.probe(ProbeOptions())  # the real pynvml fails to load libnvidia-ml here
    table = info.to_manifest()
    assert table["source"] == "nvidia-smi -q -x"
    assert "NVML Shared Library Not Found" in table["nvml_error"]
    assert (table["driver_version"], table["cuda_driver_version"]) == ("535.54.03", "12.2")
    (dev,) = table["devices"]
    migs = dev.pop("mig_instances")
    assert dev == {
        "index": 0, "name": "NVIDIA A100-SXM4-80GB", "uuid": "GPU-513536b6-7d19-9063-b049-1e69664bb298",
        "serial": "1650522003820", "pci_bus_id": "00000000:01:00.0", "memory_total_bytes": 81920 * 2**20,
        "vbios_version": "92.00.36.00.02", "ecc_enabled": True, "mig_enabled": True, "power_limit_w": 500.0,
        "board_part_number": "692-2G506-0212-002", "architecture": "Ampere", "visible": True,
    }
    assert migs[2] == {"index": 2, "gpu_instance_id": 5, "compute_instance_id": 0,
                       "memory_total_bytes": 19968 * 2**20, "multiprocessor_count": 14, "visible": False}
    assert migs[0]["cuda_index"] == 0


@pytest.mark.parametrize("stdout, rc, expect", [
    ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the latest "
     "NVIDIA driver is installed and running.\n", 9, "nvidia-smi exited 9: NVIDIA-SMI has failed"),
    ("<nvidia_smi_log><gpu id=", 0, "not XML"),
    ("<html/>", 0, "unexpected root element <html>"),
])
def test_fallback_failures_are_one_line_skips(env: pytest.MonkeyPatch, tmp_path: Path, stdout: str, rc: int, expect: str) -> None:
    _use(env, make_fake_pynvml({}, [], init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))
    write_tool(tmp_path / "bin", "nvidia-smi", {"-q -x": stdout}, rc=rc)
    env.setenv("PATH", str(tmp_path / "bin"))
    result = nvidia.probe(ProbeOptions())
    assert isinstance(result, Skipped)
    assert result.reason.startswith("no NVIDIA driver: NVML: NVML Shared Library Not Found; ")
    assert expect in result.reason and "\n" not in result.reason


def test_fallback_that_hangs_is_cut_off(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _use(env, make_fake_pynvml({}, [], init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))
    exe = tmp_path / "bin" / "nvidia-smi"
    exe.parent.mkdir()
    exe.write_text(f"#!/bin/sh\nexec {shutil.which('sleep', path='/usr/bin:/bin')} 30\n")
    exe.chmod(0o755)
    env.setenv("PATH", str(exe.parent))
    env.setattr(nvidia, "SMI_TIMEOUT_S", 0.5)
    result = nvidia.probe(ProbeOptions())
    assert isinstance(result, Skipped) and "timed out after" in result.reason


def test_parse_smi_xml_leaves_na_out() -> None:
    xml = MIG_XML.read_text().replace("<serial>1650522003820</serial>", "<serial>N/A</serial>")
    info = nvidia.parse_smi_xml(xml)
    assert info.devices[0].serial is None
    assert "serial" not in info.devices[0].to_manifest()


def test_visibility_is_pure_and_keeps_devices_in_nvml_order() -> None:
    info = nvidia.parse_smi_xml(MIG_XML.read_text())
    plain = replace(info.devices[0], mig_enabled=False, mig_instances=())
    devs = (plain, replace(plain, index=1, uuid="GPU-ffff"))
    out = nvidia.apply_visibility(devs, "1,0")
    assert [(d.index, d.cuda_index) for d in out] == [(0, 1), (1, 0)]
    assert devs[0].cuda_index is None  # inputs untouched (frozen)


def test_nvml_refusing_the_device_count_is_a_skip(env: pytest.MonkeyPatch) -> None:
    system, gpus = gpus_from_smi_q(A100_X4.read_text())
    fake = _use(env, make_fake_pynvml(system, gpus))

    def lost() -> int:
        raise pynvml.NVMLError_GpuIsLost()
    fake.nvmlDeviceGetCount = lost
    assert nvidia.probe(ProbeOptions()) == Skipped("NVML: GPU is lost")
    assert fake.initialised == 0


# --------------------------------------------------------------------------- checked on a real H200

H200_RUN = json.loads((H200 / "capture-probes-on-h200.json").read_text())


def test_fallback_reads_the_real_h200_xml_as_nvml_did() -> None:
    """On the same card, the nvidia-smi -q -x fallback gives every field NVML gave but compute capability."""
    fallback = nvidia.parse_smi_xml((H200 / "nvidia-smi-q-x.xml").read_text())
    table = replace(fallback, devices=nvidia.apply_visibility(fallback.devices, None)).to_manifest()
    nvml = H200_RUN["nvidia"]
    assert nvml["source"] == "nvml" and table["source"] == "nvidia-smi -q -x"
    expected = {**nvml, "source": "nvidia-smi -q -x",
                "devices": [{k: v for k, v in d.items() if k != "compute_capability"} for d in nvml["devices"]]}
    assert table == expected
    assert H200_RUN["nvidia_probe_s"] < 1.0  # NVML answered without a subprocess


@pytest.mark.parametrize("row", H200_RUN["visible"], ids=lambda r: repr(r["value"]))
def test_cuda_visible_devices_agrees_with_the_cuda_runtime(env: pytest.MonkeyPatch, row: dict) -> None:
    """Each value was given to the CUDA runtime on the H200; the probe must count what CUDA counted."""
    cuda_count = int(row["torch_count"].split()[0])
    _use(env, fake_pynvml_from_smi_xml((H200 / "nvidia-smi-q-x.xml").read_text()))
    env.setenv("CUDA_VISIBLE_DEVICES", row["value"])
    devices = nvidia.probe(ProbeOptions()).to_manifest()["devices"]
    assert [d["cuda_index"] for d in devices if d["visible"]] == list(range(cuda_count))

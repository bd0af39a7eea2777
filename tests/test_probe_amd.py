"""The AMD probe: the real amdsmi package failing to load here, a fake ``amdsmi`` fed by real
rocm-smi/rocminfo/amd-smi captures, ROCR_/HIP_/CUDA_VISIBLE_DEVICES, and the ``amd-smi`` fallback."""

from __future__ import annotations

import ctypes
import json
import sys
import tomllib
from pathlib import Path

import pytest

from capture import manifest
from capture.fingerprint import accelerator_summary
from capture.probes import ProbeOptions, Skipped
from capture.probes import amd
from fakes import (AMDSMI_STATUS_DRIVER_NOT_LOADED, REAL, amd_smi_static_text_to_json,
                   gpus_from_amd_smi_static, gpus_from_rocm_smi_and_rocminfo, make_fake_amdsmi, write_tool)

MI300A_STATIC = REAL / "amd-smi-static-mi300a-x4.txt"
MI300X_EXCERPT = REAL / "amd-smi-static-mi300x-excerpt.txt"
VRAM_JSON = REAL / "amd-smi-static-json-vram-mi300x-excerpt.json"
ROCM_SMI_A = REAL / "rocm-smi-a-mi300x-x4.txt"
ROCMINFO = REAL / "rocminfo-mi300x-x4-gfx942.txt"
SERIALS = ["0x8D1457E2C20F59D2", "0xB4FA34630E85D42A", "0xE8986800E182538A", "0xEFF71EDC82169115"]


def _amdsmi_loads_here() -> bool:
    for name in ("/opt/rocm/lib/libamd_smi.so", "libamd_smi.so"):
        try:
            ctypes.CDLL(name)
            return True
        except OSError:
            pass
    return False


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    for name in amd.VISIBILITY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    return monkeypatch


def _mi300x(env: pytest.MonkeyPatch, **kw: object) -> object:
    _, gpus = gpus_from_rocm_smi_and_rocminfo(ROCM_SMI_A.read_text(), ROCMINFO.read_text())
    fake = make_fake_amdsmi(gpus, **kw)
    env.setitem(sys.modules, "amdsmi", fake)
    return fake


# --------------------------------------------------------------------------- this machine


def test_amdsmi_without_its_library_is_a_clean_skip(env: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    if _amdsmi_loads_here():
        pytest.skip("this machine has libamd_smi.so")
    env.delitem(sys.modules, "amdsmi", raising=False)
    smi, why = amd.load_amdsmi()  # the installed amdsmi package, for real
    assert smi is None and why.startswith("amdsmi: ") and "libamd_smi.so" in why and "\n" not in why
    out, _ = capfd.readouterr()
    assert out == "", "amdsmi's import-time print must not reach stdout"


def test_no_amd_driver_skips_without_importing_amdsmi(env: pytest.MonkeyPatch) -> None:
    if amd.amd_driver_present():
        pytest.skip("this machine has an AMD driver or tool")
    env.delitem(sys.modules, "amdsmi", raising=False)
    result = amd.probe(ProbeOptions())
    assert isinstance(result, Skipped) and result.reason.startswith("no AMD GPU driver: no /dev/kfd")
    assert "amdsmi" not in sys.modules  # the ~90 ms import was not paid


# --------------------------------------------------------------------------- amdsmi (fake binding)


def test_mi300x_node_through_amdsmi(env: pytest.MonkeyPatch) -> None:
    fake = _mi300x(env)
    info = amd.probe(ProbeOptions())
    assert fake.initialised == 0 and fake.calls["amdsmi_shut_down"] == 1
    table = info.to_manifest()
    assert table["source"] == "amdsmi" and table["device_count"] == 4
    assert table["driver_version"] == "6.7.0"
    assert "rocm_version" not in table  # librocm-core not found: left out
    buses = ["0000:26:00.0", "0000:46:00.0", "0000:65:00.0", "0000:85:00.0"]
    for i, dev in enumerate(table["devices"]):
        assert dev == {
            "index": i, "market_name": "AMD Instinct MI300X", "gfx_target": "gfx942",
            "asic_serial": SERIALS[i], "device_id": "0x74a1", "bdf": buses[i],
            "vram_total_bytes": 196592 * 2**20, "vbios_version": "113-MI3SRIOV-001",
            "visible": True, "hip_index": i,
        }
    assert accelerator_summary({"amd": table})["memory_per_device_bytes"] == 196592 * 2**20
    body = manifest.dumps({**manifest.new_manifest(), "amd": table})
    assert tomllib.loads(body.decode())["amd"]["devices"][3]["asic_serial"] == SERIALS[3]


def test_rocm_version_when_the_library_knows_it(env: pytest.MonkeyPatch) -> None:
    _mi300x(env, rocm_version="6.2.41133")
    assert amd.probe(ProbeOptions()).to_manifest()["rocm_version"] == "6.2.41133"


def test_mi300a_fields_the_board_does_not_report_are_left_out(env: pytest.MonkeyPatch) -> None:
    gpus = gpus_from_amd_smi_static(MI300A_STATIC.read_text())
    env.setitem(sys.modules, "amdsmi", make_fake_amdsmi(gpus))
    table = amd.probe(ProbeOptions()).to_manifest()
    assert table["driver_version"] == "6.9.0-rc5+"
    dev = table["devices"][1]
    assert dev["market_name"] == "MI300A" and dev["vram_total_bytes"] == 64289 * 2**20
    assert dev["bdf"] == "0001:01:00.0" and dev["asic_serial"] == "0xB6AE7C8CEFE1F084"
    # VBIOS is N/A on this APU and the capture has no gfx target or UUID: none of them invented
    assert not {"vbios_version", "gfx_target", "uuid"} & set(dev)


def test_amdsmi_init_failure_without_amd_smi_is_skipped(env: pytest.MonkeyPatch) -> None:
    fake = _mi300x(env, init_error=AMDSMI_STATUS_DRIVER_NOT_LOADED)
    result = amd.probe(ProbeOptions())
    assert result == Skipped("no AMD GPU driver: amdsmi_init: Error code: 34 | AMDSMI_STATUS_DRIVER_NOT_LOADED"
                             " - Driver not loaded; amd-smi not found")
    assert fake.calls == {"amdsmi_init": 1}


def test_no_devices_is_skipped(env: pytest.MonkeyPatch) -> None:
    env.setitem(sys.modules, "amdsmi", make_fake_amdsmi([]))
    assert amd.probe(ProbeOptions()) == Skipped("no AMD GPU: amdsmi lists no devices")


# --------------------------------------------------------------------------- visibility


def _visible(env: pytest.MonkeyPatch, **variables: str) -> list[tuple[int, int]]:
    _mi300x(env)
    for name, value in variables.items():
        env.setenv(name, value)
    table = amd.probe(ProbeOptions()).to_manifest()
    for name in amd.VISIBILITY_VARIABLES:
        assert table.get(name.lower()) == variables.get(name)
    return [(d["index"], d["hip_index"]) for d in table["devices"] if d["visible"]]


@pytest.mark.parametrize("variables, expected", [
    ({}, [(0, 0), (1, 1), (2, 2), (3, 3)]),
    ({"HIP_VISIBLE_DEVICES": "2,0"}, [(0, 1), (2, 0)]),
    ({"CUDA_VISIBLE_DEVICES": "3"}, [(3, 0)]),  # HIP honours CUDA_VISIBLE_DEVICES
    ({"HIP_VISIBLE_DEVICES": "1", "CUDA_VISIBLE_DEVICES": "3"}, [(1, 0)]),  # HIP_ wins
    ({"ROCR_VISIBLE_DEVICES": "3,1"}, [(1, 1), (3, 0)]),
    ({"ROCR_VISIBLE_DEVICES": "3,1", "HIP_VISIBLE_DEVICES": "1"}, [(1, 0)]),  # HIP indexes ROCr's list
    ({"ROCR_VISIBLE_DEVICES": "3,1", "HIP_VISIBLE_DEVICES": "2"}, []),  # ROCr left only two
    ({"HIP_VISIBLE_DEVICES": "GPU-e8986800e182538a"}, [(2, 0)]),  # rocminfo's Uuid for GPU 2
    ({"ROCR_VISIBLE_DEVICES": "GPU-eff71edc,GPU-8d14"}, [(0, 1), (3, 0)]),  # unique prefixes
    ({"HIP_VISIBLE_DEVICES": ""}, []),
    ({"HIP_VISIBLE_DEVICES": "1,7,2"}, [(1, 0)]),  # stops at the first invalid entry
    ({"HIP_VISIBLE_DEVICES": "1,1"}, []),
])
def test_rocm_visible_devices(env: pytest.MonkeyPatch, variables: dict[str, str], expected: list) -> None:
    assert _visible(env, **variables) == expected


# --------------------------------------------------------------------------- amd-smi fallback


def _tool(env: pytest.MonkeyPatch, tmp_path: Path, static: str, rc: int = 0) -> None:
    write_tool(tmp_path / "bin", "amd-smi", {"static --json": static, "version": (REAL / "amd-smi-version.txt").read_text()}, rc=rc)
    env.setenv("PATH", str(tmp_path / "bin"))


def test_text_to_json_matches_the_real_json_shape() -> None:
    """The fake's converter gives the same VRAM object amd-smi printed with --json (other GPU, same shape)."""
    real = json.loads(VRAM_JSON.read_text())
    converted = amd_smi_static_text_to_json(MI300A_STATIC.read_text())[0]["vram"]
    assert set(converted) == set(real) and set(converted["size"]) == set(real["size"]) == {"value", "unit"}
    assert (converted["type"], converted["vendor"], converted["size"]["unit"]) == (real["type"], real["vendor"], "MB")


def test_fallback_reads_amd_smi_static_json(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    if _amdsmi_loads_here():
        pytest.skip("this machine has libamd_smi.so")
    env.delitem(sys.modules, "amdsmi", raising=False)
    _tool(env, tmp_path, json.dumps(amd_smi_static_text_to_json(MI300A_STATIC.read_text()), indent=4))
    env.setenv("ROCR_VISIBLE_DEVICES", "2")
    table = amd.probe(ProbeOptions()).to_manifest()  # the real amdsmi import fails first
    assert table["source"] == "amd-smi static --json"
    assert "libamd_smi.so" in table["amdsmi_error"]
    assert table["rocm_version"] == "6.1.0"  # from `amd-smi version`
    assert table["driver_version"] == "6.9.0-rc5+" and table["device_count"] == 4
    assert [d["bdf"] for d in table["devices"]] == ["0000:01:00.0", "0001:01:00.0", "0002:01:00.0", "0003:01:00.0"]
    assert [d.get("hip_index") for d in table["devices"]] == [None, None, 0, None]
    assert all(d["vram_total_bytes"] == 64289 * 2**20 and "vbios_version" not in d for d in table["devices"])


@pytest.mark.parametrize("wrap", [lambda gpus: gpus, lambda gpus: {"gpu_data": gpus}])
def test_fallback_reads_the_real_vram_object(env: pytest.MonkeyPatch, tmp_path: Path, wrap: object) -> None:
    env.setitem(sys.modules, "amdsmi", make_fake_amdsmi([], init_error=AMDSMI_STATUS_DRIVER_NOT_LOADED))
    excerpt = amd_smi_static_text_to_json(MI300X_EXCERPT.read_text())[0]
    excerpt["vram"] = json.loads(VRAM_JSON.read_text())
    _tool(env, tmp_path, "WARNING: some notice first\n" + json.dumps(wrap([excerpt])))
    (dev,) = amd.probe(ProbeOptions()).to_manifest()["devices"]
    assert dev["vram_total_bytes"] == 196592 * 2**20
    assert (dev["market_name"], dev["bdf"], dev["asic_serial"]) == ("MI300X-O", "0000:05:00.0", "0xAF54E92B0A5D57C8")


@pytest.mark.parametrize("static, rc, expect", [
    ("", 0, "printed no JSON"),
    ("[{\"gpu\": 0, ", 0, "invalid JSON"),
    ("\"text\"", 0, "printed no JSON"),
    ("{\"error\": 1}", 0, "lists no devices"),
    ("[{\"gpu\": " + "9" * 5000 + "}]", 0, "amd-smi static --json printed invalid JSON (an integer of more than 4,300 digits)"),
    ("[" * 100_000 + "]" * 100_000, 0, "amd-smi static --json printed invalid JSON (arrays or objects nested too deeply to read)"),
    ("AMD-SMI: could not initialise", 1, "amd-smi exited 1"),
])
def test_fallback_failures_are_one_line_skips(env: pytest.MonkeyPatch, tmp_path: Path, static: str, rc: int, expect: str) -> None:
    env.setitem(sys.modules, "amdsmi", make_fake_amdsmi([], init_error=AMDSMI_STATUS_DRIVER_NOT_LOADED))
    _tool(env, tmp_path, static, rc)
    result = amd.probe(ProbeOptions())
    assert isinstance(result, Skipped) and expect in result.reason and "\n" not in result.reason


def test_rocm_version_line() -> None:
    assert amd.rocm_version_from_amd_smi_version((REAL / "amd-smi-version.txt").read_text()) == "6.1.0"
    assert amd.rocm_version_from_amd_smi_version("AMDSMI Tool: 23.4.2") is None


def test_missing_fields_stay_out_of_the_table() -> None:
    assert amd.AmdDevice(index=0, vbios_version=None).to_manifest() == {"index": 0, "visible": True}

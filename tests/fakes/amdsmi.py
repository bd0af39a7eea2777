"""Fake ``amdsmi`` from real amd-smi static / rocm-smi / rocminfo output."""

from __future__ import annotations

import ctypes
import json
import re
import stat
import sys
import types
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from fakes._common import *  # noqa: F401,F403
from fakes._common import _MISSING_TEXT  # noqa: F401

# =========================================================================== fake amdsmi

AMDSMI_STATUS_NOT_SUPPORTED = 2
AMDSMI_STATUS_NOT_INIT = 32
AMDSMI_STATUS_DRIVER_NOT_LOADED = 34
_AMDSMI_STATUS_TEXT = {
    AMDSMI_STATUS_NOT_SUPPORTED: "AMDSMI_STATUS_NOT_SUPPORTED - Feature not supported",
    AMDSMI_STATUS_NOT_INIT: "AMDSMI_STATUS_NOT_INIT - Device not initialized",
    AMDSMI_STATUS_DRIVER_NOT_LOADED: "AMDSMI_STATUS_DRIVER_NOT_LOADED - Driver not loaded",
}
# amdsmi_link_type_t
AMD_LINK_PCIE, AMD_LINK_XGMI = 1, 2


@dataclass
class FakeAmdGpu:
    """One AMD GPU as amdsmi would describe it; NA fields make the call raise NOT_SUPPORTED."""

    market_name: str | None = NA
    gfx: str | None = NA
    asic_serial: str | None = NA
    device_id: str | None = NA
    uuid: str | None = NA
    bdf: str | None = NA
    vram_mib: int | None = NA
    vbios: str | None = NA
    driver_version: str | None = NA
    numa_node: int | None = NA
    links: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # peer -> (type, hops, weight)


def _indent_tree(text: str) -> list[tuple[int, str, str]]:
    out = []
    for raw in text.splitlines():
        if not raw.strip() or raw.strip() == "[output truncated]":
            continue
        indent = len(raw) - len(raw.lstrip(" "))
        key, sep, value = raw.strip().partition(":")
        if sep:
            out.append((indent, key.strip(), value.strip()))
    return out


def _amd_json_value(text: str) -> Any:
    m = re.fullmatch(r"(-?\d+)\s+([A-Za-z°/]+[A-Za-z/]*)", text)
    if m:
        return {"value": int(m.group(1)), "unit": m.group(2)}
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    return text


def amd_smi_static_text_to_json(text: str) -> list[dict[str, Any]]:
    """``amd-smi static`` text -> the list ``amd-smi static --json`` prints for the same GPUs.

    amd-smi renders its text from the JSON (upper-casing keys, "value unit" pairs), so this
    inverts that: lower-case keys, ``"64289 MB"`` -> ``{"value": 64289, "unit": "MB"}``.
    CPU sections are dropped (``--json`` lists them separately).
    """
    gpus: list[dict[str, Any]] = []
    stack: list[tuple[int, dict[str, Any]]] = []
    for indent, key, value in _indent_tree(text):
        if indent == 0:
            stack = []
            if key == "GPU":
                gpus.append({"gpu": int(value)})
                stack = [(0, gpus[-1])]
            continue
        if not stack:
            continue
        while len(stack) > 1 and stack[-1][0] >= indent:
            stack.pop()
        node = stack[-1][1]
        if value == "":
            child: dict[str, Any] = {}
            node[key.lower()] = child
            stack.append((indent, child))
        else:
            node[key.lower()] = _amd_json_value(value)
    return gpus


def gpus_from_amd_smi_static(text: str) -> list[FakeAmdGpu]:
    out = []
    for g in amd_smi_static_text_to_json(text):
        asic, bus, vbios = g.get("asic", {}), g.get("bus", {}), g.get("vbios", {})
        size = g.get("vram", {}).get("size")

        def s(d: dict[str, Any], k: str) -> Any:
            v = d.get(k, NA)
            return NA if v is NA or str(v) in _MISSING_TEXT else str(v)
        out.append(FakeAmdGpu(
            market_name=s(asic, "market_name"), gfx=s(asic, "target_graphics_version"),
            asic_serial=s(asic, "asic_serial"), device_id=s(asic, "device_id"),
            bdf=s(bus, "bdf"), vram_mib=size["value"] if isinstance(size, dict) and size.get("unit") == "MB" else NA,
            vbios=s(vbios, "version"), driver_version=s(g.get("driver", {}), "version"),
            numa_node=g.get("numa", {}).get("node", NA),
        ))
    return out


def gpus_from_rocm_smi_and_rocminfo(rocm_smi_a: str, rocminfo: str) -> tuple[str | None, list[FakeAmdGpu]]:
    """The MI300X x4 node: ``rocm-smi -a`` (serial, VBIOS, bus, driver) + ``rocminfo`` (gfx, VRAM)."""
    per: dict[int, dict[str, str]] = {}
    for m in re.finditer(r"^GPU\[(\d+)\]\s*:\s*([^:\n]+?):\s*(.*?)\s*$", rocm_smi_a, re.M):
        per.setdefault(int(m.group(1)), {}).setdefault(m.group(2).strip(), m.group(3).strip())
    driver = re.search(r"^Driver version:\s*(\S+)", rocm_smi_a, re.M)
    agents = [a for a in re.split(r"\n\*{7}\s*\n", rocminfo) if re.search(r"Device Type:\s+GPU", a)]
    by_serial = {}
    for a in agents:
        uuid = re.search(r"Uuid:\s+GPU-([0-9a-f]+)", a)
        pool = re.search(r"Segment:\s+GLOBAL; FLAGS: COARSE GRAINED\s*\n\s*Size:\s+(\d+)\(0x[0-9a-f]+\) KB", a)
        by_serial[uuid.group(1)] = {
            "gfx": re.search(r"^\s*Name:\s+(gfx\w+)", a, re.M).group(1),
            "market": re.search(r"Marketing Name:\s+(.*?)\s*$", a, re.M).group(1),
            "vram_mib": int(pool.group(1)) // 1024 if pool else NA,
            "bdfid": int(re.search(r"BDFID:\s+(\d+)", a).group(1)),
        }
    gpus = []
    for i in sorted(per):
        d = per[i]
        serial = d["Unique ID"]
        info = by_serial[serial[2:]]
        assert int(d["PCI Bus"].split(":")[1], 16) == info["bdfid"] >> 8, "rocminfo and rocm-smi disagree"
        gpus.append(FakeAmdGpu(
            market_name=info["market"], gfx=info["gfx"], asic_serial="0x" + serial[2:].upper(),
            device_id=d.get("Device ID", NA), bdf=d["PCI Bus"].lower(), vram_mib=info["vram_mib"],
            vbios=d.get("VBIOS version", NA), driver_version=driver.group(1) if driver else NA,
        ))
    return (driver.group(1) if driver else NA), gpus


def parse_showtopo(text: str) -> dict[str, Any]:
    """``rocm-smi --showtopo`` -> weight/hops/type matrices and NUMA nodes, keyed by GPU index."""
    out: dict[str, Any] = {"weight": {}, "hops": {}, "type": {}, "numa": {}}
    section = None
    names = {"Weight between two GPUs": "weight", "Hops between two GPUs": "hops",
             "Link Type between two GPUs": "type"}
    for line in text.splitlines():
        title = line.strip("= ").strip()
        if line.startswith("=") and title in names:
            section = names[title]
            continue
        if line.startswith("="):
            section = None
        m = re.match(r"^GPU\[(\d+)\]\s*:\s*\(Topology\) Numa Node:\s*(\d+)", line)
        if m:
            out["numa"][int(m.group(1))] = int(m.group(2))
            continue
        m = re.match(r"^GPU(\d+)\s+(.*)$", line)
        if section and m:
            for j, cell in enumerate(m.group(2).split()):
                out[section][(int(m.group(1)), j)] = cell
    return out


def gpus_from_showtopo(text: str) -> list[FakeAmdGpu]:
    """Devices known only by their place in ``rocm-smi --showtopo`` (identity fields NA)."""
    topo = parse_showtopo(text)
    n = 1 + max(i for i, _ in topo["type"])
    gpus = [FakeAmdGpu(numa_node=topo["numa"].get(i, NA)) for i in range(n)]
    for (i, j), kind in topo["type"].items():
        if i != j:
            t = {"XGMI": AMD_LINK_XGMI, "PCIE": AMD_LINK_PCIE}[kind]
            gpus[i].links[j] = (t, int(topo["hops"][(i, j)]), int(topo["weight"][(i, j)]))
    return gpus


class _AmdHandle:
    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def make_fake_amdsmi(gpus: list[FakeAmdGpu], rocm_version: str | None = NA,
                     init_error: int | None = None) -> types.ModuleType:
    """A module object shaped like ``amdsmi`` (the ``amdsmi_interface`` functions) serving ``gpus``."""
    mod = types.ModuleType("amdsmi")

    class AmdSmiException(Exception):
        """Base smi exception class"""

    class AmdSmiLibraryException(AmdSmiException):
        def __init__(self, err_code: int) -> None:
            super().__init__(err_code)
            self.err_code = err_code
            self.err_info = _AMDSMI_STATUS_TEXT.get(err_code, "AMDSMI_STATUS_UNKNOWN_ERROR - An unknown error occurred")

        def __str__(self) -> str:  # the real library's two-line message
            return f"Error code:\n\t{self.err_code} | {self.err_info}"

        def get_error_code(self) -> int:
            return self.err_code

    mod.AmdSmiException = AmdSmiException
    mod.AmdSmiLibraryException = AmdSmiLibraryException
    mod.gpus = gpus
    mod.calls = {}
    mod.initialised = 0

    def api(fn: Any) -> Any:
        def wrapper(*args: Any) -> Any:
            mod.calls[fn.__name__] = mod.calls.get(fn.__name__, 0) + 1
            if fn.__name__ != "amdsmi_init" and mod.initialised <= 0:
                raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_INIT)
            return fn(*args)
        wrapper.__name__ = fn.__name__
        setattr(mod, fn.__name__, wrapper)
        return wrapper

    def need(value: Any) -> Any:
        if value is NA:
            raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_SUPPORTED)
        return value

    def gpu(h: _AmdHandle) -> FakeAmdGpu:
        return gpus[h.index]

    def text(value: Any) -> str:  # amdsmi returns "N/A" for an empty string field
        return "N/A" if value is NA else value

    @api
    def amdsmi_init(flag: Any = None) -> None:
        if init_error is not None:
            raise AmdSmiLibraryException(init_error)
        mod.initialised += 1

    @api
    def amdsmi_shut_down() -> None:
        mod.initialised -= 1

    @api
    def amdsmi_get_processor_handles() -> list[_AmdHandle]:
        return [_AmdHandle(i) for i in range(len(gpus))]

    @api
    def amdsmi_get_gpu_asic_info(h: _AmdHandle) -> dict[str, Any]:
        g = gpu(h)
        return {"market_name": text(g.market_name), "vendor_id": "0x1002",
                "vendor_name": "Advanced Micro Devices Inc. [AMD/ATI]", "subvendor_id": "0x1002",
                "device_id": text(g.device_id), "rev_id": "0x00", "asic_serial": text(g.asic_serial),
                "oam_id": "N/A", "num_compute_units": "N/A",
                "target_graphics_version": g.gfx if g.gfx is not NA else "gfx0", "subsystem_id": "N/A"}

    @api
    def amdsmi_get_gpu_device_uuid(h: _AmdHandle) -> str:
        return need(gpu(h).uuid)

    @api
    def amdsmi_get_gpu_device_bdf(h: _AmdHandle) -> str:
        return need(gpu(h).bdf)

    @api
    def amdsmi_get_gpu_vram_info(h: _AmdHandle) -> dict[str, Any]:
        return {"vram_type": 0, "vram_vendor": "N/A", "vram_size": need(gpu(h).vram_mib),
                "vram_bit_width": "N/A", "vram_max_bandwidth": "N/A"}

    @api
    def amdsmi_get_gpu_vbios_info(h: _AmdHandle) -> dict[str, Any]:
        return {"name": "N/A", "build_date": "N/A", "part_number": "N/A", "version": need(gpu(h).vbios)}

    @api
    def amdsmi_get_gpu_driver_info(h: _AmdHandle) -> dict[str, Any]:
        return {"driver_name": "amdgpu", "driver_version": need(gpu(h).driver_version), "driver_date": "N/A"}

    @api
    def amdsmi_get_rocm_version() -> tuple[bool, str]:
        return (False, "librocm-core.so not found") if rocm_version is NA else (True, rocm_version)

    @api
    def amdsmi_topo_get_numa_node_number(h: _AmdHandle) -> int:
        return need(gpu(h).numa_node)

    def link(a: _AmdHandle, b: _AmdHandle) -> tuple[int, int, int]:
        return need(gpu(a).links.get(b.index, NA))

    @api
    def amdsmi_topo_get_link_type(a: _AmdHandle, b: _AmdHandle) -> dict[str, int]:
        t, hops, _ = link(a, b)
        return {"hops": hops, "type": t}

    @api
    def amdsmi_topo_get_link_weight(a: _AmdHandle, b: _AmdHandle) -> int:
        return link(a, b)[2]

    return mod

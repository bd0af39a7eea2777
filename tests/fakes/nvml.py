"""Fake ``pynvml`` (NVML) from real nvidia-smi output: -q text, -q -x XML, topo -m."""

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

import pynvml as _real_pynvml

from fakes._common import *  # noqa: F401,F403
from fakes._common import _MISSING_TEXT  # noqa: F401

_ARCH = {"Kepler": 2, "Maxwell": 3, "Pascal": 4, "Volta": 5, "Turing": 6, "Ampere": 7,
         "Ada Lovelace": 8, "Hopper": 9, "Blackwell": 10}

# nvidia-smi topo -m token -> nvmlGpuTopologyLevel_t
_TOPO_LEVEL = {"PIX": 10, "PXB": 20, "PHB": 30, "NODE": 40, "SYS": 50}


# =========================================================================== nvidia-smi -q text


def parse_smi_q_text(text: str) -> dict[str, Any]:
    """``nvidia-smi -q`` text -> ``{"Driver Version": ..., "gpus": [tree, ...]}``.

    Each GPU is a nested dict keyed by the printed labels (``tree["FB Memory Usage"]["Total"]``);
    sections are the label lines without a value.
    """
    top: dict[str, Any] = {"gpus": []}
    stack: list[tuple[int, dict[str, Any]]] = [(-1, top)]
    pending: tuple[int, str] | None = None
    for raw in text.splitlines():
        if not raw.strip() or raw.startswith("=="):
            continue
        indent = len(raw) - len(raw.lstrip(" "))
        line = raw.strip()
        m = re.match(r"^(.*?\S)\s+:\s?(.*)$", line)
        if pending is not None:
            p_indent, p_name = pending
            pending = None
            while stack[-1][0] >= p_indent:
                stack.pop()
            if indent > p_indent:
                child: dict[str, Any] = {}
                stack[-1][1][p_name] = child
                stack.append((p_indent, child))
            else:
                stack[-1][1][p_name] = ""
        while stack[-1][0] >= indent:
            stack.pop()
        if indent == 0 and line.startswith("GPU ") and m is None:
            gpu: dict[str, Any] = {"_bus_id": line[4:].strip()}
            top["gpus"].append(gpu)
            stack = [(-1, top), (0, gpu)]
            continue
        if m is None:
            pending = (indent, line)
            continue
        stack[-1][1][m.group(1)] = m.group(2).strip()
    return top


def _v(tree: dict[str, Any], *path: str) -> Any:
    node: Any = tree
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return NA
        node = node[key]
    if isinstance(node, str) and node.strip() in _MISSING_TEXT:
        return NA
    return node


def _mib(text: Any) -> int | None:
    if text is NA:
        return NA
    m = re.match(r"^\s*(\d+)\s*MiB\s*$", text)
    return int(m.group(1)) * 2**20 if m else NA


def _mw(text: Any) -> int | None:
    if text is NA:
        return NA
    m = re.match(r"^\s*([\d.]+)\s*W\s*$", text)
    return round(float(m.group(1)) * 1000) if m else NA


def _enabled(text: Any) -> int | None:
    if text is NA:
        return NA
    return 1 if text == "Enabled" else 0


def _cuda_int(text: Any) -> int | None:
    if text is NA:
        return NA
    major, _, minor = str(text).partition(".")
    return int(major) * 1000 + int(minor or 0) * 10


# =========================================================================== fake pynvml


@dataclass
class FakeMig:
    gpu_instance_id: int | None = NA
    compute_instance_id: int | None = NA
    memory_total_bytes: int | None = NA
    uuid: str | None = NA


@dataclass
class FakeGpu:
    """One GPU as NVML would describe it; NA fields raise NVMLError_NotSupported."""

    name: str | None = NA
    uuid: str | None = NA
    serial: str | None = NA
    vbios: str | None = NA
    board_part: str | None = NA
    arch: int | None = NA
    pci_bus_id: str | None = NA
    memory_total_bytes: int | None = NA
    power_limit_mw: int | None = NA
    ecc: tuple[int, int] | None = NA
    mig: tuple[int, int] | None = NA
    cc: tuple[int, int] | None = NA
    migs: list[FakeMig] = field(default_factory=list)
    max_mig_devices: int = 7
    cpu_list: str | None = NA  # "0-103", from nvidia-smi topo -m "CPU Affinity"
    numa_node: int | None = NA  # from "NUMA Affinity"
    # links[l] = (remote pci bus id, remote device type) for each active NVLink l
    nvlinks: list[tuple[str, int]] = field(default_factory=list)


def gpus_from_smi_q(text: str) -> tuple[dict[str, Any], list[FakeGpu]]:
    """Per-device values from real ``nvidia-smi -q`` text."""
    top = parse_smi_q_text(text)
    gpus = []
    for t in top["gpus"]:
        ecc = (_enabled(_v(t, "ECC Mode", "Current")), _enabled(_v(t, "ECC Mode", "Pending")))
        mig = (_enabled(_v(t, "MIG Mode", "Current")), _enabled(_v(t, "MIG Mode", "Pending")))
        power = _v(t, "GPU Power Readings", "Current Power Limit")
        if power is NA:
            power = _v(t, "Power Readings", "Enforced Power Limit")
        arch = _v(t, "Product Architecture")
        gpus.append(FakeGpu(
            name=_v(t, "Product Name"),
            uuid=_v(t, "GPU UUID"),
            serial=_v(t, "Serial Number"),
            vbios=_v(t, "VBIOS Version"),
            board_part=_v(t, "Board Part Number"),
            arch=_ARCH.get(arch, NA) if arch is not NA else NA,
            pci_bus_id=_v(t, "PCI", "Bus Id"),
            memory_total_bytes=_mib(_v(t, "FB Memory Usage", "Total")),
            power_limit_mw=_mw(power),
            ecc=NA if NA in ecc else ecc,
            mig=NA if NA in mig else mig,
        ))
    system = {"driver": _v(top, "Driver Version"), "cuda": _cuda_int(_v(top, "CUDA Version"))}
    return system, gpus


def gpus_from_smi_xml(text: str) -> tuple[dict[str, Any], list[FakeGpu]]:
    """Per-device values (MIG devices included) from real ``nvidia-smi -q -x`` output."""
    root = ET.fromstring(text)

    def t(node: ET.Element, path: str) -> Any:
        value = node.findtext(path)
        return NA if value is None or value.strip() in _MISSING_TEXT else value.strip()

    gpus = []
    for g in root.findall("gpu"):
        ecc = (_enabled(t(g, "ecc_mode/current_ecc")), _enabled(t(g, "ecc_mode/pending_ecc")))
        mig = (_enabled(t(g, "mig_mode/current_mig")), _enabled(t(g, "mig_mode/pending_mig")))
        arch = t(g, "product_architecture")
        migs = [FakeMig(
            gpu_instance_id=int(t(m, "gpu_instance_id")),
            compute_instance_id=int(t(m, "compute_instance_id")),
            memory_total_bytes=_mib(t(m, "fb_memory_usage/total")),
        ) for m in g.findall("mig_devices/mig_device")]
        gpus.append(FakeGpu(
            name=t(g, "product_name"), uuid=t(g, "uuid"), serial=t(g, "serial"),
            vbios=t(g, "vbios_version"), board_part=t(g, "board_part_number"),
            arch=_ARCH.get(arch, NA) if arch is not NA else NA,
            pci_bus_id=t(g, "pci/pci_bus_id"),
            memory_total_bytes=_mib(t(g, "fb_memory_usage/total")),
            power_limit_mw=_mw(t(g, "gpu_power_readings/current_power_limit")),
            ecc=NA if NA in ecc else ecc, mig=NA if NA in mig else mig, migs=migs,
        ))
    system = {"driver": t(root, "driver_version"), "cuda": _cuda_int(t(root, "cuda_version"))}
    return system, gpus


def parse_topo_m(text: str) -> dict[str, Any]:
    """``nvidia-smi topo -m`` -> ``{"gpus": [...], "matrix": {(a, b): token}, "cpu": [...], "numa": [...]}``."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    lines = text.splitlines()
    header_i = next(i for i, line in enumerate(lines) if "CPU Affinity" in line)
    header = [c.strip() for c in lines[header_i].split("\t") if c.strip()]
    peers = [c for c in header if re.fullmatch(r"(GPU|NIC)\d+", c)]
    out: dict[str, Any] = {"gpus": [], "matrix": {}, "cpu": [], "numa": []}
    for line in lines[header_i + 1:]:
        cells = line.split("\t")
        if not cells or not re.fullmatch(r"GPU\d+", cells[0].strip()):
            if cells and cells[0].strip().startswith("NIC"):
                continue
            break
        name = cells[0].strip()
        out["gpus"].append(name)
        for peer, cell in zip(peers, cells[1:1 + len(peers)]):
            out["matrix"][(name, peer)] = cell.strip()
        rest = [c.strip() for c in cells[1 + len(peers):] if c.strip()]
        out["cpu"].append(rest[0] if rest and rest[0] != "N/A" else NA)
        out["numa"].append(int(rest[1]) if len(rest) > 1 and rest[1].isdigit() else NA)
    return out


def apply_topo(gpus: list[FakeGpu], topo: dict[str, Any], nvlink_via: str = "switch") -> dict[tuple[int, int], int]:
    """Give each fake GPU the CPU affinity, NUMA node and NVLinks that ``topo -m`` shows.

    ``nvlink_via="switch"``: every GPU's NV# links end at NVSwitches (HGX boards: 18 links per
    H100 to 4 NVSwitch chips, which is why every pair reads NV18). ``"direct"``: NV# links go
    straight to the peer GPU (NVLink bridges). Returns the PCIe level of the other pairs.
    """
    names = topo["gpus"]
    assert len(names) == len(gpus), "topo -m and the device list disagree"
    levels: dict[tuple[int, int], int] = {}
    for i, g in enumerate(gpus):
        g.cpu_list = topo["cpu"][i]
        g.numa_node = topo["numa"][i]
        nv = {j: int(tok[2:]) for j, n in enumerate(names) if j != i
              for tok in [topo["matrix"][(names[i], n)]] if tok.startswith("NV")}
        for j, n in enumerate(names):
            tok = topo["matrix"][(names[i], n)]
            if tok in _TOPO_LEVEL:
                levels[(i, j)] = _TOPO_LEVEL[tok]
        if nvlink_via == "switch" and nv:
            count = set(nv.values())
            assert len(count) == 1, "a switched fabric gives every pair the same NV#"
            g.nvlinks = [(f"00000000:{0xA0 + (link % 4):02X}:00.0", 2) for link in range(count.pop())]
        else:
            for j, k in sorted(nv.items()):
                g.nvlinks += [(gpus[j].pci_bus_id, 0)] * k
            assert len(g.nvlinks) <= _real_pynvml.NVML_NVLINK_MAX_LINKS
    return levels


class _Handle:
    __slots__ = ("gpu", "mig")

    def __init__(self, gpu: int, mig: int | None = None) -> None:
        self.gpu, self.mig = gpu, mig


def _cpu_words(cpu_list: str, words: int) -> Any:
    arr = (ctypes.c_ulonglong * words)()
    for part in cpu_list.split(","):
        lo, _, hi = part.partition("-")
        for cpu in range(int(lo), int(hi or lo) + 1):
            if cpu // 64 < words:
                arr[cpu // 64] |= 1 << (cpu % 64)
    return arr


def make_fake_pynvml(system: dict[str, Any], gpus: list[FakeGpu],
                     levels: dict[tuple[int, int], int] | None = None,
                     init_error: int | None = None) -> types.ModuleType:
    """A module object shaped like ``pynvml`` that serves ``gpus``.

    ``fake.calls`` counts calls by name; ``fake.initialised`` tracks init/shutdown.
    """
    real = _real_pynvml
    mod = types.ModuleType("pynvml")
    for name in dir(real):
        if name.startswith(("NVML_", "NVMLError", "nvmlPciInfo", "c_nvml")) or name == "NVMLError":
            setattr(mod, name, getattr(real, name))
    mod.gpus = gpus
    mod.system = system
    mod.calls = {}
    mod.initialised = 0
    levels = levels or {}
    NotSupported = real.NVMLError_NotSupported

    def count(name: str) -> None:
        mod.calls[name] = mod.calls.get(name, 0) + 1

    def need(value: Any) -> Any:
        if value is NA:
            raise NotSupported()
        return value

    def api(fn: Any) -> Any:
        def wrapper(*args: Any) -> Any:
            count(fn.__name__)
            if fn.__name__ not in ("nvmlInit", "nvmlInitWithFlags") and mod.initialised <= 0:
                raise real.NVMLError_Uninitialized()
            return fn(*args)
        wrapper.__name__ = fn.__name__
        setattr(mod, fn.__name__, wrapper)
        return wrapper

    def gpu(h: _Handle) -> FakeGpu:
        if not isinstance(h, _Handle):
            raise real.NVMLError_InvalidArgument()
        return gpus[h.gpu]

    def whole(h: _Handle) -> FakeGpu:
        if h.mig is not None:
            raise NotSupported()
        return gpu(h)

    @api
    def nvmlInit() -> None:
        if init_error is not None:
            raise real.NVMLError(init_error)
        mod.initialised += 1

    @api
    def nvmlShutdown() -> None:
        mod.initialised -= 1

    @api
    def nvmlSystemGetDriverVersion() -> str:
        return need(system.get("driver", NA))

    @api
    def nvmlSystemGetCudaDriverVersion() -> int:
        return need(system.get("cuda", NA))

    @api
    def nvmlDeviceGetCount() -> int:
        return len(gpus)

    @api
    def nvmlDeviceGetHandleByIndex(index: int) -> _Handle:
        if not 0 <= index < len(gpus):
            raise real.NVMLError_InvalidArgument()
        return _Handle(index)

    @api
    def nvmlDeviceGetName(h: _Handle) -> str:
        return need(gpu(h).name)

    @api
    def nvmlDeviceGetUUID(h: _Handle) -> str:
        if h.mig is not None:
            return need(gpu(h).migs[h.mig].uuid)
        return need(gpu(h).uuid)

    @api
    def nvmlDeviceGetSerial(h: _Handle) -> str:
        return need(whole(h).serial)

    @api
    def nvmlDeviceGetVbiosVersion(h: _Handle) -> str:
        return need(whole(h).vbios)

    @api
    def nvmlDeviceGetBoardPartNumber(h: _Handle) -> str:
        return need(whole(h).board_part)

    @api
    def nvmlDeviceGetArchitecture(h: _Handle) -> int:
        return need(whole(h).arch)

    def pci_struct(bus_id: str) -> Any:
        info = real.nvmlPciInfo_t()
        info.busId = bus_id.encode()
        info.busIdLegacy = bus_id.encode()[-(real.NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE - 1):]
        domain, bus, rest = bus_id.split(":")
        info.domain, info.bus, info.device = int(domain, 16), int(bus, 16), int(rest.split(".")[0], 16)
        return info

    @api
    def nvmlDeviceGetPciInfo(h: _Handle) -> Any:
        return pci_struct(need(whole(h).pci_bus_id))

    @api
    def nvmlDeviceGetMemoryInfo(h: _Handle, version: Any = None) -> Any:
        total = gpu(h).migs[h.mig].memory_total_bytes if h.mig is not None else gpu(h).memory_total_bytes
        mem = real.c_nvmlMemory_t()
        mem.total = need(total)
        mem.free = mem.total
        return mem

    @api
    def nvmlDeviceGetCudaComputeCapability(h: _Handle) -> tuple[int, int]:
        return tuple(need(gpu(h).cc))

    @api
    def nvmlDeviceGetEccMode(h: _Handle) -> list[int]:
        return list(need(whole(h).ecc))

    @api
    def nvmlDeviceGetMigMode(h: _Handle) -> list[int]:
        return list(need(whole(h).mig))

    @api
    def nvmlDeviceGetEnforcedPowerLimit(h: _Handle) -> int:
        return need(whole(h).power_limit_mw)

    @api
    def nvmlDeviceGetMaxMigDeviceCount(h: _Handle) -> int:
        g = whole(h)
        if g.mig is NA or g.mig[0] != 1:
            raise NotSupported()
        return g.max_mig_devices

    @api
    def nvmlDeviceGetMigDeviceHandleByIndex(h: _Handle, index: int) -> _Handle:
        g = whole(h)
        if index >= len(g.migs):
            raise real.NVMLError_NotFound()
        return _Handle(h.gpu, index)

    @api
    def nvmlDeviceGetGpuInstanceId(h: _Handle) -> int:
        if h.mig is None:
            raise real.NVMLError_InvalidArgument()
        return need(gpu(h).migs[h.mig].gpu_instance_id)

    @api
    def nvmlDeviceGetComputeInstanceId(h: _Handle) -> int:
        if h.mig is None:
            raise real.NVMLError_InvalidArgument()
        return need(gpu(h).migs[h.mig].compute_instance_id)

    @api
    def nvmlDeviceGetAttributes(h: _Handle) -> Any:
        raise NotSupported()  # slice counts are in no captured output

    @api
    def nvmlDeviceGetGpuInstanceById(h: _Handle, gi: int) -> Any:
        raise real.NVMLError_NoPermission()  # needs root on a real machine

    @api
    def nvmlDeviceGetTopologyCommonAncestor(a: _Handle, b: _Handle) -> int:
        whole(a), whole(b)
        return need(levels.get((a.gpu, b.gpu), NA))

    def link(h: _Handle, n: int) -> tuple[str, int]:
        g = whole(h)
        if not 0 <= n < real.NVML_NVLINK_MAX_LINKS:
            raise real.NVMLError_InvalidArgument()
        if n >= len(g.nvlinks):
            raise NotSupported()
        return g.nvlinks[n]

    @api
    def nvmlDeviceGetNvLinkState(h: _Handle, n: int) -> int:
        link(h, n)
        return real.NVML_FEATURE_ENABLED

    @api
    def nvmlDeviceGetNvLinkRemotePciInfo(h: _Handle, n: int) -> Any:
        return pci_struct(link(h, n)[0])

    @api
    def nvmlDeviceGetNvLinkRemoteDeviceType(h: _Handle, n: int) -> int:
        return link(h, n)[1]

    @api
    def nvmlDeviceGetCpuAffinity(h: _Handle, words: int) -> Any:
        return _cpu_words(need(whole(h).cpu_list), words)

    @api
    def nvmlDeviceGetMemoryAffinity(h: _Handle, words: int, scope: int) -> Any:
        node = need(whole(h).numa_node)
        return _cpu_words(str(node), words)

    @api
    def nvmlDeviceGetNumaNodeId(h: _Handle) -> int:
        raise NotSupported()  # "GPU NUMA ID: N/A" in every captured topo -m

    return mod


def fake_pynvml_from_smi_q(text: str, topo: str | None = None, nvlink_via: str = "switch",
                           init_error: int | None = None) -> types.ModuleType:
    """A fake ``pynvml`` serving the GPUs of an ``nvidia-smi -q`` capture (and its ``topo -m``)."""
    system, gpus = gpus_from_smi_q(text)
    levels = apply_topo(gpus, parse_topo_m(topo), nvlink_via) if topo is not None else {}
    return make_fake_pynvml(system, gpus, levels, init_error)


def fake_pynvml_from_smi_xml(text: str) -> types.ModuleType:
    system, gpus = gpus_from_smi_xml(text)
    return make_fake_pynvml(system, gpus)


def h200_nvml_values() -> dict[str, Any]:
    """The NVML readings taken on a real H200 (tests/fixtures/h200/probe.json)."""
    return json.loads((H200 / "probe.json").read_text())["nvml"]


def fake_pynvml_h200() -> types.ModuleType:
    """The H200: NVML values exactly as read there, plus its ``nvidia-smi -q`` and ``topo -m``."""
    nv = h200_nvml_values()
    system, gpus = gpus_from_smi_q((H200 / "nvidia-smi-q.txt").read_text())
    g = gpus[0]
    g.name, g.uuid, g.serial, g.vbios = nv["name"], nv["uuid"], nv["serial"], nv["vbios"]
    g.board_part, g.arch, g.pci_bus_id = nv["board_part"], nv["arch"], nv["pci_bus"]
    g.memory_total_bytes, g.power_limit_mw = nv["mem_total"], nv["power_limit_mw"]
    g.ecc, g.mig, g.cc = tuple(nv["ecc"]), tuple(nv["mig"]), tuple(nv["cc"])
    system = {"driver": nv["driver"], "cuda": nv["cuda_driver"]}
    topo = (H200 / "topo.txt").read_text()
    levels = apply_topo(gpus, parse_topo_m(topo))
    return make_fake_pynvml(system, gpus, levels)

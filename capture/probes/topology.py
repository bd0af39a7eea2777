"""How the GPUs are wired: NVLink / XGMI / PCIe between each pair, CPU and NUMA affinity per GPU.

NVIDIA through NVML (``nvidia-smi topo -m`` only if NVML cannot load), AMD through amdsmi
(``rocm-smi --showtopo`` only if amdsmi cannot load). Link kinds are the tokens the vendor tools
print, so a manifest reads like ``nvidia-smi topo -m``: ``NV18`` (18 bonded NVLinks), ``PIX``,
``PXB``, ``PHB``, ``NODE``, ``SYS`` (PCIe paths, nearest to farthest); ``XGMI`` / ``PCIE`` on AMD.

NVLink count between two GPUs: links that end at the peer itself, plus, when both GPUs hang off
NVSwitches (HGX boards, where every link ends at a switch), the smaller of their switch-link
counts. This is why all pairs of an 8x H100 SXM board read ``NV18``.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Sequence

from capture.probes import ProbeOptions, Skipped
from capture.probes import nvidia as _nvidia

log = logging.getLogger(__name__)

SYSFS_PCI = Path("/sys/bus/pci/devices")

# nvmlGpuTopologyLevel_t -> nvidia-smi topo -m token
NVML_LEVELS = {0: "INTERNAL", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
AMD_LINK_TYPES: dict[object, str] = {0: "INTERNAL", 1: "PCIE", 2: "XGMI"}  # looked up with whatever amdsmi gives
NVLINK_TO_SWITCH = 2  # NVML_NVLINK_DEVICE_TYPE_SWITCH
NUMA_WORDS = 4  # 256 NUMA nodes in the NVML memory-affinity mask
MIN_CPU_WORDS = 16  # 1024 CPUs; more if os.cpu_count() says so


@dataclass(frozen=True)
class TopoDevice:
    index: int
    pci_bus_id: str | None = None
    cpu_affinity: str | None = None
    """CPUs local to the GPU, as a Linux cpu list: ``0-103``, ``0-15,32-47``."""
    numa_node: int | None = None

    def to_manifest(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


@dataclass(frozen=True)
class TopoLink:
    a: int
    b: int
    kind: str
    nvlink_count: int | None = None
    hops: int | None = None
    weight: int | None = None
    """rocm-smi's link weight (lower is closer)."""

    def to_manifest(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


@dataclass(frozen=True)
class Topology:
    """The ``[topology]`` table."""

    source: str
    vendor: str
    devices: tuple[TopoDevice, ...] = ()
    links: tuple[TopoLink, ...] = ()

    def to_manifest(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "vendor": self.vendor,
            "devices": [d.to_manifest() for d in self.devices],
            "links": [link.to_manifest() for link in self.links],
        }


# --------------------------------------------------------------------------- helpers


def cpu_list(words: Sequence[int]) -> str | None:
    """64-bit CPU mask words (word 0 = CPUs 0-63) -> ``"0-15,32-47"``; None when empty."""
    cpus = [w * 64 + bit for w, word in enumerate(words) for bit in range(64) if int(word) >> bit & 1]
    if not cpus:
        return None
    ranges: list[list[int]] = []
    for cpu in cpus:
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(f"{lo}" if lo == hi else f"{lo}-{hi}" for lo, hi in ranges)


def _bus_key(bus_id: str | None) -> tuple[int, int, int, int] | None:
    """``00000000:18:00.0`` and ``0000:18:00.0`` name the same device."""
    if not bus_id:
        return None
    m = re.fullmatch(r"\s*([0-9a-fA-F]+):([0-9a-fA-F]+):([0-9a-fA-F]+)\.([0-7])\s*", bus_id)
    if not m:
        return None
    return tuple(int(x, 16) for x in m.groups())  # type: ignore[return-value]


def _sysfs(bus_id: str | None) -> Path | None:
    key = _bus_key(bus_id)
    if key is None:
        return None
    return SYSFS_PCI / f"{key[0]:04x}:{key[1]:02x}:{key[2]:02x}.{key[3]:x}"


def sysfs_affinity(bus_id: str | None) -> tuple[str | None, int | None]:
    """``local_cpulist`` and ``numa_node`` of a PCI device from sysfs (Linux), when there."""
    folder = _sysfs(bus_id)
    if folder is None:
        return None, None
    cpus = numa = None
    try:
        cpus = (folder / "local_cpulist").read_text().strip() or None
    except OSError:
        pass
    try:
        n = int((folder / "numa_node").read_text().strip())
        numa = n if n >= 0 else None  # -1: the platform does not say
    except (OSError, ValueError):
        pass
    return cpus, numa


# --------------------------------------------------------------------------- NVIDIA


def _nvlinks(nvml: Any, handle: Any, call: Any) -> list[tuple[tuple[int, int, int, int] | None, int | None]]:
    """(remote bus, remote device type) for every active NVLink of one GPU."""
    out = []
    for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
        try:
            state = nvml.nvmlDeviceGetNvLinkState(handle, link)
        except nvml.NVMLError as exc:
            if link == 0 or isinstance(exc, getattr(nvml, "NVMLError_InvalidArgument", ())):
                break  # no NVLink on this GPU, or past its last link
            continue
        if state != nvml.NVML_FEATURE_ENABLED:
            continue
        pci = call("nvmlDeviceGetNvLinkRemotePciInfo", handle, link)
        kind = call("nvmlDeviceGetNvLinkRemoteDeviceType", handle, link)
        out.append((_bus_key(pci.busId) if pci is not None else None, kind))
    return out


def nvml_topology(nvml: Any) -> Topology:
    """Read the topology through an initialised NVML (the caller shuts it down)."""
    count = nvml.nvmlDeviceGetCount()
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    cpu_words = max(MIN_CPU_WORDS, -(-(os.cpu_count() or 1) // 64))
    devices, buses, links_of = [], [], []
    for i, h in enumerate(handles):
        call = _nvidia._Guard(nvml, f"GPU {i}")
        pci = call("nvmlDeviceGetPciInfo", h)
        bus = _nvidia._text(pci.busId) if pci is not None else None
        mask = call("nvmlDeviceGetCpuAffinity", h, cpu_words)
        cpus = cpu_list(list(mask)) if mask is not None else None
        nodes = call("nvmlDeviceGetMemoryAffinity", h, NUMA_WORDS, getattr(nvml, "NVML_AFFINITY_SCOPE_NODE", 0))
        node_list = cpu_list(list(nodes)) if nodes is not None else None
        numa = int(re.split(r"[-,]", node_list)[0]) if node_list else None
        if cpus is None or numa is None:
            sys_cpus, sys_numa = sysfs_affinity(bus)
            cpus, numa = cpus or sys_cpus, numa if numa is not None else sys_numa
        devices.append(TopoDevice(index=i, pci_bus_id=bus, cpu_affinity=cpus, numa_node=numa))
        buses.append(_bus_key(bus))
        links_of.append(_nvlinks(nvml, h, call))
    links = []
    for a in range(count):
        to_switch_a = sum(1 for _, kind in links_of[a] if kind == NVLINK_TO_SWITCH)
        for b in range(a + 1, count):
            direct = sum(1 for bus, kind in links_of[a] if bus is not None and bus == buses[b] and kind != NVLINK_TO_SWITCH)
            to_switch_b = sum(1 for _, kind in links_of[b] if kind == NVLINK_TO_SWITCH)
            n = direct + min(to_switch_a, to_switch_b)
            if n:
                links.append(TopoLink(a, b, f"NV{n}", nvlink_count=n))
                continue
            level = _nvidia._Guard(nvml, f"GPU {a}-{b}")("nvmlDeviceGetTopologyCommonAncestor", handles[a], handles[b])
            links.append(TopoLink(a, b, NVML_LEVELS.get(level, "unknown") if level is not None else "unknown"))
    return Topology(source="nvml", vendor="nvidia", devices=tuple(devices), links=tuple(links))


def parse_nvidia_topo_m(text: str) -> Topology:
    """Parse ``nvidia-smi topo -m`` (GPU rows only; NIC rows and columns are ignored)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    lines = text.splitlines()
    try:
        header_i = next(i for i, line in enumerate(lines) if "CPU Affinity" in line)
    except StopIteration:
        raise ValueError("nvidia-smi topo -m: no header row with 'CPU Affinity'") from None
    header = [c.strip() for c in lines[header_i].split("\t") if c.strip()]
    peers = [c for c in header if re.fullmatch(r"(GPU|NIC)\d+|mlx\S+", c)]
    rows: dict[int, list[str]] = {}
    devices = []
    for line in lines[header_i + 1:]:
        cells = line.split("\t")
        m = re.fullmatch(r"GPU(\d+)", cells[0].strip())
        if m is None:
            if cells[0].strip():
                continue  # a NIC row
            break  # the blank line before the legend
        index = int(m.group(1))
        rows[index] = [c.strip() for c in cells[1:1 + len(peers)]]
        rest = [c.strip() for c in cells[1 + len(peers):] if c.strip()]
        cpus = rest[0] if rest and re.fullmatch(r"[\d,-]+", rest[0]) else None
        numa = int(rest[1]) if len(rest) > 1 and rest[1].isdigit() else None
        devices.append(TopoDevice(index=index, cpu_affinity=cpus, numa_node=numa))
    if not devices:
        raise ValueError("nvidia-smi topo -m: no GPU rows")
    links = []
    gpu_cols = {int(p[3:]): k for k, p in enumerate(peers) if p.startswith("GPU")}
    for a in sorted(rows):
        for b in sorted(gpu_cols):
            if b <= a or gpu_cols[b] >= len(rows[a]):
                continue
            token = rows[a][gpu_cols[b]]
            nv = re.fullmatch(r"NV(\d+)", token)
            links.append(TopoLink(a, b, token, nvlink_count=int(nv.group(1)) if nv else None))
    return Topology(source="nvidia-smi topo -m", vendor="nvidia", devices=tuple(devices), links=tuple(links))


# --------------------------------------------------------------------------- AMD


def amdsmi_topology(smi: Any) -> Topology:
    """Read the topology through an initialised amdsmi (the caller shuts it down)."""
    from capture.probes import amd as _amd  # AMD machines only: an NVIDIA one never imports it

    handles = smi.amdsmi_get_processor_handles()
    devices = []
    for i, h in enumerate(handles):
        call = _amd._Guard(smi, f"GPU {i}")
        bdf = _amd._clean(call("amdsmi_get_gpu_device_bdf", h))
        numa = call("amdsmi_topo_get_numa_node_number", h)
        cpus, sys_numa = sysfs_affinity(bdf)
        devices.append(TopoDevice(index=i, pci_bus_id=bdf, cpu_affinity=cpus,
                                  numa_node=numa if isinstance(numa, int) and numa >= 0 else sys_numa))
    links = []
    for a in range(len(handles)):
        for b in range(a + 1, len(handles)):
            call = _amd._Guard(smi, f"GPU {a}-{b}")
            info = call("amdsmi_topo_get_link_type", handles[a], handles[b])
            weight = call("amdsmi_topo_get_link_weight", handles[a], handles[b])
            kind = AMD_LINK_TYPES.get(info.get("type"), "unknown") if isinstance(info, dict) else "unknown"
            hops = info.get("hops") if isinstance(info, dict) else None
            links.append(TopoLink(a, b, kind, hops=hops, weight=weight if isinstance(weight, int) else None))
    return Topology(source="amdsmi", vendor="amd", devices=tuple(devices), links=tuple(links))


def parse_rocm_smi_showtopo(text: str) -> Topology:
    """Parse ``rocm-smi --showtopo``: weight, hops and link-type matrices, NUMA node per GPU."""
    tables: dict[str, dict[tuple[int, int], str]] = {"weight": {}, "hops": {}, "type": {}}
    titles = {"Weight between two GPUs": "weight", "Hops between two GPUs": "hops",
              "Link Type between two GPUs": "type"}
    numa: dict[int, int] = {}
    section = None
    for line in text.splitlines():
        if line.startswith("="):
            section = titles.get(line.strip("= ").strip())
            continue
        m = re.match(r"^GPU\[(\d+)\]\s*:\s*\(Topology\) Numa Node:\s*(-?\d+)", line)
        if m:
            numa[int(m.group(1))] = int(m.group(2))
            continue
        m = re.match(r"^GPU(\d+)\s+(\S.*)$", line)
        if section and m:
            for j, cell in enumerate(m.group(2).split()):
                tables[section][(int(m.group(1)), j)] = cell
    if not tables["type"]:
        raise ValueError("rocm-smi --showtopo: no 'Link Type between two GPUs' table")
    count = 1 + max(max(k) for k in tables["type"])
    devices = tuple(TopoDevice(index=i, numa_node=numa[i] if numa.get(i, -1) >= 0 else None) for i in range(count))

    def number(table: str, a: int, b: int) -> int | None:
        v = tables[table].get((a, b))
        return int(v) if v is not None and v.isdigit() else None
    links = tuple(
        TopoLink(a, b, tables["type"][(a, b)], hops=number("hops", a, b), weight=number("weight", a, b))
        for a in range(count) for b in range(a + 1, count) if (a, b) in tables["type"]
    )
    return Topology(source="rocm-smi --showtopo", vendor="amd", devices=devices, links=links)


def _run_rocm_smi(args: Sequence[str]) -> tuple[str | None, str]:
    import shutil  # noqa: PLC0415
    import subprocess  # noqa: PLC0415

    from capture.probes import amd as _amd

    exe = shutil.which("rocm-smi")
    if exe is None:
        return None, "rocm-smi not found"
    timeout_s = _amd.SMI_TIMEOUT_S
    try:
        done = subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout_s,
                              errors="replace", check=False)
    except subprocess.TimeoutExpired:
        return None, f"rocm-smi {' '.join(args)} timed out after {timeout_s:.0f} s"
    except OSError as exc:
        return None, f"rocm-smi: {exc.strerror or exc}"
    if done.returncode != 0:
        said = (done.stderr.strip() or done.stdout.strip()).splitlines()
        return None, f"rocm-smi exited {done.returncode}" + (f": {said[0]}" if said else "")
    return done.stdout, ""


# --------------------------------------------------------------------------- probe


def _nvidia_topology() -> tuple[Topology | None, str]:
    nvml, why = _nvidia.load_nvml()
    if nvml is not None:
        try:
            if nvml.nvmlDeviceGetCount() == 0:
                return None, "NVML lists no GPU"
            return nvml_topology(nvml), ""
        finally:
            _nvidia.shutdown_nvml(nvml)
    out, smi_why = _nvidia.run_smi(["topo", "-m"])
    if out is None:
        return None, f"{why}; {smi_why}"
    try:
        return parse_nvidia_topo_m(out), ""
    except ValueError as exc:
        return None, f"{why}; {exc}"


def _amd_topology() -> tuple[Topology | None, str]:
    from capture.probes import amd as _amd

    if not _amd.amd_driver_present():
        return None, "no AMD GPU driver"
    smi, why = _amd.load_amdsmi()
    if smi is not None:
        try:
            topo = amdsmi_topology(smi)
        finally:
            _amd.shutdown_amdsmi(smi)
        return (topo, "") if topo.devices else (None, "amdsmi lists no GPU")
    out, smi_why = _run_rocm_smi(["--showtopo"])
    if out is None:
        return None, f"{why}; {smi_why}"
    try:
        return parse_rocm_smi_showtopo(out), ""
    except ValueError as exc:
        return None, f"{why}; {exc}"


def probe(options: ProbeOptions | None = None) -> Topology | Skipped:
    """The ``[topology]`` table for the NVIDIA GPUs, else the AMD GPUs, of this machine."""
    topo, nvidia_why = _nvidia_topology()
    if topo is not None:
        return topo
    topo, amd_why = _amd_topology()
    if topo is not None:
        return topo
    return Skipped(f"no GPU: NVIDIA: {nvidia_why}; AMD: {amd_why}")

"""Memory readings: the allocator's view and the device's view, and the gap between them.

PyTorch's allocator statistics miss everything allocated outside it (the CUDA context, NCCL,
library workspaces). Measured on an H200 the context alone took 650,969,088 bytes that the
allocator never reported (tests/fixtures/h200/probe.json ``ctx_overhead_bytes``). So the device's
own figure is read too, through the official bindings (NVML via ``pynvml``, ``amdsmi`` on ROCm):
this process's usage when the driver lists it, else the device's used memory minus what was used
before this process created its context.

On a CPU, the peak resident set (``VmHWM`` in /proc/self/status, reset per phase by writing 5 to
/proc/self/clear_refs) stands for device memory, and is labelled so.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

MIB = 1 << 20


def _status_kib(*fields: str) -> list[int | None]:
    """Fields of /proc/self/status in bytes (its ``kB`` figures), read in one go; None for each
    one that is missing or where the file cannot be read."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            text = f.read()
    except OSError:
        return [None] * len(fields)
    found = (re.search(rf"^{field}:\s+(\d+) kB", text, re.M) for field in fields)
    return [int(m.group(1)) * 1024 if m else None for m in found]


def rss_bytes() -> int | None:
    """Resident set size of this process now."""
    return _status_kib("VmRSS")[0]


def file_rss_bytes() -> int | None:
    """The file-backed and shared part of this process's RSS now (``RssFile`` + ``RssShmem``): the
    libraries' pages, which a child process that maps the same files shares (charged once)."""
    file, shmem = _status_kib("RssFile", "RssShmem")
    return None if file is None else file + (shmem or 0)


def data_bytes() -> int | None:
    """This process's data segment now (``VmData``: what ``RLIMIT_DATA`` bounds)."""
    return _status_kib("VmData")[0]


def peak_rss_bytes() -> int | None:
    """Peak resident set size (VmHWM) since start or the last :func:`reset_peak_rss`."""
    return _status_kib("VmHWM")[0]


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux ``clear_refs`` value 5); False where not possible."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


# --------------------------------------------------------------------------- NVML / amdsmi


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlReader:
    """Device memory through NVML. ``module`` is the ``pynvml`` binding (injectable for tests)."""

    source = "nvml"

    def __init__(self, module: Any = None) -> None:
        if module is None:
            import pynvml as module  # type: ignore[no-redef]
        self.nvml = module
        self.nvml.nvmlInit()

    def _handles(self) -> dict[str, Any]:
        out = {}
        for i in range(self.nvml.nvmlDeviceGetCount()):
            h = self.nvml.nvmlDeviceGetHandleByIndex(i)
            out[_s(self.nvml.nvmlDeviceGetUUID(h)).removeprefix("GPU-").lower()] = h
        return out

    def used_by_device(self) -> dict[str, int]:
        """Used bytes of every device, keyed by UUID (without the ``GPU-`` prefix)."""
        return {u: int(self.nvml.nvmlDeviceGetMemoryInfo(h).used) for u, h in self._handles().items()}

    def total(self, uuid: str) -> int | None:
        h = self._handles().get(uuid)
        return int(self.nvml.nvmlDeviceGetMemoryInfo(h).total) if h is not None else None

    def device_used(self, uuid: str) -> int | None:
        return self.used_by_device().get(uuid)

    def process_used(self, uuid: str, pid: int) -> int | None:
        """This process's usedGpuMemory; None when the driver does not list it (e.g. a container
        whose PIDs the driver cannot see, or a driver that reports no per-process figure)."""
        h = self._handles().get(uuid)
        if h is None:
            return None
        try:
            procs = self.nvml.nvmlDeviceGetComputeRunningProcesses(h)
        except Exception:  # NVMLError_NotSupported and friends: no per-process figure here
            return None
        for p in procs:
            used = getattr(p, "usedGpuMemory", None)
            if getattr(p, "pid", None) == pid and isinstance(used, int) and used > 0:
                return used
        return None


class AmdsmiReader:
    """Device memory through amdsmi (ROCm), devices keyed by PCI address (BDF)."""

    source = "amdsmi"

    def __init__(self, module: Any = None) -> None:
        if module is None:
            import amdsmi as module  # type: ignore[no-redef]
        self.amd = module
        self.amd.amdsmi_init()

    def _handles(self) -> dict[str, Any]:
        return {_s(self.amd.amdsmi_get_gpu_device_bdf(h)).lower(): h for h in self.amd.amdsmi_get_processor_handles()}

    def used_by_device(self) -> dict[str, int]:
        return {b: int(self.amd.amdsmi_get_gpu_vram_usage(h)["vram_used"]) * MIB for b, h in self._handles().items()}

    def total(self, bdf: str) -> int | None:
        h = self._handles().get(bdf)
        return int(self.amd.amdsmi_get_gpu_vram_usage(h)["vram_total"]) * MIB if h is not None else None

    def device_used(self, bdf: str) -> int | None:
        return self.used_by_device().get(bdf)

    def process_used(self, bdf: str, pid: int) -> int | None:
        h = self._handles().get(bdf)
        if h is None:
            return None
        try:
            procs = self.amd.amdsmi_get_gpu_process_list(h)
        except Exception:
            return None
        for p in procs:
            if isinstance(p, dict) and p.get("pid") == pid:
                vram = (p.get("memory_usage") or {}).get("vram_mem")
                if isinstance(vram, int) and vram > 0:
                    return vram
        return None


# --------------------------------------------------------------------------- readings


@dataclass(frozen=True)
class MemoryReading:
    """Memory measured over one phase."""

    device_type: str
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    device_used_bytes: int | None = None
    device_used_source: str = ""
    device_total_bytes: int | None = None
    device_total_source: str = ""

    @property
    def allocator_gap_bytes(self) -> int | None:
        """Device usage the allocator never saw (context, library workspaces, ...)."""
        if self.device_used_bytes is None or self.peak_reserved_bytes is None:
            return None
        return self.device_used_bytes - self.peak_reserved_bytes

    def to_manifest(self) -> dict[str, Any]:
        return {
            "device_type": self.device_type,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "device_used_bytes": self.device_used_bytes,
            "device_used_source": self.device_used_source,
            "allocator_gap_bytes": self.allocator_gap_bytes,
            "device_total_bytes": self.device_total_bytes,
            "device_total_source": self.device_total_source,
        }


CPU_SOURCE = "peak RSS (VmHWM) of this process: stands for device memory on a CPU run"


class DeviceMemory:
    """Memory of one torch device over a phase: call :meth:`before_context` before CUDA is
    touched, :meth:`reset_peaks` at the start of a phase, :meth:`read` at its end."""

    def __init__(self, device: Any, reader: Any = None, device_key: str | None = None) -> None:
        self.device = device
        self.type = getattr(device, "type", str(device))
        self.reader = reader
        self.key = device_key
        self.baseline_used: int | None = None
        self.note: str | None = None
        self._baselines: dict[str, int] = {}

    def _ensure_reader(self) -> Any:
        if self.reader is not None or self.type != "cuda":
            return self.reader
        import torch

        try:
            self.reader = AmdsmiReader() if torch.version.hip else NvmlReader()
        except Exception as exc:  # no binding or no library: the allocator figures still stand
            self.note = f"device-level reading unavailable ({type(exc).__name__}: {exc})"
            self.reader = None
        return self.reader

    def _device_key(self) -> str | None:
        if self.key is not None or self.type != "cuda":
            return self.key
        import torch

        # Any: torch's stubs lack the pci_* fields its CUDA and ROCm builds have
        props: Any = torch.cuda.get_device_properties(self.device)
        if torch.version.hip:
            self.key = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        else:
            self.key = str(props.uuid).removeprefix("GPU-").lower()
        return self.key

    def before_context(self) -> None:
        """Record every device's used memory before this process creates its CUDA context."""
        reader = self._ensure_reader()
        if reader is not None:
            try:
                self._baselines = reader.used_by_device()
            except Exception as exc:
                self.note = f"device-level reading failed ({type(exc).__name__}: {exc})"

    def context_bytes(self) -> int | None:
        """After the context exists: how much the device gained (the allocator cannot see it)."""
        if self.type != "cuda":
            return None
        key = self._device_key()
        self.baseline_used = self._baselines.get(key) if key else None
        reader = self._ensure_reader()
        if reader is None or key is None:
            return None
        used = reader.process_used(key, os.getpid())
        if used is not None:
            return used
        now = reader.device_used(key)
        return now - self.baseline_used if now is not None and self.baseline_used is not None else None

    def process_bytes(self, pid: int) -> int | None:
        """The device memory NVML (amdsmi) lists for process ``pid``, 0 where it lists this
        process but not that one; None where there is no per-process figure here (then another
        process's memory would count in this one's fallback reading)."""
        if self.type != "cuda":
            return None
        reader, key = self._ensure_reader(), self._device_key()
        if reader is None or key is None:
            return None
        try:
            if reader.process_used(key, os.getpid()) is None:
                return None
            return reader.process_used(key, pid) or 0
        except Exception:  # a reading that fails is no figure
            return None

    def reset_peaks(self) -> None:
        if self.type == "cuda":
            import torch

            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            reset_peak_rss()

    def total_bytes(self) -> tuple[int | None, str]:
        if self.type == "cuda":
            reader, key = self._ensure_reader(), self._device_key()
            if reader is not None and key is not None:
                total = reader.total(key)
                if total is not None:
                    return total, reader.source
            import torch

            return int(torch.cuda.get_device_properties(self.device).total_memory), "torch device properties"
        from capture.trial import hostmem

        host = hostmem.read()  # MemTotal, or the memory cgroup's limit where lower
        return host.total_bytes, host.total_source

    def device_used(self) -> tuple[int | None, str]:
        """This process's device usage now, and where the figure came from."""
        if self.type != "cuda":
            return peak_rss_bytes(), CPU_SOURCE
        reader, key = self._ensure_reader(), self._device_key()
        if reader is None or key is None:
            return None, self.note or "no device-level reading"
        used = reader.process_used(key, os.getpid())
        if used is not None:
            return used, f"{reader.source}: this process's usage"
        now = reader.device_used(key)
        if now is None:
            return None, f"{reader.source}: device not found"
        if self.baseline_used is not None:
            return now - self.baseline_used, f"{reader.source}: device used minus used before this process's context (other processes' changes would count)"
        return now, f"{reader.source}: device used (includes other processes)"

    def read(self) -> MemoryReading:
        total, total_src = self.total_bytes()
        used, used_src = self.device_used()
        if self.type == "cuda":
            import torch

            return MemoryReading("cuda", torch.cuda.max_memory_allocated(self.device), torch.cuda.max_memory_reserved(self.device),
                                 used, used_src, total, total_src)
        return MemoryReading(self.type, None, None, used, used_src, total, total_src)


def allocated_bytes(device: Any) -> int:
    """Bytes of tensors the allocator holds now (0 on a CPU, where the estimate counts tensors)."""
    if getattr(device, "type", "") == "cuda":
        import torch

        return int(torch.cuda.memory_allocated(device))
    return 0

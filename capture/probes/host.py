"""The host: OS release, kernel, CPU, memory, libc. Files and syscalls only, no subprocesses."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from capture.probes import ProbeOptions


@dataclass(frozen=True)
class HostInfo:
    hostname: str
    kernel: str
    arch: str
    os: str | None = None
    """``PRETTY_NAME`` from os-release, e.g. "Ubuntu 22.04.4 LTS"."""
    os_id: str | None = None
    os_version_id: str | None = None
    cpu_model: str | None = None
    cpu_count: int | None = None
    """Logical CPUs in the machine."""
    cpu_count_usable: int | None = None
    """Logical CPUs this process may run on (affinity mask, e.g. a container's cpuset)."""
    memory_total_bytes: int | None = None
    libc: str | None = None
    """e.g. "glibc 2.35"; absent on musl or when it cannot be told without running a program."""

    def to_manifest(self) -> dict[str, Any]:
        return {
            "hostname": self.hostname,
            "os": self.os,
            "os_id": self.os_id,
            "os_version_id": self.os_version_id,
            "kernel": self.kernel,
            "arch": self.arch,
            "cpu_model": self.cpu_model,
            "cpu_count": self.cpu_count,
            "cpu_count_usable": self.cpu_count_usable,
            "memory_total_bytes": self.memory_total_bytes,
            "libc": self.libc,
        }


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def parse_os_release(text: str) -> dict[str, str]:
    """``KEY=value`` lines with shell-style quoting, as os-release(5) defines them."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, value = line.partition("=")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] == "'":
            value = value[1:-1]
        elif len(value) >= 2 and value[0] == value[-1] == '"':
            value = re.sub(r'\\([\\"$`])', r"\1", value[1:-1])
        out[key.strip()] = value
    return out


def parse_cpu_model(text: str) -> str | None:
    """The CPU model from /proc/cpuinfo (x86 "model name", POWER "cpu", some ARM "Model")."""
    for key in ("model name", "cpu model", "Model", "cpu", "Hardware"):
        for line in text.splitlines():
            name, sep, value = line.partition(":")
            if sep and name.strip() == key and value.strip():
                return value.strip()
    # Arm servers (Grace, Graviton, Ampere) only give implementer and part numbers.
    fields: dict[str, str] = {}
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() in ("CPU implementer", "CPU part"):
            fields.setdefault(name.strip(), value.strip().lower())
    impl, part = fields.get("CPU implementer"), fields.get("CPU part")
    if impl and part:
        return _ARM_PARTS.get((impl, part), f"Arm implementer {impl} part {part}")
    return None


_ARM_PARTS = {
    ("0x41", "0xd0c"): "Arm Neoverse N1",
    ("0x41", "0xd40"): "Arm Neoverse V1",
    ("0x41", "0xd49"): "Arm Neoverse N2",
    ("0x41", "0xd4f"): "Arm Neoverse V2",
    ("0x41", "0xd8e"): "Arm Neoverse N3",
    ("0x41", "0xd84"): "Arm Neoverse V3",
    ("0xc0", "0xac3"): "Ampere-1",
}


def parse_meminfo_bytes(text: str, field: str) -> int | None:
    """One field of /proc/meminfo in bytes (``kB`` values times 1024), None where absent or not a number."""
    for line in text.splitlines():
        if line.startswith(field + ":"):
            parts = line.split()
            try:
                value = int(parts[1])
            except (IndexError, ValueError):
                return None
            unit = parts[2].lower() if len(parts) > 2 else ""
            return value * 1024 if unit == "kb" else value
    return None


def parse_meminfo_total_bytes(text: str) -> int | None:
    return parse_meminfo_bytes(text, "MemTotal")


def _libc() -> str | None:
    try:
        value = os.confstr("CS_GNU_LIBC_VERSION")  # "glibc 2.35"; no subprocess, no file scan
    except (ValueError, OSError, AttributeError):
        value = None
    if value:
        return value
    import platform  # only where confstr cannot tell: it scans the interpreter's binary

    name, version = platform.libc_ver()
    return f"{name} {version}" if name and version else None


ROOT_ENV = "CAPTURE_HOST_ROOT"


def host_root() -> Path:
    """Where the host's /etc and /proc files are read: ``$CAPTURE_HOST_ROOT``, else ``/``.

    For a host whose files are mounted elsewhere (a container with the host's root at /host), and
    for the test suite's run under another host identity (tests/test_host_identity.py)."""
    return Path(os.environ.get(ROOT_ENV) or "/")


def _line(path: Path) -> str | None:
    text = _read(path)
    return (text.strip() or None) if text is not None else None


def cpu_model(root: Path | None = None) -> str | None:
    """The CPU model as :func:`probe` records it (the trial names a CPU run after it)."""
    cpuinfo = _read((root or host_root()) / "proc/cpuinfo")
    return parse_cpu_model(cpuinfo) if cpuinfo else None


def memory_total_bytes(root: Path | None = None) -> int | None:
    """MemTotal as :func:`probe` records it (the trial's host-memory budget on a CPU)."""
    meminfo = _read((root or host_root()) / "proc/meminfo")
    return parse_meminfo_total_bytes(meminfo) if meminfo else None


def probe(options: ProbeOptions, *, root: Path | None = None) -> HostInfo:
    """``root``: a tree of files shaped like /etc and /proc (default :func:`host_root`). The
    hostname and kernel release are /proc/sys/kernel's, which are uname's on a live root."""
    root = root or host_root()
    uname = os.uname()
    release = _read(root / "etc/os-release") or _read(root / "usr/lib/os-release")
    osr = parse_os_release(release) if release else {}
    try:
        usable: int | None = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = None
    return HostInfo(
        hostname=_line(root / "proc/sys/kernel/hostname") or uname.nodename,
        kernel=_line(root / "proc/sys/kernel/osrelease") or uname.release,
        arch=uname.machine,
        os=osr.get("PRETTY_NAME") or osr.get("NAME"),
        os_id=osr.get("ID"),
        os_version_id=osr.get("VERSION_ID"),
        cpu_model=cpu_model(root),
        cpu_count=os.cpu_count(),
        cpu_count_usable=usable,
        memory_total_bytes=memory_total_bytes(root),
        libc=_libc(),
    )

"""AMD GPUs through ``amdsmi``; ``amd-smi static --json`` only when the library cannot load.

The ``amdsmi`` Python package loads ``libamd_smi.so`` when it is imported and prints (to stdout)
when it cannot; that import is done with stdout captured, so a machine without ROCm gives a
clean :class:`Skipped` and never a stray line in the command's output.

Which devices this process may use follows ROCm: ``ROCR_VISIBLE_DEVICES`` picks from the
physical devices first, then ``HIP_VISIBLE_DEVICES`` (or, when that is unset,
``CUDA_VISIBLE_DEVICES``, which HIP also honours) picks from what ROCr left. Entries are indices
or ``GPU-<unique id>`` (the ASIC serial ``rocminfo`` prints as ``Uuid``), read like CUDA reads
``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass, fields, replace
from typing import Any, Sequence

from capture import _json
from capture.probes import ProbeOptions, Skipped
from capture.probes.nvidia import DeviceIds, cuda_device_list

log = logging.getLogger(__name__)

SOURCE_AMDSMI = "amdsmi"
SOURCE_SMI_JSON = "amd-smi static --json"
SMI_TIMEOUT_S = 30.0
VISIBILITY_VARIABLES = ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")

_MISSING = frozenset({"", "N/A", "n/a", "NA", "Unknown", "unknown"})


@dataclass(frozen=True)
class AmdDevice:
    """One AMD GPU, in amdsmi order."""

    index: int
    market_name: str | None = None
    gfx_target: str | None = None
    """The ISA the kernels are built for, ``gfx942``."""
    uuid: str | None = None
    asic_serial: str | None = None
    """``0x8D1457E2C20F59D2``; ROCr's ``GPU-<id>`` device names are this number."""
    device_id: str | None = None
    bdf: str | None = None
    vram_total_bytes: int | None = None
    vbios_version: str | None = None
    visible: bool = True
    hip_index: int | None = None

    def to_manifest(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


@dataclass(frozen=True)
class AmdInfo:
    """The ``[amd]`` table."""

    source: str
    driver_version: str | None = None
    rocm_version: str | None = None
    devices: tuple[AmdDevice, ...] = ()
    rocr_visible_devices: str | None = None
    hip_visible_devices: str | None = None
    cuda_visible_devices: str | None = None
    amdsmi_error: str | None = None
    """Why amdsmi could not be used, when the ``amd-smi`` fallback answered instead."""

    def to_manifest(self) -> dict[str, Any]:
        out: dict[str, Any] = {"source": self.source, "device_count": len(self.devices)}
        for f in fields(self):
            if f.name not in ("source", "devices") and getattr(self, f.name) is not None:
                out[f.name] = getattr(self, f.name)
        out["devices"] = [d.to_manifest() for d in self.devices]
        return out


def _clean(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    value = str(value).strip()
    return None if value in _MISSING else value


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


# --------------------------------------------------------------------------- visibility


def _serial_hex(serial: str | None) -> str | None:
    if not serial:
        return None
    s = serial.lower()
    return s[2:] if s.startswith("0x") else s


def _pick(devices: Sequence[int], serials: Sequence[str | None], value: str | None) -> list[int]:
    ids = [DeviceIds(f"GPU-{_serial_hex(serials[d])}" if serials[d] else None, False, ()) for d in devices]
    return [devices[g] for g, _ in cuda_device_list(ids, value)]


def apply_visibility(devices: Sequence[AmdDevice], env: dict[str, str | None]) -> tuple[AmdDevice, ...]:
    """Set ``visible``/``hip_index`` from ROCR_/HIP_/CUDA_VISIBLE_DEVICES (see the module doc)."""
    serials = [d.asic_serial for d in devices]
    after_rocr = _pick(list(range(len(devices))), serials, env.get("ROCR_VISIBLE_DEVICES"))
    hip = env.get("HIP_VISIBLE_DEVICES")
    if hip is None:
        hip = env.get("CUDA_VISIBLE_DEVICES")
    order = _pick(after_rocr, serials, hip)
    position = {d: i for i, d in enumerate(order)}
    return tuple(replace(d, visible=i in position, hip_index=position.get(i)) for i, d in enumerate(devices))


# --------------------------------------------------------------------------- amdsmi


_IMPORT_LOCK = threading.Lock()


def load_amdsmi() -> tuple[Any | None, str | None]:
    """Import ``amdsmi`` and run ``amdsmi_init``: ``(module, None)`` or ``(None, why not)``."""
    # redirect_stdout swaps the process-wide sys.stdout: two probe threads doing it at once
    # could leave it pointing at a dead buffer, so the import is serialised.
    with _IMPORT_LOCK:
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                import amdsmi  # noqa: PLC0415 - optional dependency; loads libamd_smi.so on import
        except ImportError as exc:
            return None, f"amdsmi is not installed ({exc})"
        except Exception as exc:  # KeyError('libamd_smi.so') when the native library is missing
            said = printed.getvalue().strip().splitlines()
            return None, f"amdsmi: {said[0] if said else _one_line(exc)}"
        finally:
            for line in printed.getvalue().splitlines():
                log.debug("amdsmi import said: %s", line)
    try:
        amdsmi.amdsmi_init()
    except Exception as exc:  # AmdSmiLibraryException: driver not loaded, no permission, ...
        return None, f"amdsmi_init: {_one_line(exc)}"
    return amdsmi, None


class _Guard:
    def __init__(self, smi: Any, where: str) -> None:
        self.smi, self.where = smi, where

    def __call__(self, name: str, *args: Any) -> Any:
        fn = getattr(self.smi, name, None)
        if fn is None:
            log.debug("%s: amdsmi has no %s", self.where, name)
            return None
        try:
            return fn(*args)
        except self.smi.AmdSmiException as exc:
            log.debug("%s: %s: %s", self.where, name, _one_line(exc))
            return None


def _get(mapping: Any, *keys: str) -> str | None:
    if not isinstance(mapping, dict):
        return None
    for key in keys:
        if key in mapping:
            return _clean(mapping[key])
    return None


def _mib_bytes(value: Any) -> int | None:
    """amdsmi's ``vram_size`` (MB, i.e. MiB) -> bytes."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return None
    return value * 2**20


def read_device(smi: Any, handle: Any, index: int) -> AmdDevice:
    call = _Guard(smi, f"GPU {index}")
    asic = call("amdsmi_get_gpu_asic_info", handle)
    vram = call("amdsmi_get_gpu_vram_info", handle)
    vbios = call("amdsmi_get_gpu_vbios_info", handle)
    gfx = _get(asic, "target_graphics_version")
    return AmdDevice(
        index=index,
        market_name=_get(asic, "market_name"),
        gfx_target=gfx if gfx and gfx != "gfx0" else None,
        uuid=_clean(call("amdsmi_get_gpu_device_uuid", handle)),
        asic_serial=_get(asic, "asic_serial"),
        device_id=_get(asic, "device_id"),
        bdf=_clean(call("amdsmi_get_gpu_device_bdf", handle)),
        vram_total_bytes=_mib_bytes(vram.get("vram_size")) if isinstance(vram, dict) else None,
        vbios_version=_get(vbios, "version", "version_string"),
    )


def probe_amdsmi(smi: Any) -> AmdInfo:
    """Read everything through an initialised amdsmi (the caller shuts it down)."""
    handles = smi.amdsmi_get_processor_handles()
    devices = tuple(read_device(smi, h, i) for i, h in enumerate(handles))
    call = _Guard(smi, "system")
    driver = None
    for h in handles:
        driver = _get(call("amdsmi_get_gpu_driver_info", h), "driver_version")
        if driver:
            break
    rocm = call("amdsmi_get_rocm_version")
    rocm_version = _clean(rocm[1]) if isinstance(rocm, tuple) and len(rocm) == 2 and rocm[0] else None
    return AmdInfo(source=SOURCE_AMDSMI, driver_version=driver, rocm_version=rocm_version, devices=devices)


def shutdown_amdsmi(smi: Any) -> None:
    try:
        smi.amdsmi_shut_down()
    except Exception as exc:  # noqa: BLE001 - shutting down must never hide the result
        log.debug("amdsmi_shut_down: %s", _one_line(exc))


# --------------------------------------------------------------------------- amd-smi (fallback)


def run_amd_smi(args: Sequence[str], timeout_s: float | None = None) -> tuple[str | None, str]:
    """Run ``amd-smi ARGS``: ``(stdout, "")`` or ``(None, why not)``."""
    timeout_s = SMI_TIMEOUT_S if timeout_s is None else timeout_s
    exe = shutil.which("amd-smi")
    if exe is None:
        return None, "amd-smi not found"
    try:
        done = subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout_s,
                              errors="replace", check=False)
    except subprocess.TimeoutExpired:
        return None, f"amd-smi {' '.join(args)} timed out after {timeout_s:.0f} s"
    except OSError as exc:
        return None, f"amd-smi: {exc.strerror or exc}"
    if done.returncode != 0:
        said = (done.stderr.strip() or done.stdout.strip()).splitlines()
        return None, f"amd-smi exited {done.returncode}" + (f": {said[0]}" if said else "")
    return done.stdout, ""


def _size_bytes(value: Any) -> int | None:
    """``{"value": 196592, "unit": "MB"}`` or ``"196592 MB"`` -> bytes (amd-smi's MB are MiB)."""
    if isinstance(value, dict):
        number, unit = value.get("value"), str(value.get("unit", "")).strip()
    else:
        m = re.fullmatch(r"\s*(\d+)\s*([KMG]B)\s*", str(value))
        if not m:
            return None
        number, unit = int(m.group(1)), m.group(2)
    scale = {"KB": 2**10, "MB": 2**20, "GB": 2**30}.get(unit)
    if scale is None or isinstance(number, bool) or not isinstance(number, int):
        return None
    return number * scale


def parse_static_json(text: str) -> AmdInfo:
    """Parse ``amd-smi static --json``: a list of per-GPU objects (newer releases wrap it in
    ``{"gpu_data": [...]}``) whose keys are the lower-case names of the text output."""
    start = min((i for i in (text.find("["), text.find("{")) if i >= 0), default=-1)
    if start < 0:
        raise ValueError("amd-smi static --json printed no JSON")
    try:
        data = _json.loads(text[start:])
    except _json.JsonError as exc:
        raise ValueError(f"amd-smi static --json printed invalid JSON ({exc.reason})") from None
    if isinstance(data, dict):
        data = data.get("gpu_data", [data] if "gpu" in data else [])
    if not isinstance(data, list):
        raise ValueError("amd-smi static --json: expected a list of GPUs")
    devices = []
    driver = None
    for pos, gpu in enumerate(d for d in data if isinstance(d, dict)):
        asic = gpu.get("asic") or {}
        index = gpu.get("gpu")
        driver = driver or _get(gpu.get("driver"), "version", "driver_version")
        vram = gpu.get("vram") or {}
        devices.append(AmdDevice(
            index=index if isinstance(index, int) and not isinstance(index, bool) else pos,
            market_name=_get(asic, "market_name"),
            gfx_target=_get(asic, "target_graphics_version"),
            uuid=_get(gpu, "uuid") or _get(asic, "uuid"),
            asic_serial=_get(asic, "asic_serial"),
            device_id=_get(asic, "device_id"),
            bdf=_get(gpu.get("bus"), "bdf") or _get(gpu, "bdf"),
            vram_total_bytes=_size_bytes(vram.get("size")) if isinstance(vram, dict) else None,
            vbios_version=_get(gpu.get("vbios") or gpu.get("ifwi"), "version", "version_string"),
        ))
    return AmdInfo(source=SOURCE_SMI_JSON, driver_version=driver, devices=tuple(devices))


def rocm_version_from_amd_smi_version(text: str) -> str | None:
    """``AMDSMI Tool: ... | ROCm version: 6.1.0`` -> ``"6.1.0"``."""
    m = re.search(r"ROCm version:\s*([^\s|]+)", text)
    return _clean(m.group(1)) if m else None


# --------------------------------------------------------------------------- probe


def amd_driver_present() -> bool:
    """Anything that could answer: importing amdsmi costs ~90 ms on machines that have none."""
    return (os.path.exists("/dev/kfd") or os.path.isdir("/sys/module/amdgpu") or "amdsmi" in sys.modules
            or shutil.which("amd-smi") is not None or shutil.which("rocm-smi") is not None)


def probe(options: ProbeOptions | None = None) -> AmdInfo | Skipped:
    """The ``[amd]`` table: amdsmi first, ``amd-smi static --json`` if the library cannot load."""
    env = {name: os.environ.get(name) for name in VISIBILITY_VARIABLES}
    if not amd_driver_present():
        return Skipped("no AMD GPU driver: no /dev/kfd, no amdgpu kernel module, no amd-smi or rocm-smi")
    smi, why = load_amdsmi()
    if smi is not None:
        try:
            info = probe_amdsmi(smi)
        finally:
            shutdown_amdsmi(smi)
    else:
        out, smi_why = run_amd_smi(["static", "--json"])
        if out is None:
            return Skipped(f"no AMD GPU driver: {why}; {smi_why}")
        try:
            info = parse_static_json(out)
        except ValueError as exc:
            return Skipped(f"no AMD GPU driver: {why}; {exc}")
        version, _ = run_amd_smi(["version"])
        info = replace(info, amdsmi_error=why,
                       rocm_version=rocm_version_from_amd_smi_version(version) if version else None)
    if not info.devices:
        return Skipped(f"no AMD GPU: {info.source} lists no devices")
    return replace(info, devices=apply_visibility(info.devices, env),
                   rocr_visible_devices=env["ROCR_VISIBLE_DEVICES"],
                   hip_visible_devices=env["HIP_VISIBLE_DEVICES"],
                   cuda_visible_devices=env["CUDA_VISIBLE_DEVICES"])

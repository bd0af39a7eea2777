"""NVIDIA GPUs through NVML (``nvidia-ml-py``); ``nvidia-smi -q -x`` only when NVML cannot load.

NVML answers in tens of milliseconds and needs no subprocess (shared/DESIGN.md, decision 3).
Every per-device call may fail on some boards (``NVMLError_NotSupported`` for a serial on a
consumer card, a power limit under vGPU, ...): that field is left out, the device is kept.

Which devices this process may use follows ``CUDA_VISIBLE_DEVICES`` the way the CUDA runtime
reads it (see :func:`cuda_device_list`): each device gets ``visible`` and, where CUDA will
number it, ``cuda_index``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, fields, replace
from typing import Any, Sequence

from capture.probes import ProbeOptions, Skipped

log = logging.getLogger(__name__)

SOURCE_NVML = "nvml"
SOURCE_SMI_XML = "nvidia-smi -q -x"
SMI_TIMEOUT_S = 30.0

# NVML_DEVICE_ARCH_* -> the name nvidia-smi prints as "Product Architecture".
ARCHITECTURES = {
    2: "Kepler", 3: "Maxwell", 4: "Pascal", 5: "Volta", 6: "Turing", 7: "Ampere",
    8: "Ada Lovelace", 9: "Hopper", 10: "Blackwell", 13: "Rubin",
}

# What nvidia-smi prints for a value the board does not report.
_SMI_MISSING = frozenset({
    "", "N/A", "[N/A]", "Not Supported", "[Not Supported]", "Unknown Error", "[Unknown Error]",
    "Insufficient Permissions", "[Insufficient Permissions]", "Requested functionality has been deprecated",
})


@dataclass(frozen=True)
class MigInstance:
    """One MIG device (a compute instance inside a GPU instance)."""

    index: int
    uuid: str | None = None
    memory_total_bytes: int | None = None
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    gpu_instance_profile: str | None = None
    """NVML's profile name, e.g. ``MIG 1g.10gb``."""
    compute_instance_profile: str | None = None
    gpu_instance_slice_count: int | None = None
    compute_instance_slice_count: int | None = None
    multiprocessor_count: int | None = None
    visible: bool = False
    cuda_index: int | None = None

    def to_manifest(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


@dataclass(frozen=True)
class NvidiaDevice:
    """One physical GPU, in NVML order (PCI bus order, like ``nvidia-smi``)."""

    index: int
    name: str | None = None
    uuid: str | None = None
    serial: str | None = None
    pci_bus_id: str | None = None
    memory_total_bytes: int | None = None
    compute_capability: str | None = None
    """``"9.0"``; NVML only (``nvidia-smi -q`` does not print it)."""
    vbios_version: str | None = None
    ecc_enabled: bool | None = None
    mig_enabled: bool | None = None
    power_limit_w: float | None = None
    """The enforced power limit."""
    board_part_number: str | None = None
    architecture: str | None = None
    visible: bool = True
    cuda_index: int | None = None
    mig_instances: tuple[MigInstance, ...] = ()

    def to_manifest(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or (f.name == "mig_instances" and not value):
                continue
            out[f.name] = [m.to_manifest() for m in value] if f.name == "mig_instances" else value
        return out


@dataclass(frozen=True)
class NvidiaInfo:
    """The ``[nvidia]`` table."""

    source: str
    driver_version: str | None = None
    cuda_driver_version: str | None = None
    """The newest CUDA the driver supports, ``"13.0"`` (NVML reports 13000)."""
    devices: tuple[NvidiaDevice, ...] = ()
    cuda_visible_devices: str | None = None
    """The raw ``CUDA_VISIBLE_DEVICES`` when it is set (also when set to the empty string)."""
    cuda_device_order: str | None = None
    """The raw ``CUDA_DEVICE_ORDER`` when it is set."""
    nvml_error: str | None = None
    """Why NVML could not be used, when the ``nvidia-smi`` fallback answered instead."""

    def to_manifest(self) -> dict[str, Any]:
        out: dict[str, Any] = {"source": self.source, "device_count": len(self.devices)}
        for key in ("driver_version", "cuda_driver_version", "cuda_visible_devices", "cuda_device_order", "nvml_error"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        out["devices"] = [d.to_manifest() for d in self.devices]
        return out


# --------------------------------------------------------------------------- CUDA_VISIBLE_DEVICES


@dataclass(frozen=True)
class DeviceIds:
    """What CUDA_VISIBLE_DEVICES can name on one GPU."""

    uuid: str | None
    mig_enabled: bool
    mig: tuple[tuple[str | None, int | None, int | None], ...]  # (uuid, gpu instance id, compute instance id)


def _strtoul(text: str) -> int:
    """The leading decimal number of ``text`` (``"1gpu"`` -> 1), or -1 (CUDA parses with strtoul)."""
    digits = ""
    for i, c in enumerate(text):
        if c.isdigit() or (i == 0 and c in "+-"):
            digits += c
        else:
            break
    try:
        return int(digits)
    except ValueError:
        return -1


def _unique_prefix(candidate: str, names: Sequence[str | None]) -> int:
    hits = [i for i, n in enumerate(names) if n is not None and n.startswith(candidate)]
    return hits[0] if len(hits) == 1 else -1


def cuda_device_list(gpus: Sequence[DeviceIds], value: str | None) -> list[tuple[int, int | None]]:
    """The devices CUDA enumerates, in CUDA order: ``(gpu index, mig index or None)``.

    Follows the CUDA documentation and the behaviour PyTorch models in
    ``torch.cuda._parse_visible_devices``: entries are indices (parsed like ``strtoul``), GPU
    UUIDs or unique UUID prefixes (``GPU-8932f937``), or MIG UUIDs (``MIG-...``, also the older
    ``MIG-GPU-<uuid>/<gi>/<ci>``); the list stops at the first invalid entry; a repeated entry
    makes the whole list empty; the empty string hides every device. A MIG-enabled GPU shows up
    as its MIG devices, and CUDA enumerates only one MIG device per process (MIG user guide).
    """
    def expand(g: int) -> list[tuple[int, int | None]]:
        if gpus[g].mig_enabled:
            return [(g, m) for m in range(len(gpus[g].mig))]
        return [(g, None)]

    if value is None:
        picked: list[tuple[int, int | None]] = [(g, None) for g in range(len(gpus))]
    else:
        picked = []
        entries = value.split(",")
        mode = "GPU-" if value.startswith("GPU-") else "MIG-" if value.startswith("MIG-") else "index"
        for raw in entries:
            entry = raw.strip() if mode == "index" else raw
            if mode == "index":
                n = _strtoul(entry)
                if n < 0 or n >= len(gpus):
                    break
                target: tuple[int, int | None] = (n, None)
            elif mode == "GPU-":
                if not entry.startswith("GPU-") or entry == "GPU-":  # CUDA wants some digits
                    break
                g = _unique_prefix(entry, [x.uuid for x in gpus])
                if g < 0:
                    break
                target = (g, None)
            else:
                if not entry.startswith("MIG-") or entry == "MIG-":
                    break
                found = _find_mig(gpus, entry)
                if found is None:
                    break
                target = found
            if target in picked:
                return []
            picked.append(target)
    out: list[tuple[int, int | None]] = []
    for g, m in picked:
        out.extend(expand(g) if m is None else [(g, m)])
    migs = [t for t in out if t[1] is not None]
    if len(migs) > 1:
        out = [t for t in out if t[1] is None or t == migs[0]]
    return out


def _find_mig(gpus: Sequence[DeviceIds], entry: str) -> tuple[int, int] | None:
    if entry.startswith("MIG-GPU-") and entry.count("/") == 2:
        gpu_uuid, gi, ci = entry[len("MIG-"):].split("/")
        g = next((i for i, x in enumerate(gpus) if x.uuid == gpu_uuid), -1)
        if g < 0 or not gi.isdigit() or not ci.isdigit():
            return None
        for m, (_, gid, cid) in enumerate(gpus[g].mig):
            if gid == int(gi) and cid == int(ci):
                return g, m
        return None
    flat = [(g, m, u) for g, x in enumerate(gpus) for m, (u, _, _) in enumerate(x.mig)]
    hit = _unique_prefix(entry, [u for _, _, u in flat])
    return None if hit < 0 else (flat[hit][0], flat[hit][1])


def apply_visibility(devices: Sequence[NvidiaDevice], value: str | None,
                     device_order: str | None = None) -> tuple[NvidiaDevice, ...]:
    """Set ``visible``/``cuda_index`` on each device and MIG instance.

    CUDA numbers devices fastest-first unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``; with one model of
    GPU the two orders agree, with mixed models nobody can say which index CUDA gives, so
    ``cuda_index`` is left out rather than guessed.
    """
    ids = [DeviceIds(d.uuid, bool(d.mig_enabled and d.mig_instances),
                tuple((m.uuid, m.gpu_instance_id, m.compute_instance_id) for m in d.mig_instances))
           for d in devices]
    order = cuda_device_list(ids, value)
    models = {devices[g].name for g, _ in order}
    numbered = device_order == "PCI_BUS_ID" or len(models) <= 1
    position = {t: i for i, t in enumerate(order)}
    out = []
    for g, d in enumerate(devices):
        migs = tuple(
            replace(m, visible=(g, k) in position, cuda_index=position.get((g, k)) if numbered else None)
            for k, m in enumerate(d.mig_instances)
        )
        whole = (g, None) in position
        out.append(replace(
            d,
            visible=whole or any(m.visible for m in migs),
            cuda_index=position.get((g, None)) if (whole and numbered) else None,
            mig_instances=migs,
        ))
    return tuple(out)


# --------------------------------------------------------------------------- NVML


def _text(value: Any) -> str | None:
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    value = str(value).strip()
    return value or None


def cuda_version_string(version: int) -> str:
    """NVML's 13000 / 12020 -> ``"13.0"`` / ``"12.2"``."""
    return f"{version // 1000}.{(version % 1000) // 10}"


class _Guard:
    """Call NVML functions, turning each NVMLError into a missing value (and a debug line)."""

    def __init__(self, nvml: Any, where: str) -> None:
        self.nvml = nvml
        self.where = where

    def __call__(self, name: str, *args: Any) -> Any:
        fn = getattr(self.nvml, name, None)
        if fn is None:  # an older nvidia-ml-py without this function
            log.debug("%s: pynvml has no %s", self.where, name)
            return None
        try:
            return fn(*args)
        except self.nvml.NVMLError as exc:
            log.debug("%s: %s: %s", self.where, name, exc)
            return None


def _mig_instances(nvml: Any, handle: Any, call: _Guard) -> tuple[MigInstance, ...]:
    count = call("nvmlDeviceGetMaxMigDeviceCount", handle) or 0
    out: list[MigInstance] = []
    for slot in range(count):
        mig = call("nvmlDeviceGetMigDeviceHandleByIndex", handle, slot)
        if mig is None:  # empty slot: NVMLError_NotFound
            continue
        attrs = call("nvmlDeviceGetAttributes", mig)
        mem = call("nvmlDeviceGetMemoryInfo", mig)
        gi_id = call("nvmlDeviceGetGpuInstanceId", mig)
        ci_id = call("nvmlDeviceGetComputeInstanceId", mig)
        gi_name = ci_name = None
        # Profile names need the GPU instance object, which NVML may refuse without privileges.
        gi = call("nvmlDeviceGetGpuInstanceById", handle, gi_id) if gi_id is not None else None
        if gi is not None:
            gi_info = call("nvmlGpuInstanceGetInfo", gi)
            if gi_info is not None:
                prof = call("nvmlDeviceGetGpuInstanceProfileInfoById", handle, gi_info.profileId)
                gi_name = _text(prof.name) if prof is not None else None
            ci = call("nvmlGpuInstanceGetComputeInstanceById", gi, ci_id) if ci_id is not None else None
            ci_info = call("nvmlComputeInstanceGetInfo", ci) if ci is not None else None
            if ci_info is not None:
                prof = call("nvmlGpuInstanceGetComputeInstanceProfileInfo", gi, ci_info.profileId,
                            nvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
                ci_name = _text(prof.name) if prof is not None else None
        uuid = call("nvmlDeviceGetUUID", mig)
        total = mem.total if mem is not None else (attrs.memorySizeMB * 2**20 if attrs is not None else None)
        out.append(MigInstance(
            index=len(out),
            uuid=_text(uuid) if uuid is not None else None,
            memory_total_bytes=int(total) if total is not None else None,
            gpu_instance_id=gi_id,
            compute_instance_id=ci_id,
            gpu_instance_profile=gi_name,
            compute_instance_profile=ci_name,
            gpu_instance_slice_count=attrs.gpuInstanceSliceCount if attrs is not None else None,
            compute_instance_slice_count=attrs.computeInstanceSliceCount if attrs is not None else None,
            multiprocessor_count=attrs.multiprocessorCount if attrs is not None else None,
        ))
    return tuple(out)


def read_device(nvml: Any, index: int) -> NvidiaDevice:
    """One device through NVML; every field NVML refuses is left out."""
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    call = _Guard(nvml, f"GPU {index}")

    def text(name: str) -> str | None:
        v = call(name, handle)
        return _text(v) if v is not None else None

    pci = call("nvmlDeviceGetPciInfo", handle)
    mem = call("nvmlDeviceGetMemoryInfo", handle)
    cc = call("nvmlDeviceGetCudaComputeCapability", handle)
    ecc = call("nvmlDeviceGetEccMode", handle)
    mig = call("nvmlDeviceGetMigMode", handle)
    power_mw = call("nvmlDeviceGetEnforcedPowerLimit", handle)
    arch = call("nvmlDeviceGetArchitecture", handle)
    mig_enabled = None if mig is None else mig[0] == nvml.NVML_DEVICE_MIG_ENABLE
    return NvidiaDevice(
        index=index,
        name=text("nvmlDeviceGetName"),
        uuid=text("nvmlDeviceGetUUID"),
        serial=text("nvmlDeviceGetSerial"),
        pci_bus_id=_text(pci.busId) if pci is not None else None,
        memory_total_bytes=int(mem.total) if mem is not None else None,
        compute_capability=f"{cc[0]}.{cc[1]}" if cc is not None else None,
        vbios_version=text("nvmlDeviceGetVbiosVersion"),
        ecc_enabled=None if ecc is None else ecc[0] == nvml.NVML_FEATURE_ENABLED,
        mig_enabled=mig_enabled,
        power_limit_w=power_mw / 1000.0 if power_mw is not None else None,
        board_part_number=text("nvmlDeviceGetBoardPartNumber"),
        architecture=ARCHITECTURES.get(arch) if arch is not None else None,
        mig_instances=_mig_instances(nvml, handle, call) if mig_enabled else (),
    )


_DRIVER_SIGNS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg")


def load_nvml() -> tuple[Any | None, str | None]:
    """Import ``pynvml`` and run ``nvmlInit``: ``(module, None)`` or ``(None, why not)``.

    Tests put a fake module in ``sys.modules["pynvml"]``; nothing else is faked. Where the
    machine shows no sign of an NVIDIA driver (no ``/proc/driver/nvidia``, ``/dev/nvidiactl``,
    ``/dev/nvidia0`` nor WSL's ``/dev/dxg``), pynvml is not even imported: that import and its
    failing ``nvmlInit`` cost a CPU machine's fingerprint more than all the other probes.
    """
    import sys

    if "pynvml" not in sys.modules and not any(os.path.exists(p) for p in _DRIVER_SIGNS):
        return None, "no NVIDIA kernel driver (no /proc/driver/nvidia, no /dev/nvidiactl)"
    try:
        import pynvml  # noqa: PLC0415 - optional dependency, imported only when probing
    except ImportError as exc:
        return None, f"nvidia-ml-py is not installed ({exc})"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return None, f"NVML: {exc}"
    except OSError as exc:
        return None, f"NVML: {exc}"
    return pynvml, None


def shutdown_nvml(nvml: Any) -> None:
    try:
        nvml.nvmlShutdown()
    except nvml.NVMLError as exc:
        log.debug("nvmlShutdown: %s", exc)


def probe_nvml(nvml: Any) -> NvidiaInfo:
    """Read everything through an initialised NVML (the caller shuts it down)."""
    call = _Guard(nvml, "system")
    driver = call("nvmlSystemGetDriverVersion")
    cuda = call("nvmlSystemGetCudaDriverVersion")
    count = nvml.nvmlDeviceGetCount()
    devices = []
    for i in range(count):
        try:
            devices.append(read_device(nvml, i))
        except nvml.NVMLError as exc:  # no handle at all (GPU lost, no permission): keep its place
            log.debug("GPU %d: %s", i, exc)
            devices.append(NvidiaDevice(index=i))
    return NvidiaInfo(
        source=SOURCE_NVML,
        driver_version=_text(driver) if driver is not None else None,
        cuda_driver_version=cuda_version_string(cuda) if cuda else None,
        devices=tuple(devices),
    )


# --------------------------------------------------------------------------- nvidia-smi -q -x


def _smi(value: str | None) -> str | None:
    if value is None:
        return None
    value = value.strip()
    return None if value in _SMI_MISSING else value


def _mib_to_bytes(text: str | None) -> int | None:
    text = _smi(text)
    if text is None:
        return None
    number, _, unit = text.partition(" ")
    if unit.strip() != "MiB" or not number.isdigit():
        return None
    return int(number) * 2**20


def _watts(text: str | None) -> float | None:
    text = _smi(text)
    if text is None or not text.endswith(" W"):
        return None
    try:
        return float(text[:-2])
    except ValueError:
        return None


def _int(text: str | None) -> int | None:
    text = _smi(text)
    return int(text) if text is not None and text.isdigit() else None


def parse_smi_xml(text: str) -> NvidiaInfo:
    """Parse ``nvidia-smi -q -x`` (DTD v10-v12) into the same result NVML gives."""
    import xml.etree.ElementTree as ET  # only the fallback parses XML; the import costs ~20 ms

    try:
        root = ET.fromstring(text)
    except ET.ParseError as exc:
        raise ValueError(f"nvidia-smi -q -x printed something that is not XML ({exc})") from None
    if root.tag != "nvidia_smi_log":
        raise ValueError(f"nvidia-smi -q -x: unexpected root element <{root.tag}>")
    devices = []
    for index, gpu in enumerate(root.findall("gpu")):
        migs: list[MigInstance] = []
        for m in gpu.findall("mig_devices/mig_device"):
            migs.append(MigInstance(
                index=len(migs),
                memory_total_bytes=_mib_to_bytes(m.findtext("fb_memory_usage/total")),
                gpu_instance_id=_int(m.findtext("gpu_instance_id")),
                compute_instance_id=_int(m.findtext("compute_instance_id")),
                multiprocessor_count=_int(m.findtext("device_attributes/shared/multiprocessor_count")),
            ))
        power = (gpu.findtext("gpu_power_readings/enforced_power_limit")
                 or gpu.findtext("power_readings/enforced_power_limit")
                 or gpu.findtext("gpu_power_readings/current_power_limit")
                 or gpu.findtext("power_readings/power_limit"))
        ecc = _smi(gpu.findtext("ecc_mode/current_ecc"))
        mig = _smi(gpu.findtext("mig_mode/current_mig"))
        devices.append(NvidiaDevice(
            index=index,
            name=_smi(gpu.findtext("product_name")),
            uuid=_smi(gpu.findtext("uuid")),
            serial=_smi(gpu.findtext("serial")),
            pci_bus_id=_smi(gpu.findtext("pci/pci_bus_id")) or _smi(gpu.get("id")),
            memory_total_bytes=_mib_to_bytes(gpu.findtext("fb_memory_usage/total")),
            vbios_version=_smi(gpu.findtext("vbios_version")),
            ecc_enabled=None if ecc is None else ecc == "Enabled",
            mig_enabled=None if mig is None else mig == "Enabled",
            power_limit_w=_watts(power),
            board_part_number=_smi(gpu.findtext("board_part_number")),
            architecture=_smi(gpu.findtext("product_architecture")),
            mig_instances=tuple(migs),
        ))
    return NvidiaInfo(
        source=SOURCE_SMI_XML,
        driver_version=_smi(root.findtext("driver_version")),
        cuda_driver_version=_smi(root.findtext("cuda_version")),
        devices=tuple(devices),
    )


def run_smi(args: Sequence[str], timeout_s: float | None = None) -> tuple[str | None, str]:
    """Run ``nvidia-smi ARGS``: ``(stdout, "")`` on success, ``(None, why not)`` otherwise."""
    import shutil  # the fallback's alone: ~10 ms of imports that the NVML path never needs
    import subprocess

    timeout_s = SMI_TIMEOUT_S if timeout_s is None else timeout_s
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None, "nvidia-smi not found"
    try:
        done = subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout_s,
                              errors="replace", check=False)
    except subprocess.TimeoutExpired:
        return None, f"nvidia-smi {' '.join(args)} timed out after {timeout_s:.0f} s"
    except OSError as exc:
        return None, f"nvidia-smi: {exc.strerror or exc}"
    if done.returncode != 0:
        said = (done.stdout.strip() or done.stderr.strip()).splitlines()
        return None, f"nvidia-smi exited {done.returncode}" + (f": {said[0]}" if said else "")
    return done.stdout, ""


# --------------------------------------------------------------------------- probe


def probe(options: ProbeOptions | None = None) -> NvidiaInfo | Skipped:
    """The ``[nvidia]`` table: NVML first, ``nvidia-smi -q -x`` if NVML cannot load."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    order = os.environ.get("CUDA_DEVICE_ORDER")
    nvml, why = load_nvml()
    if nvml is not None:
        try:
            info = probe_nvml(nvml)
        except nvml.NVMLError as exc:  # e.g. the device count itself refused
            return Skipped(f"NVML: {exc}")
        finally:
            shutdown_nvml(nvml)
    else:
        out, smi_why = run_smi(["-q", "-x"])
        if out is None:
            return Skipped(f"no NVIDIA driver: {why}; {smi_why}")
        try:
            info = parse_smi_xml(out)
        except ValueError as exc:
            return Skipped(f"no NVIDIA driver: {why}; {exc}")
        info = replace(info, nvml_error=why)
    if not info.devices:
        return Skipped(f"no NVIDIA GPU: {info.source} lists no devices")
    return replace(info, devices=apply_visibility(info.devices, visible, order),
                    cuda_visible_devices=visible, cuda_device_order=order)

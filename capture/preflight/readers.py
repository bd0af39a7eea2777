"""Read each device's health fields from its driver: NVML, else ``nvidia-smi -q -x``; amdsmi, else
``amd-smi static --json`` (the same fallbacks capture.probes uses).

Behind one small interface, :class:`HealthSource`: ``read()`` gives one
:class:`~capture.preflight.health.DeviceHealth` per visible device, ``read_load(previous)``
re-reads the fields that move with load (throttle reasons, clocks, current PCIe link) while the
GEMM keeps the device busy. Tests hand the readers fake binding modules that serve values
captured on real cards (tests/test_preflight_health.py); nothing above the binding is faked.
"""

from __future__ import annotations

import logging
import os
import re
import xml.etree.ElementTree as ET
from dataclasses import replace
from typing import Any, Protocol

from capture.preflight.health import THROTTLE_BITS, DeviceHealth, throttle_names

log = logging.getLogger(__name__)

NOT_SUPPORTED = object()
"""What a guarded call returns when the driver says the field does not exist on this card."""


class HealthSource(Protocol):
    def read(self) -> list[DeviceHealth]: ...
    def read_load(self, previous: list[DeviceHealth]) -> list[DeviceHealth]: ...
    def close(self) -> None: ...


# --------------------------------------------------------------------------- NVML


class _Nvml:
    """Guarded NVML calls: a value, ``NOT_SUPPORTED``, or None (any other refusal)."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml

    def __call__(self, name: str, *args: Any) -> Any:
        fn = getattr(self.nvml, name, None)
        if fn is None:
            return None
        try:
            return fn(*args)
        except self.nvml.NVMLError_NotSupported:
            return NOT_SUPPORTED
        except self.nvml.NVMLError as exc:
            log.debug("%s: %s", name, exc)
            return None

    def first(self, names: tuple[str, ...], *args: Any) -> Any:
        for name in names:
            if getattr(self.nvml, name, None) is not None:
                return self(name, *args)
        return None


def _v(x: Any) -> Any:
    return None if x is NOT_SUPPORTED else x


def _w(mw: Any) -> float | None:
    mw = _v(mw)
    return mw / 1000.0 if isinstance(mw, (int, float)) else None


def _nvml_load_fields(call: _Nvml, h: Any) -> dict[str, Any]:
    nv = call.nvml
    mask = _v(call.first(("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"), h))
    return {
        "throttle_reasons": throttle_names(mask) if isinstance(mask, int) else None,
        "sm_clock_mhz": _v(call("nvmlDeviceGetClockInfo", h, nv.NVML_CLOCK_SM)),
        "mem_clock_mhz": _v(call("nvmlDeviceGetClockInfo", h, nv.NVML_CLOCK_MEM)),
        "pcie_gen": _v(call("nvmlDeviceGetCurrPcieLinkGeneration", h)),
        "pcie_width": _v(call("nvmlDeviceGetCurrPcieLinkWidth", h)),
        "temperature_c": _v(call("nvmlDeviceGetTemperature", h, nv.NVML_TEMPERATURE_GPU)),
    }


def read_nvml_device(nvml: Any, index: int, cuda_index: int | None = None) -> DeviceHealth:
    """Every health field NVML answers for GPU ``index`` (NVML order)."""
    call = _Nvml(nvml)
    h = nvml.nvmlDeviceGetHandleByIndex(index)
    name = _v(call("nvmlDeviceGetName", h))
    ecc = _v(call("nvmlDeviceGetEccMode", h))
    unc, cor = nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED
    retired_pending = call("nvmlDeviceGetRetiredPagesPendingStatus", h)
    retired_count = None
    if retired_pending not in (None, NOT_SUPPORTED):
        pages = [call("nvmlDeviceGetRetiredPages", h, cause) for cause in
                 (nvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS, nvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)]
        retired_count = sum(len(p) for p in pages) if all(isinstance(p, (list, tuple)) for p in pages) else None
    rows = call("nvmlDeviceGetRemappedRows", h)
    limits = _v(call("nvmlDeviceGetPowerManagementLimitConstraints", h))
    mig = _v(call("nvmlDeviceGetMigMode", h))
    persistence = _v(call("nvmlDeviceGetPersistenceMode", h))
    slowdown = _v(call("nvmlDeviceGetTemperatureThreshold", h, nvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN))
    rows_ok = isinstance(rows, (list, tuple)) and len(rows) == 4
    return DeviceHealth(
        index=cuda_index if cuda_index is not None else index,
        name=str(name) if name is not None else None,
        source="NVML",
        ecc_enabled=None if ecc is None else ecc[0] == nvml.NVML_FEATURE_ENABLED,
        ecc_pending_enabled=None if ecc is None else ecc[1] == nvml.NVML_FEATURE_ENABLED,
        ecc_volatile_uncorrected=_v(call("nvmlDeviceGetTotalEccErrors", h, unc, nvml.NVML_VOLATILE_ECC)),
        ecc_volatile_corrected=_v(call("nvmlDeviceGetTotalEccErrors", h, cor, nvml.NVML_VOLATILE_ECC)),
        ecc_aggregate_uncorrected=_v(call("nvmlDeviceGetTotalEccErrors", h, unc, nvml.NVML_AGGREGATE_ECC)),
        retired_pages_supported=False if retired_pending is NOT_SUPPORTED else (True if retired_pending is not None else None),
        retired_pages_pending=None if retired_pending in (None, NOT_SUPPORTED) else retired_pending == nvml.NVML_FEATURE_ENABLED,
        retired_pages_count=retired_count,
        remapped_rows_supported=False if rows is NOT_SUPPORTED else (True if rows_ok else None),
        remapped_rows_correctable=int(rows[0]) if rows_ok else None,
        remapped_rows_uncorrectable=int(rows[1]) if rows_ok else None,
        remapped_rows_pending=bool(rows[2]) if rows_ok else None,
        remapped_rows_failed=bool(rows[3]) if rows_ok else None,
        power_limit_w=_w(call("nvmlDeviceGetEnforcedPowerLimit", h)),
        power_default_w=_w(call("nvmlDeviceGetPowerManagementDefaultLimit", h)),
        power_min_w=_w(limits[0]) if limits else None,
        power_max_w=_w(limits[1]) if limits else None,
        sm_clock_max_mhz=_v(call("nvmlDeviceGetMaxClockInfo", h, nvml.NVML_CLOCK_SM)),
        mem_clock_max_mhz=_v(call("nvmlDeviceGetMaxClockInfo", h, nvml.NVML_CLOCK_MEM)),
        pcie_gen_max=_v(call("nvmlDeviceGetMaxPcieLinkGeneration", h)),
        pcie_gen_device_max=_v(call("nvmlDeviceGetGpuMaxPcieLinkGeneration", h)),
        pcie_width_max=_v(call("nvmlDeviceGetMaxPcieLinkWidth", h)),
        temperature_slowdown_c=slowdown if slowdown else None,
        persistence_enabled=None if persistence is None else persistence == nvml.NVML_FEATURE_ENABLED,
        mig_enabled=None if mig is None else mig[0] == nvml.NVML_DEVICE_MIG_ENABLE,
        **_nvml_load_fields(call, h),
    )


def visible_nvml_indices(nvml: Any) -> list[tuple[int, int | None]]:
    """``(NVML index, CUDA index)`` of the GPUs this process may use (CUDA_VISIBLE_DEVICES)."""
    from capture.probes.nvidia import apply_visibility, probe_nvml

    info = probe_nvml(nvml)
    devices = apply_visibility(info.devices, os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("CUDA_DEVICE_ORDER"))
    out = []
    for d in devices:
        if not d.visible:
            continue
        cuda = d.cuda_index
        if cuda is None and d.mig_instances:
            cuda = next((m.cuda_index for m in d.mig_instances if m.visible), None)
        out.append((d.index, cuda))
    return out


class NvmlSource:
    """Health through an initialised NVML (``pynvml``); ``close()`` shuts it down."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        self.indices = visible_nvml_indices(nvml)

    def read(self) -> list[DeviceHealth]:
        out = []
        for nvml_index, cuda_index in self.indices:
            try:
                out.append(read_nvml_device(self.nvml, nvml_index, cuda_index))
            except self.nvml.NVMLError as exc:  # no handle at all: the GPU fell off the bus
                out.append(DeviceHealth(index=cuda_index if cuda_index is not None else nvml_index, source=f"NVML ({exc})"))
        return out

    def read_load(self, previous: list[DeviceHealth]) -> list[DeviceHealth]:
        call = _Nvml(self.nvml)
        out = []
        for (nvml_index, _), h in zip(self.indices, previous):
            try:
                handle = self.nvml.nvmlDeviceGetHandleByIndex(nvml_index)
            except self.nvml.NVMLError:
                out.append(h)
                continue
            fields = {k: v for k, v in _nvml_load_fields(call, handle).items() if v is not None}
            out.append(replace(h, under_load=True, **fields))
        return out

    def close(self) -> None:
        from capture.probes.nvidia import shutdown_nvml

        shutdown_nvml(self.nvml)


# --------------------------------------------------------------------------- nvidia-smi -q -x

_MISSING = frozenset({"", "N/A", "[N/A]", "Not Supported", "[Not Supported]", "Unknown Error", "[Unknown Error]",
                      "Insufficient Permissions", "[Insufficient Permissions]"})


def _t(node: ET.Element | None, path: str) -> str | None:
    if node is None:
        return None
    v = node.findtext(path)
    if v is None:
        return None
    v = v.strip()
    return None if v in _MISSING else v


def _num(text: str | None) -> float | None:
    if text is None:
        return None
    m = re.match(r"^\s*(-?\d+(?:\.\d+)?)", text)
    return float(m.group(1)) if m else None


def _i(text: str | None) -> int | None:
    n = _num(text)
    return int(n) if n is not None else None


def _yes(text: str | None, yes: str = "Yes") -> bool | None:
    return None if text is None else text == yes


def parse_smi_xml_health(text: str) -> list[DeviceHealth]:
    """``nvidia-smi -q -x`` (DTD v11/v12) -> one :class:`DeviceHealth` per GPU, NVML order."""
    try:
        root = ET.fromstring(text)
    except ET.ParseError as exc:
        raise ValueError(f"nvidia-smi -q -x printed something that is not XML ({exc})") from None
    out = []
    for index, g in enumerate(root.findall("gpu")):
        reasons_node = g.find("clocks_event_reasons")
        prefix = "clocks_event_reason_"
        if reasons_node is None:
            reasons_node, prefix = g.find("clocks_throttle_reasons"), "clocks_throttle_reason_"
        reasons = None
        if reasons_node is not None:
            names = set(THROTTLE_BITS.values()) | {"display_clocks_setting"}
            reasons = tuple(child.tag[len(prefix):].replace("display_clocks_setting", "display_clock_setting")
                            for child in reasons_node if child.tag.startswith(prefix)
                            and child.tag[len(prefix):] in names and (child.text or "").strip() == "Active")
        power = g.find("gpu_power_readings")
        if power is None:
            power = g.find("power_readings")
        vol = g.find("ecc_errors/volatile")
        agg = g.find("ecc_errors/aggregate")

        def unc(node: ET.Element | None) -> int | None:
            vals = [_i(_t(node, k)) for k in ("dram_uncorrectable", "sram_uncorrectable", "double_bit/total")]
            known = [v for v in vals if v is not None]
            return sum(known) if known else None

        rows = g.find("remapped_rows")
        rows_known = rows is not None and _t(rows, "remapped_row_pending") is not None
        retired_pending = _t(g, "retired_pages/pending_retirement")
        counts = [_i(_t(g, f"retired_pages/{k}/retired_count")) for k in ("multiple_single_bit_retirement", "double_bit_retirement")]
        gen = g.find("pci/pci_gpu_link_info")
        slow = _num(_t(g, "temperature/gpu_temp_slow_threshold"))
        out.append(DeviceHealth(
            index=index,
            name=_t(g, "product_name"),
            source="nvidia-smi -q -x",
            ecc_enabled=_yes(_t(g, "ecc_mode/current_ecc"), "Enabled"),
            ecc_pending_enabled=_yes(_t(g, "ecc_mode/pending_ecc"), "Enabled"),
            ecc_volatile_uncorrected=unc(vol),
            ecc_volatile_corrected=_i(_t(vol, "dram_correctable")),
            ecc_aggregate_uncorrected=unc(agg),
            retired_pages_supported=not (retired_pending is None and None in counts),
            retired_pages_pending=_yes(retired_pending),
            retired_pages_count=sum(counts) if None not in counts else None,  # type: ignore[arg-type]
            remapped_rows_supported=True if rows_known else (False if rows is not None else None),
            remapped_rows_correctable=_i(_t(rows, "remapped_row_corr")) if rows_known else None,
            remapped_rows_uncorrectable=_i(_t(rows, "remapped_row_unc")) if rows_known else None,
            remapped_rows_pending=_yes(_t(rows, "remapped_row_pending")) if rows_known else None,
            remapped_rows_failed=_yes(_t(rows, "remapped_row_failure")) if rows_known else None,
            throttle_reasons=reasons,
            power_limit_w=_num(_t(power, "current_power_limit") or _t(power, "enforced_power_limit")),
            power_default_w=_num(_t(power, "default_power_limit")),
            power_min_w=_num(_t(power, "min_power_limit")),
            power_max_w=_num(_t(power, "max_power_limit")),
            sm_clock_mhz=_i(_t(g, "clocks/sm_clock")),
            sm_clock_max_mhz=_i(_t(g, "max_clocks/sm_clock")),
            mem_clock_mhz=_i(_t(g, "clocks/mem_clock")),
            mem_clock_max_mhz=_i(_t(g, "max_clocks/mem_clock")),
            pcie_gen=_i(_t(gen, "pcie_gen/current_link_gen")),
            pcie_gen_max=_i(_t(gen, "pcie_gen/max_link_gen")),
            pcie_gen_device_max=_i(_t(gen, "pcie_gen/max_device_link_gen")),
            pcie_width=_i(_t(gen, "link_widths/current_link_width")),
            pcie_width_max=_i(_t(gen, "link_widths/max_link_width")),
            temperature_c=_num(_t(g, "temperature/gpu_temp")),
            temperature_slowdown_c=slow if slow and slow > 0 else None,
            persistence_enabled=_yes(_t(g, "persistence_mode"), "Enabled"),
            mig_enabled=_yes(_t(g, "mig_mode/current_mig"), "Enabled"),
        ))
    return out


class SmiXmlSource:
    """The fallback when NVML cannot load: ``nvidia-smi -q -x``, run once per read."""

    def __init__(self, why: str) -> None:
        self.why = why

    def _run(self) -> list[DeviceHealth]:
        from capture.probes.nvidia import run_smi

        out, err = run_smi(["-q", "-x"])
        if out is None:
            raise ValueError(err)
        return parse_smi_xml_health(out)

    def read(self) -> list[DeviceHealth]:
        return self._run()

    def read_load(self, previous: list[DeviceHealth]) -> list[DeviceHealth]:
        try:
            now = self._run()
        except ValueError:
            return previous
        return [replace(p, under_load=True, throttle_reasons=n.throttle_reasons, sm_clock_mhz=n.sm_clock_mhz,
                        mem_clock_mhz=n.mem_clock_mhz, pcie_gen=n.pcie_gen, pcie_width=n.pcie_width,
                        temperature_c=n.temperature_c) for p, n in zip(previous, now)]

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------- amdsmi

# amdsmi's PCIe speed in MT/s (amdsmi_get_pcie_info) -> generation.
_PCIE_GEN_BY_MTS = {2500: 1, 5000: 2, 8000: 3, 16000: 4, 32000: 5, 64000: 6}
# Throttle/"independent throttle" status bits of the gpu_metrics table (amdgpu's
# SMU_THROTTLER_*): 0-15 power, 16-31 current, 32-46 temperature, 47 PROCHOT, 48 PPM, 49 FIT.
_AMD_THERMAL_BITS = range(32, 48)


def _amd_unit(value: Any) -> float | None:
    """amdsmi hands numbers, "N/A", or {"value": v, "unit": u} depending on the release."""
    if isinstance(value, dict):
        value = value.get("value")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _pcie_gen(speed: Any) -> int | None:
    s = _amd_unit(speed)
    if s is None:
        return None
    if s < 100:  # GT/s
        s *= 1000
    return _PCIE_GEN_BY_MTS.get(int(round(s)))


def _amd_power_w(value: Any) -> float | None:
    """Power caps come in microwatts (amdsmi_get_power_cap_info) or watts (JSON tool output)."""
    v = _amd_unit(value)
    if v is None:
        return None
    return v / 1e6 if v > 1e4 else v


def read_amdsmi_device(smi: Any, handle: Any, index: int) -> DeviceHealth:
    """Every health field amdsmi answers for one GPU (amdsmi order = HIP order when nothing is hidden)."""
    from capture.probes.amd import _Guard

    call = _Guard(smi, f"GPU {index}")
    asic = call("amdsmi_get_gpu_asic_info", handle) or {}
    ecc = call("amdsmi_get_gpu_total_ecc_count", handle)
    ecc_on = call("amdsmi_get_gpu_ecc_enabled", handle)
    bad = call("amdsmi_get_gpu_bad_page_info", handle)
    cap = call("amdsmi_get_power_cap_info", handle) or {}
    pcie = call("amdsmi_get_pcie_info", handle) or {}
    metrics = call("amdsmi_get_gpu_metrics_info", handle) or {}
    static, metric = pcie.get("pcie_static", {}), pcie.get("pcie_metric", {})
    temp = None
    if hasattr(smi, "AmdSmiTemperatureType"):
        temp = call("amdsmi_get_temp_metric", handle, smi.AmdSmiTemperatureType.HOTSPOT, smi.AmdSmiTemperatureMetric.CURRENT)
        slow = call("amdsmi_get_temp_metric", handle, smi.AmdSmiTemperatureType.HOTSPOT, smi.AmdSmiTemperatureMetric.CRITICAL)
    else:
        slow = None
    gfx = call("amdsmi_get_clk_freq", handle, smi.AmdSmiClkType.GFX) if hasattr(smi, "AmdSmiClkType") else None
    mem = call("amdsmi_get_clk_freq", handle, smi.AmdSmiClkType.MEM) if hasattr(smi, "AmdSmiClkType") else None
    compute = call("amdsmi_get_gpu_compute_partition", handle)
    memory = call("amdsmi_get_gpu_memory_partition", handle)
    throttle = metrics.get("indep_throttle_status", metrics.get("throttle_status"))
    reasons = None
    if isinstance(throttle, int) and not isinstance(throttle, bool) and throttle != 0xFFFFFFFFFFFFFFFF:
        reasons = tuple(["thermal"] if any(throttle >> b & 1 for b in _AMD_THERMAL_BITS) else []) + (
            ("power",) if throttle & 0xFFFF else ()) + (("prochot",) if throttle >> 47 & 1 else ())

    def freq(f: Any) -> tuple[int | None, int | None]:
        if not isinstance(f, dict) or not f.get("frequency"):
            return None, None
        levels = [x for x in f["frequency"] if isinstance(x, (int, float))]
        cur = f.get("current")
        now = levels[cur] if isinstance(cur, int) and 0 <= cur < len(levels) else None
        scale = 1e6 if levels and max(levels) > 1e5 else 1  # Hz in amdsmi, MHz in some releases
        return (int(now / scale) if now is not None else None), (int(max(levels) / scale) if levels else None)

    sm, sm_max = freq(gfx)
    mclk, mclk_max = freq(mem)
    part = "/".join(p for p in (str(compute or ""), str(memory or "")) if p) or None
    return DeviceHealth(
        index=index,
        name=str(asic.get("market_name")) if asic.get("market_name") else None,
        source="amdsmi",
        ecc_enabled=bool(ecc_on) if isinstance(ecc_on, int) else None,
        ecc_volatile_uncorrected=ecc.get("uncorrectable_count") if isinstance(ecc, dict) else None,
        ecc_volatile_corrected=ecc.get("correctable_count") if isinstance(ecc, dict) else None,
        retired_pages_supported=True if isinstance(bad, list) else None,
        retired_pages_pending=any(str(p.get("status", "")).lower().startswith("pending") for p in bad if isinstance(p, dict))
        if isinstance(bad, list) else None,
        retired_pages_count=len(bad) if isinstance(bad, list) else None,
        throttle_reasons=reasons,
        power_limit_w=_amd_power_w(cap.get("power_cap")),
        power_default_w=_amd_power_w(cap.get("default_power_cap")),
        power_min_w=_amd_power_w(cap.get("min_power_cap")),
        power_max_w=_amd_power_w(cap.get("max_power_cap")),
        sm_clock_mhz=sm, sm_clock_max_mhz=sm_max, mem_clock_mhz=mclk, mem_clock_max_mhz=mclk_max,
        pcie_gen=_pcie_gen(metric.get("pcie_speed")),
        pcie_gen_max=_pcie_gen(static.get("max_pcie_speed")),
        pcie_width=int(_amd_unit(metric.get("pcie_width")) or 0) or None,
        pcie_width_max=int(_amd_unit(static.get("max_pcie_width")) or 0) or None,
        temperature_c=_amd_unit(temp),
        temperature_slowdown_c=_amd_unit(slow),
        partition=part,
    )


class AmdSmiSource:
    def __init__(self, smi: Any) -> None:
        from capture.probes.amd import VISIBILITY_VARIABLES, AmdDevice, apply_visibility

        self.smi = smi
        self.handles = smi.amdsmi_get_processor_handles()
        serials = []
        for h in self.handles:
            try:
                serials.append((smi.amdsmi_get_gpu_asic_info(h) or {}).get("asic_serial"))
            except Exception:  # noqa: BLE001 - amdsmi raises its own exception classes
                serials.append(None)
        env = {n: os.environ.get(n) for n in VISIBILITY_VARIABLES}
        vis = apply_visibility([AmdDevice(index=i, asic_serial=s) for i, s in enumerate(serials)], env)
        self.picked = [(i, d.hip_index) for i, d in enumerate(vis) if d.visible]

    def read(self) -> list[DeviceHealth]:
        return [read_amdsmi_device(self.smi, self.handles[i], hip if hip is not None else i) for i, hip in self.picked]

    def read_load(self, previous: list[DeviceHealth]) -> list[DeviceHealth]:
        now = self.read()
        return [replace(p, under_load=True, throttle_reasons=n.throttle_reasons, sm_clock_mhz=n.sm_clock_mhz,
                        mem_clock_mhz=n.mem_clock_mhz, pcie_gen=n.pcie_gen, pcie_width=n.pcie_width,
                        temperature_c=n.temperature_c) for p, n in zip(previous, now)]

    def close(self) -> None:
        from capture.probes.amd import shutdown_amdsmi

        shutdown_amdsmi(self.smi)


# --------------------------------------------------------------------------- amd-smi static --json (fallback)


def parse_amd_smi_static_health(text: str) -> list[DeviceHealth]:
    """``amd-smi static --json``: limits, the PCIe link's maximum, slowdown temperature, RAS ECC
    state and partition. It has no live readings (clocks, current link, temperature, error counts),
    so those checks are skipped on this fallback."""
    from capture import _json

    start = min((i for i in (text.find("["), text.find("{")) if i >= 0), default=-1)
    try:
        data = _json.loads(text[start:]) if start >= 0 else None
    except _json.JsonError as exc:
        raise ValueError(f"amd-smi static --json printed invalid JSON ({exc.reason})") from None
    if isinstance(data, dict):
        data = data.get("gpu_data", [data] if "gpu" in data else [])
    if not isinstance(data, list):
        raise ValueError("amd-smi static --json printed no list of GPUs")
    out = []
    for pos, g in enumerate(d for d in data if isinstance(d, dict)):
        asic, bus, limit = g.get("asic") or {}, g.get("bus") or {}, g.get("limit") or {}
        part = g.get("partition") or {}
        umc = ((g.get("ras") or {}).get("ecc_block_state") or {}).get("umc")
        version = re.search(r"(\d+)", str(bus.get("pcie_interface_version", "")))
        gen = _pcie_gen(bus.get("max_pcie_speed")) or (int(version.group(1)) if version else None)
        width = _amd_unit(bus.get("max_pcie_width"))
        partition = "/".join(str(part[k]) for k in ("compute_partition", "memory_partition") if part.get(k) not in (None, "N/A"))
        out.append(DeviceHealth(
            index=g["gpu"] if isinstance(g.get("gpu"), int) else pos,
            name=str(asic["market_name"]) if asic.get("market_name") else None,
            source="amd-smi static --json",
            ecc_enabled=None if umc is None else umc == "ENABLED",
            power_limit_w=_amd_unit(limit.get("socket_power") or limit.get("power_cap")),
            power_min_w=_amd_unit(limit.get("min_power")),
            power_max_w=_amd_unit(limit.get("max_power")),
            pcie_gen_max=gen,
            pcie_width_max=int(width) if width else None,
            temperature_slowdown_c=_amd_unit(limit.get("slowdown_hotspot_temperature")),
            partition=partition or None,
        ))
    return out


class AmdSmiCliSource:
    """The fallback when the amdsmi library cannot load: ``amd-smi static --json``, read once."""

    def __init__(self, why: str) -> None:
        from capture.probes.amd import run_amd_smi

        self.why = why
        text, err = run_amd_smi(["static", "--json"])
        if text is None:
            raise ValueError(err)
        self.health = parse_amd_smi_static_health(text)

    def read(self) -> list[DeviceHealth]:
        return list(self.health)

    def read_load(self, previous: list[DeviceHealth]) -> list[DeviceHealth]:
        return previous

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------- choose


def open_source(kind: str) -> tuple[HealthSource | None, str | None]:
    """The health source for ``kind`` (cuda/rocm): ``(source, None)`` or ``(None, why not)``."""
    if kind == "cuda":
        from capture.probes.nvidia import load_nvml

        nvml, why = load_nvml()
        if nvml is not None:
            try:
                return NvmlSource(nvml), None
            except nvml.NVMLError as exc:
                return None, f"NVML: {exc}"
        source = SmiXmlSource(why or "NVML unavailable")
        try:
            source.read()
        except ValueError as exc:
            return None, f"{why}; {exc}"
        return source, None
    if kind == "rocm":
        from capture.probes.amd import load_amdsmi

        smi, why = load_amdsmi()
        if smi is not None:
            return AmdSmiSource(smi), None
        try:
            return AmdSmiCliSource(why or "amdsmi unavailable"), None
        except ValueError as exc:
            return None, f"{why}; {exc}"
    return None, "no GPU"

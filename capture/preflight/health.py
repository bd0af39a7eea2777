"""Health checks from what the driver says about each device (NVML, amdsmi, or their tools).

The readers (capture.preflight.readers) turn each binding's answers into one
:class:`DeviceHealth`; the checks here only look at that record, so tests feed them readings
captured on real cards. ``None`` everywhere means "the driver did not answer"; the check for it
is then ``skipped`` with that reason, never a guess.

Some fields move with load: an idle GPU drops its SM clock (345 of 1980 MHz on an idle H100) and
lowers its PCIe link generation to save power. Those fields are read while the bf16 GEMM runs
(``under_load``); read idle, a low clock or link generation is reported, never failed.
"""

from __future__ import annotations

from dataclasses import dataclass

from capture.preflight.catalog import Sku
from capture.preflight.checks import FAIL, PASS, SKIPPED, WARN, Check

# NVML's clocks-event (throttle) reason bits, nvmlClocksEventReason*/nvmlClocksThrottleReason*.
THROTTLE_BITS = {
    0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
    0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown", 0x100: "display_clock_setting",
}
THROTTLE_FAIL = frozenset({"hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown", "thermal",
                           "hw_thermal", "prochot", "vr_thermal", "hbm_thermal"})
THROTTLE_WARN = frozenset({"sw_thermal_slowdown", "applications_clocks_setting"})

POWER_WARN_BELOW = 1.0    # enforced limit below the default: warn ...
POWER_FAIL_BELOW = 0.85   # ... below 85 % of it: fail (a power-capped card)
CLOCK_WARN_BELOW = 0.80   # under load, SM clock below 80 % of its maximum: warn
MEM_CLOCK_WARN_BELOW = 0.90
TEMP_WARN_MARGIN_C = 10   # warn this close to the slowdown threshold, fail at it
TEMP_WARN_C, TEMP_FAIL_C = 85, 95   # when the driver does not say where slowdown starts


@dataclass(frozen=True)
class DeviceHealth:
    """One device's health fields as its driver reports them."""

    index: int
    name: str | None = None
    source: str = ""
    under_load: bool = False
    """Throttle reasons, clocks and the current PCIe link were read while the GEMM ran."""
    ecc_enabled: bool | None = None
    ecc_pending_enabled: bool | None = None
    ecc_volatile_uncorrected: int | None = None
    ecc_volatile_corrected: int | None = None
    ecc_aggregate_uncorrected: int | None = None
    retired_pages_supported: bool | None = None
    """False: the driver refuses retired pages (NotSupported), as cards that remap rows do."""
    retired_pages_pending: bool | None = None
    retired_pages_count: int | None = None
    remapped_rows_supported: bool | None = None
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    remapped_rows_pending: bool | None = None
    remapped_rows_failed: bool | None = None
    throttle_reasons: tuple[str, ...] | None = None
    power_limit_w: float | None = None
    """The enforced limit."""
    power_default_w: float | None = None
    power_min_w: float | None = None
    power_max_w: float | None = None
    sm_clock_mhz: int | None = None
    sm_clock_max_mhz: int | None = None
    mem_clock_mhz: int | None = None
    mem_clock_max_mhz: int | None = None
    pcie_gen: int | None = None
    pcie_gen_max: int | None = None
    """The most the link can train to (card and slot together)."""
    pcie_gen_device_max: int | None = None
    """The most the card itself supports, where the driver says."""
    pcie_width: int | None = None
    pcie_width_max: int | None = None
    temperature_c: float | None = None
    temperature_slowdown_c: float | None = None
    persistence_enabled: bool | None = None
    mig_enabled: bool | None = None
    partition: str | None = None
    """AMD compute/memory partition (``SPX/NPS1``)."""


def throttle_names(mask: int) -> tuple[str, ...]:
    return tuple(name for bit, name in THROTTLE_BITS.items() if mask & bit) + (
        (f"unknown_0x{mask & ~sum(THROTTLE_BITS):x}",) if mask & ~sum(THROTTLE_BITS) else ())


def _skip(name: str, h: DeviceHealth, what: str) -> Check:
    return Check(name, SKIPPED, f"{h.source or 'the driver'} does not report {what}", device=h.index)


def check_ecc(h: DeviceHealth) -> list[Check]:
    out = []
    if h.ecc_enabled is None:
        out.append(_skip("ecc_mode", h, "ECC mode"))
    elif h.ecc_enabled:
        out.append(Check("ecc_mode", PASS, "ECC enabled", device=h.index, value="enabled"))
    else:
        pending = " (enabled after the next reset)" if h.ecc_pending_enabled else ""
        out.append(Check("ecc_mode", WARN, f"ECC disabled{pending}: memory errors go undetected", device=h.index,
                         value="disabled", expected="enabled"))
    v = h.ecc_volatile_uncorrected
    if v is None:
        out.append(_skip("ecc_volatile_uncorrected", h, "volatile uncorrected ECC errors"))
    else:
        corrected = f"; {h.ecc_volatile_corrected} corrected" if h.ecc_volatile_corrected else ""
        out.append(Check("ecc_volatile_uncorrected", FAIL if v else PASS,
                         (f"{v} uncorrected ECC errors since the last driver load: the card is corrupting data" if v
                          else "no uncorrected ECC errors since the last driver load") + corrected,
                         device=h.index, value=v, unit="errors", expected="0"))
    a = h.ecc_aggregate_uncorrected
    if a is None:
        out.append(_skip("ecc_aggregate_uncorrected", h, "lifetime uncorrected ECC errors"))
    else:
        out.append(Check("ecc_aggregate_uncorrected", WARN if a else PASS,
                         f"{a} uncorrected ECC errors over the card's life" + (" (none since the last driver load)" if a and not v else "")
                         if a else "no uncorrected ECC errors over the card's life",
                         device=h.index, value=a, unit="errors", expected="0"))
    return out


def check_memory_repair(h: DeviceHealth) -> list[Check]:
    """Row remapping (Ampere and later) and page retirement (older cards)."""
    out = []
    if h.remapped_rows_supported is False or h.remapped_rows_failed is None and h.remapped_rows_pending is None:
        out.append(_skip("remapped_rows", h, "row remapping"))
    elif h.remapped_rows_failed:
        out.append(Check("remapped_rows", FAIL, "a row remapping failed: the memory has errors it can no longer repair",
                         device=h.index, value="failed", expected="no failure, none pending"))
    elif h.remapped_rows_pending:
        out.append(Check("remapped_rows", WARN, "a row remapping is pending: reset the GPU to apply it",
                         device=h.index, value="pending", expected="no failure, none pending"))
    else:
        n = (h.remapped_rows_correctable or 0) + (h.remapped_rows_uncorrectable or 0)
        out.append(Check("remapped_rows", PASS, f"{n} rows remapped, none pending, no failure", device=h.index,
                         value=n, unit="rows", expected="no failure, none pending"))
    if h.retired_pages_supported is False:
        if h.remapped_rows_supported or h.remapped_rows_pending is not None:
            out.append(Check("retired_pages", PASS, "not supported: this card remaps rows instead (see remapped_rows)",
                             device=h.index, value="not supported"))
        else:
            out.append(_skip("retired_pages", h, "retired pages"))
    elif h.retired_pages_pending is None and h.retired_pages_count is None:
        out.append(_skip("retired_pages", h, "retired pages"))
    elif h.retired_pages_pending:
        out.append(Check("retired_pages", WARN, "a page retirement is pending: reset the GPU to apply it",
                         device=h.index, value="pending", expected="none pending"))
    else:
        pages = h.retired_pages_count
        out.append(Check("retired_pages", PASS, f"{pages if pages is not None else 'no'} pages retired, none pending",
                         device=h.index, value=pages if pages is not None else "none pending",
                         unit="pages" if pages is not None else None,
                         expected="none pending"))
    return out


def check_throttle(h: DeviceHealth) -> Check:
    if h.throttle_reasons is None:
        return _skip("throttle", h, "clock throttle reasons")
    when = "under load" if h.under_load else "idle"
    reasons = [r for r in h.throttle_reasons if r not in ("gpu_idle", "sync_boost", "display_clock_setting")]
    text = ", ".join(h.throttle_reasons) or "none"
    bad = [r for r in reasons if r in THROTTLE_FAIL]
    if bad:
        return Check("throttle", FAIL, f"hardware slowdown {when}: {', '.join(bad)}", device=h.index, value=text,
                     expected="no hardware slowdown")
    soft = [r for r in reasons if r in THROTTLE_WARN or r.startswith("unknown")]
    if soft:
        return Check("throttle", WARN, f"clocks held down {when}: {', '.join(soft)}", device=h.index, value=text,
                     expected="no hardware slowdown")
    if "sw_power_cap" in reasons:
        return Check("throttle", PASS, f"at the power limit {when} (sw_power_cap): normal for a dense GEMM", device=h.index,
                     value=text, expected="no hardware slowdown")
    return Check("throttle", PASS, f"no clock throttling {when}" + (" (idle)" if "gpu_idle" in h.throttle_reasons else ""),
                 device=h.index, value=text, expected="no hardware slowdown")


def check_power(h: DeviceHealth) -> Check:
    lim, default = h.power_limit_w, h.power_default_w
    if lim is None:
        return _skip("power_limit", h, "the power limit")
    span = f" (range {h.power_min_w:.0f}-{h.power_max_w:.0f} W)" if h.power_min_w is not None and h.power_max_w is not None else ""
    if default is None:
        return Check("power_limit", PASS, f"enforced limit {lim:.0f} W; the default is not reported{span}", device=h.index,
                     value=round(lim, 1), unit="W")
    expected = f">= {default:.0f} W (the default{span})"
    if lim >= default * POWER_WARN_BELOW - 0.5:
        return Check("power_limit", PASS, f"{lim:.0f} W of the default {default:.0f} W{span}", device=h.index,
                     value=round(lim, 1), unit="W", expected=expected)
    share = lim / default
    verdict = FAIL if share < POWER_FAIL_BELOW else WARN
    return Check("power_limit", verdict, f"power-capped: {lim:.0f} W is {share:.0%} of the default {default:.0f} W{span}",
                 device=h.index, value=round(lim, 1), unit="W", expected=expected)


def check_clocks(h: DeviceHealth) -> Check:
    if h.sm_clock_mhz is None or not h.sm_clock_max_mhz:
        return _skip("clocks", h, "SM clocks against their maximum")
    sm = f"SM {h.sm_clock_mhz} of {h.sm_clock_max_mhz} MHz"
    mem = (f", memory {h.mem_clock_mhz} of {h.mem_clock_max_mhz} MHz" if h.mem_clock_mhz is not None and h.mem_clock_max_mhz else "")
    expected = f">= {CLOCK_WARN_BELOW:.0%} of the maximum under load"
    if not h.under_load:
        return Check("clocks", PASS, f"{sm}{mem} (read idle: an idle GPU lowers its clocks; not judged)", device=h.index,
                     value=h.sm_clock_mhz, unit="MHz", expected=expected)
    low = []
    if h.sm_clock_mhz < CLOCK_WARN_BELOW * h.sm_clock_max_mhz:
        low.append("SM")
    if h.mem_clock_mhz is not None and h.mem_clock_max_mhz and h.mem_clock_mhz < MEM_CLOCK_WARN_BELOW * h.mem_clock_max_mhz:
        low.append("memory")
    capped = h.throttle_reasons is not None and "sw_power_cap" in h.throttle_reasons
    at_default = h.power_limit_w is not None and (h.power_default_w is None or h.power_limit_w >= h.power_default_w - 0.5)
    if low and capped and at_default and low == ["SM"]:
        return Check("clocks", PASS, f"under load: {sm}{mem}; held by the power limit (sw_power_cap) at its default, "
                     "as a dense GEMM does", device=h.index, value=h.sm_clock_mhz, unit="MHz", expected=expected)
    if low:
        return Check("clocks", WARN, f"{' and '.join(low)} clock low under load: {sm}{mem}", device=h.index,
                     value=h.sm_clock_mhz, unit="MHz", expected=expected)
    return Check("clocks", PASS, f"under load: {sm}{mem}", device=h.index, value=h.sm_clock_mhz, unit="MHz", expected=expected)


def check_pcie(h: DeviceHealth, sku: Sku | None) -> Check:
    if h.pcie_gen is None or h.pcie_width is None or h.pcie_gen_max is None or h.pcie_width_max is None:
        return _skip("pcie_link", h, "the PCIe link")
    value = f"Gen{h.pcie_gen} x{h.pcie_width}"
    best = f"Gen{h.pcie_gen_max} x{h.pcie_width_max}"
    expected = f"Gen{sku.pcie_gen} x{sku.pcie_width} ({sku.name})" if sku and sku.pcie_gen and sku.pcie_width else best
    notes = []
    verdict = PASS
    if h.pcie_width < h.pcie_width_max:
        notes.append(f"link trained at x{h.pcie_width} of x{h.pcie_width_max}")
        verdict = WARN if not h.under_load else FAIL
    if h.pcie_gen < h.pcie_gen_max:
        if h.under_load:
            notes.append(f"Gen{h.pcie_gen} under load, the link can do Gen{h.pcie_gen_max}")
            verdict = WARN if verdict == PASS else verdict
        else:
            notes.append(f"Gen{h.pcie_gen} idle (an idle GPU lowers its link speed; the pinned copies measure it)")
    if sku and sku.pcie_gen and h.pcie_gen_max < sku.pcie_gen:
        where = (f"the card supports Gen{h.pcie_gen_device_max}, so the slot or riser limits it"
                 if h.pcie_gen_device_max and h.pcie_gen_device_max > h.pcie_gen_max else f"{sku.name} is built for Gen{sku.pcie_gen}")
        notes.append(f"the link can train to Gen{h.pcie_gen_max} only: {where}")
        verdict = WARN if verdict == PASS else verdict
    if sku and sku.pcie_width and h.pcie_width_max < sku.pcie_width:
        notes.append(f"the link is x{h.pcie_width_max} at most, {sku.name} is built for x{sku.pcie_width}")
        verdict = WARN if verdict == PASS else verdict
    reason = f"{value} of {best}" + (f"; {'; '.join(notes)}" if notes else (" under load" if h.under_load else ""))
    return Check("pcie_link", verdict, reason, device=h.index, value=value, expected=expected)


def check_temperature(h: DeviceHealth) -> Check:
    t = h.temperature_c
    if t is None:
        return _skip("temperature", h, "the temperature")
    if h.temperature_slowdown_c:
        fail_at, warn_at = h.temperature_slowdown_c, h.temperature_slowdown_c - TEMP_WARN_MARGIN_C
        basis = f"slowdown at {fail_at:.0f} C"
    else:
        fail_at, warn_at = TEMP_FAIL_C, TEMP_WARN_C
        basis = f"the driver gives no slowdown threshold; warn at {warn_at} C, fail at {fail_at} C"
    verdict = FAIL if t >= fail_at else WARN if t >= warn_at else PASS
    return Check("temperature", verdict, f"{t:.0f} C ({basis})", device=h.index, value=round(float(t), 1), unit="C",
                 expected=f"< {warn_at:.0f} C")


def check_persistence(h: DeviceHealth) -> Check:
    if h.persistence_enabled is None:
        return _skip("persistence_mode", h, "persistence mode")
    if h.persistence_enabled:
        return Check("persistence_mode", PASS, "persistence mode on", device=h.index, value="enabled")
    return Check("persistence_mode", WARN, "persistence mode off: the driver re-initialises the GPU for every new process (seconds each)",
                 device=h.index, value="disabled", expected="enabled")


def check_mig(h: DeviceHealth) -> Check:
    if h.partition:
        spx = h.partition.split("/")[0] in ("SPX", "")
        return Check("partition", PASS if spx else WARN,
                     f"compute/memory partition {h.partition}" + ("" if spx else ": this process sees one partition; figures are not the whole card's"),
                     device=h.index, value=h.partition)
    if h.mig_enabled is None:
        return _skip("mig_mode", h, "MIG mode")
    if h.mig_enabled:
        return Check("mig_mode", WARN, "MIG enabled: this process sees one MIG slice; performance figures are not the whole card's",
                     device=h.index, value="enabled", expected="disabled")
    return Check("mig_mode", PASS, "MIG disabled: the whole card", device=h.index, value="disabled")


def health_checks(h: DeviceHealth, sku: Sku | None) -> list[Check]:
    """Every health check for one device, in a fixed order."""
    return [*check_ecc(h), *check_memory_repair(h), check_throttle(h), check_power(h), check_clocks(h),
            check_pcie(h, sku), check_temperature(h), check_persistence(h), check_mig(h)]

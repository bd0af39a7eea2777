"""Run the preflight: health from the driver, then the measured figures, judged per SKU.

:func:`run_preflight` is the library entry point (`capture preflight` and the trial's first
stage both call it); :func:`trial_preflight` is the stage as the trial runs it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from capture.errors import PreflightFailed, UsageError
import capture.preflight.perf as perf
from capture.preflight.allreduce import TIMEOUT_S, run_allreduce
from capture.preflight.catalog import (
    PreflightCatalog,
    Range,
    Sku,
    default_ranges,
    load_catalog,
    pcie_bytes_per_s,
)
from capture.preflight.checks import (
    FAIL,
    MODES,
    PASS,
    SKIPPED,
    WARN,
    Check,
    PreflightResult,
)
from capture.preflight.health import DeviceHealth, health_checks
from capture.preflight.readers import HealthSource, open_source

Progress = Callable[[str], None]


def _say(msg: str) -> None:
    sys.stderr.write(f"capture: preflight: {msg}\n")
    sys.stderr.flush()


def resolve_kind(device: str) -> tuple[str, Any]:
    """``auto|cuda|rocm|cpu`` -> ``(device kind, torch)``; torch is not imported for ``cpu``."""
    if device not in ("auto", "cuda", "rocm", "cpu"):
        raise UsageError(f"--device: unknown device {device!r}", "use auto, cuda, rocm or cpu")
    import torch

    if device == "cpu":
        return "cpu", torch
    if torch.cuda.is_available():
        kind = "rocm" if getattr(torch.version, "hip", None) else "cuda"
        if device in ("cuda", "rocm") and device != kind:
            raise UsageError(f"--device {device}: this torch drives {kind} devices", f"use --device {kind} or auto")
        return kind, torch
    if device == "auto":
        return "cpu", torch
    raise UsageError(f"--device {device}: no {device} device is visible to torch",
                     "check the driver and CUDA_VISIBLE_DEVICES, or use --device cpu")


# --------------------------------------------------------------------------- judging figures


def _round(v: float) -> float:
    return round(v, 1) if abs(v) >= 100 else float(f"{v:.4g}")


_OOM_MARKERS = ("out of memory", "can't allocate memory", "cannot allocate memory")


def _out_of_memory(error: str | None) -> bool:
    return error is not None and any(m in error.lower() for m in _OOM_MARKERS)


def judge(fig: perf.Figure, reference: float | None, rng: Range | None, what: str, scale: float = 1.0) -> Check:
    """A measured figure against its reference (``scale`` turns the reference into the figure's unit)."""
    if fig.value is None and not fig.wrong and _out_of_memory(fig.error):
        # buffers that cannot be allocated say the memory is taken (other processes, a ulimit),
        # not that the card or host is slower than paid for: not measured, and said so
        return Check(fig.name, WARN, f"not measured: could not allocate its buffers ({fig.error})",
                     device=fig.device, unit=fig.unit)
    if fig.value is None or fig.error:
        reason = fig.error or "not measured"
        return Check(fig.name, FAIL, reason + (f" ({fig.detail})" if fig.detail else ""), device=fig.device,
                     value=_round(fig.value) if fig.value is not None else None, unit=fig.unit)
    value = _round(fig.value)
    if reference is None or rng is None:
        return Check(fig.name, PASS, f"{fig.detail}; correct results; not judged: {what}", device=fig.device,
                     value=value, unit=fig.unit)
    ref = reference * scale
    share = fig.value / ref
    verdict = rng.verdict(share)
    expected = f"{rng.pass_fraction * ref:.0f}-{ref:.0f} {fig.unit} ({what})"
    words = {PASS: "healthy", WARN: f"below the healthy {rng.pass_fraction:.0%}",
             FAIL: f"well below the range (fails under {rng.warn_fraction:.0%})"}[verdict]
    return Check(fig.name, verdict, f"{share:.0%} of {ref:.0f} {fig.unit}, {words}; {fig.detail}", device=fig.device,
                 value=value, unit=fig.unit, expected=expected)


def _catalog_check(index: int, name: str | None, sku: Sku | None) -> Check:
    if sku is not None:
        return Check("catalog", PASS, f"{name} is {sku.name}; {sku.source}", device=index, value=sku.name)
    return Check("catalog", WARN, f"{name or 'this device'} is not in the preflight catalog: figures are recorded, not judged",
                 device=index, value=name or "unknown",
                 expected="a [[sku]] entry in capture/data/preflight.toml or ~/.config/capture/preflight.toml")


# --------------------------------------------------------------------------- GPU


def _gpu_checks(torch: Any, kind: str, mode: str, catalog: PreflightCatalog, say: Progress) -> list[Check]:
    sizes = perf.GPU_SIZES[mode]
    count = torch.cuda.device_count()
    source: HealthSource | None
    source, why = open_source(kind)
    base: dict[int, DeviceHealth] = {}
    if source is not None:
        try:
            base = {h.index: h for h in source.read()}
        except Exception as exc:  # noqa: BLE001 - a driver that answers nothing is a skipped check, not a crash
            why, source = f"{type(exc).__name__}: {exc}", None
    loaded: dict[int, DeviceHealth] = {}
    checks: list[Check] = []
    if source is None:
        checks.append(Check("health", SKIPPED, f"no driver health readings: {why}"))
    t0 = time.perf_counter()
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    say(f"{count} {kind} device(s); CUDA context in {time.perf_counter() - t0:.2f} s")
    skus: dict[int, Sku | None] = {}
    try:
        for i in range(count):
            device = torch.device("cuda", i)
            name = base[i].name if i in base and base[i].name else torch.cuda.get_device_name(i)
            sku = skus[i] = catalog.match(name)
            mig = i in base and bool(base[i].mig_enabled) or (i in base and base[i].partition not in (None, "SPX/NPS1", "SPX"))
            checks.append(_catalog_check(i, name, sku))
            what = "no healthy range for a MIG slice or partition" if mig else ("no catalog entry" if sku is None else "")

            def during(est_s: float, i: int = i) -> None:
                if source is None:
                    return
                time.sleep(min(0.3, est_s / 3))
                try:
                    now = source.read_load(list(base.values()))
                except Exception:  # noqa: BLE001 - keep the idle reading
                    return
                loaded.update({h.index: h for h in now if h.index == i})

            say(f"cuda:{i} {name}: bf16 GEMM")
            g = perf.gemm(torch, device, sizes, during)
            rng = sku.healthy.get("gemm_bf16") if sku and not mig else None
            peak = sku.peak_bf16_dense_flops if sku and not mig else None
            # a user's [[sku]] entry may leave a figure out: not judged then, as without an entry
            checks.append(judge(g, peak, rng,
                                what or (f"{sku.name}, data-sheet dense bf16 {peak / 1e12:.0f}" if sku and peak
                                         else "the catalog entry gives no peak_bf16_dense_flops"), 1e-12))
            say(f"cuda:{i}: device copy")
            c = perf.device_copy(torch, device, sizes)
            bw = sku.memory_bytes_per_s if sku and not mig else None
            checks.append(judge(c, bw, sku.healthy.get("copy_d2d") if sku and not mig else None,
                                what or (f"{sku.name}, data-sheet memory bandwidth {bw / 1e12:.2f} TB/s" if sku and bw
                                         else "the catalog entry gives no memory_bytes_per_s"), 1e-9))
            say(f"cuda:{i}: pinned host<->device")
            h = loaded.get(i) or base.get(i)
            gen = h.pcie_gen_max if h and h.pcie_gen_max else (sku.pcie_gen if sku else None)
            width = h.pcie_width_max if h and h.pcie_width_max else (sku.pcie_width if sku else None)
            link = pcie_bytes_per_s(gen, width)
            prng = (sku.healthy.get("pcie") if sku else None) or default_ranges()["pcie"]
            for fig in perf.host_copies(torch, device, sizes):
                label = f"PCIe Gen{gen} x{width} per direction" if link else "the PCIe link is not reported"
                checks.append(judge(fig, link, prng if link else None, label, 1e-9))
            torch.cuda.empty_cache()
        for i in range(count):
            h = loaded.get(i) or base.get(i)
            if h is not None:
                checks.extend(health_checks(h, skus.get(i)))
        if count >= 2:
            checks.extend(_multi_gpu(torch, count, mode, sizes, skus, say))
        else:
            checks.append(Check("p2p", SKIPPED, "one visible GPU: no peer copies"))
            checks.append(Check("allreduce", SKIPPED, "one visible GPU: no all-reduce"))
    finally:
        torch.cuda.empty_cache()
        if source is not None:
            source.close()
    return checks


def _multi_gpu(torch: Any, count: int, mode: str, sizes: perf.Sizes, skus: dict[int, Sku | None], say: Progress) -> list[Check]:
    out = []
    say(f"peer copies between {count} GPUs")
    ranges = default_ranges()
    for fig, peer in perf.peer_copies(torch, count, sizes, all_pairs=mode == "full"):
        sku = skus.get(fig.device or 0)
        ref = sku.interconnect_bytes_per_s if sku and peer else None
        if sku and not peer:
            ref = pcie_bytes_per_s(sku.pcie_gen, sku.pcie_width)
        rng = (sku.healthy.get("p2p") if sku else None) or ranges["p2p"]
        what = (f"{sku.name}, GPU-to-GPU {ref / 1e9:.0f} GB/s per direction" if peer else
                f"{sku.name}, no peer access: PCIe {ref / 1e9:.0f} GB/s") if sku and ref else "no catalog entry"
        out.append(judge(fig, ref, rng if ref else None, what, 1e-9))
    backend = "nccl"
    say(f"all-reduce across {count} GPUs ({'RCCL' if torch.version.hip else 'NCCL'}, {count} processes)")
    r = run_allreduce(count, backend, sizes.allreduce_bytes, sizes.allreduce_iters, TIMEOUT_S[mode])
    sku = skus.get(0)
    ref = sku.interconnect_bytes_per_s if sku else None
    out.append(_allreduce_check(r, ref, (sku.healthy.get("allreduce") if sku else None) or ranges["allreduce"],
                                f"{sku.name}, GPU-to-GPU {ref / 1e9:.0f} GB/s per direction" if sku and ref else "no catalog entry"))
    return out


def _allreduce_check(r: Any, ref: float | None, rng: Range | None, what: str) -> Check:
    detail = f"{r.world_size} ranks, {r.backend}, {r.nbytes / 2**20:.0f} MiB fp32, {r.iterations} all-reduces"
    if r.error or r.busbw_bytes_per_s is None:
        return Check("allreduce", FAIL, f"{r.error or 'not measured'} ({detail})", unit="GB/s")
    fig = perf.Figure("allreduce", r.busbw_bytes_per_s / 1e9, "GB/s", None, r.iterations, 0.0,
                      f"bus bandwidth (algbw {r.algbw_bytes_per_s / 1e9:.1f} GB/s x 2(n-1)/n), {detail}")
    return judge(fig, ref, rng if ref else None, what, 1e-9)


# --------------------------------------------------------------------------- CPU


def _cpu_checks(torch: Any, mode: str, say: Progress) -> list[Check]:
    sizes = perf.CPU_SIZES[mode]
    cpu = torch.device("cpu")
    what = "no reference range for CPUs; recorded for comparison"
    checks = [Check("health", SKIPPED, "no GPU: driver health checks do not apply")]
    say(f"CPU fp32 GEMM ({torch.get_num_threads()} threads)")
    checks.append(judge(perf.gemm(torch, cpu, sizes), None, None, what))
    say("CPU memory copy")
    checks.append(judge(perf.device_copy(torch, cpu, sizes), None, None, what))
    say("gloo all-reduce across 2 processes")
    r = run_allreduce(2, "gloo", sizes.allreduce_bytes, sizes.allreduce_iters, TIMEOUT_S[mode])
    checks.append(_allreduce_check(r, None, None, what))
    return checks


# --------------------------------------------------------------------------- entry points


def run_preflight(mode: str = "quick", device: str = "auto", catalog: PreflightCatalog | None = None,
                  progress: Progress | None = None, started: float | None = None) -> PreflightResult:
    """Health and performance checks on every visible device of ``device`` kind.

    ``started``: a ``time.perf_counter()`` reading to count the duration from (the command's
    start, so importing torch and starting CUDA are counted).
    """
    if mode not in MODES:
        raise UsageError(f"preflight mode must be quick or full, got {mode!r}")
    t0 = started if started is not None else time.perf_counter()
    say = progress or _say
    catalog = catalog or load_catalog()
    kind, torch = resolve_kind(device)
    say(f"{mode} checks on {kind}")
    checks = _cpu_checks(torch, mode, say) if kind == "cpu" else _gpu_checks(torch, kind, mode, catalog, say)
    return PreflightResult(mode=mode, device_kind=kind, duration_s=time.perf_counter() - t0, checks=tuple(checks))


def failure_message(result: PreflightResult) -> PreflightFailed:
    bad = result.failed
    first = bad[0]
    where = f" on device {first.device}" if first.device is not None else ""
    more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
    return PreflightFailed(f"preflight failed: {first.name}{where}: {first.reason}{more}",
                           "this is not the machine that was paid for: show the table to the provider, or try another machine")


def trial_preflight(manifest: dict[str, Any], device: Any, mode: str, go_on: bool,
                    write: Callable[[], Any], progress: Progress | None = None) -> PreflightResult:
    """The trial's first stage: record ``[preflight]`` in ``manifest``; on a failed check write the
    manifest (fingerprint + preflight) through ``write`` and raise PreflightFailed, unless ``go_on``."""
    say = progress or _say
    kind = "cpu" if getattr(device, "type", "cpu") == "cpu" else "auto"
    result = run_preflight(mode, kind, progress=lambda m: say(f"preflight: {m}"))
    manifest["preflight"] = result.to_manifest()
    for c in result.warned:
        say(f"preflight warning: {c.name}" + (f" (device {c.device})" if c.device is not None else "") + f": {c.reason}")
    if result.failed:
        if go_on:
            say("preflight FAILED; going on as --ignore-preflight-failure asks")
        else:
            manifest["kind"] = "fingerprint"  # no trial results follow: the file records the stack and the preflight
            write()
            raise failure_message(result)
    else:
        say(f"preflight {result.verdict} in {result.duration_s:.1f} s")
    return result

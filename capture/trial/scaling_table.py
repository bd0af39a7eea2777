"""From the ranks' results to the ``[scaling]`` table's figures: each shape's summary, whether it
fits, the efficiency's reference (the smallest N that fits) and the restore verdicts. Split from
:mod:`capture.trial.scaling`, which launches the ranks; nothing here imports torch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from capture.trial.scaling import COLLECTIVE_MARKERS, NO_COLLECTIVE, BatchPlan, step_stats

EFFICIENCY_DEFINITION = (
    "throughput_N / ((N / M) x throughput_M): M is the smallest number of devices that fits the run (1, the "
    "single-device baseline, when it fits; else the smallest FSDP shape that fits), measured in the same step, on "
    "the same machine, at the same global batch")


def _fits_row(item: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A shape that ran out of memory: its verdict, no figures."""
    if not isinstance(item, Mapping) or item.get("fits", True):
        return None
    return {k: item[k] for k in ("fits", "verdict", "oom", "failed_at", "oom_rank") if item.get(k) is not None}


def baseline_summary(item: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if not isinstance(item, Mapping):
        return None
    failed = _fits_row(item)
    if failed is not None:
        return failed
    b = dict(item)
    b.update(step_stats(b.pop("step_times_s")))
    wall = b["step_time_total_s"]
    b["throughput_tokens_per_s"] = b["tokens_measured"] / wall if wall > 0 else None
    b["tokens_per_optimizer_step"] = b["tokens_measured"] // b["measured_steps"]
    b["peak_memory_per_rank_bytes"] = b.pop("peak_memory_bytes", None)
    b["verdict"] = "fits on one device"
    return b


def strategy_summary(data: Mapping[str, Any], plan: BatchPlan) -> dict[str, Any]:
    failed = _fits_row(data)
    if failed is not None:
        return failed
    ranks = sorted(data["ranks"], key=lambda r: r["rank"])
    measured = data["measured_steps"]
    slowest = max(ranks, key=lambda r: r["step_time_median_s"])
    wall = max(r["step_time_total_s"] for r in ranks)
    tokens = data["tokens_measured"]
    out: dict[str, Any] = {
        "fits": True,
        "verdict": f"fits on {plan.world_size} device{'s' if plan.world_size > 1 else ''}",
        "world_size": plan.world_size,
        "measured_steps": measured,
        "warmup_steps": data["warmup_steps"],
        "tokens_measured": tokens,
        "tokens_per_optimizer_step": tokens // measured if measured else None,
        "throughput_tokens_per_s": tokens / wall if wall > 0 else None,
        "throughput_basis": "tokens of the measured optimizer steps (packed sequences, no padding) / the slowest rank's total step time",
        "step_time_median_s": slowest["step_time_median_s"],
        "step_time_p90_s": slowest["step_time_p90_s"],
        "step_time_cv": slowest["step_time_cv"],
        "slowest_rank": slowest["rank"],
        "memory_basis": data.get("memory_basis"),
        "final_loss": data.get("final_loss"),
        "losses": data.get("losses"),
    }
    peaks = [r.get("peak_memory_bytes") for r in ranks if r.get("peak_memory_bytes") is not None]
    if peaks:
        out["peak_memory_per_rank_bytes"] = max(peaks)
    host = [r["peak_host_rss_bytes"] for r in ranks if r.get("peak_host_rss_bytes") is not None]
    if host:
        out["peak_host_rss_per_rank_bytes"] = max(host)
    shares = [r["comm_share"] for r in ranks if isinstance(r.get("comm_share"), float)]
    if shares and len(shares) == len(ranks):
        out["comm_share"] = sum(shares) / len(shares)
        out["comm_share_basis"] = ("wall time with a collective in flight (union of profiler events named "
                                   f"{'/'.join(COLLECTIVE_MARKERS)}) / step time over {data.get('profiled_steps')} "
                                   "profiled steps, mean over ranks; overlap with compute counts")
    elif plan.world_size == 1 and all(r.get("comm_share_note") == NO_COLLECTIVE for r in ranks):
        out["comm_share"] = 0.0
        out["comm_share_basis"] = "world size 1: the profiler recorded no collective, none was needed"
    else:
        notes = sorted({r.get("comm_share_note", "") for r in ranks if r.get("comm_share_note")})
        out["comm_share_note"] = "not attributable" + (f": {notes[0]}" if notes else "")
    for key in ("wrapper", "sharding_units", "gradient_sync", "offload", "materialization", "weights",
                "optimizer_device", "params_total", "param_bytes_total", "replicas_in_sync", "replicas_in_sync_basis"):
        if data.get(key) is not None:
            out[key] = data[key]
    out["ranks"] = ranks
    return out


def efficiency_reference(baseline: Mapping[str, Any] | None, smaller: list[dict[str, Any]],
                         shapes: Mapping[str, Mapping[str, Any]], world: int) -> dict[str, Any] | None:
    """The smallest N that fits, and its throughput: one device when the baseline fits; else the
    first FSDP shape of the smaller ones that fits; else the full world (FSDP before DDP)."""
    if isinstance(baseline, Mapping) and baseline.get("fits") and baseline.get("throughput_tokens_per_s"):
        return {"world_size": 1, "shape": "1 device (the baseline)",
                "throughput_tokens_per_s": baseline["throughput_tokens_per_s"], "basis": "one device fits"}
    for s in smaller:
        if s.get("fits") and s.get("throughput_tokens_per_s"):
            return {"world_size": s["world_size"], "shape": f"FSDP x{s['world_size']}",
                    "throughput_tokens_per_s": s["throughput_tokens_per_s"],
                    "basis": f"one device does not fit; FSDP x{s['world_size']} is the smallest N that fits"}
    for name in ("fsdp", "ddp"):
        full = shapes.get(name)
        if isinstance(full, Mapping) and full.get("fits") and full.get("throughput_tokens_per_s"):
            tried = ", ".join(f"FSDP x{x['world_size']}" for x in smaller)
            return {"world_size": world, "shape": f"{name.upper()} x{world}", "throughput_tokens_per_s": full["throughput_tokens_per_s"],
                    "basis": f"one device does not fit{', nor ' + tried if tried else ''}; {name.upper()} x{world} "
                             "is the smallest N that fits, so its own efficiency is 1 by definition"}
    return None


def apply_efficiency(summary: dict[str, Any], reference: Mapping[str, Any] | None, world: int) -> None:
    tps = summary.get("throughput_tokens_per_s")
    if reference is None or not tps:
        return
    m, ref_tps = reference["world_size"], reference["throughput_tokens_per_s"]
    summary["efficiency"] = tps / ((world / m) * ref_tps)
    summary["speedup"] = tps / ref_tps
    summary["efficiency_against"] = reference["shape"]


def recovery_verdict(reference: Mapping[str, Any], resumed: Mapping[str, Any] | None, failure: str | None,
                     k: int, n: int) -> dict[str, Any]:
    from capture.trial import recover

    if not reference.get("fits", True):
        return {"verdict": f"failed: {reference.get('verdict', 'does not fit')}", "save_at_step": k, "total_steps": n}
    out: dict[str, Any] = {
        "save_at_step": k,
        "total_steps": n,
        "fresh_processes": True,
        "checkpoint_format": reference["checkpoint_format"],
        "checkpoint_size_bytes": reference["checkpoint_size_bytes"],
        "checkpoint_write_s": reference["checkpoint_write_s"],
        "losses_uninterrupted": reference["losses"],
        "param_hash_uninterrupted": reference["param_hash"],
    }
    if resumed is None:
        out["verdict"] = f"failed: {failure}"
        return out
    step, diff, equal = recover.compare_run(reference["losses"][k:], (reference["param_hash"], ""), resumed["losses"],
                                            (resumed["param_hash"], ""), k)
    out.update(verdict=recover.verdict_text(step, equal), losses_resumed=resumed["losses"],
               param_hash_resumed=resumed["param_hash"], restore_load_s=resumed["restore_load_s"], loss_diff=diff)
    if step is not None:
        out["diverged_at_step"] = step
    return out


def results_tables(items: Mapping[str, Any], plan: BatchPlan, ladder: list[BatchPlan], strategies: tuple[str, ...],
                   restored: Mapping[str, Any], restore_failed: str | None, k: int, n: int) -> dict[str, Any]:
    """The ``baseline``, ``smaller_shapes``, per-strategy and ``efficiency_reference`` entries."""
    out: dict[str, Any] = {}
    baseline = baseline_summary(items.get("baseline"))
    if baseline is not None:
        out["baseline"] = baseline
    smaller = [strategy_summary(items[f"fsdp@{p.world_size}"], p) | {"world_size": p.world_size, "batch": p.to_manifest()}
               for p in ladder if f"fsdp@{p.world_size}" in items]
    if smaller:
        out["smaller_shapes"] = smaller
    shapes = {s: strategy_summary(items[s], plan) | {"world_size": plan.world_size} for s in strategies if s in items}
    reference = efficiency_reference(baseline, smaller, shapes, plan.world_size)
    if reference is not None:
        out["efficiency_reference"] = reference
    for s, summary in shapes.items():
        apply_efficiency(summary, reference, plan.world_size)
        ref = items.get(f"recovery:{s}")
        if ref is not None:
            summary["recovery"] = recovery_verdict(ref, restored.get(s), restore_failed or "no result", k, n)
        out[s] = summary
    return out


def memory_limit_how(device_type: str) -> str:
    if device_type == "cuda":
        return ("torch.cuda.set_per_process_memory_fraction(limit / device total) in every rank: the caching allocator "
                "raises OutOfMemoryError past the limit; the CUDA context and NCCL buffers are outside it")
    return ("RLIMIT_DATA in every rank, set after the framework and the process group are up to that data segment "
            "plus the limit: an allocation past it fails (MemoryError / RuntimeError); a CPU run counts host memory "
            "as device memory, rank 0's full CPU copy during FSDP's build included")

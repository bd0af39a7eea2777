"""How to read a scaling table: the one-line reading and the side-by-side text (DDP vs FSDP
against the single-device baseline). Split from :mod:`capture.trial.scaling`, which runs the step."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from capture.fmt import bytes_str
from capture.manifest import table_at
from capture.trial.scaling_args import STRATEGIES

TIE_FRACTION = 0.05
"""Throughputs or memories within this fraction of each other read as a tie: step times vary by a few percent."""

def _better(a: float, b: float, higher_is_better: bool) -> int:
    """1 when a wins, -1 when b wins, 0 for a tie (within :data:`TIE_FRACTION`)."""
    if max(abs(a), abs(b)) == 0 or abs(a - b) <= TIE_FRACTION * max(abs(a), abs(b)):
        return 0
    return (1 if a > b else -1) * (1 if higher_is_better else -1)


def _compare(d: Mapping[str, Any], f: Mapping[str, Any]) -> str:
    """DDP against FSDP, both measured: which to choose for throughput, for memory, or for both."""
    thr = _better(d["throughput_tokens_per_s"], f["throughput_tokens_per_s"], True)
    dm, fm = d.get("peak_memory_per_rank_bytes"), f.get("peak_memory_per_rank_bytes")
    mem = _better(dm, fm, False) if dm is not None and fm is not None else 0
    thr_txt = (f"{d['throughput_tokens_per_s']:.0f} vs {f['throughput_tokens_per_s']:.0f} tokens/s, "
               f"efficiency {d.get('efficiency', float('nan')):.2f} vs {f.get('efficiency', float('nan')):.2f}")
    mem_txt = f"{bytes_str(dm)} vs {bytes_str(fm)} peak per rank"
    name = {1: "DDP", -1: "FSDP"}
    if thr and thr == mem:
        return f"choose {name[thr]} for throughput and for memory ({thr_txt}; {mem_txt}, DDP vs FSDP)"
    if thr and mem:
        return (f"choose {name[thr]} for throughput ({thr_txt}), {name[mem]} for memory ({mem_txt}); "
                f"for both, {name[mem]} only if the model does not fit under {name[thr]}")
    if thr:
        return (f"choose {name[thr]} for throughput and for both ({thr_txt}); {name[-thr]} saves no memory "
                f"at this size ({mem_txt}, DDP vs FSDP)")
    if mem:
        return (f"choose {name[mem]} for memory and for both ({mem_txt}, DDP vs FSDP); {name[-mem]} is no faster "
                f"({thr_txt})")
    return f"DDP and FSDP are about equal here in throughput ({thr_txt}) and memory ({mem_txt}); either fits"


def _alone(table: Mapping[str, Any], name: str, n: Any) -> str:
    s = table[name]
    eff = s.get("efficiency")
    eff_txt = f", efficiency {eff:.2f}" if isinstance(eff, (int, float)) else ""
    return (f"{s['throughput_tokens_per_s']:.0f} tokens/s on {n} ranks{eff_txt}, "
            f"{bytes_str(s.get('peak_memory_per_rank_bytes'))} per rank")


def reading(table: Mapping[str, Any]) -> str:
    """One line for the user: which shape to choose for throughput, for memory, or for both; when
    one device does not fit, which shapes do, and what the efficiency is measured against."""
    n = table.get("world_size", "?")
    shapes = [s for s in STRATEGIES if isinstance(table.get(s), Mapping)]
    done = [s for s in shapes if table[s].get("throughput_tokens_per_s")]
    unfit = [s for s in shapes if table[s].get("fits") is False]
    base = table_at(table, "baseline")
    ref = table_at(table, "efficiency_reference")
    one_device_fits = base.get("fits") is not False
    head = "" if one_device_fits else "one device does not fit; "
    if not done:
        if unfit:
            more = "" if table.get("fsdp_offload") or "fsdp" not in unfit else "; try --fsdp-offload, or more devices"
            return (f"{head}{' nor '.join(s.upper() for s in unfit)} does not fit on {n} ranks either{more}"
                    if head else f"{' nor '.join(s.upper() for s in unfit)} does not fit on {n} ranks")
        return "no strategy was measured; nothing to choose from"
    if len(done) == 1:
        name = done[0]
        if unfit:
            line = (f"{head}choose {name.upper()}, the only shape that fits on {n} ranks ({_alone(table, name, n)}); "
                    f"{', '.join(s.upper() for s in unfit)} does not fit")
        else:
            line = f"{head}only {name.upper()} was measured ({_alone(table, name, n)}); run --strategy both to compare"
    else:
        line = head + _compare(table["ddp"], table["fsdp"])
    effs = [table[s].get("efficiency") for s in done if isinstance(table[s].get("efficiency"), (int, float))]
    if ref and ref.get("world_size", 1) != 1:
        line += f"; efficiency is against {ref.get('shape')}, the smallest N that fits"
        if ref.get("world_size") == n:
            line += " (1 by definition: no smaller shape fits)"
    elif effs and max(effs) < 0.5:
        line += f"; {n} ranks are not worth it at this size (best efficiency {max(effs):.2f})"
    return line


def render_scaling(scaling_table: Mapping[str, Any]) -> str:
    """The ``[scaling]`` table for the terminal: the single-device baseline, the smaller FSDP shapes
    tried when it does not fit, then DDP and FSDP on every rank, side by side."""
    t = scaling_table
    if not isinstance(t, Mapping) or not t:
        return "scaling: not measured"
    if t.get("skipped"):
        return f"scaling: skipped ({t['skipped']})"
    n = t.get("world_size", "?")
    ref = table_at(t, "efficiency_reference")
    columns: list[tuple[str, Mapping[str, Any]]] = [("1 device", table_at(t, "baseline"))]
    columns += [(f"FSDP x{s.get('world_size')}", s) for s in t.get("smaller_shapes") or [] if isinstance(s, Mapping)]
    columns += [(f"{s.upper()} x{n}", t[s]) for s in STRATEGIES if isinstance(t.get(s), Mapping)]

    def num(v: Any, spec: str) -> str:
        return format(v, spec) if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"

    def cell(head: str, s: Mapping[str, Any], key: str) -> str:
        baseline = head == "1 device"
        if key == "fits":
            return "-" if not s else ("no (out of memory)" if s.get("fits") is False else "yes")
        if key == "throughput":
            return num(s.get("throughput_tokens_per_s"), ",.0f")
        if key == "efficiency":
            if head == ref.get("shape") or (baseline and ref.get("world_size") == 1):
                return "1 (def.)"
            return num(s.get("efficiency"), ".2f")
        if key == "step":
            return f"{num(s.get('step_time_median_s'), '.3f')} / {num(s.get('step_time_p90_s'), '.3f')}"
        if key == "cv":
            return num(s.get("step_time_cv"), ".3f")
        if key == "slowest":
            return "-" if baseline else str(s.get("slowest_rank", "-"))
        if key == "memory":
            return bytes_str(s.get("peak_memory_per_rank_bytes")) if s.get("peak_memory_per_rank_bytes") is not None else "-"
        if key == "comm":
            share = s.get("comm_share")
            return f"{share:.1%}" if isinstance(share, float) else ("-" if baseline or s.get("fits") is False else "n/a")
        if key == "restore":
            rec = table_at(s, "recovery")
            verdict = str(rec.get("verdict", "-"))
            return "failed (below)" if verdict.startswith("failed") else verdict
        return "-"

    rows = [("fits", "fits"), ("useful throughput (tokens/s)", "throughput"), ("scaling efficiency", "efficiency"),
            ("step time median / p90 (s)", "step"), ("step time CV (slowest rank)", "cv"),
            ("slowest rank", "slowest"), ("peak memory per rank", "memory"),
            ("communication share", "comm"), ("restore in fresh processes", "restore")]
    body = [[label] + [cell(head, col, key) for head, col in columns] for label, key in rows]
    header = [""] + [head for head, _ in columns]
    widths = [max(len(r[i]) for r in body + [header]) for i in range(len(header))]
    lines = []
    batch, coll = table_at(t, "batch"), table_at(t, "collective")
    lines.append(f"scaling: {n} ranks on {t.get('device_type', '?')}, "
                 f"{coll.get('library', '?')} {coll.get('version', '')}".rstrip())
    if batch:
        lines.append(f"  batch: {batch.get('tokens_per_optimizer_step')} tokens per optimizer step for every column "
                     f"(baseline {batch.get('baseline_micro_batch')} x {batch.get('baseline_grad_accum')}, per rank "
                     f"{batch.get('per_rank_micro_batch')} x {batch.get('per_rank_grad_accum')}; {batch.get('method')})")
    lines.append("  " + "  ".join(h.ljust(widths[i]) if i == 0 else h.rjust(widths[i]) for i, h in enumerate(header)))
    for r in body:
        lines.append("  " + "  ".join(v.ljust(widths[i]) if i == 0 else v.rjust(widths[i]) for i, v in enumerate(r)))
    mem_basis = next((c.get("memory_basis") for _, c in columns if c.get("memory_basis")), None)
    if mem_basis:
        lines.append(f"  memory: {mem_basis}")
    limit = table_at(t, "rank_memory_limit")
    if limit.get("bytes"):
        lines.append(f"  memory limit per rank: {bytes_str(limit['bytes'])}")
    for head, c in columns:
        if c.get("fits") is False:
            lines.append(f"  {head}: {c.get('verdict', 'does not fit')}" + (f" ({c['oom']})" if c.get("oom") else ""))
        rec = c.get("recovery") if isinstance(c.get("recovery"), Mapping) else None
        if isinstance(rec, Mapping) and str(rec.get("verdict", "")).startswith("failed"):
            lines.append(f"  restore ({head}): {rec['verdict']}")
    if t.get("reading"):
        lines.append(f"  reading: {t['reading']}")
    return "\n".join(lines)

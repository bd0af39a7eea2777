"""How to read a scaling table: the one-line reading and the side-by-side text (DDP vs FSDP
against the single-device baseline). Split from :mod:`capture.trial.scaling`, which runs the step."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from capture.fmt import bytes_str
from capture.trial.scaling_args import STRATEGIES

TIE_FRACTION = 0.05
"""Throughputs or memories within this fraction of each other read as a tie: step times vary by a few percent."""

def _better(a: float, b: float, higher_is_better: bool) -> int:
    """1 when a wins, -1 when b wins, 0 for a tie (within :data:`TIE_FRACTION`)."""
    if max(abs(a), abs(b)) == 0 or abs(a - b) <= TIE_FRACTION * max(abs(a), abs(b)):
        return 0
    return (1 if a > b else -1) * (1 if higher_is_better else -1)


def reading(table: Mapping[str, Any]) -> str:
    """One line for the user: which shape to choose for throughput, for memory, or for both."""
    n = table.get("world_size", "?")
    done = [s for s in STRATEGIES if isinstance(table.get(s), Mapping) and table[s].get("throughput_tokens_per_s")]
    if not done:
        return "no strategy was measured; nothing to choose from"
    if len(done) == 1:
        s = table[done[0]]
        eff = s.get("efficiency")
        eff_txt = f", efficiency {eff:.2f}" if isinstance(eff, (int, float)) else ""
        return (f"only {done[0].upper()} was measured ({s['throughput_tokens_per_s']:.0f} tokens/s on {n} ranks{eff_txt}, "
                f"{bytes_str(s.get('peak_memory_per_rank_bytes'))} per rank); run --strategy both to compare")
    d, f = table["ddp"], table["fsdp"]
    thr = _better(d["throughput_tokens_per_s"], f["throughput_tokens_per_s"], True)
    dm, fm = d.get("peak_memory_per_rank_bytes"), f.get("peak_memory_per_rank_bytes")
    mem = _better(dm, fm, False) if dm is not None and fm is not None else 0
    thr_txt = (f"{d['throughput_tokens_per_s']:.0f} vs {f['throughput_tokens_per_s']:.0f} tokens/s, "
               f"efficiency {d.get('efficiency', float('nan')):.2f} vs {f.get('efficiency', float('nan')):.2f}")
    mem_txt = f"{bytes_str(dm)} vs {bytes_str(fm)} peak per rank"
    name = {1: "DDP", -1: "FSDP"}
    if thr and thr == mem:
        line = f"choose {name[thr]} for throughput and for memory ({thr_txt}; {mem_txt}, DDP vs FSDP)"
    elif thr and mem:
        line = (f"choose {name[thr]} for throughput ({thr_txt}), {name[mem]} for memory ({mem_txt}); "
                f"for both, {name[mem]} only if the model does not fit under {name[thr]}")
    elif thr:
        line = (f"choose {name[thr]} for throughput and for both ({thr_txt}); {name[-thr]} saves no memory "
                f"at this size ({mem_txt}, DDP vs FSDP)")
    elif mem:
        line = (f"choose {name[mem]} for memory and for both ({mem_txt}, DDP vs FSDP); {name[-mem]} is no faster "
                f"({thr_txt})")
    else:
        line = f"DDP and FSDP are about equal here in throughput ({thr_txt}) and memory ({mem_txt}); either fits"
    effs = [table[s].get("efficiency") for s in done if isinstance(table[s].get("efficiency"), (int, float))]
    if effs and max(effs) < 0.5:
        line += f"; {n} ranks are not worth it at this size (best efficiency {max(effs):.2f})"
    return line


def render_scaling(scaling_table: Mapping[str, Any]) -> str:
    """The ``[scaling]`` table for the terminal: DDP and FSDP side by side with the baseline."""
    t = scaling_table
    if not isinstance(t, Mapping) or not t:
        return "scaling: not measured"
    if t.get("skipped"):
        return f"scaling: skipped ({t['skipped']})"
    cols = ["baseline"] + [s for s in STRATEGIES if isinstance(t.get(s), Mapping)]
    heads = {"baseline": "1 device", "ddp": f"DDP x{t.get('world_size', '?')}", "fsdp": f"FSDP x{t.get('world_size', '?')}"}

    def num(v: Any, spec: str) -> str:
        return format(v, spec) if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"

    def cell(col: str, key: str) -> str:
        s = t.get(col) if isinstance(t.get(col), Mapping) else {}
        if key == "throughput":
            return num(s.get("throughput_tokens_per_s"), ",.0f")
        if key == "efficiency":
            return num(s.get("efficiency"), ".2f") if col != "baseline" else "1 (def.)"
        if key == "step":
            return f"{num(s.get('step_time_median_s'), '.3f')} / {num(s.get('step_time_p90_s'), '.3f')}"
        if key == "cv":
            return num(s.get("step_time_cv"), ".3f")
        if key == "slowest":
            return "-" if col == "baseline" else str(s.get("slowest_rank", "-"))
        if key == "memory":
            return bytes_str(s.get("peak_memory_per_rank_bytes")) if s.get("peak_memory_per_rank_bytes") is not None else "-"
        if key == "comm":
            share = s.get("comm_share")
            return f"{share:.1%}" if isinstance(share, float) else ("-" if col == "baseline" else "n/a")
        if key == "restore":
            rec = s.get("recovery") if isinstance(s.get("recovery"), Mapping) else {}
            verdict = str(rec.get("verdict", "-"))
            return "failed (below)" if verdict.startswith("failed") else verdict
        return "-"

    rows = [("useful throughput (tokens/s)", "throughput"), ("scaling efficiency", "efficiency"),
            ("step time median / p90 (s)", "step"), ("step time CV (slowest rank)", "cv"),
            ("slowest rank", "slowest"), ("peak memory per rank", "memory"),
            ("communication share", "comm"), ("restore in fresh processes", "restore")]
    body = [[label] + [cell(c, key) for c in cols] for label, key in rows]
    header = [""] + [heads[c] for c in cols]
    widths = [max(len(r[i]) for r in body + [header]) for i in range(len(header))]
    lines = []
    batch = t.get("batch") if isinstance(t.get("batch"), Mapping) else {}
    coll = t.get("collective") if isinstance(t.get("collective"), Mapping) else {}
    lines.append(f"scaling: {t.get('world_size', '?')} ranks on {t.get('device_type', '?')}, "
                 f"{coll.get('library', '?')} {coll.get('version', '')}".rstrip())
    if batch:
        lines.append(f"  batch: {batch.get('tokens_per_optimizer_step')} tokens per optimizer step for both "
                     f"(baseline {batch.get('baseline_micro_batch')} x {batch.get('baseline_grad_accum')}, per rank "
                     f"{batch.get('per_rank_micro_batch')} x {batch.get('per_rank_grad_accum')}; {batch.get('method')})")
    lines.append("  " + "  ".join(h.ljust(widths[i]) if i == 0 else h.rjust(widths[i]) for i, h in enumerate(header)))
    for r in body:
        lines.append("  " + "  ".join(v.ljust(widths[i]) if i == 0 else v.rjust(widths[i]) for i, v in enumerate(r)))
    mem_basis = next((t[c].get("memory_basis") for c in cols if isinstance(t.get(c), Mapping) and t[c].get("memory_basis")), None)
    if mem_basis:
        lines.append(f"  memory: {mem_basis}")
    for c in cols:
        rec = t[c].get("recovery") if isinstance(t.get(c), Mapping) else None
        if isinstance(rec, Mapping) and str(rec.get("verdict", "")).startswith("failed"):
            lines.append(f"  restore ({c}): {rec['verdict']}")
    if t.get("reading"):
        lines.append(f"  reading: {t['reading']}")
    return "\n".join(lines)



"""The memory estimate against the device, shape by shape: the grid of issue 23.

Grid: Llama 1B (the llama-1b example's shape) and 8B (Llama-3.1-8B's own config.json) x full /
LoRA r16 / QLoRA nf4 (bf16 weights, fused AdamW) x gradient checkpointing off / on x two
micro-batches x sequence 2048 and 8192, plus the fp32-master (bf16 autocast) full fine-tune.

Each (size, method) group runs in its own process: the model is built once, then every shape of
the group runs two training steps after ``torch.cuda.empty_cache()`` (the second is measured:
the optimizer state exists, as in every step of a real run). Per shape it records the allocator's
peak allocated and reserved bytes, the allocated bytes after the forward, after the backward and
after the optimizer step, NVML's figure for the process, and (``--trace``) the allocator's event
history of the measured step (``torch.cuda.memory._record_memory_history``), written compactly.
Then, beside each measurement, the estimate ``capture estimate`` makes for the same config: per
term, total, and the ratio estimate / measured, for the allocator's peak and for the device.

    python3 benchmarks/memory_estimate.py --out DIR [--groups 1b-full,8b-lora] [--trace] [--quick]
    python3 benchmarks/memory_estimate.py --out DIR --report GROUPS_JSONL          # estimate beside it
    python3 benchmarks/memory_estimate.py --out DIR --settings-table GROUPS_JSONL  # cost of each setting

``--quick`` runs a tiny Llama on the CPU (CI): the estimate against the traced allocation peak.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LLAMA_1B = {"architecture": "llama", "config": {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 16,
                                                "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 32000,
                                                "max_position_embeddings": 8192, "attention_dropout": 0.0}}
LLAMA_8B = {"config_file": str(ROOT / "capture/trial/examples/llama-3.1-8b/config.json")}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

SHAPES = {  # (seq, micro-batches) per size
    "1b": [(2048, (2, 8)), (8192, (1, 2))],
    "8b": [(2048, (1, 4)), (8192, (1, 2))],
}
METHODS = ("full", "lora", "qlora", "amp")


def config_text(size: str, method: str, gc: bool, seq: int, mb: int) -> str:
    model = LLAMA_1B if size == "1b" else LLAMA_8B
    lines = ["[trial]", 'name = "grid"', "seed = 1234", "warmup_steps = 1", "measured_steps = 1",
             f'method = "{"full" if method in ("full", "amp") else "lora"}"', "[trial.model]"]
    if "config_file" in model:
        lines.append(f'config_file = "{model["config_file"]}"')
    else:
        lines.append(f'architecture = "{model["architecture"]}"')
    if method == "qlora":
        lines.append('quantization = "nf4"')
    if "config" in model:
        lines.append("[trial.model.config]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in model["config"].items()]
    lines += ["[trial.training]", f"gradient_checkpointing = {'true' if gc else 'false'}",
              "[trial.lora]", "rank = 16", "alpha = 32", "dropout = 0.05", f"target_modules = {json.dumps(TARGETS)}",
              "[trial.optimizer]", 'name = "adamw"', "lr = 1e-5",
              "[trial.precision]", 'dtype = "bf16"', f"autocast = {'true' if method == 'amp' else 'false'}",
              "[trial.batch]", f"max_seq_len = {seq}", f"micro_batch_size = {mb}",
              "[trial.data]", 'source = "synthetic"', "synthetic_sequences = 8", "validation_fraction = 0.0"]
    return "\n".join(lines) + "\n"


def grid(groups: list[str]) -> list[tuple[str, str, list[tuple[bool, int, int]]]]:
    out = []
    for g in groups:
        size, method = g.split("-")
        shapes = [(gc, seq, mb) for seq, mbs in SHAPES[size] for mb in mbs for gc in (False, True)]
        if method == "amp":
            shapes = [(gc, 2048, SHAPES[size][0][1][0]) for gc in (False, True)]
        out.append((size, method, shapes))
    return out


# --------------------------------------------------------------------------- one group, on the GPU


def _compact_trace(snapshot: dict, frames: dict[str, int]) -> list[list]:
    """[action, addr, size, frame id] per allocator event; the frame is the innermost Python frame
    outside torch's own internals (the model code, peft, bitsandbytes, capture)."""
    codes = {"alloc": 0, "free_requested": 1, "free_completed": 2, "segment_alloc": 3, "segment_free": 4,
             "segment_map": 5, "segment_unmap": 6, "oom": 7, "snapshot": 8}
    out = []
    for ev in snapshot.get("device_traces", [[]])[0]:
        where = ""
        for fr in ev.get("frames", []) or []:
            fn = fr.get("filename", "")
            if "/torch/" in fn and "/nn/modules/" not in fn and "/utils/checkpoint" not in fn:
                continue
            where = f"{fn.rsplit('/site-packages/', 1)[-1]}:{fr.get('line')}:{fr.get('name')}"
            break
        out.append([codes.get(ev["action"], 9), ev["addr"], ev["size"], frames.setdefault(where, len(frames))])
    return out


def run_group(size: str, method: str, shapes: list[tuple[bool, int, int]], out: Path, trace: bool) -> None:
    import torch

    from capture.trial.build import model as model_mod
    from capture.trial.build.data import full_batch
    from capture.trial.config import parse
    from capture.trial.devmem import DeviceMemory
    from capture.trial.workload import build_workload

    dev = torch.device("cuda", 0)
    dm = DeviceMemory(dev)
    dm.before_context()
    torch.zeros(1, device=dev)
    torch.cuda.synchronize()
    ctx = dm.context_bytes()
    first = shapes[0]
    cfg = parse(config_text(size, method, first[0], first[1], first[2]), "grid.toml", ROOT, "grid")
    t0 = time.perf_counter()
    wl = build_workload(cfg, dev)
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    base = wl.model.get_base_model() if hasattr(wl.model, "get_base_model") else wl.model
    weights_alloc = torch.cuda.memory_allocated(dev)
    results = []
    frames: dict[str, int] = {}
    traces = {}
    for gc, seq, mb in shapes:
        if gc:
            model_mod.enable_checkpointing(base)
        else:
            base.gradient_checkpointing_disable()
        g = torch.Generator().manual_seed(1)
        batch = full_batch(torch.randint(0, wl.model.config.get_text_config().vocab_size, (mb, seq), generator=g)).to(dev)
        row: dict = {"size": size, "method": method, "gradient_checkpointing": gc, "seq": seq, "micro_batch": mb,
                     "config_toml": config_text(size, method, gc, seq, mb)}
        torch.cuda.empty_cache()
        try:
            for step in range(2):
                measured = step == 1
                if measured:
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(dev)
                    if trace:
                        torch.cuda.memory._record_memory_history(max_entries=400_000, context="alloc", stacks="python")
                a0 = torch.cuda.memory_allocated(dev)
                t = time.perf_counter()
                with wl.autocast():
                    loss = wl.loss(wl.model, batch)
                torch.cuda.synchronize()
                a_fwd, p_fwd = torch.cuda.memory_allocated(dev), torch.cuda.max_memory_allocated(dev)
                loss.backward()
                torch.cuda.synchronize()
                a_bwd, p_bwd = torch.cuda.memory_allocated(dev), torch.cuda.max_memory_allocated(dev)
                wl.optimizer.step()
                wl.optimizer.zero_grad(set_to_none=True)
                torch.cuda.synchronize()
                dt = time.perf_counter() - t
                if measured:
                    if trace:
                        snap = torch.cuda.memory._snapshot()
                        torch.cuda.memory._record_memory_history(enabled=None)
                        traces[f"{size}-{method}-gc{int(gc)}-s{seq}-mb{mb}"] = _compact_trace(snap, frames)
                    used, src = dm.device_used()
                    row.update(step_s=dt, allocated_before=a0, allocated_after_forward=a_fwd, peak_forward=p_fwd,
                               allocated_after_backward=a_bwd, peak_backward=p_bwd,
                               allocated_after_step=torch.cuda.memory_allocated(dev),
                               peak_allocated=torch.cuda.max_memory_allocated(dev),
                               peak_reserved=torch.cuda.max_memory_reserved(dev), device_used=used, device_used_source=src,
                               fits=True, loss=float(loss))
            del loss
        except torch.OutOfMemoryError as exc:
            if trace:
                torch.cuda.memory._record_memory_history(enabled=None)
            row.update(fits=False, oom=str(exc).splitlines()[0][:300])
            wl.optimizer.zero_grad(set_to_none=True)
        import gc as _gc

        _gc.collect()
        torch.cuda.empty_cache()
        results.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "config_toml"}), flush=True)
    opt_state = sum(t.untyped_storage().nbytes() for s in wl.optimizer.state.values() for t in s.values()
                    if isinstance(t, torch.Tensor))
    meta = {"size": size, "method": method, "context_bytes": ctx, "build_s": build_s, "weights_allocated": weights_alloc,
            "optimizer_state_bytes": opt_state, "params_total": wl.params_total, "params_trainable": wl.params_trainable,
            "torch": torch.__version__, "device": torch.cuda.get_device_name(dev),
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "info": wl.info,
            "capacity_bytes": int(torch.cuda.get_device_properties(dev).total_memory)}
    with open(out / "groups.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"meta": meta, "rows": results}, default=str) + "\n")
    if trace:
        with gzip.open(out / f"trace-{size}-{method}.json.gz", "wt") as f:
            json.dump({"frames": sorted(frames, key=frames.get), "traces": traces}, f)


# --------------------------------------------------------------------------- the estimate beside it


def _built(config_toml: str, cfg: Any, cache: dict[str, Any]) -> Any:
    """The meta-device build of a grid row's model, once per model: rows differ mostly in their
    batch (60 rows, 16 models; each LoRA build on meta takes peft about 0.8 s)."""
    from capture.trial.build import model as model_mod

    key = re.sub(r"(?m)^(micro_batch_size|max_seq_len)\s*=.*$", "", config_toml)
    if key not in cache:
        cache[key] = model_mod.build_meta(cfg)
    return cache[key]


def estimate_group(size: str, method: str, rows: list[dict], device_type: str = "cuda",
                   expandable: bool = False, capacity: int | None = None) -> list[dict]:
    """The estimate for every shape of a group, replaying the benchmark's own sequence (one
    build; per shape a step, empty_cache, peaks reset, the measured step), so that the allocator
    model sees the history the device saw."""
    from capture.trial import memory as M
    from capture.trial.allocator import CachingAllocator, ExpandableAllocator, round_size
    from capture.trial.config import parse

    tr = M.Trace()
    marks: list[tuple[dict, Any]] = []
    states: list[int] = []
    first = True
    built = False
    builds: dict[str, Any] = {}
    for r in rows:
        cfg = parse(r["config_toml"], "grid.toml", ROOT, "grid")
        plan = M.plan_for(cfg, device_type, built=_built(r["config_toml"], cfg, builds))
        if not built:
            M._build_events(tr, plan)
            tr.alloc(M.CUBLAS_WORKSPACES_BYTES, "library_workspaces")
            built = True
        tr.mark("empty_cache")
        if not r.get("fits"):
            continue
        M._step_events(tr, plan, r["micro_batch"], first, states)
        first = False
        tr.mark("empty_cache")
        tr.mark("reset_peaks")
        M._step_events(tr, plan, r["micro_batch"], False, states)
        tr.mark("snap", len(marks))
        marks.append((r, plan))
    alloc = ExpandableAllocator() if expandable else CachingAllocator()
    live: dict[int, Any] = {}
    by_tag: dict[str, int] = {}
    peak_tags: dict[str, int] = {}
    small = large = exp_peak = 0
    out = []
    for ev in tr.events:
        k = ev[0]
        if k == "alloc":
            live[ev[1]] = (alloc.malloc(ev[2]), round_size(ev[2]), ev[3])
            by_tag[ev[3]] = by_tag.get(ev[3], 0) + round_size(ev[2])
            if round_size(ev[2]) <= 1 << 20:
                small += round_size(ev[2])
            else:
                large += round_size(ev[2])
            exp_peak = max(exp_peak, _pages(small) + _pages(large))
            if alloc.allocated >= alloc.peak_allocated:
                peak_tags = dict(by_tag)
        elif k == "free":
            h, nbytes, tag = live.pop(ev[1])
            alloc.free(h)
            by_tag[tag] -= nbytes
            if nbytes <= 1 << 20:
                small -= nbytes
            else:
                large -= nbytes
        elif k == "retag":
            h, nbytes, old = live[ev[1]]
            live[ev[1]] = (h, nbytes, ev[2])
            by_tag[old] -= nbytes
            by_tag[ev[2]] = by_tag.get(ev[2], 0) + nbytes
        elif k == "empty_cache":
            alloc.empty_cache()
        elif k == "reset_peaks":
            alloc.reset_peaks()
            peak_tags = dict(by_tag)
            exp_peak = _pages(small) + _pages(large)
        elif k == "snap":
            r, plan = marks[ev[1]]
            outside = M.CONTEXT_REFERENCE_BYTES + M.LIBRARIES_REFERENCE_BYTES
            reserved = alloc.peak_reserved
            if capacity:  # at the card's limit the allocator frees its cache and retries instead of failing
                reserved = min(reserved, max(alloc.peak_allocated, capacity - outside))
            device = reserved + outside
            out.append({"size": size, "method": method, "gradient_checkpointing": r["gradient_checkpointing"],
                        "seq": r["seq"], "micro_batch": r["micro_batch"],
                        "measured": {"peak_allocated": r["peak_allocated"], "peak_reserved": r["peak_reserved"],
                                     "device_used": r["device_used"]},
                        "estimate": {"peak_allocated": alloc.peak_allocated, "peak_reserved": reserved,
                                     "device": device, "terms_at_peak": {t: v for t, v in peak_tags.items() if v},
                                     "outside_allocator": outside},
                        "ratio": {"allocated": alloc.peak_allocated / r["peak_allocated"],
                                  "reserved": reserved / r["peak_reserved"], "device": device / r["device_used"]}})
    return out


def _pages(n: int) -> int:
    return (2 << 20) * ((n + (2 << 20) - 1) // (2 << 20))


def report(groups_file: Path, out: Path) -> int:
    G = 2 ** 30
    rows_out = []
    for line in groups_file.read_text().splitlines():
        d = json.loads(line)
        m = d["meta"]
        exp = "expandable_segments:true" in (m.get("alloc_conf") or "").lower()
        rows_out += [dict(r, expandable_segments=exp, context_measured=m.get("context_bytes"))
                     for r in estimate_group(m["size"], m["method"], d["rows"], expandable=exp,
                                             capacity=m.get("capacity_bytes"))]
    print(f"{'shape':<34}{'alloc meas':>11}{'est':>9}{'ratio':>7}{'resv meas':>11}{'est':>9}{'ratio':>7}"
          f"{'device meas':>12}{'est':>9}{'ratio':>7}")
    worst = {"allocated": 0.0, "reserved": 0.0, "device": 0.0}
    for r in rows_out:
        name = (f"{r['size']}-{r['method']}{'@exp' if r['expandable_segments'] else ''} gc={int(r['gradient_checkpointing'])} "
                f"{r['seq']}x{r['micro_batch']}")
        m, e, q = r["measured"], r["estimate"], r["ratio"]
        for k in worst:
            worst[k] = max(worst[k], abs(q[k] - 1))
        print(f"{name:<34}{m['peak_allocated'] / G:>11.2f}{e['peak_allocated'] / G:>9.2f}{q['allocated']:>7.3f}"
              f"{m['peak_reserved'] / G:>11.2f}{e['peak_reserved'] / G:>9.2f}{q['reserved']:>7.3f}"
              f"{m['device_used'] / G:>12.2f}{e['device'] / G:>9.2f}{q['device']:>7.3f}")
    print(f"worst |ratio - 1|: allocated {worst['allocated']:.1%}, reserved {worst['reserved']:.1%}, device {worst['device']:.1%}"
          f" over {len(rows_out)} shapes (GiB; estimate / measured)")
    misses = [r for r in rows_out if abs(r["ratio"]["device"] - 1) > 0.05]
    if misses:
        print(f"\nshapes beyond 5 % of the device figure ({len(misses)}), by term (estimate - measured, GiB):")
        for r in misses:
            m, e = r["measured"], r["estimate"]
            parts = {"tensors (peak allocated)": e["peak_allocated"] - m["peak_allocated"],
                     "allocator_reserve": (e["peak_reserved"] - e["peak_allocated"]) - (m["peak_reserved"] - m["peak_allocated"]),
                     "outside the allocator (context, libraries)": e["outside_allocator"] - (m["device_used"] - m["peak_reserved"])}
            worst_term = max(parts, key=lambda k: abs(parts[k]))
            name = (f"{r['size']}-{r['method']}{'@exp' if r['expandable_segments'] else ''} "
                    f"gc={int(r['gradient_checkpointing'])} {r['seq']}x{r['micro_batch']}")
            print(f"  {name:<32} device {r['ratio']['device'] - 1:+.1%}: " + ", ".join(
                f"{k} {v / G:+.2f}" for k, v in parts.items()) + f"; the miss is in {worst_term}")
    (out / "memory-grid.json").write_text(json.dumps({"rows": rows_out, "worst": worst}, indent=1))
    return 0


def settings_table(groups_file: Path) -> int:
    """What each setting costs on the device that ran the grid: device memory, the measured step's
    time and its tokens/s, per shape (one step after a warm-up step, with a device sync after the
    forward, the backward and the optimizer step: an indication, not a trial's median)."""
    G = 2 ** 30
    names = {"full": "full fine-tune, bf16", "lora": "LoRA r16, bf16 base", "qlora": "QLoRA r16, nf4 base",
             "amp": "full fine-tune, fp32 master + bf16 autocast"}
    print(f"{'size':<5}{'setting':<46}{'ckpt':>5}{'seq':>6}{'mb':>4}{'device GiB':>11}{'step s':>8}{'tokens/s':>10}")
    for line in groups_file.read_text().splitlines():
        d = json.loads(line)
        m = d["meta"]
        setting = names[m["method"]] + (" (expandable segments)" if "expandable" in (m.get("alloc_conf") or "") else "")
        for r in d["rows"]:
            if not r.get("fits"):
                print(f"{m['size']:<5}{setting:<46}{'on' if r['gradient_checkpointing'] else 'off':>5}{r['seq']:>6}"
                      f"{r['micro_batch']:>4}{'OOM':>11}")
                continue
            tps = r["micro_batch"] * r["seq"] / r["step_s"]
            print(f"{m['size']:<5}{setting:<46}{'on' if r['gradient_checkpointing'] else 'off':>5}{r['seq']:>6}"
                  f"{r['micro_batch']:>4}{r['device_used'] / G:>11.2f}{r['step_s']:>8.3f}{tps:>10.0f}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--groups", default="1b-full,1b-lora,1b-qlora,1b-amp,8b-full,8b-lora,8b-qlora,8b-amp")
    ap.add_argument("--trace", action="store_true")
    ap.add_argument("--group", help=argparse.SUPPRESS)
    ap.add_argument("--report", type=Path, metavar="GROUPS_JSONL", help="only compare: estimate against a recorded groups.jsonl")
    ap.add_argument("--settings-table", type=Path, metavar="GROUPS_JSONL",
                    help="only print memory, step time and tokens/s per setting from a recorded groups.jsonl")
    args = ap.parse_args()
    if args.settings_table:
        return settings_table(args.settings_table)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.report:
        return report(args.report, args.out)
    if args.group:
        size, method = args.group.split("-")
        shapes = grid([args.group])[0][2]
        run_group(size, method, shapes, args.out, args.trace)
        return 0
    for g in args.groups.split(","):
        t = time.perf_counter()
        env = dict(os.environ)
        if g.endswith("@exp"):
            g = g[:-4]
            env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        cmd = [sys.executable, __file__, "--out", str(args.out), "--group", g] + (["--trace"] if args.trace else [])
        rc = subprocess.call(cmd, env=env)
        print(f"# group {g}: exit {rc}, {time.perf_counter() - t:.0f} s", flush=True)
    return report(args.out / "groups.jsonl", args.out)


if __name__ == "__main__":
    raise SystemExit(main())

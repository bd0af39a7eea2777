"""Every rank measures; rank 0 gathers the figures and the stacks and writes one manifest.

Each rank sends a small record: its step statistics, memory, data wait and a summary of its
stack (driver, torch, NCCL/RCCL, CUDA/HIP, GPU model, Python, every package version) with the
SHA-256 of that summary. Rank 0 groups the ranks by host, names the slowest rank (highest mean
step time) and lists every stack field on which ranks disagree, so a run whose nodes were not
the same machine says so in the signed record.

The records travel as JSON through the process group's key-value store (the one torchrun or
``init_process_group`` set up), not through a collective: every rank writes its own key and
returns, rank 0 waits for all keys, reads and deletes them. A collective was tried first
(``all_gather_object``) and crashed one run in ~30 under gloo: the backend's worker thread drops
its last reference to the gathered tensors after the caller has moved on, must take the
interpreter lock to do so, and a rank whose script ends right after ``write_manifest`` may be
finalizing by then, where Python ends the thread through a C++ frame that cannot unwind
(``terminate called without an active exception``; the core showed
``~AsyncAllgatherWork -> decref_pyobject -> take_gil -> pthread_exit``). The store needs no
worker thread, no device tensors and no ``torch.cuda.set_device``, so gloo, NCCL and RCCL runs
exchange the same way, and nothing received is unpickled.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

_KEY_PREFIX = "capture/recorder"
_exchanges = itertools.count()
"""Numbers each exchange of this process: every rank calls :func:`gather` equally often."""

STACK_DIGEST_INPUTS = ("driver, torch, torch's CUDA/HIP build, NCCL/RCCL, accelerator model and count, "
                       "Python version and every installed package version (sha256 of their JSON)")


@dataclass(frozen=True)
class Gathered:
    """What rank 0 learned from all ranks (other ranks get ``is_writer=False`` and nothing else)."""

    is_writer: bool
    table: dict[str, Any] = field(default_factory=dict)
    run_fields: dict[str, Any] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()


def world() -> tuple[int, int] | None:
    """(rank, world size) under an initialised process group of more than one rank, else None."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    return dist.get_rank(), dist.get_world_size()


def stack_summary(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The fields that make two ranks' software stacks the same (from a fingerprint)."""
    acc = manifest.get("accelerator") or {}
    fw = manifest.get("framework") or {}
    nv, amd = manifest.get("nvidia") or {}, manifest.get("amd") or {}
    py = manifest.get("python") or {}
    pkgs = {name: str(p.get("version")) for name, p in (py.get("packages") or {}).items() if isinstance(p, Mapping)}
    out = {
        "driver": acc.get("driver_version") or nv.get("driver_version") or amd.get("driver_version"),
        "torch": fw.get("version"),
        "torch_cuda": fw.get("cuda_version") or fw.get("hip_version"),
        "nccl": fw.get("nccl_version") or fw.get("rccl_version"),
        "accelerator_model": acc.get("model"),
        "accelerator_count": acc.get("count"),
        "python": py.get("version"),
        "packages": pkgs,
    }
    return {k: v for k, v in out.items() if v is not None}


def stack_digest(summary: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(summary, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _rank_record(rank: int, result: Any, trial: Mapping[str, Any], manifest: Mapping[str, Any]) -> dict[str, Any]:
    stats = trial.get("stats") or {}
    mem = result.memory
    summary = stack_summary(manifest)
    rec: dict[str, Any] = {
        "rank": rank,
        "local_rank": int(os.environ.get("LOCAL_RANK", rank)),
        "hostname": (manifest.get("host") or {}).get("hostname") or os.uname().nodename,
        "device": result.device,
        "device_name": result.device_name,
        "measured_steps": len(result.step_time_s),
        "step_time_median_s": stats.get("step_time_median_s"),
        "step_time_mean_s": stats.get("step_time_mean_s"),
        "step_time_p90_s": stats.get("step_time_p90_s"),
        "data_wait_total_s": stats.get("data_wait_total_s"),
        "stall_share": stats.get("stall_share"),
        "tokens_per_s": stats.get("tokens_per_s"),
        "peak_allocated_bytes": mem.peak_allocated_bytes,
        "peak_reserved_bytes": mem.peak_reserved_bytes,
        "device_used_bytes": mem.device_used_bytes,
        "stack_sha256": stack_digest(summary),
    }
    return {"record": rec, "stack": summary}


def _flatten(summary: Mapping[str, Any]) -> dict[str, str]:
    out = {k: str(v) for k, v in summary.items() if k != "packages"}
    out.update({f"packages.{n}": v for n, v in (summary.get("packages") or {}).items()})
    return out


def stack_differences(stacks: Mapping[int, Mapping[str, Any]]) -> list[str]:
    """One line per stack field on which ranks disagree: ``packages.foo: 1.0 (ranks 0), 2.0 (ranks 1)``."""
    flat = {r: _flatten(s) for r, s in stacks.items()}
    keys = sorted(set().union(*flat.values())) if flat else []
    lines = []
    for key in keys:
        by_value: dict[str, list[int]] = {}
        for r in sorted(flat):
            by_value.setdefault(flat[r].get(key, "(absent)"), []).append(r)
        if len(by_value) > 1:
            parts = ", ".join(f"{v} (rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))})" for v, rs in by_value.items())
            lines.append(f"{key}: {parts}")
    return lines


def summarize_ranks(records: list[dict[str, Any]]) -> Gathered:
    """Rank 0's view: the ``[trial.distributed]`` table, ``[trial.run]`` additions and warnings."""
    ranks = sorted((r["record"] for r in records), key=lambda r: r["rank"])
    stacks = {r["record"]["rank"]: r["stack"] for r in records}
    nodes: dict[str, list[dict[str, Any]]] = {}
    for r in ranks:
        nodes.setdefault(str(r["hostname"]), []).append(r)
    node_rows = []
    for host, rs in nodes.items():
        digests = {r["stack_sha256"] for r in rs}
        s = stacks[rs[0]["rank"]]
        row = {"hostname": host, "ranks": [r["rank"] for r in rs], "stack_sha256": rs[0]["stack_sha256"],
               "stack_consistent": len(digests) == 1}
        row.update({k: s[k] for k in ("driver", "torch", "torch_cuda", "nccl", "accelerator_model", "python") if k in s})
        node_rows.append(row)
    timed = [r for r in ranks if isinstance(r.get("step_time_mean_s"), (int, float))]
    table: dict[str, Any] = {"world_size": len(ranks), "node_count": len(nodes), "stack_digest_inputs": STACK_DIGEST_INPUTS}
    run: dict[str, Any] = {"world_size": len(ranks), "nodes": len(nodes)}
    if timed:
        slow = max(timed, key=lambda r: r["step_time_mean_s"])
        fast = min(timed, key=lambda r: r["step_time_mean_s"])
        table.update({"slowest_rank": slow["rank"], "slowest_rank_host": slow["hostname"],
                      "slowest_step_time_mean_s": slow["step_time_mean_s"],
                      "fastest_step_time_mean_s": fast["step_time_mean_s"],
                      "step_time_spread": (slow["step_time_mean_s"] / fast["step_time_mean_s"] - 1.0)
                      if fast["step_time_mean_s"] else 0.0})
        run["slowest_rank"] = f"rank {slow['rank']} on {slow['hostname']}"
        waits = [r for r in timed if isinstance(r.get("data_wait_total_s"), (int, float))]
        if waits:
            most = max(waits, key=lambda r: r["data_wait_total_s"])
            table["most_data_wait_rank"] = most["rank"]
        tps = [r["tokens_per_s"] for r in ranks if isinstance(r.get("tokens_per_s"), (int, float))]
        if len(tps) == len(ranks):
            table["tokens_per_s_all_ranks"] = float(sum(tps))
    diffs = stack_differences(stacks)
    table["stacks_identical"] = not diffs
    warnings: list[str] = []
    if diffs:
        table["stack_differences"] = diffs
        warnings.append(f"the ranks' stacks differ in {len(diffs)} field(s): " + "; ".join(diffs[:5])
                        + (" ..." if len(diffs) > 5 else ""))
        table["warnings"] = warnings
        run["stacks"] = f"DIFFER across ranks ({len(diffs)} field(s); see trial.distributed.stack_differences)"
    table["ranks"] = ranks
    table["nodes"] = node_rows
    return Gathered(True, table, run, tuple(warnings))


def gather(result: Any, trial: Mapping[str, Any], manifest: Mapping[str, Any]) -> Gathered | None:
    """Every rank calls it (like a collective). None when not distributed."""
    w = world()
    if w is None:
        return None
    import torch.distributed as dist

    rank, size = w
    store = dist.PrefixStore(f"{_KEY_PREFIX}/{next(_exchanges)}/", dist.distributed_c10d._get_default_store())
    everyone = exchange(store, rank, size, _rank_record(rank, result, trial, manifest))
    return Gathered(False) if everyone is None else summarize_ranks(everyone)


def exchange(store: Any, rank: int, size: int, mine: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """Write this rank's record under its own key of ``store``; on rank 0 wait for every rank's,
    read them in rank order and delete them. Other ranks return None without waiting.

    Rank 0 waits as long as the store's timeout (the process group's, 30 minutes unless set)
    and then names the ranks that never wrote."""
    store.set(str(rank), json.dumps(mine, sort_keys=True, default=str))
    if rank != 0:
        return None
    keys = [str(r) for r in range(size)]
    try:
        store.wait(keys)
    except RuntimeError as exc:  # DistStoreError: the store's timeout ran out
        missing = [k for k in keys if not store.check([k])]
        raise RuntimeError(f"capture: rank 0 waited for every rank's record; ranks {', '.join(missing) or '?'} "
                           f"never called write_manifest ({str(exc).splitlines()[0][:200]})") from None
    records = [_decode(store.get(k), r) for r, k in enumerate(keys)]
    for k in keys:
        store.delete_key(k)
    return records


def _decode(raw: bytes, rank: int) -> dict[str, Any]:
    try:
        rec = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        rec = None
    if not (isinstance(rec, dict) and isinstance(rec.get("record"), dict) and isinstance(rec.get("stack"), dict)
            and rec["record"].get("rank") == rank and isinstance(rec["record"].get("stack_sha256"), str)):
        raise ValueError(f"capture: the store's record for rank {rank} is not one this version of capture wrote")
    return rec

"""One rank of the scaling step, started by torchrun:
``python -m torch.distributed.run ... -m capture.trial._dist_worker JOB.json``.

The job (written by :func:`capture.trial.scaling.run_scaling`; the format is internal to that
pair) names a phase. ``measure`` runs items in order, each measured on every rank that takes part:
``baseline`` (global rank 0 alone, the others wait), then, when one device does not fit,
``fsdp@M`` on the first M ranks for each M of the job's ``ladder`` until one fits, then each
strategy on all ranks, then, with recovery on, ``recovery:S``: the uninterrupted reference that
saves a distributed checkpoint after ``save_at_step``. ``restore``: fresh processes restore those
checkpoints and continue to ``total_steps``.

Out of memory is a result. The baseline catches it in-process (no other rank is involved). A
rank that runs out of memory in a distributed item cannot tell the others, who wait in a
collective for it, so it writes ``OUT.rankR.oom`` (the item and the reason) and exits; torchrun
stops the rest, and the parent launches again with the finished items (``OUT.progress``, written
by rank 0 after each item) and the failed one carried in the job's ``done``. A rank the kernel
kills (SIGKILL: on a CPU, the host's memory ran out) writes nothing; each rank's ``OUT.rankR.at``
(the item it is in, its PID) lets the parent treat it the same way. Any other failure
writes ``OUT.rankR.error`` (one line). Rank 0 writes the job's ``out`` file at the end.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable

from capture._atomic import atomic_write
from capture.trial import scratch, state
from capture.trial._dist_build import Built, build, warm_imports
from capture.trial._dist_facts import binding_row, collective_loaded, local_topology
from capture.trial.scaling import NO_COLLECTIVE, BatchPlan, is_collective, step_stats, union_seconds

_T0 = time.perf_counter()
_ITEM: dict[str, str | None] = {"key": None}  # the item being run, for the out-of-memory marker


@dataclasses.dataclass
class Team:
    """The ranks that train one item together: all of them, or the first ``size`` (a mesh of its own)."""

    size: int
    rank: int
    member: bool
    mesh: Any = None
    group: Any = None  # the collectives' group; None: the default group


_MESHES: dict[int, Any] = {}


def team(strategy: str, size: int, rank: int, world: int, device: Any) -> Team:
    """Every rank must call this (a mesh's process groups are created collectively)."""
    if strategy != "fsdp":
        return Team(world, rank, True)
    if size not in _MESHES:
        from torch.distributed.device_mesh import DeviceMesh

        _MESHES[size] = DeviceMesh(device.type, list(range(size)))
    mesh = _MESHES[size]
    member = rank < size
    return Team(size, rank if member else -1, member, mesh, mesh.get_group() if member else None)


# --------------------------------------------------------------------------- measuring


def _memory(reading: Any, device: Any) -> dict[str, Any]:
    from capture.trial import devmem

    if device.type == "cuda":
        # Host memory too: with --fsdp-offload the parameters and optimizer state live there.
        return {"peak_memory_bytes": reading.peak_allocated_bytes, "peak_allocated_bytes": reading.peak_allocated_bytes,
                "peak_reserved_bytes": reading.peak_reserved_bytes, "device_used_bytes": reading.device_used_bytes,
                "device_used_source": reading.device_used_source, "device_total_bytes": reading.device_total_bytes,
                "peak_host_rss_bytes": devmem.peak_rss_bytes()}
    return {"peak_memory_bytes": reading.device_used_bytes, "peak_rss_bytes": reading.device_used_bytes,
            "host_memory_total_bytes": reading.device_total_bytes}


def _reset_peaks(mem: Any) -> None:
    from capture.trial import devmem

    mem.reset_peaks()
    if mem.type == "cuda":
        devmem.reset_peak_rss()


def _now_bytes(device: Any) -> int | None:
    from capture.trial import devmem

    if device.type == "cuda":
        import torch

        return int(torch.cuda.memory_allocated(device))
    return devmem.rss_bytes()


def _build_memory(mem: Any, device: Any, before: int | None) -> dict[str, Any]:
    """What building took: the peak since ``before`` was read (a peak reset with it). FSDP's
    meta-device build shows here: no rank's device held the whole model."""
    from capture.trial import devmem

    reading = mem.read()
    out: dict[str, Any] = {"memory_before_build_bytes": before,
                           "build_peak_memory_bytes": reading.peak_allocated_bytes if device.type == "cuda"
                           else reading.device_used_bytes}
    if device.type == "cuda":
        out["build_peak_host_rss_bytes"] = devmem.peak_rss_bytes()
    return out


def memory_basis(device: Any) -> str:
    if device.type == "cuda":
        return ("peak allocated tensor memory per rank (torch allocator); device_used_bytes per rank is the "
                "device's own figure (NVML/amdsmi), which includes the CUDA context and NCCL buffers")
    return "peak RSS per rank (VmHWM, reset per phase): CPU run, host memory stands for device memory"


def _timed_steps(built: Built, steps: int, device: Any) -> tuple[list[float], list[Any]]:
    from capture.trial.measure import make_clock

    clock = make_clock(device, steps)
    losses = []
    clock.mark()
    for _ in range(steps):
        losses.append(built.workload.train_step_async(built.feed))
        clock.mark()
    return clock.durations_s(), losses


def _profile(built: Built, steps: int, device: Any) -> dict[str, Any]:
    """Share of step time with a collective in flight, from torch.profiler over ``steps`` steps."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    try:
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                built.workload.train_step_async(built.feed)
            state.sync(device)
            elapsed = time.perf_counter() - t0
        events = list(prof.events())
    except Exception as exc:  # e.g. CUPTI unavailable: the step is still measured, only this share is not
        from capture.trial.fit import is_oom

        if is_oom(exc):
            raise
        return {"comm_share_note": f"the profiler failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"}
    cuda_type = torch.autograd.DeviceType.CUDA
    on_device = [(e.time_range.start, e.time_range.end) for e in events
                 if e.device_type == cuda_type and is_collective(e.name)]
    on_host = [(e.time_range.start, e.time_range.end) for e in events
               if e.device_type != cuda_type and is_collective(e.name)]
    if on_device:
        return {"comm_share": min(1.0, union_seconds(on_device) / elapsed), "comm_share_source": "device kernels",
                "profiled_step_time_s": elapsed / steps}
    if on_host:
        return {"comm_share": min(1.0, union_seconds(on_host) / elapsed), "comm_share_source": "host ops (all threads)",
                "profiled_step_time_s": elapsed / steps}
    return {"comm_share_note": NO_COLLECTIVE}


def _global_mean(values: list[Any], t: Team) -> list[float]:
    import torch
    import torch.distributed as dist

    x = torch.stack([v.detach().float().reshape(()) for v in values]).clone()
    dist.all_reduce(x, group=t.group)  # SUM: gloo has no AVG
    return [float(v) / t.size for v in x.cpu().tolist()]


def _global_sum(value: int, device: Any, t: Team) -> int:
    import torch
    import torch.distributed as dist

    x = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(x, group=t.group)
    return int(x.item())


def _baseline(config: Any, device: Any, mem: Any, job: dict[str, Any], where: list[str]) -> dict[str, Any]:
    built = build("baseline", config, BatchPlan.from_manifest(job["plan"]), device, 0, 1)
    _say(0, "baseline: built")
    state.release_memory(device)
    _reset_peaks(mem)
    for i in range(config.warmup_steps):
        where[0] = f"warm-up step {i + 1}"
        built.workload.train_step_async(built.feed)
    state.sync(device)
    built.feed.tokens = 0
    where[0] = "the measured steps"
    times, losses = _timed_steps(built, config.measured_steps, device)
    out = {"fits": True, "warmup_steps": config.warmup_steps, "measured_steps": config.measured_steps,
           "tokens_measured": built.feed.tokens, "step_times_s": times,
           "micro_batch": config.batch.micro_batch_size, "grad_accum": config.batch.grad_accum,
           "losses": [float(x) for x in losses], "memory_basis": memory_basis(device)}
    out["final_loss"] = out["losses"][-1]
    out.update(_memory(mem.read(), device))
    return out


def measure_baseline(config: Any, device: Any, mem: Any, job: dict[str, Any]) -> dict[str, Any]:
    """Single device, no process group involved: the baseline's own micro-batch and grad_accum.
    Out of memory is caught here and returned as the result ("does not fit on one device")."""
    from capture.trial.fit import is_oom, oom_text

    where = ["building the model"]
    try:
        out = _baseline(config, device, mem, job, where)
    except Exception as exc:
        if not is_oom(exc):
            raise
        out = {"fits": False, "verdict": f"does not fit on one device: out of memory in {where[0]}",
               "oom": oom_text(exc), "failed_at": where[0]}
    # Out of the except block: the traceback (and the workload its frames hold) is gone before this.
    state.release_memory(device)
    return out


def measure_strategy(strategy: str, config: Any, plan: BatchPlan, device: Any, mem: Any, job: dict[str, Any],
                     t: Team, rank: int, world: int, coord: Any) -> dict[str, Any] | None:
    """Every rank calls this; the team's members train, the others wait at the barrier and gather."""
    import torch.distributed as dist

    built = None
    if t.member:
        state.release_memory(device)
        _reset_peaks(mem)
        before = _now_bytes(device)
        built = build(strategy, config, plan, device, t.rank, t.size, t.mesh, bool(job.get("fsdp_offload")))
        build_memory = _build_memory(mem, device, before)
        _say(rank, f"{strategy} x{t.size}: built")
        state.release_memory(device)
        _reset_peaks(mem)
        for _ in range(config.warmup_steps):
            built.workload.train_step_async(built.feed)
        state.sync(device)
    dist.barrier(group=coord)
    row: dict[str, Any] | None = None
    summary: dict[str, Any] = {}
    if built is not None:
        _say(rank, f"{strategy} x{t.size}: warmed up")
        built.feed.tokens = 0
        times, losses = _timed_steps(built, config.measured_steps, device)
        _say(rank, f"{strategy} x{t.size}: measured")
        row = {"rank": rank, "tokens_measured": built.feed.tokens}
        row.update(step_stats(times))
        row.update(_memory(mem.read(), device))
        row.update(build_memory)
        row.update(_profile(built, int(job["profile_steps"]), device))
        global_losses = _global_mean(losses, t)
        summary = dict(built.info, tokens_measured=_global_sum(row["tokens_measured"], device, t), losses=global_losses,
                       final_loss=global_losses[-1])
        if strategy == "ddp":
            summary["replicas_in_sync"] = replicas_in_sync(built.workload.model)
            summary["replicas_in_sync_basis"] = "per-parameter float64 sums equal on every rank after the profiled steps"
        del built
        state.release_memory(device)
    rows = [r for r in _gather(row, rank, world, coord) if r is not None]
    if rank != 0:
        return None
    return dict(summary, fits=True, world_size=t.size, ranks=rows, measured_steps=config.measured_steps,
                warmup_steps=config.warmup_steps, profiled_steps=int(job["profile_steps"]),
                memory_basis=memory_basis(device), batch=plan.to_manifest())


def replicas_in_sync(model: Any) -> bool:
    """DDP keeps one replica per rank; a gradient that was never all-reduced shows up here."""
    import torch
    import torch.distributed as dist

    from capture.trial.dist_checkpoint import unwrap

    sums = torch.stack([p.detach().double().sum() for p in unwrap(model).parameters()])
    low, high = sums.clone(), sums.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    return bool(torch.equal(low, high))


def _steps_global(built: Built, count: int, t: Team) -> list[float]:
    return [_global_mean([built.workload.train_step_async(built.feed)], t)[0] for _ in range(count)]


def reference_run(strategy: str, config: Any, plan: BatchPlan, device: Any, job: dict[str, Any], t: Team) -> dict[str, Any]:
    from capture.trial import dist_checkpoint

    k, n = int(job["recovery"]["save_at_step"]), int(job["recovery"]["total_steps"])
    built = build(strategy, config, plan, device, t.rank, t.size, t.mesh, bool(job.get("fsdp_offload")))
    losses = _steps_global(built, k, t)
    state.sync(device)
    saved = dist_checkpoint.save(strategy, built.workload, Path(job["checkpoint_dir"]) / strategy, k, device)
    losses += _steps_global(built, n - k, t)
    state.sync(device)
    digest = dist_checkpoint.full_param_hash(strategy, built.workload.model)
    del built
    state.release_memory(device)
    return dict(saved, losses=losses, param_hash=digest)


def restore_run(strategy: str, config: Any, plan: BatchPlan, device: Any, job: dict[str, Any], t: Team) -> dict[str, Any]:
    from capture.trial import dist_checkpoint

    k, n = int(job["recovery"]["save_at_step"]), int(job["recovery"]["total_steps"])
    built = build(strategy, config, plan, device, t.rank, t.size, t.mesh, bool(job.get("fsdp_offload")))
    loaded = dist_checkpoint.load(strategy, built.workload, Path(job["checkpoint_dir"]) / strategy, device)
    if loaded["step"] != k:
        raise RuntimeError(f"the {strategy} checkpoint is from step {loaded['step']}, expected {k}")
    losses = _steps_global(built, n - k, t)
    state.sync(device)
    digest = dist_checkpoint.full_param_hash(strategy, built.workload.model)
    del built
    state.release_memory(device)
    return {"losses": losses, "param_hash": digest, "restore_load_s": loaded["restore_load_s"]}


# --------------------------------------------------------------------------- the rank's memory limit


def apply_memory_limit(device: Any, limit: int) -> dict[str, Any]:
    """Let this rank use no more than ``limit`` bytes of memory for the training state, as a
    device of that size would: a larger allocation fails with the framework's out-of-memory
    error. CUDA/ROCm: the caching allocator's cap. CPU: ``RLIMIT_DATA`` set to the data segment
    the rank has now (interpreter, torch, transformers, the process group) plus ``limit``."""
    if device.type == "cuda":
        import torch

        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), device)
        return {"limit_bytes": limit, "device_total_bytes": total}
    import resource

    from capture.trial import devmem

    state.release_memory(device)
    base = devmem.data_bytes() or 0
    _soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    cap = base + limit if hard == resource.RLIM_INFINITY else min(hard, base + limit)
    resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))
    return {"limit_bytes": limit, "data_segment_before_bytes": base, "rlimit_data_bytes": cap}


# --------------------------------------------------------------------------- items


class Items:
    """The measure phase's results by item; carried ones (from an earlier launch) are not run again."""

    def __init__(self, carried: dict[str, Any], rank: int, out: Path) -> None:
        self.carried = dict(carried)
        self.results = dict(carried)
        self.rank, self.out = rank, out

    def run(self, key: str, fn: Callable[[], Any]) -> Any:
        if key in self.carried:
            return self.carried[key]
        _ITEM["key"] = key
        # Where this rank is, for the parent: a rank the kernel kills (SIGKILL, past the host's
        # memory on a CPU) writes nothing more, and its PID in torchrun's log names the marker.
        atomic_write(Path(f"{self.out}.rank{self.rank}.at"),
                     json.dumps({"item": key, "rank": self.rank, "pid": os.getpid(), "host": socket.gethostname()}).encode())
        scratch.pause_point(f"scaling.item.{key}")
        value = fn()
        _ITEM["key"] = None
        if self.rank == 0:
            self.results[key] = value
            atomic_write(Path(f"{self.out}.progress"), json.dumps(self.results).encode())
        return value

    def fits(self, key: str) -> bool:
        """An item that ran in this launch fitted (out of memory ends the launch); carried ones say."""
        return bool(self.carried.get(key, {}).get("fits", True)) if key in self.carried else True


def _per_rank(config: Any, plan: BatchPlan) -> Any:
    return dataclasses.replace(config, batch=dataclasses.replace(
        config.batch, micro_batch_size=plan.per_rank_micro_batch, grad_accum=plan.per_rank_grad_accum))


def measure(job: dict[str, Any], config: Any, device: Any, mem: Any, rank: int, world: int, coord: Any,
            result: dict[str, Any]) -> None:
    plan = BatchPlan.from_manifest(job["plan"])
    items = Items(job.get("done") or {}, rank, Path(job["out"]))
    result["items"] = items.results
    base = items.run("baseline", lambda: measure_baseline(config, device, mem, job) if rank == 0 else None)
    base_fits = _bcast(base.get("fits") if isinstance(base, dict) else None, coord)
    _say(rank, f"baseline: {'fits' if base_fits else 'does not fit on one device'}")
    _barrier(coord)
    if not base_fits:  # the smallest N that fits is the efficiency's reference
        for entry in job.get("ladder") or []:
            m, plan_m = int(entry["world_size"]), BatchPlan.from_manifest(entry["plan"])
            key = f"fsdp@{m}"
            t = team("fsdp", m, rank, world, device)
            items.run(key, lambda: measure_strategy("fsdp", _per_rank(config, plan_m), plan_m, device, mem, job, t,
                                                    rank, world, coord))
            if items.fits(key):
                break
    per_rank = _per_rank(config, plan)
    for s in job["strategies"]:
        t = team(s, world, rank, world, device)
        items.run(s, lambda: measure_strategy(s, per_rank, plan, device, mem, job, t, rank, world, coord))
        _say(rank, f"{s} measured")
    if job["recovery"]["enabled"]:
        for s in job["strategies"]:
            if items.fits(s):
                t = team(s, world, rank, world, device)
                items.run(f"recovery:{s}", lambda: reference_run(s, per_rank, plan, device, job, t))
        _say(rank, "uninterrupted references run and checkpoints saved")


def _bcast(value: Any, coord: Any) -> Any:
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0, group=coord)
    return box[0]


def _barrier(coord: Any) -> None:
    import torch.distributed as dist

    dist.barrier(group=coord)


def _gather(obj: Any, rank: int, world: int, coord: Any) -> list[Any]:
    import torch.distributed as dist

    bucket: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(obj, bucket, dst=0, group=coord)
    return bucket or []


# --------------------------------------------------------------------------- entry


def _say(rank: int, text: str) -> None:
    if rank == 0:
        sys.stderr.write(f"[capture rank 0 +{time.perf_counter() - _T0:.1f}s] {text}\n")
        sys.stderr.flush()


def run(job: dict[str, Any], rank: int, world: int, local_rank: int) -> dict[str, Any] | None:
    import torch
    import torch.distributed as dist

    from capture.probes import ProbeOptions
    from capture.probes import environment as env_probe
    from capture.trial.config import TrialConfig
    from capture.trial.devmem import DeviceMemory
    from capture.trial.recover import config_from_dict

    device = torch.device("cuda", local_rank) if job["device_type"] == "cuda" else torch.device("cpu")
    mem = DeviceMemory(device)
    mem.before_context()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=float(job["timeout_s"]))
    if device.type == "cuda":
        dist.init_process_group(backend=job["backend"], timeout=timeout, device_id=device)
    else:
        dist.init_process_group(backend=job["backend"], timeout=timeout)
    _say(rank, f"process group up ({job['backend']}, {world} ranks)")
    # Barriers and object gathers go over gloo: rank 0 may train the baseline for minutes meanwhile.
    coord = dist.new_group(backend="gloo", timeout=timeout) if job["backend"] != "gloo" else None

    config = config_from_dict(TrialConfig, job["config"])
    plan = BatchPlan.from_manifest(job["plan"])
    # Every rank pays the first build's lazy imports now and in parallel, on the meta device (no memory).
    warm_imports(config)
    _barrier(coord)
    result: dict[str, Any] = {}
    if job.get("rank_memory_limit"):
        limits = _gather(apply_memory_limit(device, int(job["rank_memory_limit"])), rank, world, coord)
        result["rank_memory_limit"] = {"per_rank": limits}
    if job["phase"] == "measure":
        binding = _gather(binding_row(rank, local_rank, device), rank, world, coord)
        if rank == 0:
            result.update(binding=binding, topology=local_topology(device), collective=collective_loaded(job["backend"]),
                          environment=env_probe.probe(ProbeOptions(), env=os.environ).to_manifest())
        measure(job, config, device, mem, rank, world, coord, result)
    else:
        per_rank = _per_rank(config, plan)
        result["restore"] = {}
        for s in job["strategies"]:
            t = team(s, world, rank, world, device)
            result["restore"][s] = restore_run(s, per_rank, plan, device, job, t)
        _say(rank, "restored and continued")
    _barrier(coord)
    return result if rank == 0 else None


def _write_failure(out: Path, rank: int, exc: Exception) -> str:
    from capture.trial.fit import is_oom, oom_text

    if is_oom(exc) and _ITEM["key"]:
        reason = oom_text(exc)
        atomic_write(Path(f"{out}.rank{rank}.oom"),
                     json.dumps({"item": _ITEM["key"], "rank": rank, "reason": reason}).encode())
        return f"rank {rank}: out of memory in {_ITEM['key']}: {reason}"
    reason = f"rank {rank}: {type(exc).__name__}: {exc}".splitlines()[0]
    atomic_write(Path(f"{out}.rank{rank}.error"), (reason + "\n").encode())
    return reason


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or "RANK" not in os.environ:
        sys.stderr.write("usage: python -m torch.distributed.run ... -m capture.trial._dist_worker JOB.json\n")
        return 2
    job = json.loads(Path(argv[0]).read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    out = Path(job["out"])
    try:
        result = run(job, rank, world, local_rank)
        if rank == 0:
            atomic_write(out, json.dumps(result).encode())
    except Exception as exc:  # the parent turns this line into the result or error the user sees
        sys.stderr.write(f"error: {_write_failure(out, rank, exc)}\n")
        if os.environ.get("CAPTURE_SCALING_TRACEBACK"):
            raise
        return 1  # no teardown: peers may be waiting in a collective for this rank; torchrun stops them
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    return 0


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Results are written and fsynced: skip the interpreter's teardown of torch and transformers,
    # which takes seconds per rank and delays the launcher's exit.
    os._exit(status)

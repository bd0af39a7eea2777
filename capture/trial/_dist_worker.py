"""One rank of the scaling step, started by torchrun:
``python -m torch.distributed.run ... -m capture.trial._dist_worker JOB.json``.

The job (written by :func:`capture.trial.scaling.run_scaling`; the format is internal to that
pair) names a phase. ``measure``: global rank 0 measures the single-device baseline alone while
the other ranks wait; then every rank measures each strategy (warm-up, timed steps, a few
profiled steps) and, with recovery on, runs the uninterrupted reference that saves a distributed
checkpoint after ``save_at_step``. ``restore``: fresh processes restore that checkpoint and
continue to ``total_steps``. Rank 0 gathers every rank's rows and writes the job's ``out`` file;
a rank that fails writes ``OUT.rankR.error`` (one line) and exits 1, and torchrun stops the rest.
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
from typing import Any, Iterator

from capture._atomic import atomic_write
from capture.trial import state
from capture.trial.scaling import NO_COLLECTIVE, BatchPlan, is_collective, step_stats, union_seconds

_T0 = time.perf_counter()
_RANK_SEED_STRIDE = 1_000_033  # rank r > 0 draws dropout from seed + r * stride; rank 0 keeps the baseline's stream


# --------------------------------------------------------------------------- data


class ShardedLoader:
    """Each rank's shard of the baseline's stream, with DistributedSampler semantics.

    One global :class:`~capture.trial.workload.PackedLoader` of ``per_rank_micro_batch x world``
    sequences per micro-step, identical on every rank; rank ``r`` keeps rows ``r, r+N, ...``.
    So the ranks together read, step for step, exactly the sequences the baseline reads, and the
    position (the global loader's) is the same on every rank.
    """

    def __init__(self, source: Any, per_rank_micro_batch: int, world: int, rank: int, seed: int, device: Any) -> None:
        import torch

        from capture.trial.workload import PackedLoader

        self.inner = PackedLoader(source, per_rank_micro_batch * world, seed, torch.device("cpu"))
        self.world, self.rank, self.device = world, rank, device
        self.source = source

    def __iter__(self) -> ShardedLoader:
        return self

    def __next__(self) -> Any:
        rows = next(self.inner)[self.rank::self.world]
        if self.device.type == "cuda":
            return rows.pin_memory().to(self.device, non_blocking=True)
        return rows.to(self.device)

    def state_dict(self) -> dict[str, int]:
        return dict(self.inner.state_dict(), world_size=self.world, rank=self.rank)

    def load_state_dict(self, state: dict[str, int]) -> None:
        if int(state.get("world_size", self.world)) != self.world:
            raise RuntimeError(f"data position is for {state['world_size']} ranks, this launch has {self.world}")
        self.inner.load_state_dict(state)


class Feed:
    """What ``train_step_async`` reads from: counts tokens; under DDP, lets gradients synchronise
    only on the last micro-batch of an optimizer step (what ``DDP.no_sync`` does for the others)."""

    def __init__(self, loader: Iterator[Any], accum: int, ddp_model: Any = None) -> None:
        self.loader, self.accum, self.ddp = loader, accum, ddp_model
        self.calls = 0
        self.tokens = 0

    def __iter__(self) -> Feed:
        return self

    def __next__(self) -> Any:
        if self.ddp is not None:
            # DDP reads this flag in forward() to decide whether backward all-reduces.
            self.ddp.require_backward_grad_sync = self.calls % self.accum == self.accum - 1
        self.calls += 1
        batch = next(self.loader)
        self.tokens += batch.numel()
        return batch


# --------------------------------------------------------------------------- building


@dataclasses.dataclass
class Built:
    workload: Any
    feed: Feed
    info: dict[str, Any]


def _shard_fsdp(model: Any) -> dict[str, Any]:
    """FSDP2: one sharding unit per transformer block (the model's ``_no_split_modules``), then the root."""
    import torch
    from torch.distributed.fsdp import fully_shard

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    block_names = set(getattr(base, "_no_split_modules", None) or ())
    units = [m for m in model.modules() if type(m).__name__ in block_names]
    if not units:
        lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
        units = list(lists[0]) if lists else []
    for m in units:
        fully_shard(m)
    fully_shard(model)
    return {"wrapper": "FSDP2 (torch.distributed.fsdp.fully_shard)",
            "sharding_units": f"{len(units)} x {', '.join(sorted({type(m).__name__ for m in units})) or 'none'} + root",
            "gradient_sync": "reduce-scatter after every micro-batch (sharded gradients, least memory)"}


def build(strategy: str, config: Any, plan: BatchPlan, device: Any, rank: int, world: int) -> Built:
    """A fresh workload (seeded as the baseline's), wrapped for ``strategy``, reading its shard."""
    import torch

    from capture.trial import workload as wl_mod

    wl = wl_mod.build_workload(config, device)
    if strategy == "baseline":
        return Built(wl, Feed(wl.loader, config.batch.grad_accum), {})
    wl.loader = ShardedLoader(wl.loader.source, plan.per_rank_micro_batch, world, rank, config.seed, device)
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        wl.model = DDP(wl.model, device_ids=[device.index] if device.type == "cuda" else None)
        info = {"wrapper": "DistributedDataParallel",
                "gradient_sync": "all-reduce on the last micro-batch of each optimizer step (no_sync before it)"}
        feed = Feed(wl.loader, plan.per_rank_grad_accum, wl.model)
    elif strategy == "fsdp":
        info = _shard_fsdp(wl.model)
        # fully_shard swaps the parameters for sharded ones: the optimizer and schedule must be rebuilt on them.
        wl.optimizer, _ = wl_mod._build_optimizer(wl.model, config, device)
        horizon = config.warmup_steps + config.measured_steps
        wl.scheduler = torch.optim.lr_scheduler.LambdaLR(
            wl.optimizer, wl_mod._Schedule(config.scheduler.name, config.scheduler.warmup_steps, horizon))
        feed = Feed(wl.loader, plan.per_rank_grad_accum)
    else:
        raise ValueError(f"unknown strategy {strategy!r}")
    if rank:
        wl_mod.seed_everything(config.seed + rank * _RANK_SEED_STRIDE)
    return Built(wl, feed, info)


# --------------------------------------------------------------------------- measuring


def _memory(reading: Any, device: Any) -> dict[str, Any]:
    if device.type == "cuda":
        return {"peak_memory_bytes": reading.peak_allocated_bytes, "peak_allocated_bytes": reading.peak_allocated_bytes,
                "peak_reserved_bytes": reading.peak_reserved_bytes, "device_used_bytes": reading.device_used_bytes,
                "device_used_source": reading.device_used_source, "device_total_bytes": reading.device_total_bytes}
    return {"peak_memory_bytes": reading.device_used_bytes, "peak_rss_bytes": reading.device_used_bytes,
            "host_memory_total_bytes": reading.device_total_bytes}


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


def _global_mean(values: Any, world: int) -> list[float]:
    import torch
    import torch.distributed as dist

    t = torch.stack([v.detach().float().reshape(()) for v in values]) if isinstance(values, list) else values
    t = t.clone()
    dist.all_reduce(t)  # SUM: gloo has no AVG
    return [float(x) / world for x in t.cpu().tolist()]


def _global_sum(value: int, device: Any) -> int:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(t)
    return int(t.item())


def measure_baseline(config: Any, device: Any, mem: Any, job: dict[str, Any]) -> dict[str, Any]:
    """Single device, no process group involved: the baseline's own micro-batch and grad_accum."""
    built = build("baseline", config, BatchPlan.from_manifest(job["plan"]), device, 0, 1)
    _say(0, "baseline: built")
    state.release_memory(device)
    mem.reset_peaks()
    for _ in range(config.warmup_steps):
        built.workload.train_step_async(built.feed)
    state.sync(device)
    built.feed.tokens = 0
    times, losses = _timed_steps(built, config.measured_steps, device)
    out = {"warmup_steps": config.warmup_steps, "measured_steps": config.measured_steps,
           "tokens_measured": built.feed.tokens, "step_times_s": times,
           "micro_batch": config.batch.micro_batch_size, "grad_accum": config.batch.grad_accum,
           "losses": [float(x) for x in losses], "memory_basis": memory_basis(device)}
    out["final_loss"] = out["losses"][-1]
    out.update(_memory(mem.read(), device))
    del built
    state.release_memory(device)
    return out


def measure_strategy(strategy: str, config: Any, plan: BatchPlan, device: Any, mem: Any, job: dict[str, Any],
                     rank: int, world: int, coord: Any) -> dict[str, Any] | None:
    import torch.distributed as dist

    built = build(strategy, config, plan, device, rank, world)
    _say(rank, f"{strategy}: built")
    state.release_memory(device)
    mem.reset_peaks()
    for _ in range(config.warmup_steps):
        built.workload.train_step_async(built.feed)
    state.sync(device)
    dist.barrier(group=coord)
    _say(rank, f"{strategy}: warmed up")
    built.feed.tokens = 0
    times, losses = _timed_steps(built, config.measured_steps, device)
    _say(rank, f"{strategy}: measured")
    tokens = built.feed.tokens
    row: dict[str, Any] = {"rank": rank, "tokens_measured": tokens}
    row.update(step_stats(times))
    row.update(_memory(mem.read(), device))
    row.update(_profile(built, int(job["profile_steps"]), device))
    _say(rank, f"{strategy}: profiled")
    global_losses = _global_mean(losses, world)
    global_tokens = _global_sum(tokens, device)
    in_sync = replicas_in_sync(built.workload.model) if strategy == "ddp" else None
    rows = _gather(row, rank, world, coord)
    info = dict(built.info)
    if in_sync is not None:
        info["replicas_in_sync"] = in_sync
        info["replicas_in_sync_basis"] = "per-parameter float64 sums equal on every rank after the profiled steps"
    del built
    state.release_memory(device)
    if rank != 0:
        return None
    return dict(info, ranks=rows, measured_steps=config.measured_steps,
                warmup_steps=config.warmup_steps, tokens_measured=global_tokens, losses=global_losses,
                final_loss=global_losses[-1], profiled_steps=int(job["profile_steps"]), memory_basis=memory_basis(device))


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


def _steps_global(built: Built, count: int, world: int) -> list[float]:
    return [_global_mean([built.workload.train_step_async(built.feed)], world)[0] for _ in range(count)]


def reference_run(strategy: str, config: Any, plan: BatchPlan, device: Any, job: dict[str, Any],
                  rank: int, world: int) -> dict[str, Any]:
    from capture.trial import dist_checkpoint

    k, n = int(job["recovery"]["save_at_step"]), int(job["recovery"]["total_steps"])
    built = build(strategy, config, plan, device, rank, world)
    losses = _steps_global(built, k, world)
    state.sync(device)
    saved = dist_checkpoint.save(strategy, built.workload, Path(job["checkpoint_dir"]) / strategy, k, device)
    losses += _steps_global(built, n - k, world)
    state.sync(device)
    digest = dist_checkpoint.full_param_hash(strategy, built.workload.model)
    del built
    state.release_memory(device)
    return dict(saved, losses=losses, param_hash=digest)


def restore_run(strategy: str, config: Any, plan: BatchPlan, device: Any, job: dict[str, Any],
                rank: int, world: int) -> dict[str, Any]:
    from capture.trial import dist_checkpoint

    k, n = int(job["recovery"]["save_at_step"]), int(job["recovery"]["total_steps"])
    built = build(strategy, config, plan, device, rank, world)
    loaded = dist_checkpoint.load(strategy, built.workload, Path(job["checkpoint_dir"]) / strategy, device)
    if loaded["step"] != k:
        raise RuntimeError(f"the {strategy} checkpoint is from step {loaded['step']}, expected {k}")
    losses = _steps_global(built, n - k, world)
    state.sync(device)
    digest = dist_checkpoint.full_param_hash(strategy, built.workload.model)
    del built
    state.release_memory(device)
    return {"losses": losses, "param_hash": digest, "restore_load_s": loaded["restore_load_s"]}


# --------------------------------------------------------------------------- facts before the run


def cpu_ranges(cpus: set[int] | list[int]) -> str:
    """``{0,1,2,5}`` -> ``"0-2,5"`` (the kernel's cpulist notation)."""
    xs = sorted(cpus)
    out: list[str] = []
    i = 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out)


def parse_cpulist(text: str) -> set[int]:
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def numa_nodes_of(cpus: set[int], sys_root: Path = Path("/sys/devices/system/node")) -> list[int] | None:
    """NUMA nodes whose CPUs this process may run on; None where /sys has no node folders."""
    nodes = []
    try:
        folders = sorted(sys_root.glob("node[0-9]*"))
    except OSError:
        return None
    if not folders:
        return None
    for folder in folders:
        try:
            node_cpus = parse_cpulist((folder / "cpulist").read_text())
        except (OSError, ValueError):
            continue
        if node_cpus & cpus:
            nodes.append(int(folder.name[4:]))
    return nodes


def binding_row(rank: int, local_rank: int, device: Any) -> dict[str, Any]:
    cpus = os.sched_getaffinity(0)
    row: dict[str, Any] = {"rank": rank, "local_rank": local_rank, "hostname": socket.gethostname(),
                           "device": str(device), "cpu_affinity": cpu_ranges(cpus), "cpu_affinity_count": len(cpus),
                           "numa_nodes": numa_nodes_of(cpus)}
    if device.type == "cuda":
        import torch

        props = torch.cuda.get_device_properties(device)
        row["device_name"] = props.name
        uuid = getattr(props, "uuid", None)
        if uuid is not None:
            row["device_uuid"] = str(uuid) if str(uuid).startswith("GPU-") or torch.version.hip else f"GPU-{uuid}"
        bdf = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        row["device_pci_bus_id"] = bdf
        try:
            node = int(Path(f"/sys/bus/pci/devices/{bdf}/numa_node").read_text())
            row["device_numa_node"] = node  # -1: the platform reports no affinity
        except (OSError, ValueError):
            pass
        for name in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"):
            if name in os.environ:
                row[name.lower()] = os.environ[name]
    return row


def local_topology(device: Any) -> dict[str, Any]:
    """Peer access between this node's rank devices, as torch sees it (rank 0's node)."""
    if device.type != "cuda":
        return {"skipped": "CPU ranks: no accelerator links between them"}
    import torch

    n = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    matrix = [[i == j or bool(torch.cuda.can_device_access_peer(i, j)) for j in range(n)] for i in range(n)]
    return {"peer_access": matrix, "peer_access_source": "torch.cuda.can_device_access_peer between local ranks' devices",
            "devices": [torch.cuda.get_device_properties(i).name for i in range(n)]}


def collective_loaded(backend: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    out: dict[str, Any] = {"backend_in_use": dist.get_backend()}
    if backend == "nccl":
        try:
            v = torch.cuda.nccl.version()
            out["version_loaded"] = ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
        except Exception:
            pass
    return out


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
    per_rank = dataclasses.replace(config, batch=dataclasses.replace(
        config.batch, micro_batch_size=plan.per_rank_micro_batch, grad_accum=plan.per_rank_grad_accum))
    result: dict[str, Any] = {}
    if job["phase"] == "measure":
        # Every rank pays its first-build costs (lazy imports, data) now and in parallel, not after
        # rank 0's baseline while rank 0 waits for it in DDP's first broadcast.
        from capture.trial.workload import build_workload

        build_workload(per_rank, device)
        state.release_memory(device)
        dist.barrier(group=coord)
        _say(rank, "every rank built the workload once")
        binding = _gather(binding_row(rank, local_rank, device), rank, world, coord)
        if rank == 0:
            result.update(binding=binding, topology=local_topology(device), collective=collective_loaded(job["backend"]),
                          environment=env_probe.probe(ProbeOptions(), env=os.environ).to_manifest())
            result["baseline"] = measure_baseline(config, device, mem, job)
            _say(rank, "baseline measured")
        dist.barrier(group=coord)
        result["strategies"] = {}
        for s in job["strategies"]:
            result["strategies"][s] = measure_strategy(s, per_rank, plan, device, mem, job, rank, world, coord)
            _say(rank, f"{s} measured")
        if job["recovery"]["enabled"]:
            result["recovery"] = {s: reference_run(s, per_rank, plan, device, job, rank, world) for s in job["strategies"]}
            _say(rank, "uninterrupted references run and checkpoints saved")
    else:
        result["restore"] = {s: restore_run(s, per_rank, plan, device, job, rank, world) for s in job["strategies"]}
        _say(rank, "restored and continued")
    dist.barrier(group=coord)
    return result if rank == 0 else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or "RANK" not in os.environ:
        sys.stderr.write("usage: python -m torch.distributed.run ... -m capture.trial._dist_worker JOB.json\n")
        return 2
    job = json.loads(Path(argv[0]).read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    out = Path(job["out"])
    code = 0
    try:
        result = run(job, rank, world, local_rank)
        if rank == 0:
            atomic_write(out, json.dumps(result).encode())
    except Exception as exc:  # the parent turns this line into the error the user sees; a traceback helps no one there
        reason = f"rank {rank}: {type(exc).__name__}: {exc}".splitlines()[0]
        atomic_write(Path(f"{out}.rank{rank}.error"), (reason + "\n").encode())
        sys.stderr.write(f"error: {reason}\n")
        if os.environ.get("CAPTURE_SCALING_TRACEBACK"):
            raise
        code = 1
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
    return code


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Results are written and fsynced: skip the interpreter's teardown of torch and transformers,
    # which takes seconds per rank and delays the launcher's exit.
    os._exit(status)

"""The scaling step of the staged trial (guide section 5): DDP and FSDP against one device.

``capture trial CONFIG --nproc N --strategy ddp|fsdp|both`` launches the trial through PyTorch's
own launcher (``python -m torch.distributed.run``, i.e. torchrun); several nodes join through
torchrun's rendezvous options, passed through unchanged. Every rank runs
:mod:`capture.trial._dist_worker`. In one launch, global rank 0 first measures the single-device
baseline alone (one process, the same global batch), then all ranks measure each strategy and,
when recovery is on, run the uninterrupted reference that saves a distributed checkpoint. A
second launch (fresh processes) restores that checkpoint and continues; the losses step by step
and a hash of the parameters at the end are compared with the reference.

The effective batch equals the baseline's (:func:`derive_batch`), every rank reads its strided
shard of the same deterministic stream, so the ranks together see exactly the baseline's
sequences in every optimizer step.

This module does not import torch at import time: the CLI parser and the worker import it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from capture import _parent_death as parent_death
from capture._atomic import atomic_write
from capture.errors import CaptureError, ConfigError, UsageError
from capture.trial.scaling_args import ScalingOptions
from capture.trial.scaling_text import TIE_FRACTION, reading, render_scaling  # noqa: F401 - public here too

log = logging.getLogger(__name__)

WORKER_MODULE = "capture.trial._dist_worker"
LAUNCHER = "torch.distributed.run"

# NVLink SHARP / multicast objects are a shared-host hazard (the GPU machines this project runs on
# require them off) and DDP/FSDP are correct without them, so on CUDA they are off by default.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

# A profiler event is a collective when its name holds one of these (case-insensitive).
COLLECTIVE_MARKERS = ("allreduce", "all_reduce", "all_gather", "allgather", "reduce_scatter", "nccl", "gloo", "c10d")
PROFILED_STEPS = 2
CPU_MMAP_THRESHOLD = 1 << 20  # fixed (no longer dynamic): blocks of 1 MiB and more are returned when freed
NO_COLLECTIVE = "the profiler recorded no collective op in the profiled steps"
DEFAULT_LAUNCH_TIMEOUT_S = 3600.0


# --------------------------------------------------------------------------- batch


@dataclass(frozen=True)
class BatchPlan:
    """How the baseline's optimizer step is split over ``world_size`` ranks (tokens per step kept)."""

    world_size: int
    seq_len: int
    baseline_micro_batch: int
    baseline_grad_accum: int
    per_rank_micro_batch: int
    per_rank_grad_accum: int
    method: str

    @property
    def baseline_tokens_per_optimizer_step(self) -> int:
        return self.baseline_micro_batch * self.baseline_grad_accum * self.seq_len

    @property
    def tokens_per_optimizer_step(self) -> int:
        """Global: per-rank micro-batch x per-rank grad_accum x world_size x seq_len."""
        return self.per_rank_micro_batch * self.per_rank_grad_accum * self.world_size * self.seq_len

    @property
    def global_micro_batch(self) -> int:
        """Sequences the ranks read together per micro-step (each takes every world_size-th)."""
        return self.per_rank_micro_batch * self.world_size

    def to_manifest(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "seq_len": self.seq_len,
            "baseline_micro_batch": self.baseline_micro_batch,
            "baseline_grad_accum": self.baseline_grad_accum,
            "per_rank_micro_batch": self.per_rank_micro_batch,
            "per_rank_grad_accum": self.per_rank_grad_accum,
            "baseline_tokens_per_optimizer_step": self.baseline_tokens_per_optimizer_step,
            "tokens_per_optimizer_step": self.tokens_per_optimizer_step,
            "method": self.method,
        }

    @classmethod
    def from_manifest(cls, data: Mapping[str, Any]) -> BatchPlan:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls)})


def derive_batch(micro_batch: int, grad_accum: int, world_size: int, seq_len: int) -> BatchPlan:
    """Per-rank micro-batch and grad_accum so that global = micro x accum x N equals the baseline.

    Keep the micro-batch and divide grad_accum by N; else divide the micro-batch; else split N
    over both (largest per-rank micro-batch not above the baseline's); else a :class:`ConfigError`.
    """
    def plan(mb: int, ga: int, method: str) -> BatchPlan:
        return BatchPlan(world_size, seq_len, micro_batch, grad_accum, mb, ga, method)

    if world_size == 1:
        return plan(micro_batch, grad_accum, "unchanged (world size 1)")
    if grad_accum % world_size == 0:
        return plan(micro_batch, grad_accum // world_size, "grad_accum divided by world_size")
    if micro_batch % world_size == 0:
        return plan(micro_batch // world_size, grad_accum, "micro_batch divided by world_size")
    total = micro_batch * grad_accum
    if total % world_size == 0:
        per_rank = total // world_size
        mb = max(d for d in range(1, micro_batch + 1) if per_rank % d == 0)
        return plan(mb, per_rank // mb, "micro_batch and grad_accum both divided (world_size split between them)")
    # The smallest grad_accum above the current one that makes the split possible, for the hint.
    ga_fix = next(g for g in range(grad_accum + 1, grad_accum + world_size + 1) if (micro_batch * g) % world_size == 0)
    raise ConfigError(
        f"trial.batch.grad_accum: {micro_batch} x {grad_accum} sequences per optimizer step cannot be split over "
        f"{world_size} ranks (micro_batch_size x grad_accum must be a multiple of --nproc x nodes)",
        f"set trial.batch.grad_accum to {ga_fix} (or a multiple of {world_size}), or trial.batch.micro_batch_size "
        f"to a multiple of {world_size}, or use a different --nproc",
    )


# --------------------------------------------------------------------------- statistics


def step_stats(step_times_s: Sequence[float]) -> dict[str, float]:
    """Median, p90 and coefficient of variation (population std / mean) of step times."""
    from capture.trial.measure import percentile

    n = len(step_times_s)
    if n == 0:
        raise ValueError("no measured steps")
    mean = sum(step_times_s) / n
    std = math.sqrt(sum((t - mean) ** 2 for t in step_times_s) / n)
    return {
        "step_time_median_s": percentile(step_times_s, 50),
        "step_time_p90_s": percentile(step_times_s, 90),
        "step_time_cv": std / mean if mean > 0 else 0.0,
        "step_time_total_s": float(sum(step_times_s)),
    }


def is_collective(name: str) -> bool:
    low = name.lower()
    return any(m in low for m in COLLECTIVE_MARKERS)


def union_seconds(intervals_us: Sequence[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals given in microseconds, in seconds.

    Collective events nest (``FSDP::all_gather`` holds ``c10d::_allgather_base_``) and run on
    several threads at once, so summing them would count the same wall time more than once.
    """
    total = 0.0
    end_so_far = -math.inf
    for start, end in sorted(intervals_us):
        if end <= end_so_far:
            continue
        total += end - max(start, end_so_far)
        end_so_far = end
    return total / 1e6


# --------------------------------------------------------------------------- command line


def launch_command(args: ScalingOptions, job_path: Path, rdzv_suffix: str = "") -> list[str]:
    """``python -m torch.distributed.run <rendezvous> -m capture.trial._dist_worker JOB``."""
    nnodes = args.nnodes
    cmd = [sys.executable, "-m", LAUNCHER, "--nproc-per-node", str(args.nproc), "--max-restarts", "0"]
    if nnodes == 1 and not args.explicit_rendezvous:
        cmd.append("--standalone")  # c10d rendezvous on a free local port
    else:
        cmd += ["--nnodes", str(nnodes)]
        if args.node_rank is not None:
            cmd += ["--node-rank", str(args.node_rank)]
        if args.rdzv_backend:
            cmd += ["--rdzv-backend", args.rdzv_backend]
        if args.rdzv_endpoint:
            cmd += ["--rdzv-endpoint", args.rdzv_endpoint]
        if args.rdzv_id:
            cmd += ["--rdzv-id", args.rdzv_id + rdzv_suffix]
        if args.master_addr:
            cmd += ["--master-addr", args.master_addr]
        if args.master_port:
            cmd += ["--master-port", str(args.master_port)]
    return cmd + ["-m", WORKER_MODULE, str(job_path)]


def child_environment(device_type: str, nproc: int, env: Mapping[str, str] | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """The ranks' environment, and what capture set in it (name -> value) beyond ours."""
    base = dict(os.environ if env is None else env)
    added: dict[str, str] = {}
    if device_type == "cuda":
        for name, value in MULTICAST_OFF.items():
            if name not in base:
                base[name] = added[name] = value
    else:
        if "OMP_NUM_THREADS" not in base:
            # N ranks on a CPU share its cores; more threads than cores makes every rank slower.
            base["OMP_NUM_THREADS"] = added["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
        if "MALLOC_MMAP_THRESHOLD_" not in base:
            # Host memory stands for device memory: glibc's threshold, fixed at its initial value, no
            # longer rises, so freed blocks go back to the system and RSS follows live memory.
            base["MALLOC_MMAP_THRESHOLD_"] = added["MALLOC_MMAP_THRESHOLD_"] = str(CPU_MMAP_THRESHOLD)
    # The ranks import capture from wherever this process did (a checkout that is not installed too).
    root = str(Path(__file__).resolve().parents[2])
    paths = [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in paths:
        base["PYTHONPATH"] = os.pathsep.join([root] + paths)
    return base, added


class LaunchFailed(CaptureError):
    """A torchrun launch exited non-zero or timed out (exit 2, like other trial failures)."""


class RankOutOfMemory(LaunchFailed):
    """A rank ran out of memory in a distributed item (``OUT.rankR.oom``): a result, not a failure;
    :func:`run_scaling` records it and launches again for the items after it."""

    def __init__(self, item: str, rank: int, reason: str, elapsed_s: float) -> None:
        super().__init__(f"scaling: rank {rank} ran out of memory in {item}: {reason}")
        self.item, self.rank, self.reason, self.elapsed_s = item, rank, reason, elapsed_s


def _log_end(path: Path) -> str:
    """The last MiB of a launcher's log (its failure summary is at the end), "" where unreadable."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - (1 << 20)))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _tail(text: str, lines: int = 15) -> str:
    keep = [ln for ln in text.splitlines() if ln.strip() and "USDT:" not in ln]  # profiler start/stop chatter
    return "\n".join(keep[-lines:])


def _killed_rank(text: str) -> str | None:
    """The PID of a rank torchrun says got SIGKILL ("Signal 9 (SIGKILL) received by PID N"), if any."""
    m = re.search(r"Signal 9 \(SIGKILL\) received by PID (\d{1,10})", text)
    return m.group(1) if m else None


def _rank_at(out_path: Path, pid: str) -> tuple[str, int] | None:
    """(item, rank) from the ``OUT.rankR.at`` marker of the rank process ``pid`` on this host (a
    shared --dist-dir holds other nodes' markers, whose PIDs may repeat), None where none says so."""
    import socket

    from capture._json import JsonError, loads

    for marker in sorted(out_path.parent.glob(out_path.name + ".rank*.at")):
        try:
            at = loads(marker.read_bytes()[:4096])
        except (OSError, JsonError):
            continue  # half-written by a rank stopped meanwhile
        if isinstance(at, dict) and str(at.get("pid")) == pid and at.get("host") == socket.gethostname() \
                and isinstance(at.get("item"), str) and type(at.get("rank")) is int:
            return at["item"], at["rank"]
    return None


def run_launch(cmd: list[str], env: Mapping[str, str], log_path: Path, out_path: Path, timeout_s: float) -> dict[str, Any]:
    """Run one launch, its output to ``log_path``; return rank 0's result (``out_path``)."""
    log.debug("launch: %s", " ".join(cmd))
    t0 = time.perf_counter()
    with open(log_path, "wb") as logf:
        # In a session of its own (stopped as a group below); and where this process is killed
        # outright (SIGKILL: the kernel's OOM killer), the kernel sends the launcher SIGTERM, on
        # which it stops its ranks: they never train on alone, holding the devices.
        proc = subprocess.Popen(cmd, env=dict(env), stdout=logf, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=parent_death.preexec(signal.SIGTERM, 1))
        try:
            rc = proc.wait(timeout=timeout_s)
        except BaseException:
            # The launcher and its ranks share a session of their own: stop them all, not only the launcher.
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
            if sys.exc_info()[0] is subprocess.TimeoutExpired:
                raise LaunchFailed(f"scaling: the launch did not finish within {timeout_s:.0f} s",
                                   f"see {log_path}; a rank may be waiting for one that never joined") from None
            raise
    elapsed = time.perf_counter() - t0
    errors = sorted(out_path.parent.glob(out_path.name + ".rank*.error"))
    if rc == 0 and not out_path.exists() and not errors:
        # Several nodes: global rank 0 ran on another node, whose invocation writes the results.
        return {"rank0_elsewhere": True, "launch_wall_s": elapsed}
    if rc != 0 or not out_path.exists():
        for marker in sorted(out_path.parent.glob(out_path.name + ".rank*.oom")):
            try:
                oom = json.loads(marker.read_text())
                item, rank, why = str(oom["item"]), int(oom["rank"]), str(oom["reason"])
            except (OSError, ValueError, KeyError, TypeError):
                continue  # half-written by a rank that was stopped meanwhile: the next marker, or the error
            raise RankOutOfMemory(item, rank, why, elapsed)
        reason = ""
        if errors:
            reason = errors[0].read_text(errors="replace").strip().splitlines()[0]
        log_text = _log_end(log_path)
        tail, killed = _tail(log_text), _killed_rank(log_text)
        if killed and not reason:  # no traceback to show: a signal from outside, on a CPU the OOM killer
            from capture.trial.worker_proc import killed_reason

            at = _rank_at(out_path, killed)
            if at is not None:  # in an item of the measure phase: as out of memory, a result
                raise RankOutOfMemory(at[0], at[1], killed_reason(f"its process (PID {killed})", signal.SIGKILL),
                                      elapsed)
            raise LaunchFailed(f"scaling: {killed_reason(f'rank process {killed}', signal.SIGKILL)}",
                f"--rank-memory-limit BYTES caps each rank, so that an allocation past it is a result (does not "
                f"fit) instead; fewer --nproc or a smaller micro-batch; the launcher's output is in {log_path}")
        raise LaunchFailed(
            f"scaling: the distributed launch failed (exit {rc}){': ' + reason if reason else ''}",
            f"the launcher's output is in {log_path}" + (f"; its last lines:\n{tail}" if tail and not reason else ""))
    result = json.loads(out_path.read_text())
    result["launch_wall_s"] = elapsed
    return result


# --------------------------------------------------------------------------- orchestration


def _collective_library(device_type: str) -> dict[str, Any]:
    import torch

    if device_type != "cuda":
        return {"backend": "gloo", "library": "gloo", "version": f"bundled with torch {torch.__version__}",
                "version_source": "gloo has no version of its own; it is built into torch"}
    lib = "rccl" if torch.version.hip else "nccl"
    out: dict[str, Any] = {"backend": "nccl", "library": lib}
    try:
        v = torch.cuda.nccl.version()
        out["version"] = ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
        out["version_source"] = "torch.cuda.nccl.version()"
    except Exception as exc:  # a build without NCCL: the launch will say so too
        out["version_note"] = f"torch.cuda.nccl.version() failed: {type(exc).__name__}"
    return out


def _topology_probe() -> dict[str, Any] | None:
    from capture.probes import ProbeOptions, as_table, topology

    try:
        return as_table(topology.probe(ProbeOptions(progress=False)))
    except Exception as exc:  # the probe is a guest here: its failure must not stop the scaling step
        return {"skipped": f"probe failed: {type(exc).__name__}: {exc}"}


def plan_scaling(config: Any, args: ScalingOptions) -> BatchPlan:
    """Check the scaling flags and the batch split without launching anything (call it before the
    single-device stages, so a bad ``--nproc`` fails in a second, not after them)."""
    from capture.trial.workload import resolve_device

    world = args.world_size
    if resolve_device(config.device).type == "cuda":
        import torch

        if args.nproc > torch.cuda.device_count():
            raise UsageError(f"--nproc {args.nproc}: only {torch.cuda.device_count()} CUDA/ROCm device(s) are visible here",
                             "lower --nproc, or check CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES")
    return derive_batch(config.batch.micro_batch_size, config.batch.grad_accum, world, config.batch.max_seq_len)


def ladder(config: Any, world: int) -> list[BatchPlan]:
    """The smaller shapes FSDP is measured on when one device does not fit: 2, 4, 8, ... ranks
    below ``world`` whose batch split keeps the global batch (others are skipped)."""
    out = []
    m = 2
    while m < world:
        try:
            out.append(derive_batch(config.batch.micro_batch_size, config.batch.grad_accum, m, config.batch.max_seq_len))
        except ConfigError:
            pass
        m *= 2
    return out


def _clear(base: Path, out_path: Path) -> None:
    for stale in list(base.glob(out_path.name + "*")):
        stale.unlink()


def launch_measure(job: dict[str, Any], args: ScalingOptions, base: Path, env: Mapping[str, str], timeout_s: float,
                   done: Mapping[str, Any] | None = None) -> tuple[dict[str, Any], list[str], list[dict[str, Any]], float]:
    """The measure phase, launched again after each rank that ran out of memory, with what was
    finished carried over (the failed item recorded as "does not fit"); ``done`` holds items
    already measured, which are not measured again. Returns rank 0's result, the first launch
    command, the relaunches and the launches' wall time."""
    done = dict(done or {})
    items_total = 1 + len(job["ladder"]) + 2 * len(job["strategies"])
    relaunches: list[dict[str, Any]] = []
    wall = 0.0
    first_cmd: list[str] = []
    job_path, out_path = base / "job-measure.json", base / "result-measure.json"
    for attempt in range(items_total + 1):  # every relaunch records one more item: this ends
        _clear(base, out_path)
        atomic_write(job_path, json.dumps(dict(job, phase="measure", out=str(out_path), done=done), indent=1).encode())
        cmd = launch_command(args, job_path, f"-{attempt}" if attempt else "")
        first_cmd = first_cmd or cmd
        sys.stderr.write(f"scaling: measure: {job['plan']['world_size']} rank(s) on {job['device_type']} "
                         f"({', '.join(job['strategies'])}, baseline{'; again, ' + str(len(done)) + ' item(s) kept' if done else ''})\n")
        log_path = base / (f"launch-measure-{attempt}.log" if attempt else "launch-measure.log")
        try:
            result = run_launch(cmd, env, log_path, out_path, timeout_s)
        except RankOutOfMemory as exc:
            wall += exc.elapsed_s
            progress = Path(f"{out_path}.progress")
            if progress.exists():
                done.update(json.loads(progress.read_text()))
            where = "does not fit on one device" if exc.item == "baseline" else "does not fit"
            done[exc.item] = {"fits": False, "verdict": f"{where}: out of memory on rank {exc.rank}",
                              "oom": exc.reason, "oom_rank": exc.rank}
            relaunches.append({"after_item": exc.item, "rank": exc.rank, "reason": exc.reason, "log": log_path.name})
            sys.stderr.write(f"scaling: {exc.item} does not fit (rank {exc.rank}: {exc.reason}); launching again\n")
            continue
        wall += result.get("launch_wall_s", 0.0)
        return result, first_cmd, relaunches, wall
    raise LaunchFailed("scaling: more out-of-memory relaunches than items to measure",
                       f"see the launch logs in {base}")  # each relaunch carries one more item: not reached


def measure_job(config: Any, args: ScalingOptions, plan: BatchPlan, base: Path, timeout_s: float) -> dict[str, Any]:
    """What every rank reads (the format is internal to this module and the worker)."""
    from capture.trial.recover import config_to_dict
    from capture.trial.workload import resolve_device

    device_type = resolve_device(config.device).type
    rec = config.recovery
    return {
        "config": config_to_dict(config),
        "device_type": device_type,
        "backend": "nccl" if device_type == "cuda" else "gloo",
        "strategies": list(args.strategies),
        "plan": plan.to_manifest(),
        "ladder": [{"world_size": p.world_size, "plan": p.to_manifest()} for p in ladder(config, plan.world_size)],
        "profile_steps": PROFILED_STEPS,
        "recovery": {"enabled": bool(rec.enabled) and args.recovery, "save_at_step": rec.save_at_step,
                     "total_steps": rec.total_steps},
        "checkpoint_dir": str(base / "checkpoints"),
        "timeout_s": timeout_s,
        "fsdp_offload": args.fsdp_offload,
        "rank_memory_limit": args.rank_memory_limit,
    }


def run_scaling(config: Any, args: ScalingOptions, workdir: str | os.PathLike[str],
                timeout_s: float = DEFAULT_LAUNCH_TIMEOUT_S, start_bytes: int | None = None) -> dict[str, Any]:
    """Run the scaling step and return the ``[scaling]`` table.

    ``args`` holds the flags of :func:`add_arguments` (``nproc`` must be set). Raises a
    :class:`CaptureError` subclass for bad flags, a batch that cannot be split, or a failed launch.
    Out of memory (one device, a shape) is a result in the table, not an error. ``start_bytes``:
    what a rank holds of the host's memory once imported (a CPU's measured overhead; None: a
    process like this one, capture.trial.hostmem.fresh_process_bytes); where the host cannot hold
    this node's ranks, nothing is made or launched.
    """
    from capture.trial.scaling_table import EFFICIENCY_DEFINITION, memory_limit_how, results_tables
    from capture.trial.workload import resolve_device

    plan = plan_scaling(config, args)
    strategies = args.strategies
    world = plan.world_size
    device_type = resolve_device(config.device).type
    rec = config.recovery

    from capture.trial.hostmem import before_ranks

    refusal = before_ranks(args.nproc, start_bytes)  # before anything is made or launched
    if refusal:
        raise LaunchFailed(f"scaling: not launched: {refusal}",
                           "run fewer ranks (--nproc), or give the trial more memory (a container's --memory)")
    base = Path(args.dist_dir) if args.dist_dir else Path(workdir) / "scaling"
    try:
        base.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--dist-dir: cannot create {base} ({exc.strerror})", "name a writable folder") from None
    for stale in list(base.glob("result-*.json*")):
        stale.unlink()
    env, added = child_environment(device_type, args.nproc)
    notes: list[str] = []
    if device_type == "cpu" and args.nproc > (os.cpu_count() or 1):
        notes.append(f"{args.nproc} ranks on {os.cpu_count()} CPU cores: the ranks share cores, so efficiency "
                     "understates what separate devices would give")
        log.warning("scaling: %s", notes[-1])

    job = measure_job(config, args, plan, base, timeout_s)
    measure, first_cmd, relaunches, wall = launch_measure(job, args, base, env, timeout_s)
    items = measure.get("items", {})
    restored: dict[str, Any] = {}
    restore_failed: str | None = None
    to_restore = [s for s in strategies if isinstance(items.get(f"recovery:{s}"), Mapping)
                  and items[f"recovery:{s}"].get("fits", True)]
    if measure.get("rank0_elsewhere") and job["recovery"]["enabled"]:
        # This node cannot see which references rank 0 saved (no shared --dist-dir): join the restore
        # launch of every strategy, as rank 0's node does when all of them fitted.
        to_restore = list(strategies)
    if to_restore:
        job_path, out_path = base / "job-restore.json", base / "result-restore.json"
        _clear(base, out_path)
        atomic_write(job_path, json.dumps(dict(job, strategies=to_restore, phase="restore", out=str(out_path)),
                                          indent=1).encode())
        sys.stderr.write(f"scaling: restore: {world} rank(s) on {device_type} ({', '.join(to_restore)}, "
                         "restore in fresh processes)\n")
        try:
            result = run_launch(launch_command(args, job_path, "-restore"), env, base / "launch-restore.log",
                                out_path, timeout_s)
            restored = result.get("restore", {})
            wall += result.get("launch_wall_s", 0.0)
        except LaunchFailed as exc:
            restore_failed = exc.message
            log.warning("%s", exc.message)

    table: dict[str, Any] = {
        "world_size": world,
        "nproc_per_node": args.nproc,
        "nnodes": args.nnodes,
        "strategies": list(strategies),
        "device_type": device_type,
        "launcher": f"python -m {LAUNCHER} (torchrun)",
        "launch_command": [Path(c).name if i == 0 else c for i, c in enumerate(first_cmd)][:-1] + ["JOB.json"],
        "env_set_by_capture": added,
        "multicast_note": ("NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 are set for the "
                           "ranks on CUDA unless already set: multicast objects are a hazard on shared hosts and "
                           "DDP/FSDP do not need them") if device_type == "cuda" else None,
        "efficiency_definition": EFFICIENCY_DEFINITION,
        "fsdp_offload": args.fsdp_offload,
        "batch": plan.to_manifest(),
        "collective": dict(_collective_library(device_type), **measure.get("collective", {})),
        "environment": measure.get("environment", {"skipped": "no rank result"}),
        "binding": measure.get("binding", []),
        "notes": notes or None,
    }
    if args.rank_memory_limit:
        table["rank_memory_limit"] = dict(measure.get("rank_memory_limit", {}), bytes=args.rank_memory_limit,
                                          how=memory_limit_how(device_type))
    if relaunches:
        table["relaunches"] = relaunches
    topo = dict(measure.get("topology", {}))
    probe_table = _topology_probe()
    if probe_table is not None:
        topo["probe"] = probe_table
    table["topology"] = topo or {"skipped": "no topology readings"}
    smaller = [BatchPlan.from_manifest(e["plan"]) for e in job["ladder"]]
    table.update(results_tables(items, plan, smaller, strategies, restored, restore_failed,
                                rec.save_at_step, rec.total_steps))
    table["reading"] = reading(table)
    table["elapsed_s"] = wall
    if measure.get("rank0_elsewhere"):
        table["note"] = "global rank 0 runs on another node: its manifest holds the measurements"
    if not args.dist_dir:
        _cleanup(base)
    return table


def _cleanup(base: Path) -> None:
    import shutil

    shutil.rmtree(base / "checkpoints", ignore_errors=True)

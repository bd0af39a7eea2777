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
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
NO_COLLECTIVE = "the profiler recorded no collective op in the profiled steps"
EFFICIENCY_DEFINITION = ("throughput_N / (N x throughput_1); throughput_1 is the single-device baseline measured "
                         "in the same launch, on the same machine, at the same global batch")
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
    elif "OMP_NUM_THREADS" not in base:
        # N ranks on a CPU share its cores; more threads than cores makes every rank slower.
        base["OMP_NUM_THREADS"] = added["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    # The ranks import capture from wherever this process did (a checkout that is not installed too).
    root = str(Path(__file__).resolve().parents[2])
    paths = [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in paths:
        base["PYTHONPATH"] = os.pathsep.join([root] + paths)
    return base, added


class LaunchFailed(CaptureError):
    """A torchrun launch exited non-zero or timed out (exit 2, like other trial failures)."""


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    keep = [ln for ln in text.splitlines() if ln.strip() and "USDT:" not in ln]  # profiler start/stop chatter
    return "\n".join(keep[-lines:])


def run_launch(cmd: list[str], env: Mapping[str, str], log_path: Path, out_path: Path, timeout_s: float) -> dict[str, Any]:
    """Run one launch, its output to ``log_path``; return rank 0's result (``out_path``)."""
    log.debug("launch: %s", " ".join(cmd))
    t0 = time.perf_counter()
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(cmd, env=dict(env), stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
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
        reason = ""
        if errors:
            reason = errors[0].read_text(errors="replace").strip().splitlines()[0]
        tail = _tail(log_path)
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


def _strategy_summary(data: Mapping[str, Any], plan: BatchPlan, baseline_tps: float | None) -> dict[str, Any]:
    ranks = sorted(data["ranks"], key=lambda r: r["rank"])
    measured = data["measured_steps"]
    slowest = max(ranks, key=lambda r: r["step_time_median_s"])
    wall = max(r["step_time_total_s"] for r in ranks)
    tokens = data["tokens_measured"]
    tps = tokens / wall if wall > 0 else None
    out: dict[str, Any] = {
        "measured_steps": measured,
        "warmup_steps": data["warmup_steps"],
        "tokens_measured": tokens,
        "tokens_per_optimizer_step": tokens // measured if measured else None,
        "throughput_tokens_per_s": tps,
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
    if tps is not None and baseline_tps:
        out["efficiency"] = tps / (plan.world_size * baseline_tps)
        out["speedup"] = tps / baseline_tps
    for key in ("wrapper", "sharding_units", "gradient_sync", "replicas_in_sync", "replicas_in_sync_basis"):
        if data.get(key) is not None:
            out[key] = data[key]
    out["ranks"] = ranks
    return out


def _recovery_verdict(reference: Mapping[str, Any], resumed: Mapping[str, Any] | None, failure: str | None,
                      k: int, n: int) -> dict[str, Any]:
    from capture.trial import recover

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


def run_scaling(config: Any, args: ScalingOptions, workdir: str | os.PathLike[str],
                timeout_s: float = DEFAULT_LAUNCH_TIMEOUT_S) -> dict[str, Any]:
    """Run the scaling step and return the ``[scaling]`` table.

    ``args`` holds the flags of :func:`add_arguments` (``nproc`` must be set). Raises a
    :class:`CaptureError` subclass for bad flags, a batch that cannot be split, or a failed launch.
    """
    from capture.trial.recover import config_to_dict
    from capture.trial.workload import resolve_device

    plan = plan_scaling(config, args)
    strategies = args.strategies
    nnodes = args.nnodes
    world = plan.world_size
    device_type = resolve_device(config.device).type
    rec = config.recovery
    recovery = bool(rec.enabled) and args.recovery

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

    job: dict[str, Any] = {
        "config": config_to_dict(config),
        "device_type": device_type,
        "backend": "nccl" if device_type == "cuda" else "gloo",
        "strategies": list(strategies),
        "plan": plan.to_manifest(),
        "profile_steps": PROFILED_STEPS,
        "recovery": {"enabled": recovery, "save_at_step": rec.save_at_step, "total_steps": rec.total_steps},
        "checkpoint_dir": str(base / "checkpoints"),
        "timeout_s": timeout_s,
    }
    first_cmd: list[str] | None = None
    results: dict[str, Any] = {}
    for phase in ("measure", "restore") if recovery else ("measure",):
        job_path = base / f"job-{phase}.json"
        out_path = base / f"result-{phase}.json"
        atomic_write(job_path, json.dumps(dict(job, phase=phase, out=str(out_path)), indent=1).encode())
        cmd = launch_command(args, job_path, "" if phase == "measure" else "-restore")
        first_cmd = first_cmd or cmd
        sys.stderr.write(f"scaling: {phase}: {world} rank(s) on {device_type} "
                         f"({', '.join(strategies)}{', baseline' if phase == 'measure' else ', restore in fresh processes'})\n")
        try:
            results[phase] = run_launch(cmd, env, base / f"launch-{phase}.log", out_path, timeout_s)
        except LaunchFailed as exc:
            if phase == "measure":
                raise
            results["restore_failed"] = exc.message
            log.warning("%s", exc.message)

    measure = results.get("measure", {})
    table: dict[str, Any] = {
        "world_size": world,
        "nproc_per_node": args.nproc,
        "nnodes": nnodes,
        "strategies": list(strategies),
        "device_type": device_type,
        "launcher": f"python -m {LAUNCHER} (torchrun)",
        "launch_command": [Path(c).name if i == 0 else c for i, c in enumerate(first_cmd or [])][:-1] + ["JOB.json"],
        "env_set_by_capture": added,
        "multicast_note": ("NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 are set for the "
                           "ranks on CUDA unless already set: multicast objects are a hazard on shared hosts and "
                           "DDP/FSDP do not need them") if device_type == "cuda" else None,
        "efficiency_definition": EFFICIENCY_DEFINITION,
        "batch": plan.to_manifest(),
        "collective": dict(_collective_library(device_type), **measure.get("collective", {})),
        "environment": measure.get("environment", {"skipped": "no rank result"}),
        "binding": measure.get("binding", []),
        "notes": notes or None,
    }
    topo = dict(measure.get("topology", {}))
    probe_table = _topology_probe()
    if probe_table is not None:
        topo["probe"] = probe_table
    table["topology"] = topo or {"skipped": "no topology readings"}

    if "baseline" in measure:
        b = dict(measure["baseline"])
        b.update(step_stats(b.pop("step_times_s")))
        wall = b["step_time_total_s"]
        b["throughput_tokens_per_s"] = b["tokens_measured"] / wall if wall > 0 else None
        b["tokens_per_optimizer_step"] = b["tokens_measured"] // b["measured_steps"]
        b["peak_memory_per_rank_bytes"] = b.pop("peak_memory_bytes", None)
        table["baseline"] = b
    baseline_tps = table.get("baseline", {}).get("throughput_tokens_per_s")
    restored = results.get("restore", {}).get("restore", {})
    for s in strategies:
        data = measure.get("strategies", {}).get(s)
        if data is None:
            continue
        summary = _strategy_summary(data, plan, baseline_tps)
        ref = measure.get("recovery", {}).get(s)
        if ref is not None:
            summary["recovery"] = _recovery_verdict(ref, restored.get(s), results.get("restore_failed", "no result"),
                                                    rec.save_at_step, rec.total_steps)
        table[s] = summary
    table["reading"] = reading(table)
    table["elapsed_s"] = sum(r.get("launch_wall_s", 0.0) for r in results.values() if isinstance(r, Mapping))
    if measure.get("rank0_elsewhere"):
        table["note"] = "global rank 0 runs on another node: its manifest holds the measurements"
    if not args.dist_dir:
        _cleanup(base)
    return table


def _cleanup(base: Path) -> None:
    import shutil

    shutil.rmtree(base / "checkpoints", ignore_errors=True)

"""The runs of the recovery check, wherever they execute.

- :func:`run_reference`: the uninterrupted run; it saves the checkpoint after step k (in the
  parent, or in a fresh process of its own in deterministic mode).
- :class:`Restorer`: a fresh process's workload, built once (early, while the reference runs,
  when memory allows) and reloaded in place for every restore: the frozen base of a LoRA run is
  built and verified once, and each restore loads only the checkpoint's state (adapter or model,
  optimizer, scheduler, scaler, RNG, data position) from the host copy read once from disk.
- :func:`run_restore` (the first fresh process) and :func:`run_resume_again` (the second).

:data:`PLAN` is how the stage runs; :data:`BASELINE` is the path before it (the whole model in
the checkpoint, a fresh build per restore, one resume), kept as the named baseline of
benchmarks/recovery_phases.py and as what the reload path is tested against.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from capture.trial import base, checkpoint_io, data_order, scratch, state
from capture.trial.state import device_type


@dataclass(frozen=True)
class Plan:
    adapter_only: bool = True
    """A LoRA run's checkpoint holds its adapter; the base is verified (capture.trial.base)."""
    reload: bool = True
    """One build per fresh process, reloaded for every restore; False: a fresh build per restore."""
    early_build: bool | None = None
    """Build in the fresh processes while the reference runs: None decides by memory."""
    resume_again: bool = True
    """Resume a second time from the checkpoint the first resumed run writes, and compare batches."""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


PLAN = Plan()
# A restoring process started before its stage: its setup says this instead of early_build, and
# it waits (imported) for the go-ahead, which says whether to build early.
ON_GO = "on the go-ahead"
BASELINE = Plan(adapter_only=False, reload=False, early_build=False, resume_again=False)
BASELINE_NAME = "full-state checkpoint, a fresh build per restore (the path before issue 24)"


def second_save_step(k: int, n: int) -> int | None:
    """k': where the first resumed run saves again (midway between k and n); None when n < k + 2."""
    return (k + n + 1) // 2 if n - k >= 2 else None


@dataclass(frozen=True)
class Reference:
    losses: list[float]
    param_hash: str
    """The ``model`` component's hash after the last step (a LoRA run: its adapter)."""
    optimizer_hash: str
    saved_hashes: dict[str, str]
    """component -> hash of the state at the save point (before anything was left out)."""
    saved: dict[str, Any]
    """checkpoint_io.SaveTiming.to_manifest() of the write."""
    applicability: dict[str, str | None]
    step_time_s: list[float]
    contents: str = ""
    batches: list[list[str]] = dataclasses.field(default_factory=list)
    """Per step, the hash of each micro-batch it consumed (capture.trial.data_order)."""
    boundary: dict[str, Any] = dataclasses.field(default_factory=dict)
    positions: dict[str, Any] = dataclasses.field(default_factory=dict)
    base_digest: str = ""
    """A LoRA base built from a config: its state's sha256 here (capture.trial.base)."""
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    fresh_process: bool = False

    @property
    def hashes(self) -> tuple[str, str]:
        return self.param_hash, self.optimizer_hash

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def contents(config: Any, plan: Plan) -> str:
    if config.method == "lora" and plan.adapter_only:
        return "the LoRA adapter (peft), optimizer, scheduler, scaler, RNG states, data position; the base is verified, not written"
    return "the whole model, optimizer, scheduler, scaler, RNG states, data position"


def _timed_steps(workload: Any, count: int, times: list[float], log: data_order.BatchLog,
                 batches: list[list[str]]) -> list[float]:
    losses = []
    for _ in range(count):
        t0 = time.perf_counter()
        losses.append(float(workload.train_step(log)))  # .item() waits for the device
        times.append(time.perf_counter() - t0)
        batches.append(log.take())
    return losses


def _rebuilt_base(config: Any, plan: Plan) -> bool:
    return plan.adapter_only and config.method == "lora" and base.model_spec(config) is None


def run_reference(config: Any, device: Any, checkpoint: Path, k: int, n: int, leave_out: Sequence[str] = (),
                  plan: Plan = PLAN, k2: int | None = None) -> Reference:
    """The uninterrupted run, saving the checkpoint after step ``k``. With ``k2`` the loader starts
    near the end of an epoch, so that it wraps between k and k2. ``leave_out``: components dropped
    from the file after hashing (a planted incomplete checkpoint, for tests)."""
    from capture.trial.workload import build_workload

    timings: dict[str, float] = {}
    with state.RngGuard(device):
        t0 = time.perf_counter()
        workload = build_workload(config, device)
        timings["build_s"] = time.perf_counter() - t0
        base_check = base.RebuiltCheck(workload.model) if _rebuilt_base(config, plan) else None
        boundary = data_order.arrange_epoch_boundary(workload.loader, config, k) if k2 is not None else {}
        log = data_order.BatchLog(workload.loader)
        times: list[float] = []
        batches: list[list[str]] = []
        losses = _timed_steps(workload, k, times, log, batches)
        state.sync(device)
        positions = {"at_save": dict(workload.loader.state_dict())}
        t0 = time.perf_counter()
        saved_state = state.capture_state(workload, device, k, plan.adapter_only)
        with ThreadPoolExecutor(1) as pool:  # hashing overlaps the write: both only read the state
            hashing = pool.submit(state.component_hashes, dict(saved_state))
            for c in leave_out:
                saved_state.pop(c, None)
            timing = checkpoint_io.save(saved_state, checkpoint, config.checkpoint.format, device_type(device))
            saved_hashes = hashing.result()
        timings["save_s"] = time.perf_counter() - t0
        del saved_state
        scratch.pause_point("recovery.checkpoint_written")
        if k2 is not None:
            losses += _timed_steps(workload, k2 - k, times, log, batches)
            positions["at_second_save"] = dict(workload.loader.state_dict())
        losses += _timed_steps(workload, n - len(losses), times, log, batches)
        state.sync(device)
        timings["steps_s"] = sum(times)
        t0 = time.perf_counter()
        param_hash = state.model_hash(workload.model, plan.adapter_only)
        optimizer_hash = state.optimizer_hash(workload.optimizer)
        timings["final_hash_s"] = time.perf_counter() - t0
        base_digest = ""
        if base_check is not None:
            found = base_check.result()
            if found.error:
                raise RuntimeError(f"hashing the base: {found.error}")
            base_digest, timings["base_hash_s"] = found.digest, found.seconds
        ref = Reference(losses=losses, param_hash=param_hash, optimizer_hash=optimizer_hash, saved_hashes=saved_hashes,
                        saved=timing.to_manifest(), applicability=state.applicability(workload, device),
                        step_time_s=times, contents=contents(config, plan), batches=batches, boundary=boundary,
                        positions=positions, base_digest=base_digest, timings=timings)
    del workload
    state.release_memory(device)  # the fresh process needs the memory this one holds
    return ref


# --------------------------------------------------------------------------- the fresh processes


class Restorer:
    """A fresh process's workload and the checks that belong to its build.

    ``snapshot``: the components to keep as built (state.as_built), so that a withheld component
    can be put back as a fresh build would have it after the workload trained. ``expected``: the
    base to verify (files: hashed in a thread from :meth:`start_base_check` on; rebuilt: after the build)."""

    def __init__(self, config: Any, device: Any, seed: int, plan: Plan, snapshot: Sequence[str] = (),
                 expected: base.Expectation | None = None) -> None:
        self.config, self.device, self.seed, self.plan = config, device, seed, plan
        self.snapshot_components = tuple(snapshot)
        self.expected = expected
        self.workload: Any = None
        self.snapshot: dict[str, Any] | None = None
        self.used = False
        self.built_early = False
        self.timings: dict[str, float] = {}
        self._files: base.FileCheck | None = None
        self._rebuilt: base.RebuiltCheck | None = None

    def start_base_check(self) -> None:
        """Start hashing a pretrained base's files (in a thread); a rebuilt base is checked after the build."""
        if self.expected is not None and self.expected.kind == base.FILES and self._files is None:
            self._files = base.FileCheck(self.expected)

    def add(self, name: str, seconds: float) -> None:
        self.timings[name] = self.timings.get(name, 0.0) + seconds

    def build(self, early: bool = False) -> None:
        from capture.trial.workload import build_workload

        t0 = time.perf_counter()
        self.workload = build_workload(self.config, self.device)  # seeds everything from config.seed
        if self.plan.reload:
            self.snapshot = state.as_built(self.workload, self.snapshot_components, self.plan.adapter_only)
        state.sync(self.device)
        self.add("build_s", time.perf_counter() - t0)
        self.built_early = self.built_early or early
        if self.expected is not None and self.expected.kind == base.REBUILT and self._rebuilt is None:
            self._rebuilt = base.RebuiltCheck(self.workload.model)

    def restore(self, host: Mapping[str, Any], withhold: Sequence[str]) -> list[str]:
        if self.workload is None or (self.used and not self.plan.reload):
            self.workload = None
            state.release_memory(self.device)
            self.build()
        t0 = time.perf_counter()
        missing = state.restore_state(self.workload, host, withhold, self.seed,
                                      self.snapshot if self.used else None, self.plan.adapter_only)
        state.sync(self.device)
        self.used = True
        self.add("restore_s", time.perf_counter() - t0)
        return missing

    def base_check(self) -> base.Check | None:
        check = self._files or self._rebuilt
        if check is None:
            return None
        t0 = time.perf_counter()
        out = check.result()
        self.add("base_verify_wait_s", time.perf_counter() - t0)
        self.timings["base_verify_s"] = out.seconds
        return out

    def continue_to(self, count: int, reference: list[float] | None, save_again: Mapping[str, Any] | None = None,
                    step_times: list[float] | None = None) -> dict[str, Any]:
        """``count`` steps (with ``reference``, a deterministic step: stop at the first loss that
        differs and skip the final hashes); with ``save_again``, save the state after its
        ``steps`` steps first, as a resumed run writes its next checkpoint."""
        wl = self.workload
        log = data_order.BatchLog(wl.loader)
        losses: list[float] = []
        batches: list[list[str]] = []
        out: dict[str, Any] = {}
        t_start = time.perf_counter()
        for i in range(count):
            if save_again is not None and i == int(save_again["steps"]):
                out["saved_again"] = self._save_again(save_again)
            t0 = time.perf_counter()
            loss = float(wl.train_step(log))
            if step_times is not None:
                step_times.append(time.perf_counter() - t0)
            losses.append(loss)
            batches.append(log.take())
            if reference is not None and (i >= len(reference) or loss != reference[i]):
                break
        state.sync(self.device)
        self.add("steps_s", time.perf_counter() - t_start - out.get("saved_again", {}).get("seconds", 0.0))
        out.update(losses=losses, batches=batches)
        if reference is not None and losses != reference[:len(losses)]:
            out.update(param_hash="", optimizer_hash="", hashes="skipped: losses differ")
            return out
        t0 = time.perf_counter()
        out.update(param_hash=state.model_hash(wl.model, self.plan.adapter_only),
                   optimizer_hash=state.optimizer_hash(wl.optimizer))
        self.add("final_hash_s", time.perf_counter() - t0)
        return out

    def _save_again(self, spec: Mapping[str, Any]) -> dict[str, Any]:
        t0 = time.perf_counter()
        state.sync(self.device)
        saved = state.capture_state(self.workload, self.device, int(spec["step"]), self.plan.adapter_only)
        with ThreadPoolExecutor(1) as pool:  # hashing overlaps the write: both only read the state
            hashing = pool.submit(state.component_hashes, saved)
            timing = checkpoint_io.save(saved, Path(spec["path"]), self.config.checkpoint.format,
                                        device_type(self.device))
            hashes = hashing.result()
        del saved
        seconds = time.perf_counter() - t0
        self.add("save_again_s", seconds)
        return dict(timing.to_manifest(), hashes=hashes, seconds=seconds)


# The restoring processes' host memory on an accelerator: torch's CPU allocator advises transparent
# huge pages for large buffers, so reading a 48 GB checkpoint takes some 24 thousand page faults
# instead of 12 million (1.8x the read on an H100 host: benchmarks/host_copy.py). Not on a CPU
# trial, where the training itself runs on that memory; a value set in the environment is kept.
THP_ENV = "THP_MEM_ALLOC_ENABLE"  # torch reads it once a process; only "1" turns huge pages on
MAPPED_READ = "the second resume maps its checkpoint (torch.load mmap): it writes none after"


def reader_env(env: Mapping[str, str], device: Any, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """``env`` for a process that reads a checkpoint back: with huge pages where they apply."""
    if device_type(device) == "cpu" or THP_ENV in environ:
        return dict(env)
    return dict(env, **{THP_ENV: "1"})


def host_memory(device: Any, environ: Mapping[str, str] = os.environ) -> str:
    """How this (restoring) process allocates host memory, in words, for the manifest: from its
    own environment, as torch reads it."""
    if device_type(device) == "cpu":
        return "default (a CPU trial)"
    value = environ.get(THP_ENV)
    if value == "1":
        return f"huge pages ({THP_ENV}=1)"
    return "default" if value is None else f"default ({THP_ENV}={value[:16]!r} as set)"


def _read(job: Mapping[str, Any], config: Any, k: int, timings: dict[str, float], mmap: bool = False) -> dict[str, Any]:
    t0 = time.perf_counter()
    host = checkpoint_io.load(Path(job["checkpoint"]), config.checkpoint.format, mmap)  # the one read of the file
    if int(host.get("step", -1)) != k:
        raise RuntimeError(f"checkpoint is from step {host.get('step')}, expected {k}")
    # Every later restore uses the host copy: the file goes now, so that the next checkpoint (the
    # resumed run's, at k2) has its disk. Two full checkpoints of an 8B model with AdamW are 90 GB.
    checkpoint_io.remove(Path(job["checkpoint"]))
    timings["read_s"] = timings.get("read_s", 0.0) + time.perf_counter() - t0
    return host


def _state_check(r: Restorer, k: int, applicable: Sequence[str]) -> dict[str, str]:
    t0 = time.perf_counter()
    live = state.capture_state(r.workload, r.device, k, r.plan.adapter_only)
    restored = state.component_hashes(live, applicable)
    del live
    r.add("state_check_s", time.perf_counter() - t0)
    return restored


def _pinned(host: dict[str, Any], device: Any) -> dict[str, Any]:
    """The host copy in page-locked memory on CUDA (each restore then copies at full PCIe speed);
    as it was when pinning fails (a host short of lockable memory). ``device`` is made current
    first: this runs in a thread of its own."""
    if device_type(device) != "cuda":
        return host
    import torch

    try:
        with torch.cuda.device(device):
            return state.pin(host)
    except RuntimeError:
        return host


def _pinned_timed(host: dict[str, Any], device: Any) -> tuple[dict[str, Any], float]:
    """:func:`_pinned` and how long it took."""
    t0 = time.perf_counter()
    host = _pinned(host, device)
    return host, time.perf_counter() - t0


def _rng_hashes(device: Any) -> dict[str, str]:
    """A hash per RNG stream of this process (reading a state does not advance it)."""
    return {c: state.value_hash(v) for c, v in state.capture_rng(device).items()}


def _same(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return (a["losses"], a["param_hash"], a["optimizer_hash"]) == (b["losses"], b["param_hash"], b["optimizer_hash"])


def run_restore(r: Restorer, job: Mapping[str, Any]) -> dict[str, Any]:
    """The first fresh process: restore, check the state before any step, continue (saving again
    at k2), the band, the sensitivity pass; every restore from the one host copy."""
    k, n = int(job["save_at_step"]), int(job["total_steps"])
    withhold = list(job.get("withhold", []))
    t0 = time.perf_counter()
    host = _read(job, r.config, k, r.timings)
    missing = r.restore(host, withhold)
    load_s = time.perf_counter() - t0
    restored = _state_check(r, k, job.get("applicable", state.COMPONENTS))
    check = r.base_check()
    out: dict[str, Any] = {"restore_load_s": load_s, "restored_hashes": restored, "missing": missing,
                           "base": check.to_json() if check is not None else None, "built_early": r.built_early,
                           "host_memory": host_memory(r.device)}
    saved = job.get("saved_hashes", {})
    expected = job.get("base_expected")
    base_bad = check is not None and expected is not None and not check.equal(base.Expectation.from_json(expected))
    if base_bad or any(restored.get(c) != h for c, h in saved.items() if c in restored and c not in withhold):
        out["continuations"] = []  # an incomplete restore: no step is run
        return out
    step_times: list[float] = []
    t_runs = time.perf_counter()
    save_again = job.get("save_again")
    if save_again is not None:
        save_again = dict(save_again, steps=int(save_again["step"]) - k)
    streams = _rng_hashes(r.device)
    # The host copy is not read again before the band's restores: it is pinned beside the first
    # continuation (which saves again at k2), not after it; pinning 48 GB takes about 27 s.
    with ThreadPoolExecutor(1, thread_name_prefix="pin") as pool:
        pinning = pool.submit(_pinned_timed, host, r.device)
        first = r.continue_to(n - k, None, save_again, step_times)
        t1 = time.perf_counter()
        host, pin_s = pinning.result()
    r.add("pin_wait_s", time.perf_counter() - t1)
    r.add("pin_s", pin_s)
    # A stream the continuation never drew from cannot change it when perturbed: no restore needed.
    undrawn = {c for c, h in _rng_hashes(r.device).items() if streams.get(c) == h}
    out["saved_again"] = first.pop("saved_again", None)
    runs = [first]
    for _ in range(2):  # the band: two continuations from the same state; a third when they differ
        r.restore(host, withhold)
        runs.append(r.continue_to(n - k, None, step_times=step_times))
        if _same(runs[-1], runs[0]):
            break
    out["continuations"] = runs
    out["continuation_step_time_s"] = step_times
    r.add("continuations_s", time.perf_counter() - t_runs)
    deterministic = all(_same(x, runs[0]) for x in runs)
    reference = job.get("reference_losses")
    t_sens = time.perf_counter()
    if job.get("sensitivity"):
        out["sensitivity"] = {}
    for c in job.get("sensitivity", []):
        if c in undrawn:
            out["sensitivity"][c] = {"undrawn": True}
            continue
        try:
            r.restore(host, [c])
            variant = r.continue_to(n - k, reference if deterministic else None)
            variant.pop("batches", None)
            out["sensitivity"][c] = variant
        except Exception as exc:
            out["sensitivity"][c] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
    if job.get("sensitivity"):
        r.add("sensitivity_s", time.perf_counter() - t_sens)
    return out


def run_resume_again(r: Restorer, job: Mapping[str, Any]) -> dict[str, Any]:
    """The second fresh process: restore what the first resumed run wrote at k2, check, continue."""
    k2, n = int(job["save_at_step"]), int(job["total_steps"])
    t0 = time.perf_counter()
    host = _read(job, r.config, k2, r.timings, mmap=True)  # MAPPED_READ
    missing = r.restore(host, [])
    load_s = time.perf_counter() - t0
    restored = _state_check(r, k2, job.get("applicable", state.COMPONENTS))
    out: dict[str, Any] = {"restore_load_s": load_s, "restored_hashes": restored, "missing": missing,
                           "built_early": r.built_early}
    saved = job.get("saved_hashes", {})
    if any(restored.get(c) != h for c, h in saved.items() if c in restored):
        return out
    out["continuation"] = r.continue_to(n - k2, None)
    return out

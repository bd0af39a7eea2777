"""Stage 5 of the trial: prove that a checkpoint restores in a new process, as training resumes (guide section 6).

A successful save proves nothing. This stage (the runs themselves: capture.trial.recover_steps):

1. runs the workload uninterrupted for ``total_steps``, saving after ``save_at_step`` (k) what
   the user's run saves, in the format the config names (capture.trial.checkpoint_io): the model
   (a LoRA run: its adapter only), optimizer, LR scheduler, grad scaler, the RNG states of python
   ``random``, numpy, torch CPU and every CUDA/ROCm device, the data-loader position; each
   component is hashed (capture.trial.state.component_hashes). The loader starts near the end of
   an epoch, so that it wraps into the next one after the save (capture.trial.data_order);
2. restores that checkpoint in a fresh interpreter (``python -m capture.trial._recover_worker``)
   and, **before any step**, hashes every restored component and compares it with what was
   saved; a LoRA run's base, which is not in the checkpoint, is verified there too
   (capture.trial.base). A checkpoint that lacks a part is caught here and no step is run;
3. continues to ``total_steps`` twice from that state (three times when the two differ): the
   spread of those continuations is the run-to-run band; the verdict against the uninterrupted
   run is bit-exact, within the band, or diverged beyond it. The first continuation saves again
   at k2 (midway), as a resumed run writes its next checkpoint; a second fresh process restores
   that one and continues: the second resume. Both resumes' batches (sha256 of each micro-batch's
   input ids, per step) are compared with the uninterrupted run's, across the epoch boundary;
4. runs the sensitivity pass in the first fresh process, from the host copy of the checkpoint
   read once: one restore per component with that component withheld. A component is one the
   continuation *depends* on when withholding it moves the losses by more than ``BAND_MARGIN``
   times the band (with a band of 0: by anything at all, losses or final state).

Fast by design: each fresh process builds its workload once, while the reference runs when the
device has the memory for it, and reloads the state into it for every restore (a frozen base is
built and verified once); the base's files are hashed while the process starts; the checkpoint
is read once. ``[trial.recovery.phases]`` says where the time went, and the stage prints it.

Deterministic mode (``[trial.recovery] deterministic``, ``--recovery-deterministic``): the
reference then also runs in a fresh process, and the processes start with
``CUBLAS_WORKSPACE_CONFIG=:4096:8`` in their environment (before CUDA initialises),
``torch.use_deterministic_algorithms(True)``, ``cudnn.deterministic = True`` and
``cudnn.benchmark = False``. The trial's own measured steps keep the user's settings. An op
without a deterministic implementation makes torch raise; the stage then names the op and runs
again with the user's settings, judged by the band.

A withheld component is *perturbed*, not merely skipped (see capture.trial.state.restore_state).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from capture.errors import ConfigError
from capture.termtable import say_wrapped
from capture.trial import base, checkpoint_io
from capture.trial import recover_judge as rj
from capture.trial.recover_judge import (  # noqa: F401  (the stage's vocabulary, used by the scaling step and tests)
    BAND_MARGIN, BIT_EXACT, compare_run, first_divergence, judge, max_loss_diff, run_to_run_band, verdict_text)
from capture.trial.recover_memory import MemoryBudget, budget_from_trial  # noqa: F401  (the stage's, tests')
from capture.trial.recover_steps import (  # noqa: F401
    BASELINE, BASELINE_NAME, MAPPED_READ, ON_GO, PLAN, Plan, Reference, reader_env, run_reference,
    second_save_step)
from capture.trial.state import COMPONENTS, device_type
from capture.trial.worker_proc import Worker, WorkerFailed  # noqa: F401

log = logging.getLogger(__name__)

DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
_DETERMINISTIC_CUBLAS = (":4096:8", ":16:8")
_NO_DETERMINISTIC_OP = re.compile(r"^(?:RuntimeError: )?(\S+) does not have a deterministic implementation")


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class GlobalSettings:
    """Process-wide torch settings that change numerics; a fresh process must match them."""

    num_threads: int
    deterministic_algorithms: bool
    deterministic_warn_only: bool
    cudnn_deterministic: bool
    cudnn_benchmark: bool
    matmul_allow_tf32: bool
    cudnn_allow_tf32: bool

    @classmethod
    def current(cls) -> GlobalSettings:
        import torch

        return cls(
            num_threads=torch.get_num_threads(),
            deterministic_algorithms=torch.are_deterministic_algorithms_enabled(),
            deterministic_warn_only=torch.is_deterministic_algorithms_warn_only_enabled(),
            cudnn_deterministic=bool(torch.backends.cudnn.deterministic),
            cudnn_benchmark=bool(torch.backends.cudnn.benchmark),
            matmul_allow_tf32=bool(torch.backends.cuda.matmul.allow_tf32),
            cudnn_allow_tf32=bool(torch.backends.cudnn.allow_tf32),
        )

    def deterministic(self) -> GlobalSettings:
        return dataclasses.replace(self, deterministic_algorithms=True, deterministic_warn_only=False,
                                   cudnn_deterministic=True, cudnn_benchmark=False)

    def apply(self) -> None:
        import torch

        torch.set_num_threads(self.num_threads)
        torch.use_deterministic_algorithms(self.deterministic_algorithms, warn_only=self.deterministic_warn_only)
        torch.backends.cudnn.deterministic = self.cudnn_deterministic
        torch.backends.cudnn.benchmark = self.cudnn_benchmark
        torch.backends.cuda.matmul.allow_tf32 = self.matmul_allow_tf32
        torch.backends.cudnn.allow_tf32 = self.cudnn_allow_tf32


@dataclass(frozen=True)
class Determinism:
    """What the recovery check runs under, and why."""

    enabled: bool
    requested: str
    """"auto", "true" or "false" (from the config or --recovery-deterministic)."""
    reason: str
    env: dict[str, str]

    def to_manifest(self) -> dict[str, Any]:
        out: dict[str, Any] = {"enabled": self.enabled, "requested": self.requested, "reason": self.reason}
        if self.enabled:
            out["settings"] = ["torch.use_deterministic_algorithms(True)", "torch.backends.cudnn.deterministic = True",
                               "torch.backends.cudnn.benchmark = False"]
            out["environment"] = dict(self.env)
            out["scope"] = "the recovery reference and restore processes only; the measured steps keep the run's settings"
        return out


def resolve_determinism(requested: bool | None, device: Any, outer: GlobalSettings,
                        environ: Mapping[str, str] | None = None) -> Determinism:
    environ = os.environ if environ is None else environ
    word = "auto" if requested is None else str(bool(requested)).lower()
    env: dict[str, str] = {}
    if requested is False:
        return Determinism(False, word, "off as configured: the verdict is judged against the run-to-run band", env)
    if requested is None and device_type(device) != "cuda":
        return Determinism(False, word, "auto: off on a CPU (its kernels are deterministic for a fixed thread count)", env)
    if environ.get("CUBLAS_WORKSPACE_CONFIG") not in _DETERMINISTIC_CUBLAS:
        env.update(DETERMINISTIC_ENV)
    reason = ("on as configured" if requested else
              "auto: on for a GPU, so that the verdict can be bit-exact while the measured steps keep the run's settings")
    if outer.deterministic_algorithms:
        reason = "the run itself uses deterministic algorithms"
    return Determinism(True, word, reason, env)


def _early(plan: Plan, budget: MemoryBudget | None, device: Any) -> bool:
    if plan.early_build is not None:
        return plan.early_build
    if budget is not None:
        return budget.fits_early_build()
    return device_type(device) == "cpu"  # without figures, only where memory is the host's


# --------------------------------------------------------------------------- the stage


def _recovery_settings(config: Any) -> tuple[int, int, tuple[str, ...], bool, int]:
    rec = config.recovery
    k, n = int(rec.save_at_step), int(rec.total_steps)
    withhold = tuple(rec.withhold or ())
    if not 1 <= k < n:
        raise ConfigError(f"recovery.save_at_step = {k} must be at least 1 and below recovery.total_steps = {n}",
                          "set e.g. save_at_step = 4 and total_steps = 8 in [recovery]")
    unknown = sorted(set(withhold) - set(COMPONENTS))
    if unknown:
        raise ConfigError(f"recovery.withhold names unknown component(s): {', '.join(unknown)}",
                          f"choose from: {', '.join(COMPONENTS)}")
    return k, n, withhold, bool(rec.sensitivity), int(config.seed)


def config_to_dict(config: Any) -> dict[str, Any]:
    """The TrialConfig as JSON-safe data, overrides included, for the fresh process to rebuild."""
    return dataclasses.asdict(config)


def config_from_dict(cls: Any, data: Mapping[str, Any]) -> Any:
    """Rebuild a (nested, frozen) config dataclass from :func:`config_to_dict` output after JSON."""
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        value = data[f.name]
        ftype = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default) and isinstance(value, Mapping):
            value = config_from_dict(type(default), value)
        elif isinstance(value, list) and "tuple" in ftype:
            value = tuple(value)
        kwargs[f.name] = value
    return cls(**kwargs)


def no_deterministic_op(reason: str) -> str | None:
    """The op named by torch's "X does not have a deterministic implementation" error, if that is the reason."""
    m = _NO_DETERMINISTIC_OP.match(reason)
    return m.group(1) if m else None


def run_recoverability(config: Any, device: Any, workdir: Path, timeout_s: float | None = 1800,
                       sensitivity: bool | None = None, leave_out: Sequence[str] = (), plan: Plan = PLAN,
                       budget: MemoryBudget | None = None, models: Any = None,
                       progress: Callable[[str], None] | None = None,
                       early: EarlyWorkers | None = None) -> dict[str, Any]:
    """Run the whole stage and return the ``[trial.recovery]`` table (layout: docs/trial.md).

    ``models``: the fingerprint's ``[[models]]`` (a LoRA base's recorded files); ``budget``: the
    trial's measured memory (early builds); ``progress``: where the phase table is printed;
    ``early``: fresh processes from :func:`start_early` (stopped here in any case)."""
    t_start = time.perf_counter()
    k, n, withhold, configured, seed = _recovery_settings(config)
    sensitivity = configured if sensitivity is None else sensitivity
    workdir = Path(workdir) / "recovery"
    workdir.mkdir(parents=True, exist_ok=True)
    outer = GlobalSettings.current()
    det = resolve_determinism(config.recovery.deterministic, device, outer)
    expected, base_skipped = None, None
    try:
        expected = base.expect(config, models) if plan.adapter_only else None
    except Exception as exc:  # the base's files cannot be listed: the rest of the check still runs
        base_skipped = f"the base cannot be verified: {type(exc).__name__}: {exc}".splitlines()[0]
    if budget is not None and budget.warning is not None and progress is not None:
        say_wrapped(f"recovery: {budget.warning}", progress)
    if budget is not None and budget.refusal is not None:  # a CPU's: the kernel would kill the restoring process
        if early is not None:
            early.stop()
        if progress is not None:
            say_wrapped(f"recovery: skipped: {budget.refusal}", progress)
        _cleanup(workdir)
        return {"skipped": f"the restoring process does not fit the host's memory: {budget.refusal}",
                "memory_budget": budget.to_manifest()}
    overlap = budget is None or budget.fits_overlap()
    if not overlap and early is not None:  # their imports would take what the restoring process needs
        early.stop()
        early = None
    args = (config, device, workdir, outer, k, n, withhold, sensitivity, seed, leave_out, timeout_s, plan,
            _early(plan, budget, device), expected, overlap)
    try:
        table = _attempt(det, *args, early=early)
        op = no_deterministic_op(str(table.get("verdict", "")).removeprefix("failed: "))
        if det.enabled and op is not None:
            log.warning("recovery: %s has no deterministic implementation; running again with the run's settings", op)
            off = Determinism(False, det.requested, f"fell back: {op} has no deterministic implementation", {})
            table = _attempt(off, *args)
            table["deterministic"]["fallback_op"] = op
        if budget is not None:  # whichever attempt the table is, it was planned by this budget
            table["memory_budget"] = budget.to_manifest()
    finally:
        outer.apply()
        if early is not None:
            early.stop()
    if base_skipped:
        table["base_model"] = {"skipped": base_skipped}
    table["elapsed_s"] = time.perf_counter() - t_start
    table["phases"]["total_s"] = table["elapsed_s"]
    if progress is not None:
        for line in phase_text(table["phases"]).splitlines():
            progress(line)
    if not str(table.get("verdict", "")).startswith("failed"):
        _cleanup(workdir)
    return table


def _setup(config: Any, device: Any, seed: int, settings: GlobalSettings, plan: Plan, role: str,
           **extra: Any) -> dict[str, Any]:
    return dict({"config": config_to_dict(config), "device": str(device), "seed": seed,
                 "settings": dataclasses.asdict(settings), "plan": plan.to_json(), "role": role}, **extra)


def _worker_settings(outer: GlobalSettings, device: Any, det: Determinism) -> GlobalSettings:
    settings = outer
    if device_type(device) == "cpu":
        # Half the cores each, so a worker's start-up overlaps the other process instead of
        # fighting it (busy-waiting OpenMP threads slow down badly when oversubscribed); the
        # count only has to be the same on both sides for the results to be comparable.
        settings = dataclasses.replace(outer, num_threads=max(1, outer.num_threads // 2))
    return settings.deterministic() if det.enabled else settings


WITH_STEPS = "with the measured steps"
AFTER_STEPS = "when the measured steps ended"


def early_start(device: Any, cores: int | None = None, process_figures: bool = True) -> str:
    """When the trial starts the recovery stage's fresh processes (:func:`start_early`).

    On an accelerator with cores to spare, with the measured steps: they wait on the device, and
    the processes only import (on cores of their own) and touch no device memory before their
    work, so their 10-20 s of imports are off the stage's path (at 8B they were longer than validation,
    checkpoint and fit together). On a CPU, or with fewer than four cores, when the steps end:
    there the imports would take cores from the steps being measured. Likewise where the device
    has no per-process memory figure (``process_figures``: the trial's reading would then be the
    device's, and count a second process)."""
    cores = os.cpu_count() if cores is None else cores
    spare = device_type(device) != "cpu" and (cores or 1) >= 4 and process_figures
    return WITH_STEPS if spare else AFTER_STEPS


@dataclass
class EarlyWorkers:
    """The stage's fresh processes, started before it (:func:`start_early`) so that their imports
    overlap other work: the reference (deterministic checks) and the first restoring process,
    which waits for its go-ahead before it touches files or the device."""

    reference: Worker | None = None
    restore: Worker | None = None

    def workers(self) -> dict[str, Worker]:
        return {name: w for name, w in (("reference", self.reference), ("restore", self.restore)) if w is not None}

    def stop(self) -> None:
        for w in self.workers().values():
            w.stop()


def start_early(config: Any, device: Any, workdir: Path, models: Any = None, plan: Plan = PLAN,
                when: str = AFTER_STEPS) -> EarlyWorkers | None:
    """The stage's fresh processes, started before it (``when``: see :func:`early_start`):
    they only import until the stage gives them their work, and touch no device memory before.
    None where there is nothing to start. The caller decides that the stage will run and stops
    them in ``finally``; :func:`run_recoverability` takes them (``early=``) and uses each only
    where its setup is exactly the one the stage would give a fresh one."""
    outer = GlobalSettings.current()
    det = resolve_determinism(config.recovery.deterministic, device, outer)
    folder = Path(workdir) / "recovery"
    folder.mkdir(parents=True, exist_ok=True)
    early = EarlyWorkers()
    try:
        if det.enabled:
            early.reference = Worker("reference", _reference_setup(config, device, outer, det, plan), folder,
                                     det.env, started=when)
        try:
            expected = base.expect(config, models) if plan.adapter_only else None
        except Exception:  # the stage says why the base cannot be verified; its process starts then
            return early if early.workers() else None
        _, _, withhold, sensitivity, seed = _recovery_settings(config)
        early.restore = Worker("restore", _restore_setup(config, device, seed, _worker_settings(outer, device, det),
                                                         plan, expected, withhold, sensitivity), folder,
                               reader_env(det.env, device), started=when)
    except BaseException:  # nobody else holds them yet: a process already started must not outlive this
        early.stop()
        raise
    return early


def _reference_setup(config: Any, device: Any, outer: GlobalSettings, det: Determinism, plan: Plan) -> dict[str, Any]:
    """The setup of the reference's fresh process: the same for one started early and one started by the stage."""
    return _setup(config, device, _recovery_settings(config)[4], _worker_settings(outer, device, det), plan,
                  "reference")


def _restore_setup(config: Any, device: Any, seed: int, settings: GlobalSettings, plan: Plan,
                   expected: base.Expectation | None, withhold: Sequence[str], sensitivity: bool) -> dict[str, Any]:
    """The first restoring process's setup, its early build left to the go-ahead (ON_GO): the
    same for one started early and one started by the stage."""
    snapshot = ["optimizer", "scheduler", "scaler", "data_position"]
    if "model" in withhold or sensitivity:
        snapshot.append("model")
    return _setup(config, device, seed, settings, plan, "restore", early_build=ON_GO,
                  base=expected.to_json() if expected else None, snapshot=snapshot)


def _adopt(early: EarlyWorkers | None, name: str, wanted: Mapping[str, Any], workdir: Path,
           env: Mapping[str, str]) -> Worker | None:
    """The process started early for ``name``, if it is still alive and set up exactly as the
    stage would set up a fresh one; else None (and it is stopped)."""
    worker = early.workers().get(name) if early is not None else None
    if worker is None:
        return None
    if worker.setup == dict(wanted) and worker.env == dict(env) and worker.out.parent == workdir \
            and worker.proc.poll() is None:
        return worker
    worker.stop()
    return None


def _attempt(det: Determinism, config: Any, device: Any, workdir: Path, outer: GlobalSettings, k: int, n: int,
             withhold: tuple[str, ...], sensitivity: bool, seed: int, leave_out: Sequence[str],
             timeout_s: float | None, plan: Plan, build_early: bool, expected: base.Expectation | None,
             overlap: bool = True, early: EarlyWorkers | None = None) -> dict[str, Any]:
    fmt = config.checkpoint.format
    checkpoint = workdir / checkpoint_io.file_name(fmt)
    settings = _worker_settings(outer, device, det)
    k2 = second_save_step(k, n) if plan.resume_again and not withhold and not leave_out else None
    table: dict[str, Any] = {"save_at_step": k, "total_steps": n, "fresh_process": True, "withheld": list(withhold),
                             "deterministic_algorithms": settings.deterministic_algorithms,
                             "deterministic": det.to_manifest(), "checkpoint_format": fmt,
                             "plan": {"checkpoint": "adapter" if plan.adapter_only and config.method == "lora" else "full",
                                      "restore": "one build, reloaded per restore" if plan.reload else
                                                 "a fresh build per restore",
                                      "early_build": build_early,
                                      "fresh_processes": "started while another trains" if overlap else
                                                         "each started when the one before it ended (memory)"}}
    if fmt == "torch.save" and k2 is not None:
        table["plan"]["second_read"] = MAPPED_READ
    if device_type(device) == "cpu":
        table["cpu_threads"] = settings.num_threads
    phases: dict[str, Any] = {}
    table["phases"] = phases
    restore_setup = _restore_setup(config, device, seed, settings, plan, expected, withhold, sensitivity)
    readers = reader_env(det.env, device)  # the environment of both processes that read a checkpoint back
    restore = _adopt(early, "restore", restore_setup, workdir, readers)
    if restore is not None:  # imported already: it goes on to its early build (or waits for its job)
        restore.go({"early_build": build_early})
        phases["restore_started"] = restore.started
        phases["restore_head_start_s"] = restore.head_start_s()
    elif overlap:
        restore = Worker("restore", dict(restore_setup, early_build=build_early), workdir, readers)
    again: Worker | None = None
    try:
        log.info("recovery: uninterrupted run of %d steps, checkpoint after step %d", n, k)
        t0 = time.perf_counter()
        if det.enabled:  # a fresh process, so that the environment is there before CUDA starts
            wanted = _reference_setup(config, device, outer, det, plan)
            ref_worker = _adopt(early, "reference", wanted, workdir, det.env)
            if ref_worker is not None:
                phases["reference_started_early"] = True
                phases["reference_started"] = ref_worker.started
            else:
                ref_worker = Worker("reference", wanted, workdir, det.env)
            try:
                ref_worker.start_job({"kind": "reference", "checkpoint": str(checkpoint), "save_at_step": k,
                                      "total_steps": n, "leave_out": list(leave_out), "second_save_at_step": k2})
                ref_result = ref_worker.result(timeout_s)
                ref = Reference(**ref_result["reference"])
            except WorkerFailed as exc:
                table["verdict"] = f"failed: {exc.reason}"
                return table
            finally:
                ref_worker.stop()
            head_start = ref_worker.head_start_s()  # from its start to its job: the time its imports had
            if head_start is not None:
                phases["reference_head_start_s"] = head_start
            wait = ref_worker.job_wait_s(ref_result)  # what its imports still cost (0 when it started early enough)
            if wait is not None:
                phases["reference_start_wait_s"] = wait
        else:
            settings.apply()
            try:
                ref = run_reference(config, device, checkpoint, k, n, leave_out, plan, k2)
            finally:
                outer.apply()
        phases["reference_wall_s"] = time.perf_counter() - t0
        if expected is not None and expected.kind == base.REBUILT:
            expected = dataclasses.replace(expected, digest=ref.base_digest)
        applicable = [c for c in COMPONENTS if ref.applicability[c] is None]
        table.update(rj.reference_table(ref, withhold, leave_out))
        log.info("recovery: restoring in a fresh process%s", f", then {len(applicable)} sensitivity variants"
                 if sensitivity else "")
        save_again = ({"step": k2, "path": str(workdir / ("again-" + checkpoint_io.file_name(fmt)))}
                      if k2 is not None else None)
        t0 = time.perf_counter()
        if restore is None:  # not beside the reference: the memory is not there for both
            restore = Worker("restore", dict(restore_setup, early_build=False), workdir, readers)
        restore.start_job({"kind": "restore", "checkpoint": str(checkpoint), "save_at_step": k, "total_steps": n,
                           "withhold": list(withhold), "saved_hashes": ref.saved_hashes, "applicable": applicable,
                           "reference_losses": ref.losses[k:], "sensitivity": applicable if sensitivity else [],
                           "base_expected": expected.to_json() if expected else None, "save_again": save_again})
        def second(early_build: bool) -> Worker:
            return Worker("resume-again", _setup(config, device, seed, settings, plan, "resume_again",
                                                 early_build=early_build, snapshot=[]), workdir, readers)

        if k2 is not None and overlap:  # started now, so that its imports (and build) overlap the first restore
            again = second(build_early)
        try:
            result = restore.result(timeout_s)
        except WorkerFailed as exc:
            table["verdict"] = f"failed: {exc.reason}"
            log.warning("recovery: restore failed (%s)", exc.reason)
            return table
        phases["restore_wall_s"] = time.perf_counter() - t0
        table["plan"]["host_memory"] = result.get("host_memory")  # as the restoring process had it
        started = restore.start_s(result)
        if started is not None:
            phases["worker_start_s"] = started
        # Its job is done: its device memory and host copy go before the second resume builds
        # and reads (two full 8B workloads do not fit one 80 GB card).
        restore.stop()
        again_result = None
        if k2 is not None and result.get("saved_again"):
            assert save_again is not None  # both exist exactly when k2 is not None
            t0 = time.perf_counter()
            again = again or second(False)
            again.start_job({"kind": "resume_again", "checkpoint": save_again["path"], "save_at_step": k2,
                             "total_steps": n, "saved_hashes": result["saved_again"]["hashes"],
                             "applicable": applicable})
            try:
                again_result = again.result(timeout_s)
            except WorkerFailed as exc:
                again_result = {"error": exc.reason}
            phases["second_resume_s"] = time.perf_counter() - t0  # the parent's wait: what it adds to the stage
    finally:
        for worker in (restore, again):
            if worker is not None:
                worker.stop()
    assert restore is not None  # started before its job, which every path past the reference gives it
    base_row = base.row(expected, base.Check(**result["base"]) if result.get("base") else None) if expected else None
    table.update(rj.restore_table(ref, result, withhold, k, base_row))
    if expected is not None:
        table["base_model"] = base.table(expected, base.Check(**result["base"]) if result.get("base") else None)
    why_not = ("components are withheld or left out on purpose" if withhold or leave_out else
               "needs recovery.total_steps >= save_at_step + 2" if plan.resume_again else "not part of this plan")
    _second_resume(table, ref, result, again_result, k, k2, why_not)
    phases.update(_phases(ref, result))
    wait = restore.job_wait_s(result)
    if wait:
        phases["worker_start_wait_s"] = wait
        phases["overlapped"].remove("worker_start")
    go_wait = restore.go_wait_s(result)  # what its imports still cost, when it was started early
    if go_wait is not None:
        phases["restore_start_wait_s"] = go_wait
    return table


def _second_resume(table: dict[str, Any], ref: Reference, result: Mapping[str, Any],
                   again_result: Mapping[str, Any] | None, k: int, k2: int | None, why_not: str) -> None:
    if table.get("verdict_kind") == "state_differs" or not result.get("continuations"):
        return
    again = None
    if k2 is None:
        table["resume_again"] = {"skipped": why_not}
    elif again_result is None or "error" in (again_result or {}):
        reason = (again_result or {}).get("error", "the first resume wrote no checkpoint")
        table["resume_again"] = {"save_at_step": k2, "verdict": f"failed: {reason}", "verdict_kind": "failed"}
    else:
        again = rj.resume_again_table(ref, result["saved_again"], again_result, k2, table.get("run_to_run_band", 0.0))
        table["resume_again"] = again
    order = rj.data_order_table(ref, k, result["continuations"][0], k2,
                                (again_result or {}).get("continuation") if again is not None else None)
    table["data_order"] = order
    rj.overall(table, again, order)


def _phases(ref: Reference, result: Mapping[str, Any]) -> dict[str, Any]:
    """Where the stage's time went, per sub-phase (seconds; ``overlapped`` names those that ran
    while another process worked, so they cost no wall time of their own)."""
    t = result.get("timings", {})
    out: dict[str, Any] = {
        "reference_s": ref.timings.get("build_s", 0.0) + ref.timings.get("steps_s", 0.0)
        + ref.timings.get("final_hash_s", 0.0),
        "save_s": ref.timings.get("save_s", 0.0),
        "restore_build_s": t.get("build_s", 0.0),
        "base_verify_s": t.get("base_verify_s", 0.0),
        "restore_s": t.get("read_s", 0.0) + t.get("restore_s", 0.0) + t.get("state_check_s", 0.0),
        "continuations_s": t.get("continuations_s", 0.0),
        "sensitivity_s": t.get("sensitivity_s", 0.0),
    }
    overlapped = ["worker_start"]
    if result.get("built_early"):
        overlapped.append("restore_build")
    if t.get("base_verify_s", 0.0) > t.get("base_verify_wait_s", 0.0) + 1e-3:
        overlapped.append("base_verify")
    out["base_verify_wait_s"] = t.get("base_verify_wait_s", 0.0)
    out["overlapped"] = overlapped
    return out


PHASE_ORDER = ("reference", "save", "worker_start", "restore_build", "base_verify", "restore", "continuations",
               "second_resume", "sensitivity", "total")


def phase_text(phases: Mapping[str, Any]) -> str:
    """The phase table as printed on stderr: one line per sub-phase."""
    overlapped = set(phases.get("overlapped", ()))
    lines = ["recovery phases (seconds):"]
    for name in PHASE_ORDER:
        value = phases.get(f"{name}_s")
        if isinstance(value, (int, float)):
            note = "  (overlapped with the reference)" if name in overlapped else ""
            lines.append(f"  {name.replace('_', ' '):16s} {value:8.2f}{note}")
    return "\n".join(lines)


def _cleanup(workdir: Path) -> None:
    for p in workdir.iterdir():
        if p.is_dir():
            checkpoint_io.remove(p)
        elif p.suffix in (".pt", ".json", ".txt", ".safetensors"):
            p.unlink()
    try:
        workdir.rmdir()
    except OSError:
        pass

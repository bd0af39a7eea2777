"""Stage 5 of the trial: prove that a checkpoint restores in a new process (guide section 6).

A successful save proves nothing. This stage:

1. runs the workload uninterrupted for ``total_steps``, saving the FULL training state after
   ``save_at_step`` (model, optimizer, LR scheduler, grad scaler, the RNG states of python
   ``random``, numpy, torch CPU and every CUDA/ROCm device, the data-loader position) in the
   format the config names (capture.trial.checkpoint_io), and hashing every component of what
   it saved (capture.trial.state.component_hashes);
2. restores that checkpoint in a fresh interpreter (``python -m capture.trial._recover_worker``)
   and, **before any step**, hashes every restored component and compares it with what was
   saved: the headline of the stage, independent of kernel determinism. A checkpoint that lacks
   a part is caught here and no step is run;
3. continues to ``total_steps`` twice from that state (three times when the two differ): the
   spread of those continuations is the run-to-run band; the verdict against the uninterrupted
   run is bit-exact, within the band, or diverged beyond it;
4. runs the sensitivity pass in the same fresh process, from the host copy of the checkpoint
   loaded once: one restore per component with that component withheld. A component is one the
   continuation *depends* on when withholding it moves the losses by more than ``BAND_MARGIN``
   times the band (with a band of 0: by anything at all, losses or final state).

Deterministic mode (``[trial.recovery] deterministic``, ``--recovery-deterministic``): the
reference then also runs in a fresh process, and both processes start with
``CUBLAS_WORKSPACE_CONFIG=:4096:8`` in their environment (before CUDA initialises),
``torch.use_deterministic_algorithms(True)``, ``cudnn.deterministic = True`` and
``cudnn.benchmark = False``. The trial's own measured steps keep the user's settings. An op
without a deterministic implementation makes torch raise; the stage then names the op and runs
again with the user's settings, judged by the band.

A withheld component is *perturbed*, not merely skipped (see capture.trial.state.restore_state).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from capture.errors import ConfigError
from capture.trial import checkpoint_io, state
from capture.trial.state import COMPONENTS, device_type

log = logging.getLogger(__name__)

WORKER_MODULE = "capture.trial._recover_worker"
BIT_EXACT = "bit-exact"
BAND_MARGIN = 10.0
"""A difference is inside the run-to-run band when at most BAND_MARGIN × the band (the band is
measured from two or three continuations only, so it is a low estimate of the spread)."""
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


# --------------------------------------------------------------------------- comparing


def first_divergence(reference: Sequence[float], resumed: Sequence[float], first_step: int) -> tuple[int | None, float]:
    """(1-based global step of the first loss that differs, resumed − reference there)."""
    for i, (a, b) in enumerate(zip(reference, resumed)):
        if a != b and not (math.isnan(a) and math.isnan(b)):
            return first_step + i, b - a
    return None, 0.0


def compare_run(reference_losses: Sequence[float], reference_hashes: tuple[str, str], losses: Sequence[float],
                hashes: tuple[str, str], save_at_step: int) -> tuple[int | None, float, bool]:
    """(diverged_at_step or None, loss_diff, every loss equal) of a resumed run against the reference.

    ``reference_losses`` covers the steps after ``save_at_step``. Equal losses with a different
    final state count as a divergence at the last step.
    """
    step, diff = first_divergence(reference_losses, losses, save_at_step + 1)
    losses_equal = step is None and len(losses) == len(reference_losses)
    if step is None and (not losses_equal or hashes != reference_hashes):
        step = save_at_step + len(reference_losses)
    return step, diff, losses_equal


def verdict_text(diverged_at_step: int | None, losses_equal: bool) -> str:
    if diverged_at_step is None:
        return BIT_EXACT
    if losses_equal:
        return f"diverged at step {diverged_at_step} (final state differs; every loss equal)"
    return f"diverged at step {diverged_at_step}"


def max_loss_diff(a: Sequence[float], b: Sequence[float]) -> float:
    """The largest |a_i − b_i| over the steps both ran (inf when one is NaN and the other not)."""
    worst = 0.0
    for x, y in zip(a, b):
        if math.isnan(x) or math.isnan(y):
            if not (math.isnan(x) and math.isnan(y)):
                return math.inf
            continue
        worst = max(worst, abs(x - y))
    return worst


def run_to_run_band(continuations: Sequence[Mapping[str, Any]]) -> float:
    """The largest loss difference between any two continuations from the same restored state."""
    return max((max_loss_diff(a["losses"], b["losses"]) for i, a in enumerate(continuations)
                for b in continuations[i + 1:]), default=0.0)


def judge(reference_losses: Sequence[float], reference_hashes: tuple[str, str], run: Mapping[str, Any],
          band: float, k: int) -> dict[str, Any]:
    """One continuation against the reference: kind (bit-exact | within_band | beyond_band), step, sizes."""
    step, diff, losses_equal = compare_run(reference_losses, reference_hashes, run["losses"],
                                           (run["param_hash"], run["optimizer_hash"]), k)
    size = max_loss_diff(reference_losses, run["losses"])
    out: dict[str, Any] = {"loss_diff": diff, "loss_diff_max": size}
    if step is None:
        out.update(kind="bit-exact", text=BIT_EXACT)
        return out
    out["diverged_at_step"] = step
    if band > 0 and size <= BAND_MARGIN * band:
        out.update(kind="within_band", text=f"equal within the run-to-run band (max |Δloss| {size:.3g}, "
                                            f"band {band:.3g}, margin {BAND_MARGIN:g}×)")
    elif band > 0:
        out.update(kind="beyond_band", text=f"diverged beyond the run-to-run band at step {step} "
                                            f"(max |Δloss| {size:.3g}, band {band:.3g})")
    else:
        out.update(kind="beyond_band", text=verdict_text(step, losses_equal))
        if losses_equal:
            out["note"] = "every loss equal; the final parameters or optimizer state differ"
    return out


# --------------------------------------------------------------------------- the reference


@dataclass(frozen=True)
class Reference:
    losses: list[float]
    param_hash: str
    optimizer_hash: str
    saved_hashes: dict[str, str]
    """component -> hash of the state at the save point (before anything was left out)."""
    saved: dict[str, Any]
    """checkpoint_io.SaveTiming.to_manifest() of the write."""
    applicability: dict[str, str | None]
    step_time_s: list[float]
    fresh_process: bool = False

    @property
    def hashes(self) -> tuple[str, str]:
        return self.param_hash, self.optimizer_hash

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _timed_steps(workload: Any, count: int, times: list[float]) -> list[float]:
    losses = []
    for _ in range(count):
        t0 = time.perf_counter()
        losses.append(float(workload.train_step()))  # .item() waits for the device
        times.append(time.perf_counter() - t0)
    return losses


def run_reference(config: Any, device: Any, checkpoint: Path, k: int, n: int,
                  leave_out: Sequence[str] = ()) -> Reference:
    """The uninterrupted run, saving the checkpoint after step ``k``. ``leave_out``: components
    dropped from the file after hashing (a planted incomplete checkpoint, for tests)."""
    from capture.trial.workload import build_workload

    with state.RngGuard(device):
        workload = build_workload(config, device)
        times: list[float] = []
        losses = _timed_steps(workload, k, times)
        state.sync(device)
        saved_state = state.capture_state(workload, device, k)
        saved_hashes = state.component_hashes(saved_state)
        for c in leave_out:
            saved_state.pop(c, None)
        timing = checkpoint_io.save(saved_state, checkpoint, config.checkpoint.format, device_type(device))
        del saved_state
        losses += _timed_steps(workload, n - k, times)
        state.sync(device)
        ref = Reference(losses=losses, param_hash=state.param_hash(workload.model),
                        optimizer_hash=state.optimizer_hash(workload.optimizer), saved_hashes=saved_hashes,
                        saved=timing.to_manifest(), applicability=state.applicability(workload, device),
                        step_time_s=times)
    del workload
    state.release_memory(device)  # the fresh process needs the memory this one holds
    return ref


# --------------------------------------------------------------------------- the fresh processes


class WorkerFailed(Exception):
    """A worker exited without a result; ``reason`` is its last error line."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Worker:
    """One fresh interpreter (``python -m capture.trial._recover_worker``), driven over stdin.

    It is started early with only the setup (config, device, settings), so its imports overlap
    with other work; it sees no training state until :meth:`start_job` sends the job. Two JSON
    lines in, a result file out (see _recover_worker). ``env`` is added to its environment, so it
    is there before the process initialises CUDA.
    """

    def __init__(self, name: str, setup: Mapping[str, Any], workdir: Path, env: Mapping[str, str] | None = None) -> None:
        self.name = name
        self.out = workdir / f"{name}.result.json"
        self.err = workdir / f"{name}.stderr.txt"
        environ = dict(os.environ, **(env or {}))
        package_root = str(Path(__file__).resolve().parents[2])
        environ["PYTHONPATH"] = os.pathsep.join([package_root, *filter(None, [environ.get("PYTHONPATH")])])
        with open(self.err, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", WORKER_MODULE], env=environ, stdin=subprocess.PIPE,
                                         stdout=subprocess.DEVNULL, stderr=err)
        self._send(dict(setup, out=str(self.out)))

    def _send(self, message: Mapping[str, Any]) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(message).encode() + b"\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # it died; result() reports why

    def start_job(self, job: Mapping[str, Any]) -> None:
        self._send(job)
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.close()
        except BrokenPipeError:
            pass

    def result(self, timeout_s: float | None) -> dict[str, Any]:
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            raise WorkerFailed(f"the {self.name} process ran past {timeout_s:.0f} s") from None
        result: dict[str, Any] = {}
        if self.out.exists():
            result = json.loads(self.out.read_text())
        if code != 0 or "error" in result:
            lines = [ln for ln in self.err.read_text(errors="replace").splitlines() if ln.strip()]
            raise WorkerFailed(result.get("error") or (lines[-1] if lines else f"exit status {code}"))
        return result

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


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
                       sensitivity: bool | None = None, leave_out: Sequence[str] = ()) -> dict[str, Any]:
    """Run the whole stage and return the ``[trial.recovery]`` table (layout: docs/trial.md)."""
    t_start = time.perf_counter()
    k, n, withhold, configured, seed = _recovery_settings(config)
    sensitivity = configured if sensitivity is None else sensitivity
    workdir = Path(workdir) / "recovery"
    workdir.mkdir(parents=True, exist_ok=True)
    outer = GlobalSettings.current()
    det = resolve_determinism(config.recovery.deterministic, device, outer)
    try:
        table = _attempt(config, device, workdir, det, outer, k, n, withhold, sensitivity, seed, leave_out, timeout_s)
        op = no_deterministic_op(str(table.get("verdict", "")).removeprefix("failed: "))
        if det.enabled and op is not None:
            log.warning("recovery: %s has no deterministic implementation; running again with the run's settings", op)
            off = Determinism(False, det.requested, f"fell back: {op} has no deterministic implementation", {})
            table = _attempt(config, device, workdir, off, outer, k, n, withhold, sensitivity, seed, leave_out,
                             timeout_s)
            table["deterministic"]["fallback_op"] = op
    finally:
        outer.apply()
    table["elapsed_s"] = time.perf_counter() - t_start
    if not str(table.get("verdict", "")).startswith("failed"):
        _cleanup(workdir)
    return table


def _attempt(config: Any, device: Any, workdir: Path, det: Determinism, outer: GlobalSettings, k: int, n: int,
             withhold: tuple[str, ...], sensitivity: bool, seed: int, leave_out: Sequence[str],
             timeout_s: float | None) -> dict[str, Any]:
    checkpoint = workdir / checkpoint_io.file_name(config.checkpoint.format)
    settings = outer
    if device_type(device) == "cpu":
        # Half the cores each, so a worker's start-up overlaps the other process instead of
        # fighting it (busy-waiting OpenMP threads slow down badly when oversubscribed); the
        # count only has to be the same on both sides for the results to be comparable.
        settings = dataclasses.replace(outer, num_threads=max(1, outer.num_threads // 2))
    if det.enabled:
        settings = settings.deterministic()
    setup = {"config": config_to_dict(config), "device": str(device), "seed": seed,
             "settings": dataclasses.asdict(settings)}
    table: dict[str, Any] = {"save_at_step": k, "total_steps": n, "fresh_process": True, "withheld": list(withhold),
                             "deterministic_algorithms": settings.deterministic_algorithms,
                             "deterministic": det.to_manifest(), "checkpoint_format": config.checkpoint.format}
    if device_type(device) == "cpu":
        table["cpu_threads"] = settings.num_threads
    restore = Worker("restore", setup, workdir, det.env)  # imports while the reference runs
    try:
        log.info("recovery: uninterrupted run of %d steps, checkpoint after step %d", n, k)
        if det.enabled:  # a fresh process, so that the environment is there before CUDA starts
            ref_worker = Worker("reference", setup, workdir, det.env)
            try:
                ref_worker.start_job({"kind": "reference", "checkpoint": str(checkpoint), "save_at_step": k,
                                      "total_steps": n, "leave_out": list(leave_out)})
                ref = Reference(**ref_worker.result(timeout_s)["reference"])
            except WorkerFailed as exc:
                table["verdict"] = f"failed: {exc.reason}"
                return table
            finally:
                ref_worker.stop()
        else:
            settings.apply()
            try:
                ref = run_reference(config, device, checkpoint, k, n, leave_out)
            finally:
                outer.apply()
        applicable = [c for c in COMPONENTS if ref.applicability[c] is None]
        table.update(_reference_table(ref, withhold, leave_out))
        log.info("recovery: restoring in a fresh process%s", f", then {len(applicable)} sensitivity variants"
                 if sensitivity else "")
        restore.start_job({"kind": "restore", "checkpoint": str(checkpoint), "save_at_step": k, "total_steps": n,
                           "withhold": list(withhold), "saved_hashes": ref.saved_hashes,
                           "applicable": applicable, "reference_losses": ref.losses[k:],
                           "sensitivity": applicable if sensitivity else []})
        try:
            result = restore.result(timeout_s)
        except WorkerFailed as exc:
            table["verdict"] = f"failed: {exc.reason}"
            log.warning("recovery: restore failed (%s); files kept in %s", exc.reason, workdir)
            return table
    finally:
        restore.stop()
    table.update(_restore_table(ref, result, withhold, k))
    return table


def _reference_table(ref: Reference, withhold: tuple[str, ...], leave_out: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "reference_fresh_process": ref.fresh_process,
        "losses_uninterrupted": ref.losses,
        "param_hash_uninterrupted": ref.param_hash,
        "optimizer_hash_uninterrupted": ref.optimizer_hash,
        "checkpoint_size_bytes": ref.saved["size_bytes"],
        "checkpoint_write_s": ref.saved["durable_s"],
        "checkpoint_blocked_s": ref.saved["blocked_s"],
        "components_saved": [c for c in COMPONENTS if ref.applicability[c] is None and c not in leave_out],
        "step_time_s": ref.step_time_s,
    }
    if len(ref.step_time_s) > 1:
        after_first = sorted(ref.step_time_s[1:])
        out["step_time_median_s"] = after_first[len(after_first) // 2]
        out["step_time_basis"] = "the reference's steps after its first, each waited for (loss.item())"
    if leave_out:
        out["left_out_of_checkpoint"] = list(leave_out)
    not_applicable = [c for c in withhold if ref.applicability[c] is not None]
    if not_applicable:
        out["withheld_not_applicable"] = not_applicable
    return out


def _restore_table(ref: Reference, result: Mapping[str, Any], withhold: tuple[str, ...], k: int) -> dict[str, Any]:
    out: dict[str, Any] = {"restore_load_s": result["restore_load_s"]}
    if result.get("timings"):
        out["restore_timings"] = {k: float(v) for k, v in result["timings"].items()}
    rows = []
    for c in COMPONENTS:
        if ref.applicability[c] is not None:
            continue
        saved, restored = ref.saved_hashes.get(c), result["restored_hashes"].get(c)
        row: dict[str, Any] = {"component": c, "equal": saved is not None and saved == restored,
                               "saved_sha256": saved or "", "restored_sha256": restored or ""}
        if c in withhold:
            row["note"] = "withheld on purpose"
        elif c in result.get("missing", []):
            row["note"] = "not in the checkpoint: left as freshly built"
        rows.append(row)
    out["restored_state"] = rows
    unexpected = [r["component"] for r in rows if not r["equal"] and r["component"] not in withhold]
    equal = sum(r["equal"] for r in rows)
    out["restored_state_verdict"] = (f"all {len(rows)} components equal to what was saved" if equal == len(rows) else
                                     f"{equal} of {len(rows)} equal; differs: " +
                                     ", ".join(r["component"] for r in rows if not r["equal"]))
    if unexpected:
        out["verdict"] = (f"restored state differs from the saved state: {', '.join(unexpected)} "
                          "(caught before any step ran)")
        out["verdict_kind"] = "state_differs"
        return out
    runs = result["continuations"]
    band = run_to_run_band(runs)
    main = runs[0]
    j = judge(ref.losses[k:], ref.hashes, main, band, k)
    out.update(verdict=j["text"], verdict_kind=j["kind"], loss_diff=j["loss_diff"], loss_diff_max=j["loss_diff_max"],
               run_to_run_band=band, run_to_run_runs=len(runs), band_margin=BAND_MARGIN,
               losses_resumed=main["losses"], param_hash_resumed=main["param_hash"],
               optimizer_hash_resumed=main["optimizer_hash"])
    if "diverged_at_step" in j:
        out["diverged_at_step"] = j["diverged_at_step"]
    out["restore_repeat"] = "identical" if band == 0 and all(
        (r["param_hash"], r["optimizer_hash"]) == (main["param_hash"], main["optimizer_hash"]) for r in runs) else (
        f"differs from the first restore (max |Δloss| {band:.3g}): the step is not deterministic on this stack")
    if "sensitivity" in result:
        out["sensitivity_rule"] = (f"depends: withholding it moves the losses by more than {BAND_MARGIN:g} × the "
                                   f"run-to-run band ({band:.3g})" if band > 0 else
                                   "depends: withholding it changes any loss or the final state (the band is 0)")
        out["sensitivity"] = _sensitivity(ref, result["sensitivity"], band, k)
    return out


def _sensitivity(ref: Reference, variants: Mapping[str, Mapping[str, Any]], band: float, k: int) -> list[dict[str, Any]]:
    entries = []
    for c in COMPONENTS:
        reason = ref.applicability[c]
        entry: dict[str, Any] = {"component": c, "applicable": reason is None}
        variant = variants.get(c)
        if reason is not None:
            entry["note"] = reason
        elif variant is None:
            entry["note"] = "not run"
        elif "error" in variant:
            entry["note"] = f"failed: {variant['error']}"
        else:
            j = judge(ref.losses[k:], ref.hashes, variant, band, k)
            entry.update(depends=j["kind"] == "beyond_band", loss_diff=j["loss_diff"], loss_diff_max=j["loss_diff_max"])
            if "diverged_at_step" in j and j["kind"] == "beyond_band":
                entry["diverged_at_step"] = j["diverged_at_step"]
            if j["kind"] == "within_band":
                entry["note"] = f"moved the losses by {j['loss_diff_max']:.3g}: inside the run-to-run band"
            elif "note" in j:
                entry["note"] = j["note"]
        entries.append(entry)
    return entries


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

"""Stage 5 of the trial: prove that a checkpoint restores in a new process (guide section 6).

A successful save proves nothing. This stage:

1. runs the workload uninterrupted for ``total_steps`` in this process, saving the FULL training
   state after ``save_at_step`` (model, optimizer, LR scheduler, grad scaler, the RNG states of
   python ``random``, numpy, torch CPU and every CUDA/ROCm device, and the data-loader position);
2. restores that checkpoint in a fresh interpreter (``python -m capture.trial.recover_worker``),
   continues to ``total_steps`` and compares every loss (exact float equality) and, at the end,
   a sha256 over the parameters and one over the optimizer state;
3. runs a sensitivity pass in one more fresh interpreter: the checkpoint is restored once per
   component with that component withheld, to show which ones the continuation depends on.

A withheld component is *perturbed*, not merely skipped: a fresh process that rebuilds the
workload from the same seed may land in the very state the checkpoint holds (an RNG nobody
consumed, say), which would hide nothing but also prove nothing. So a withheld RNG is re-seeded
from ``seed + PERTURB_SEED_OFFSET``; a withheld model, optimizer, scheduler or scaler stays as
freshly built (step 0); a withheld data position leaves the loader at position 0.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from capture._atomic import atomic_open
from capture.errors import ConfigError

log = logging.getLogger(__name__)

COMPONENTS = (
    "model",
    "optimizer",
    "scheduler",
    "scaler",
    "rng_python",
    "rng_numpy",
    "rng_torch_cpu",
    "rng_cuda",
    "data_position",
)
PERTURB_SEED_OFFSET = 1_000_003
"""A withheld RNG is re-seeded from ``config.seed + PERTURB_SEED_OFFSET``."""

WORKER_MODULE = "capture.trial.recover_worker"
BIT_EXACT = "bit-exact"


# --------------------------------------------------------------------------- state


def applicability(workload: Any, device: Any) -> dict[str, str | None]:
    """For each component: None when it applies to this run, else why it does not."""
    out: dict[str, str | None] = {c: None for c in COMPONENTS}
    if getattr(workload, "scheduler", None) is None:
        out["scheduler"] = "not applicable: the workload has no LR scheduler"
    scaler = getattr(workload, "scaler", None)
    if scaler is None or (hasattr(scaler, "is_enabled") and not scaler.is_enabled()):
        out["scaler"] = "not applicable: no grad scaler (only fp16 training uses one)"
    if _device_type(device) != "cuda":
        out["rng_cuda"] = f"not applicable: the trial ran on {_device_type(device)}, no CUDA/ROCm RNG is used"
    return out


def _device_type(device: Any) -> str:
    return getattr(device, "type", None) or str(device).split(":")[0]


def capture_state(workload: Any, device: Any, step: int) -> dict[str, Any]:
    """Everything a continuation may need, as plain tensors and containers (no pickled objects)."""
    import numpy as np
    import torch

    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "format": "capture-recovery-1",
        "step": step,
        "model": workload.model.state_dict(),
        "optimizer": workload.optimizer.state_dict(),
        "rng_python": random.getstate(),
        # numpy's state as a tensor and ints, so that torch.load(weights_only=True) can read it.
        "rng_numpy": {
            "kind": str(np_state[0]),
            "keys": torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "rng_torch_cpu": torch.get_rng_state(),
        "data_position": workload.loader.state_dict(),
    }
    if getattr(workload, "scheduler", None) is not None:
        state["scheduler"] = workload.scheduler.state_dict()
    if getattr(workload, "scaler", None) is not None:
        state["scaler"] = workload.scaler.state_dict()
    if _device_type(device) == "cuda":
        state["rng_cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_state(workload: Any, state: Mapping[str, Any], withhold: Iterable[str], seed: int) -> None:
    """Load ``state`` into a freshly built workload, perturbing every withheld component."""
    import numpy as np
    import torch

    withhold = set(withhold)
    other_seed = int(seed) + PERTURB_SEED_OFFSET
    if "model" not in withhold:
        workload.model.load_state_dict(state["model"])
    if "optimizer" not in withhold:
        workload.optimizer.load_state_dict(state["optimizer"])
    if "scheduler" not in withhold and "scheduler" in state:
        workload.scheduler.load_state_dict(state["scheduler"])
    if "scaler" not in withhold and "scaler" in state:
        workload.scaler.load_state_dict(state["scaler"])
    if "data_position" not in withhold:
        workload.loader.load_state_dict(state["data_position"])
    # RNG last: loading the rest must not shift a stream after it was set.
    if "rng_python" in withhold:
        random.seed(other_seed)
    else:
        py = state["rng_python"]
        random.setstate((py[0], tuple(py[1]), py[2]))
    if "rng_numpy" in withhold:
        np.random.seed(other_seed % 2**32)
    else:
        s = state["rng_numpy"]
        np.random.set_state((s["kind"], s["keys"].cpu().numpy().astype(np.uint32), s["pos"], s["has_gauss"], s["cached_gaussian"]))
    if "rng_torch_cpu" in withhold:
        torch.default_generator.manual_seed(other_seed)  # CPU only; torch.manual_seed would reseed CUDA too
    else:
        torch.set_rng_state(state["rng_torch_cpu"])
    if "rng_cuda" in state:
        if "rng_cuda" in withhold:
            torch.cuda.manual_seed_all(other_seed)
        else:
            torch.cuda.set_rng_state_all(state["rng_cuda"])


def save_checkpoint(state: Mapping[str, Any], path: Path) -> tuple[int, float]:
    """``torch.save`` streamed through :func:`capture._atomic.atomic_open` (temp file in the same
    folder, fsync, rename); returns (bytes, seconds). Streamed, not built as bytes first: a
    checkpoint can be tens of GB, and holding it twice in memory is not an option.
    """
    import torch

    path = Path(path)
    t0 = time.perf_counter()
    with atomic_open(path) as f:
        torch.save(dict(state), f)
    return path.stat().st_size, time.perf_counter() - t0


def load_checkpoint(path: Path, device: Any) -> dict[str, Any]:
    import torch

    # weights_only: the file holds only tensors and plain containers (see capture_state).
    return torch.load(path, map_location="cpu", weights_only=True)  # RNG states must stay CPU tensors; load_state_dict moves the rest


# --------------------------------------------------------------------------- comparing


def _tensor_bytes(t: Any) -> Any:
    import torch

    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()


def param_hash(model: Any) -> str:
    """sha256 over every entry of the model's state_dict, in order: name, dtype, shape, bytes."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(_tensor_bytes(t))
    return "sha256:" + h.hexdigest()


def optimizer_hash(optimizer: Any) -> str:
    """sha256 over the optimizer state_dict (moments, step counts, param groups incl. the LR)."""
    import torch

    h = hashlib.sha256()

    def walk(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            h.update(f"T{v.dtype}{tuple(v.shape)}\0".encode())
            h.update(_tensor_bytes(v))
        elif isinstance(v, Mapping):
            h.update(b"{")
            for k in sorted(v, key=repr):
                h.update(repr(k).encode() + b":")
                walk(v[k])
            h.update(b"}")
        elif isinstance(v, (list, tuple)):
            h.update(b"[")
            for x in v:
                walk(x)
            h.update(b"]")
        else:
            h.update(repr(v).encode() + b";")

    walk(optimizer.state_dict())
    return "sha256:" + h.hexdigest()


def params_to_cpu(model: Any) -> dict[str, Any]:
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def max_abs_param_diff(a: Mapping[str, Any], b: Mapping[str, Any]) -> float:
    """The largest absolute difference between two state_dicts (inf if their keys/shapes differ)."""
    if list(a) != list(b):
        return float("inf")
    worst = 0.0
    for k in a:
        x, y = a[k], b[k]
        if x.shape != y.shape:
            return float("inf")
        if x.numel():
            worst = max(worst, float((x.double() - y.double()).abs().max()))
    return worst


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


# --------------------------------------------------------------------------- running


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

    def apply(self) -> None:
        import torch

        torch.set_num_threads(self.num_threads)
        torch.use_deterministic_algorithms(self.deterministic_algorithms, warn_only=self.deterministic_warn_only)
        torch.backends.cudnn.deterministic = self.cudnn_deterministic
        torch.backends.cudnn.benchmark = self.cudnn_benchmark
        torch.backends.cuda.matmul.allow_tf32 = self.matmul_allow_tf32
        torch.backends.cudnn.allow_tf32 = self.cudnn_allow_tf32


def train_steps(workload: Any, count: int, reference: Sequence[float] | None = None) -> list[float]:
    """Run ``count`` optimizer steps; with ``reference``, stop at the first loss that differs."""
    losses: list[float] = []
    for i in range(count):
        loss = float(workload.train_step())
        losses.append(loss)
        if reference is not None and (i >= len(reference) or loss != reference[i]):
            break
    return losses


def _sync(device: Any) -> None:
    if _device_type(device) == "cuda":
        import torch

        torch.cuda.synchronize()


@dataclass(frozen=True)
class Reference:
    losses: list[float]
    param_hash: str
    optimizer_hash: str
    params_cpu: dict[str, Any]
    checkpoint_size_bytes: int
    checkpoint_write_s: float
    applicability: dict[str, str | None]

    @property
    def hashes(self) -> tuple[str, str]:
        return self.param_hash, self.optimizer_hash


class _RngGuard:
    """Leave the caller's global RNG streams as they were: the runner's next stage may rely on them."""

    def __init__(self, device: Any) -> None:
        self.device = device

    def __enter__(self) -> _RngGuard:
        import numpy as np
        import torch

        self.saved = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
                      torch.cuda.get_rng_state_all() if _device_type(self.device) == "cuda" else None)
        return self

    def __exit__(self, *exc: Any) -> None:
        import numpy as np
        import torch

        py, npy, cpu, cuda = self.saved
        random.setstate(py)
        np.random.set_state(npy)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def run_reference(config: Any, device: Any, checkpoint: Path, save_at_step: int, total_steps: int) -> Reference:
    """The uninterrupted run, in this process, saving the checkpoint after ``save_at_step``."""
    from capture.trial.workload import build_workload

    with _RngGuard(device):
        workload = build_workload(config, device)
        losses = train_steps(workload, save_at_step)
        _sync(device)
        state = capture_state(workload, device, save_at_step)
        size, write_s = save_checkpoint(state, checkpoint)
        del state
        losses += train_steps(workload, total_steps - save_at_step)
        _sync(device)
        ref = Reference(
            losses=losses,
            param_hash=param_hash(workload.model),
            optimizer_hash=optimizer_hash(workload.optimizer),
            params_cpu=params_to_cpu(workload.model),
            checkpoint_size_bytes=size,
            checkpoint_write_s=write_s,
            applicability=applicability(workload, device),
        )
    del workload
    if _device_type(device) == "cuda":  # the fresh process needs the memory this one holds
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()
    return ref


class WorkerFailed(Exception):
    """A restore worker exited without a result; ``reason`` is its last error line."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Worker:
    """One fresh interpreter (``python -m capture.trial.recover_worker``), driven over stdin.

    It is started before the reference run with only the setup (config, device, settings), so
    its imports overlap with that run; it sees no training state until :meth:`start_job` names
    the checkpoint. Two JSON lines in, a result file out (see recover_worker).
    """

    def __init__(self, name: str, setup: Mapping[str, Any], workdir: Path) -> None:
        self.name = name
        self.out = workdir / f"{name}.result.json"
        self.err = workdir / f"{name}.stderr.txt"
        env = dict(os.environ)
        package_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join([package_root, *filter(None, [env.get("PYTHONPATH")])])
        with open(self.err, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", WORKER_MODULE], env=env, stdin=subprocess.PIPE,
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
        if code != 0 or "error" in result or "variants" not in result:
            lines = [ln for ln in self.err.read_text(errors="replace").splitlines() if ln.strip()]
            raise WorkerFailed(result.get("error") or (lines[-1] if lines else f"exit status {code}"))
        return result

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _sensitivity_entry(component: str, reason: str | None, variant: Mapping[str, Any] | None,
                       reference: Reference, save_at_step: int, control_ok: bool) -> dict[str, Any]:
    entry: dict[str, Any] = {"component": component, "applicable": reason is None}
    if reason is not None:
        entry["note"] = reason
        return entry
    assert variant is not None
    if "error" in variant:
        entry["note"] = f"failed: {variant['error']}"
        return entry
    step, diff, losses_equal = compare_run(reference.losses[save_at_step:], reference.hashes, variant["losses"],
                                           (variant["param_hash"], variant["optimizer_hash"]), save_at_step)
    entry.update(depends=step is not None, loss_diff=diff)
    if step is not None:
        entry["diverged_at_step"] = step
        if losses_equal:
            entry["note"] = "every loss equal; the final parameters or optimizer state differ"
    if not control_ok:
        entry["note"] = "unreliable: the control (full restore, same process) was not bit-exact either"
    return entry


def _recovery_settings(config: Any) -> tuple[int, int, tuple[str, ...], bool, int]:
    rec = config.recovery
    k, n = int(rec.save_at_step), int(rec.total_steps)
    withhold = tuple(getattr(rec, "withhold", ()) or ())
    sensitivity = bool(getattr(rec, "sensitivity", True))  # no config key yet: on unless the caller says
    if not 1 <= k < n:
        raise ConfigError(f"recovery.save_at_step = {k} must be at least 1 and below recovery.total_steps = {n}",
                          "set e.g. save_at_step = 4 and total_steps = 8 in [recovery]")
    unknown = sorted(set(withhold) - set(COMPONENTS))
    if unknown:
        raise ConfigError(f"recovery.withhold names unknown component(s): {', '.join(unknown)}",
                          f"choose from: {', '.join(COMPONENTS)}")
    return k, n, withhold, sensitivity, int(getattr(config, "seed", 0))


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


def run_recoverability(config: Any, device: Any, workdir: Path, timeout_s: float | None = 1800,
                       sensitivity: bool | None = None) -> dict[str, Any]:
    """Run the whole stage and return the ``[trial.recovery]`` table.

    One fresh interpreter does the restores: first the main one (what the config asks to
    withhold, usually nothing), then one per applicable component for the sensitivity pass,
    then the full restore again as a control. The main restore is the first thing that process
    does with any training state; the control shows whether reusing the process for later
    variants changed anything (``sensitivity_control``).
    """
    t_start = time.perf_counter()
    k, n, withhold, configured, seed = _recovery_settings(config)
    sensitivity = configured if sensitivity is None else sensitivity
    workdir = Path(workdir) / "recovery"
    workdir.mkdir(parents=True, exist_ok=True)
    checkpoint = workdir / "checkpoint.pt"
    dump_path = workdir / "resumed-params.pt"
    outer = GlobalSettings.current()
    settings = outer
    if _device_type(device) == "cpu":
        # Half the cores each, so the worker's start-up overlaps the reference run instead of
        # fighting it (busy-waiting OpenMP threads slow down badly when oversubscribed); the
        # count only has to be the same on both sides for the results to be comparable.
        settings = dataclasses.replace(outer, num_threads=max(1, outer.num_threads // 2))
    setup = {"config": config_to_dict(config), "device": str(device), "seed": seed,
             "settings": dataclasses.asdict(settings)}
    worker = Worker("restore", setup, workdir)  # imports while the reference runs
    try:
        log.info("recovery: uninterrupted run of %d steps, checkpoint after step %d", n, k)
        settings.apply()
        try:
            ref = run_reference(config, device, checkpoint, k, n)
        finally:
            outer.apply()
        applicable = [c for c in COMPONENTS if ref.applicability[c] is None]
        variants: list[dict[str, Any]] = [{"withhold": list(withhold), "full": True}]
        if sensitivity:
            variants += [{"withhold": [c], "stop_at_divergence": True} for c in applicable]
            variants.append({"withhold": [], "stop_at_divergence": True, "control": True})
        log.info("recovery: restoring in a fresh process%s%s",
                 f" (withheld: {', '.join(withhold)})" if withhold else "",
                 f", then {len(applicable)} sensitivity variants and a control" if sensitivity else "")
        worker.start_job({"checkpoint": str(checkpoint), "save_at_step": k, "total_steps": n,
                          "variants": variants, "reference_losses": ref.losses[k:],
                          "dump_params_path": str(dump_path), "reference_param_hash": ref.param_hash})
        table = _main_table(ref, withhold, k, n)
        if _device_type(device) == "cpu":
            table["cpu_threads"] = settings.num_threads
        try:
            results = worker.result(timeout_s)["variants"]
            if "error" in results[0]:
                raise WorkerFailed(results[0]["error"])
        except WorkerFailed as exc:
            table["verdict"] = f"failed: {exc.reason}"
            table["elapsed_s"] = time.perf_counter() - t_start
            log.warning("recovery: restore failed (%s); files kept in %s", exc.reason, workdir)
            return table
    finally:
        worker.stop()
    table.update(_main_result(ref, results[0], k, dump_path))
    if sensitivity:
        table.update(_sensitivity(ref, results[1:-1], results[-1], k))
    table["elapsed_s"] = time.perf_counter() - t_start
    _cleanup(workdir)
    return table


def _main_table(ref: Reference, withhold: tuple[str, ...], k: int, n: int) -> dict[str, Any]:
    import torch

    table: dict[str, Any] = {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "save_at_step": k,
        "total_steps": n,
        "fresh_process": True,
        "withheld": list(withhold),
        "losses_uninterrupted": ref.losses,
        "param_hash_uninterrupted": ref.param_hash,
        "optimizer_hash_uninterrupted": ref.optimizer_hash,
        "checkpoint_size_bytes": ref.checkpoint_size_bytes,
        "checkpoint_write_s": ref.checkpoint_write_s,
        "components_saved": [c for c in COMPONENTS if ref.applicability[c] is None],
    }
    not_applicable = [c for c in withhold if ref.applicability[c] is not None]
    if not_applicable:
        table["withheld_not_applicable"] = not_applicable
    return table


def _main_result(ref: Reference, main: Mapping[str, Any], k: int, dump_path: Path) -> dict[str, Any]:
    step, diff, losses_equal = compare_run(ref.losses[k:], ref.hashes, main["losses"],
                                           (main["param_hash"], main["optimizer_hash"]), k)
    out: dict[str, Any] = {
        "verdict": verdict_text(step, losses_equal),
        "loss_diff": diff,
        "losses_resumed": main["losses"],
        "param_hash_resumed": main["param_hash"],
        "optimizer_hash_resumed": main["optimizer_hash"],
        "restore_load_s": main["restore_load_s"],
    }
    if step is not None:
        out["diverged_at_step"] = step
    repeat = main.get("repeat")
    if isinstance(repeat, Mapping):
        r_step, _, r_equal = compare_run(main["losses"], (main["param_hash"], main["optimizer_hash"]), repeat["losses"],
                                         (repeat["param_hash"], repeat["optimizer_hash"]), k)
        out["restore_repeat"] = "identical" if r_step is None else verdict_text(r_step, r_equal).replace(
            "diverged", "differs from the first restore")
    if main.get("params_dumped"):
        import torch

        resumed = torch.load(dump_path, map_location="cpu", weights_only=True)
        out["max_abs_param_diff"] = max_abs_param_diff(ref.params_cpu, resumed)
    elif main["param_hash"] == ref.param_hash:
        out["max_abs_param_diff"] = 0.0
    return out


def _sensitivity(ref: Reference, variants: Sequence[Mapping[str, Any]], control: Mapping[str, Any],
                 k: int) -> dict[str, Any]:
    if "error" in control:
        control_text, control_ok = f"failed: {control['error']}", False
    else:
        c_step, _, c_losses_equal = compare_run(ref.losses[k:], ref.hashes, control["losses"],
                                                (control["param_hash"], control["optimizer_hash"]), k)
        control_text, control_ok = verdict_text(c_step, c_losses_equal), c_step is None
    by_component = {v["withhold"][0]: v for v in variants}
    entries = [_sensitivity_entry(c, ref.applicability[c], by_component.get(c), ref, k, control_ok)
               for c in COMPONENTS]
    return {"sensitivity_control": control_text, "sensitivity": entries}


def _cleanup(workdir: Path) -> None:
    for p in workdir.iterdir():
        if p.is_file() and p.suffix in (".pt", ".json", ".txt"):
            p.unlink()
    try:
        workdir.rmdir()
    except OSError:
        pass

"""The fresh processes of the recoverability stage: ``python -m capture.trial._recover_worker``.

Started by :class:`capture.trial.recover.Worker`, it reads two JSON lines on stdin:

1. the setup (``config``, ``device``, ``seed``, ``settings``, ``out``), sent at once, so that
   the imports happen while the parent works;
2. the job, ``kind`` one of:

   - ``reference`` (``checkpoint``, ``save_at_step``, ``total_steps``, ``leave_out``): the
     uninterrupted run that writes the checkpoint (capture.trial.recover.run_reference), in a
     process whose environment was set before CUDA started (deterministic mode);
   - ``restore`` (``checkpoint``, ``save_at_step``, ``total_steps``, ``withhold``,
     ``saved_hashes``, ``reference_losses``, ``sensitivity``): load the checkpoint once into host
     memory; restore it into a freshly built workload and hash every component *before any
     step*; stop there if a component differs from what was saved; else continue to the last
     step, twice (three times when the two differ: the run-to-run band), then once per
     sensitivity component with that component withheld, each from the host copy.

The result, ``{"reference": ...}``, ``{"restored_hashes": ..., "continuations": [...], ...}`` or
``{"error": "..."}``, goes to the ``out`` file. If stdin closes before a job arrives it exits quietly.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from capture._atomic import atomic_write


def _read_message() -> dict[str, Any] | None:
    line = sys.stdin.readline()
    return json.loads(line) if line.strip() else None


def prewarm(config: Any) -> None:
    """Import what building the model needs, without allocating it (best effort, saves seconds)."""
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        if config.model.source == "from_config":
            with torch.device("meta"):
                AutoModelForCausalLM.from_config(AutoConfig.for_model(config.model.architecture, **config.model.config))
    except Exception:  # the real build reports any real problem
        pass


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0]


def _continue(workload: Any, count: int, reference: list[float] | None) -> list[float]:
    """``count`` steps; with ``reference``, stop at the first loss that differs from it."""
    losses: list[float] = []
    for i in range(count):
        loss = float(workload.train_step())
        losses.append(loss)
        if reference is not None and (i >= len(reference) or loss != reference[i]):
            break
    return losses


def _restored(host: dict[str, Any], withhold: list[str], config: Any, device: Any, seed: int,
              timings: dict[str, float]) -> tuple[Any, list[str]]:
    from capture.trial import state
    from capture.trial.workload import build_workload

    t0 = time.perf_counter()
    workload = build_workload(config, device)  # seeds everything from config.seed
    t1 = time.perf_counter()
    missing = state.restore_state(workload, host, withhold, seed)
    state.sync(device)
    timings["build_s"] = timings.get("build_s", 0.0) + t1 - t0
    timings["restore_s"] = timings.get("restore_s", 0.0) + time.perf_counter() - t1
    return workload, missing


def _pinned(host: dict[str, Any], device: Any) -> dict[str, Any]:
    """The host copy in page-locked memory on CUDA (each restore then copies at full PCIe speed);
    as it was when pinning fails (a host short of lockable memory)."""
    from capture.trial import state

    if state.device_type(device) != "cuda":
        return host
    try:
        return state.pin(host)
    except RuntimeError:
        return host


def _finish(workload: Any, device: Any, count: int, reference: list[float] | None,
            timings: dict[str, float]) -> dict[str, Any]:
    """Continue and hash the final state; with ``reference`` (a deterministic step), a run whose
    losses already differ stops there and skips the hashes (they cannot make it equal again)."""
    from capture.trial import state

    t0 = time.perf_counter()
    losses = _continue(workload, count, reference)
    state.sync(device)
    timings["steps_s"] = timings.get("steps_s", 0.0) + time.perf_counter() - t0
    if reference is not None and losses != reference[:len(losses)]:
        return {"losses": losses, "param_hash": "", "optimizer_hash": "", "hashes": "skipped: losses differ"}
    t0 = time.perf_counter()
    out = {"losses": losses, "param_hash": state.param_hash(workload.model),
           "optimizer_hash": state.optimizer_hash(workload.optimizer)}
    timings["final_hash_s"] = timings.get("final_hash_s", 0.0) + time.perf_counter() - t0
    return out


def run_restore(setup: dict[str, Any], job: dict[str, Any], config: Any, device: Any) -> dict[str, Any]:
    from capture.trial import checkpoint_io, state

    k, n, seed = int(job["save_at_step"]), int(job["total_steps"]), int(setup["seed"])
    withhold = list(job.get("withhold", []))
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    host = checkpoint_io.load(Path(job["checkpoint"]), config.checkpoint.format)  # the one read of the file
    if int(host.get("step", -1)) != k:
        raise RuntimeError(f"checkpoint is from step {host.get('step')}, expected {k}")
    timings["read_s"] = time.perf_counter() - t0
    workload, missing = _restored(host, withhold, config, device, seed, timings)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    live = state.capture_state(workload, device, k)
    restored = state.component_hashes(live, job.get("applicable", state.COMPONENTS))
    del live
    timings["state_check_s"] = time.perf_counter() - t0
    out: dict[str, Any] = {"restore_load_s": load_s, "state_check_s": timings["state_check_s"],
                           "restored_hashes": restored, "missing": missing, "timings": timings}
    saved = job.get("saved_hashes", {})
    if any(restored.get(c) != h for c, h in saved.items() if c in restored and c not in withhold):
        out["continuations"] = []  # an incomplete restore: no step is run
        return out
    runs = [_finish(workload, device, n - k, None, timings)]
    del workload
    state.release_memory(device)
    t0 = time.perf_counter()
    host = _pinned(host, device)
    timings["pin_s"] = time.perf_counter() - t0
    for _ in range(2):  # the band: two continuations from the same state; a third when they differ
        wl, _ = _restored(host, withhold, config, device, seed, timings)
        runs.append(_finish(wl, device, n - k, None, timings))
        del wl
        state.release_memory(device)
        if runs[-1] == runs[0]:
            break
    out["continuations"] = runs
    deterministic = all(r == runs[0] for r in runs)
    reference = job.get("reference_losses")
    if job.get("sensitivity"):
        out["sensitivity"] = {}
    for c in job.get("sensitivity", []):
        try:
            wl, _ = _restored(host, [c], config, device, seed, timings)
            out["sensitivity"][c] = _finish(wl, device, n - k, reference if deterministic else None, timings)
            del wl
        except Exception as exc:
            out["sensitivity"][c] = {"error": _reason(exc)}
        state.release_memory(device)
    return out


def main() -> int:
    setup = _read_message()
    if setup is None:
        return 0
    out = Path(setup["out"])
    try:
        from capture.trial import recover
        from capture.trial.config import TrialConfig

        recover.GlobalSettings(**setup["settings"]).apply()
        config = recover.config_from_dict(TrialConfig, setup["config"])
        prewarm(config)
        job = _read_message()
        if job is None:
            return 0
        import torch

        device = torch.device(setup["device"])
        if job.get("kind") == "reference":
            ref = recover.run_reference(config, device, Path(job["checkpoint"]), int(job["save_at_step"]),
                                        int(job["total_steps"]), job.get("leave_out", ()))
            result: dict[str, Any] = {"reference": dict(ref.to_json(), fresh_process=True)}
        else:
            result = run_restore(setup, job, config, device)
    except Exception as exc:  # the parent records the reason in the manifest; a traceback helps no one there
        reason = _reason(exc)
        atomic_write(out, json.dumps({"error": reason}).encode())
        sys.stderr.write(f"error: {reason}\n")
        return 1
    atomic_write(out, json.dumps(result).encode())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

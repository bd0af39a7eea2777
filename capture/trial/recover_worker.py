"""The fresh process of the recoverability stage: ``python -m capture.trial.recover_worker``.

Started by :class:`capture.trial.recover.Worker`, it reads two JSON lines on stdin:

1. the setup (``config``, ``device``, ``seed``, ``settings``, ``out``), sent at once, so that
   the imports happen while the parent runs the uninterrupted reference;
2. the job (``checkpoint``, ``save_at_step``, ``total_steps``, ``variants``, and optionally
   ``reference_losses``, ``dump_params_path``, ``reference_param_hash``), sent once the
   checkpoint exists.

For each variant it builds the workload afresh, restores the checkpoint with that variant's
components withheld (:func:`capture.trial.recover.restore_state`), continues to the last step
and records losses and hashes. The result, ``{"variants": [...]}`` or ``{"error": "..."}``, goes
to the ``out`` file. If stdin closes before a job arrives it exits quietly.
"""

from __future__ import annotations

import gc
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


def _run_variant(job: dict[str, Any], variant: dict[str, Any], config: Any, device: Any, k: int, n: int,
                 seed: int) -> dict[str, Any]:
    from capture.trial import recover
    from capture.trial.workload import build_workload

    t0 = time.perf_counter()
    # Read from disk per variant: optimizer.load_state_dict may keep the loaded tensors, which
    # the next steps then update in place, so a cached copy would not be the checkpoint.
    state = recover.load_checkpoint(Path(job["checkpoint"]), device)
    if int(state["step"]) != k:
        raise RuntimeError(f"checkpoint is from step {state['step']}, expected {k}")
    load_s = time.perf_counter() - t0
    workload = build_workload(config, device)  # seeds everything from config.seed
    t0 = time.perf_counter()
    recover.restore_state(workload, state, variant["withhold"], seed)
    recover._sync(device)
    load_s += time.perf_counter() - t0
    del state
    stop_ref = job.get("reference_losses") if variant.get("stop_at_divergence") else None
    losses = recover.train_steps(workload, n - k, stop_ref)
    recover._sync(device)
    p_hash = recover.param_hash(workload.model)
    dumped = False
    dump = job.get("dump_params_path")
    if dump and variant.get("full") and p_hash != job.get("reference_param_hash"):
        recover.save_checkpoint(recover.params_to_cpu(workload.model), Path(dump))
        dumped = True
    return {
        "withhold": variant["withhold"],
        "losses": losses,
        "param_hash": p_hash,
        "optimizer_hash": recover.optimizer_hash(workload.optimizer),
        "restore_load_s": load_s,
        "params_dumped": dumped,
    }


def run_job(setup: dict[str, Any], job: dict[str, Any], config: Any) -> dict[str, Any]:
    import torch

    device = torch.device(setup["device"])
    k, n = int(job["save_at_step"]), int(job["total_steps"])
    results: list[dict[str, Any]] = []
    for i, variant in enumerate(job["variants"]):
        try:
            result = _run_variant(job, variant, config, device, k, n, setup["seed"])
            if variant.get("full") and result["param_hash"] != job.get("reference_param_hash"):
                # Restore the same checkpoint once more: if the two restores differ from each
                # other, the step itself is not deterministic, whatever the checkpoint holds.
                again = _run_variant(job, dict(variant, full=False), config, device, k, n, setup["seed"])
                result["repeat"] = {key: again[key] for key in ("losses", "param_hash", "optimizer_hash")}
            results.append(result)
        except Exception as exc:
            if i == 0:  # the main restore: the whole stage failed
                raise
            results.append({"withhold": variant["withhold"], "error": _reason(exc)})
        if device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
    return {"variants": results}


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
        result = run_job(setup, job, config)
    except Exception as exc:  # the parent records the reason in the manifest; a traceback helps no one there
        reason = _reason(exc)
        atomic_write(out, json.dumps({"error": reason}).encode())
        sys.stderr.write(f"error: {reason}\n")
        return 1
    atomic_write(out, json.dumps(result).encode())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

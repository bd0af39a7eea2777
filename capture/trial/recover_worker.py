"""The fresh process of the recoverability stage: ``python -m capture.trial.recover_worker JOB.json``.

It rebuilds the workload from the trial config, restores the checkpoint once per variant (each
variant withholds some components, see :func:`capture.trial.recover.restore_state`), continues to
the last step and writes ``{"variants": [{"withhold", "losses", "param_hash", "optimizer_hash",
"restore_load_s", "params_dumped"}]}`` to the job's ``out`` path. On failure it writes
``{"error": "..."}`` and exits 1. It is started by :func:`capture.trial.recover.run_worker`;
the job format is internal to that pair.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from capture._atomic import atomic_write


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    import torch

    from capture.trial import recover
    from capture.trial.config import TrialConfig
    from capture.trial.workload import build_workload

    recover.GlobalSettings(**job["settings"]).apply()
    config = recover.config_from_dict(TrialConfig, job["config"])
    device = torch.device(job["device"])
    k, n = int(job["save_at_step"]), int(job["total_steps"])
    reference_losses = job.get("reference_losses")
    results = []
    for variant in job["variants"]:
        workload = build_workload(config, device)
        t0 = time.perf_counter()
        # Read from disk per variant: optimizer.load_state_dict may keep the loaded tensors, which
        # the next steps then update in place, so a cached copy would not be the checkpoint.
        state = recover.load_checkpoint(Path(job["checkpoint"]), device)
        if int(state["step"]) != k:
            raise RuntimeError(f"checkpoint is from step {state['step']}, expected {k}")
        recover.restore_state(workload, state, variant["withhold"], job["seed"])
        recover._sync(device)
        load_s = time.perf_counter() - t0
        del state
        stop_ref = reference_losses if variant.get("stop_at_divergence") else None
        losses = recover.train_steps(workload, n - k, stop_ref)
        recover._sync(device)
        p_hash = recover.param_hash(workload.model)
        dumped = False
        dump = job.get("dump_params_path")
        if dump and variant.get("full") and p_hash != job.get("reference_param_hash"):
            recover.save_checkpoint(recover.params_to_cpu(workload.model), Path(dump))
            dumped = True
        results.append({
            "withhold": variant["withhold"],
            "losses": losses,
            "param_hash": p_hash,
            "optimizer_hash": recover.optimizer_hash(workload.optimizer),
            "restore_load_s": load_s,
            "params_dumped": dumped,
        })
        del workload
    return {"variants": results}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        sys.stderr.write("usage: python -m capture.trial.recover_worker JOB.json\n")
        return 2
    job = json.loads(Path(argv[0]).read_text())
    out = Path(job["out"])
    try:
        result = run_job(job)
    except Exception as exc:  # the parent records the reason in the manifest; a traceback helps no one there
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
        atomic_write(out, json.dumps({"error": reason}).encode())
        sys.stderr.write(f"error: {reason}\n")
        return 1
    atomic_write(out, json.dumps(result).encode())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

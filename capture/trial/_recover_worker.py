"""The fresh processes of the recoverability stage: ``python -m capture.trial._recover_worker``.

Started by :class:`capture.trial.worker_proc.Worker`, it reads two JSON lines on stdin:

1. the setup (``config``, ``device``, ``seed``, ``settings``, ``out``, ``plan``, and for a
   restoring process ``early_build``, ``snapshot`` and ``base``), sent at once, so that the
   imports happen while the parent works. A restoring process starts verifying a pretrained base's
   files now, and with ``early_build`` builds its workload now (and hashes a rebuilt base).
   A restoring process started before its stage has ``early_build = ON_GO``: after its imports
   it waits for one more line, the go-ahead (``{"early_build": bool}``), and only then touches
   files or the device;
2. the job, ``kind`` one of (capture.trial.recover_steps):

   - ``reference``: the uninterrupted run that writes the checkpoint, in a process whose
     environment was set before CUDA started (deterministic mode);
   - ``restore``: read the checkpoint once into host memory; restore it and hash every component
     *before any step*, verify the base; stop there if anything differs; else continue to the
     last step (saving again at k2 on the way), twice (three times when the two differ: the
     run-to-run band), then once per sensitivity component with that component withheld;
   - ``resume_again``: restore the checkpoint the first resumed process wrote at k2, check it,
     continue to the last step.

The result (``{"reference": ...}``, the restore's tables, or ``{"error": "..."}``) goes to the
``out`` file, with ``ready_at`` (wall clock when the setup was done). If stdin closes before a job
arrives it exits quietly. Where the platform allows, it dies with its parent (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from capture._atomic import atomic_write


def _read_message() -> dict[str, Any] | None:
    line = sys.stdin.readline()
    return json.loads(line) if line.strip() else None


def _die_with_parent() -> None:
    """Ask Linux to kill this process when its parent dies (a parent killed by SIGKILL cannot stop it)."""
    from capture import _parent_death

    if _parent_death.request(signal.SIGKILL) and os.getppid() == 1:  # the parent was already gone
        os._exit(1)


def prewarm(config: Any) -> None:
    """Import what building the model needs, without allocating it (best effort, saves seconds)."""
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        if config.model.source == "from_config":
            with torch.device("meta"):
                AutoModelForCausalLM.from_config(AutoConfig.for_model(config.model.architecture, **config.model.config))
        if config.method == "lora":
            import peft  # noqa: F401
    except Exception:  # the real build reports any real problem
        pass


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0]


def main() -> int:
    _die_with_parent()
    setup = _read_message()
    if setup is None:
        return 0
    out = Path(setup["out"])
    try:
        from capture.trial import base, recover_steps, scratch
        from capture.trial.config import TrialConfig
        from capture.trial.recover import GlobalSettings, config_from_dict

        GlobalSettings(**setup["settings"]).apply()
        config = config_from_dict(TrialConfig, setup["config"])
        plan = recover_steps.Plan(**setup.get("plan", {}))
        import torch

        device = torch.device(setup["device"])
        restorer = None
        if setup.get("role", "restore") != "reference":
            expected = base.Expectation.from_json(setup["base"]) if setup.get("base") else None
            restorer = recover_steps.Restorer(config, device, int(setup["seed"]), plan, setup.get("snapshot", ()),
                                              expected)
        prewarm(config)
        extra: dict[str, Any] = {}
        if restorer is not None:
            early = setup.get("early_build")
            if early == recover_steps.ON_GO:  # started before its stage: imported, it waits for the go-ahead
                extra["imports_done_at"] = time.time()
                go = _read_message()
                if go is None:
                    return 0
                early = go.get("early_build")
            restorer.start_base_check()
            if early:
                restorer.build(early=True)
        scratch.pause_point(f"recovery.{setup.get('role', 'restore')}_ready")
        ready_at = time.time()
        job = _read_message()
        if job is None:
            return 0
        if job.get("kind") == "reference":
            k2 = job.get("second_save_at_step")
            ref = recover_steps.run_reference(config, device, Path(job["checkpoint"]), int(job["save_at_step"]),
                                              int(job["total_steps"]), job.get("leave_out", ()), plan,
                                              int(k2) if k2 is not None else None)
            result: dict[str, Any] = {"reference": dict(ref.to_json(), fresh_process=True)}
        else:
            assert restorer is not None
            run = recover_steps.run_resume_again if job.get("kind") == "resume_again" else recover_steps.run_restore
            result = run(restorer, job)
            result["timings"] = restorer.timings
        result.update(extra, ready_at=ready_at)
    except Exception as exc:  # the parent records the reason in the manifest; a traceback helps no one there
        reason = _reason(exc)
        atomic_write(out, json.dumps({"error": reason}).encode())
        sys.stderr.write(f"error: {reason}\n")
        return 1
    atomic_write(out, json.dumps(result).encode())
    return 0


if __name__ == "__main__":
    code = main()
    sys.stderr.flush()
    # The result is on disk: leave without tearing down the interpreter and the framework (seconds
    # with gigabytes of device memory), which the parent would otherwise wait for.
    os._exit(code)

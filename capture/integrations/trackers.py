"""Send the signed manifest and the step figures to the trackers a team already keeps.

::

    from capture.integrations.trackers import MLflow, TensorBoard, WandB

    rec.write_manifest("run.toml", trackers=[MLflow(), WandB(), TensorBoard("runs/capture")])

Each tracker gets, after the manifest is signed (rank 0 only): the manifest file (and its HTML
report) as an artifact, its SHA-256 as a tag, one scalar per measured step
(``capture/step_time_s``, ``capture/data_wait_s``, ``capture/loss``) and the run's summary
figures (step-time median/p90, tokens/s, MFU, peak allocated/reserved and device memory, and
per rank under torch.distributed). The library is imported only when a tracker logs. The
tracker never changes the manifest: what it shows is a copy; the signed file is the record.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

__all__ = ["MLflow", "TensorBoard", "Tracker", "WandB", "step_series", "summary_scalars"]

_STEP_SERIES = (("step_time_s", "capture/step_time_s"), ("data_wait_s", "capture/data_wait_s"), ("loss", "capture/loss"))
_STATS = ("step_time_median_s", "step_time_p90_s", "step_time_mean_s", "step_time_cv", "stall_share", "tokens_per_s", "mfu")
_MEMORY = ("peak_allocated_bytes", "peak_reserved_bytes", "device_used_bytes")
_RANK = ("step_time_mean_s", "data_wait_total_s", "peak_allocated_bytes", "device_used_bytes")


class Tracker(Protocol):
    def log(self, manifest_path: Path, trial: Mapping[str, Any]) -> None: ...


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def step_series(trial: Mapping[str, Any]) -> dict[str, list[float]]:
    """Per measured step: ``{"capture/step_time_s": [...], ...}``."""
    steps = trial.get("steps") or {}
    return {name: [float(v) for v in steps[key]] for key, name in _STEP_SERIES if steps.get(key)}


def summary_scalars(trial: Mapping[str, Any]) -> dict[str, float]:
    """The run's figures as flat ``capture/...`` scalars (memory in bytes, times in seconds)."""
    out: dict[str, float] = {}
    stats = trial.get("stats") or {}
    out.update({f"capture/{k}": float(stats[k]) for k in _STATS if _num(stats.get(k))})
    mem = (trial.get("memory") or {}).get("measured") or {}
    out.update({f"capture/memory/{k}": float(mem[k]) for k in _MEMORY if _num(mem.get(k))})
    for r in (trial.get("distributed") or {}).get("ranks") or []:
        out.update({f"capture/rank{r['rank']}/{k}": float(r[k]) for k in _RANK if _num(r.get(k))})
    return out


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _files(manifest_path: Path, trial: Mapping[str, Any]) -> list[Path]:
    html = (trial.get("report") or {}).get("html")
    extra = manifest_path.parent / html if isinstance(html, str) else None
    return [manifest_path] + ([extra] if extra is not None and extra.is_file() else [])


@dataclass
class MLflow:
    """Log to the active MLflow run, or to a new run (ended again) when none is active.

    ``tracking_uri``: where (default: MLflow's own setting, ``MLFLOW_TRACKING_URI``);
    ``experiment``: the experiment name for a new run.
    """

    tracking_uri: str | None = None
    experiment: str | None = None
    run_id: str | None = field(default=None, init=False)

    def log(self, manifest_path: Path, trial: Mapping[str, Any]) -> None:
        import mlflow

        if self.tracking_uri:
            mlflow.set_tracking_uri(self.tracking_uri)
        if self.experiment:
            mlflow.set_experiment(self.experiment)
        started = mlflow.active_run() is None
        run: Any = mlflow.start_run() if started else mlflow.active_run()
        try:
            self.run_id = run.info.run_id
            for path in _files(manifest_path, trial):
                mlflow.log_artifact(str(path), artifact_path="capture")
            mlflow.set_tag("capture.manifest_sha256", _sha256(manifest_path))
            for name, values in step_series(trial).items():
                for i, v in enumerate(values):
                    mlflow.log_metric(name, v, step=i)
            mlflow.log_metrics(summary_scalars(trial))
        finally:
            if started:
                mlflow.end_run()


@dataclass
class WandB:
    """Log to the current W&B run, or to a new one (finished again) started with ``init``
    (for example ``{"project": "my-project"}``; ``WANDB_MODE=offline`` works as usual).
    Step figures use their own x-axis, ``capture/step``, so they never clash with the
    framework's own steps."""

    init: dict[str, Any] = field(default_factory=dict)
    run_dir: str | None = field(default=None, init=False)

    def log(self, manifest_path: Path, trial: Mapping[str, Any]) -> None:
        import wandb

        started = wandb.run is None
        run: Any = wandb.init(**self.init) if started else wandb.run
        try:
            self.run_dir = str(Path(run.dir).parent)
            run.define_metric("capture/step")
            series = step_series(trial)
            for name in series:
                run.define_metric(name, step_metric="capture/step")
            for i in range(max((len(v) for v in series.values()), default=0)):
                run.log({"capture/step": i, **{n: v[i] for n, v in series.items() if i < len(v)}})
            run.summary.update({**summary_scalars(trial), "capture/manifest_sha256": _sha256(manifest_path)})
            artifact = wandb.Artifact("capture-manifest", type="capture-manifest",
                                      metadata={"sha256": _sha256(manifest_path)})
            for path in _files(manifest_path, trial):
                artifact.add_file(str(path))
            run.log_artifact(artifact)
        finally:
            if started:
                run.finish()


@dataclass
class TensorBoard:
    """Write TensorBoard event files into ``log_dir``, with the manifest copied beside them and
    its text shown under the Text tab (TensorBoard has no artifacts)."""

    log_dir: str | Path = "runs/capture"

    def log(self, manifest_path: Path, trial: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        folder = Path(self.log_dir)
        folder.mkdir(parents=True, exist_ok=True)
        writer = SummaryWriter(log_dir=str(folder))
        try:
            for name, values in step_series(trial).items():
                for i, v in enumerate(values):
                    writer.add_scalar(name, v, global_step=i)
            for name, v in summary_scalars(trial).items():
                writer.add_scalar(name, v, global_step=0)
            text = manifest_path.read_text(encoding="utf-8")
            writer.add_text("capture/manifest", "    " + text.replace("\n", "\n    "), global_step=0)
        finally:
            writer.close()
        for path in _files(manifest_path, trial):
            shutil.copyfile(path, folder / path.name)

"""A Lightning ``Callback`` that records ``Trainer.fit`` with :class:`capture.Recorder`.

::

    from capture.integrations.lightning import CaptureCallback

    trainer = lightning.Trainer(max_steps=1000, callbacks=[CaptureCallback("run.toml")])
    trainer.fit(module, datamodule)     # run.toml (signed) and run.html when training ends

A step is one optimizer step (``trainer.global_step`` moving on); micro-batches of a gradient
accumulation cycle add to it. Data wait is the host time between one batch's end and the next
batch's start. Validation runs (``on_validation_start``/``end``) and checkpoint saves (every
``trainer.save_checkpoint``, ModelCheckpoint's included) are timed with the device synced and
left out of the step times. Under DDP every rank records and rank 0 writes the one manifest.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

try:
    from lightning.pytorch import Callback
except ImportError:  # the standalone package name
    try:
        from pytorch_lightning import Callback  # type: ignore[assignment]
    except ImportError as exc:  # pragma: no cover - the extra is not installed
        raise ImportError("capture.integrations.lightning needs Lightning: pip install 'capture-stack[lightning]'") from exc

from capture.integrations._frameworks import RecordingCallback, count_tokens, dataset_fields, framework_version, model_fields
from capture.recorder import Recorder


def precision_name(lightning_precision: Any) -> str:
    """``"bf16-mixed"`` → ``bf16``, ``"16-mixed"`` → ``fp16``, ``"32-true"`` → ``fp32``."""
    p = str(lightning_precision)
    if "bf16" in p:
        return "bf16"
    for prefix, name in (("16", "fp16"), ("32", "fp32"), ("64", "fp64"), ("transformer-engine", "fp8")):
        if p.startswith(prefix):
            return name
    return p


def _batch_size(batch: Any) -> int | None:
    if isinstance(batch, dict):
        batch = next(iter(batch.values()), None)
    if isinstance(batch, (list, tuple)) and batch:
        batch = batch[0]
    shape = getattr(batch, "shape", None)
    return int(shape[0]) if shape else None


class CaptureCallback(RecordingCallback, Callback):
    """Record the fit's steps, validation runs and checkpoint saves; sign them when training ends.

    ``output``: the manifest path (default ``<trainer.default_root_dir>/capture.toml``; under
    ``capture exec`` with no ``output``, only exec's manifest gets the figures).
    ``tokens_per_step``: global tokens per optimizer step where batches hold no ``input_ids`` or
    integer tensor to count. ``dataset_revision``: the data set's ``repo@revision``.
    """

    def _reset(self) -> None:
        self._step = 0
        self._tokens = 0
        self._counted = True
        self._t_batch_end = 0.0
        self._t_val = 0.0
        self._save: Any = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._world = max(1, int(trainer.world_size))
        accum = int(trainer.accumulate_grad_batches)
        run: dict[str, Any] = {
            "config_source": "lightning.Trainer.fit with capture.integrations.lightning.CaptureCallback",
            "framework": f"lightning {framework_version('lightning') or framework_version('pytorch-lightning')}",
            "strategy": type(trainer.strategy).__name__, "grad_accum": accum, "world_size": self._world,
            "lightning_precision": str(trainer.precision), "max_steps": int(trainer.max_steps),
            "model": model_fields(pl_module),
            "data": dataset_fields(getattr(trainer.train_dataloader, "dataset", None), self.dataset_revision),
        }
        rec = Recorder(pl_module.device, warmup_steps=self.warmup_steps, precision=precision_name(trainer.precision),
                       model=pl_module, run=run)
        self._step = int(trainer.global_step)
        self._save = trainer.save_checkpoint

        def timed_save(filepath: Any, *args: Any, **kwargs: Any) -> Any:
            t0 = rec.synced_now()
            try:
                return self._save(filepath, *args, **kwargs)
            finally:
                if rec.recording:
                    rec.add_checkpoint(rec.synced_now() - t0, filepath if Path(filepath).exists() else None)
                    self._t_batch_end = time.perf_counter()

        trainer.save_checkpoint = timed_save
        self.recorder = rec.start()
        self._t_batch_end = time.perf_counter()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        rec = self._active()
        if rec is None:
            return
        rec.add_data_wait(time.perf_counter() - max(self._t_batch_end, rec.last_mark_s))
        if "micro_batch_size" not in rec.run:
            size = _batch_size(batch)
            if size is not None:
                rec.run["micro_batch_size"] = size
                rec.run["global_batch_size"] = size * int(trainer.accumulate_grad_batches) * self._world
        n = count_tokens(batch)
        if n is None:
            self._counted = False
        else:
            self._tokens += n

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        rec = self._active()
        if rec is None:
            return
        if int(trainer.global_step) > self._step:
            self._step = int(trainer.global_step)
            tokens = self._tokens if self._counted else (self.tokens_per_step // self._world if self.tokens_per_step else None)
            rec.step(tokens=tokens)
            self._tokens, self._counted = 0, True
        self._t_batch_end = time.perf_counter()

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        rec = self._active()
        if rec is not None:
            self._t_val = rec.synced_now()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        rec = self._active()
        if rec is not None and self._t_val:
            rec.add_validation(rec.synced_now() - self._t_val)
            self._t_val = 0.0
            self._t_batch_end = time.perf_counter()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        rec = self._active()
        if self._save is not None:
            trainer.save_checkpoint = self._save
            self._save = None
        if rec is None:
            return
        self._finish(rec, trainer.default_root_dir)

"""A ``transformers.TrainerCallback`` that records the Trainer's run with :class:`capture.Recorder`.

::

    from capture.integrations.hf import CaptureCallback

    trainer = Trainer(model, args, train_dataset=ds, callbacks=[CaptureCallback("run.toml")])
    trainer.train()         # run.toml (signed) and run.html when training ends

A step is one optimizer step (``on_step_end``); logging, evaluation and checkpoint saves that
the Trainer runs between steps are timed apart and left out of the step times. Data wait is
the host time from the previous step's end to ``on_step_begin`` (the Trainer fetches the
batches of a whole accumulation cycle there). Tokens come from ``state.num_input_tokens_seen``
when the Trainer counts them (``include_num_input_tokens_seen``), else from ``tokens_per_step``.
Under torchrun every rank records and rank 0 writes the one manifest.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

try:
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - the extra is not installed
    raise ImportError("capture.integrations.hf needs transformers: pip install 'capture-stack[hf]'") from exc

from capture.integrations._frameworks import RecordingCallback, dataset_fields, framework_version, model_fields
from capture.recorder import Recorder

_GAP_TIMING = ("host wall clock from the end of the previous Trainer event (step end, log or evaluation) "
               "to this one; not synchronized with the device")


class CaptureCallback(RecordingCallback, TrainerCallback):
    """Record the Trainer's steps, evaluations and checkpoint saves; sign them when training ends.

    ``output``: the manifest path (default ``<output_dir>/capture.toml``; under ``capture exec``
    with no ``output``, the figures go only into exec's manifest). ``tokens_per_step``: global
    tokens per optimizer step, when the Trainer does not count them. ``dataset_revision``: the
    data set's ``repo@revision`` when the Trainer cannot know it. ``trackers``: see
    :mod:`capture.integrations.trackers`.
    """

    def _reset(self) -> None:
        self._tokens_seen = 0

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, train_dataloader: Any = None,
                       **kwargs: Any) -> None:
        self._world = max(1, int(getattr(args, "world_size", 1) or 1))
        precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
        micro, accum = int(args.per_device_train_batch_size), int(args.gradient_accumulation_steps)
        run: dict[str, Any] = {
            "config_source": "transformers.Trainer with capture.integrations.hf.CaptureCallback",
            "framework": f"transformers {framework_version('transformers')}",
            "micro_batch_size": micro, "grad_accum": accum, "global_batch_size": micro * accum * self._world,
            "world_size": self._world, "max_steps": int(state.max_steps or 0),
            "model": model_fields(model),
            "data": dataset_fields(getattr(train_dataloader, "dataset", None), self.dataset_revision),
        }
        self._tokens_seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)
        rec = Recorder(args.device, warmup_steps=self.warmup_steps, precision=precision, model=model, run=run)
        rec.validation_timing = rec.checkpoint_timing = _GAP_TIMING
        self.recorder = rec.start()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        rec = self._active()
        if rec is not None:
            rec.add_data_wait(rec.since_last_mark_s())

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        rec = self._active()
        if rec is None:
            return
        seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)
        tokens: int | None = None
        if seen > self._tokens_seen:
            tokens = (seen - self._tokens_seen) // self._world
        elif self.tokens_per_step:
            tokens = self.tokens_per_step // self._world
        self._tokens_seen = seen
        rec.step(tokens=tokens)

    def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        rec = self._active()
        if rec is not None:
            rec.resume()  # logging (and the loss read it waits for) is not a training step

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        rec = self._active()
        if rec is not None:
            rec.add_validation(rec.since_last_mark_s())

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        rec = self._active()
        if rec is not None:
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            rec.add_checkpoint(rec.since_last_mark_s(), folder if folder.exists() else None)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        rec = self._active()
        if rec is None:
            return
        self._finish(rec, args.output_dir)

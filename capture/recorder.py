"""Measure your own training loop and sign what it did into a manifest.

::

    from capture import Recorder

    with Recorder(warmup_steps=3, model=model, precision="bf16") as rec:
        for batch in rec.batches(loader):            # times how long next(loader) blocks
            loss = train_one_step(batch)             # your forward, backward, optimizer step
            rec.step(tokens=batch.numel(), loss=loss)    # a step boundary; no host sync
            if rec.measured_steps == 100:
                break
            if rec.steps % 50 == 0:
                with rec.validation():               # timed, and left out of the step times
                    evaluate(model)
    rec.write_manifest("run.toml")                   # fingerprint + [trial], signed, + run.html

Per step: CUDA events on a GPU (read once, after the loop), ``perf_counter`` on a CPU; the time
``next(loader)`` blocked; median/p90/p99/CV, stall share, tokens/s, MFU where the device's dense
peak is in the accelerator catalog; peak allocated and reserved memory and the device's own
figure (NVML/amdsmi; peak RSS on a CPU). Validation and checkpoint blocks are timed on their own.

Under ``torch.distributed`` every rank measures and every rank must call :meth:`write_manifest`:
each leaves its figures and stack in the process group's store; rank 0 waits for them all, names
the slowest rank, warns when the ranks' stacks differ, and writes one signed manifest; the other
ranks write nothing.
Under ``capture exec`` the figures also go to the side file that exec merges into its manifest.
The framework callbacks (:mod:`capture.integrations.hf`, :mod:`capture.integrations.lightning`)
are thin layers over the methods below.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from capture._safe_read import tree_bytes
from capture.trial.devmem import DeviceMemory, MemoryReading
from capture.trial.measure import StepClock, StepStats, first_nonfinite, flops_per_token, make_clock, mfu, summarize

T = TypeVar("T")
SYNCED_TIMING = "host wall clock, the device synchronized before and after"

__all__ = ["Recorder", "RecorderResult", "device_name", "throughput_fields"]


def device_name(device: Any) -> str:
    """The accelerator's name as torch reports it, or the host CPU's model."""
    if getattr(device, "type", device) == "cuda":
        import torch

        return str(torch.cuda.get_device_name(device))
    from capture.probes.host import cpu_model  # the host probe's reading, so [host] and the trial agree

    model = cpu_model()
    return f"CPU: {model}" if model else "CPU"


def throughput_fields(tokens_per_s: float | None, params_total: int | None, params_trainable: int | None,
                      precision: str | None, name: str, catalog: Any) -> dict[str, Any]:
    """MFU where the tested device's peak is known for the precision used; the reason where not."""
    out: dict[str, Any] = {}
    if tokens_per_s is None or not params_total:
        out["mfu_note"] = "not computed: token counts or parameter counts unknown"
        return out
    card = catalog.match(name) if catalog is not None else None
    if card is None or card.peak_bf16_dense_flops is None:
        out["mfu_note"] = f"not computed: no peak FLOP/s for {name!r} in the accelerator catalog"
        return out
    if precision not in ("bf16", "fp16"):
        out["mfu_note"] = f"not computed: the catalog holds dense bf16/fp16 peaks and this run computed in {precision}"
        return out
    trainable = params_trainable if params_trainable is not None else params_total
    fpt, formula = flops_per_token(params_total, trainable)
    out["mfu"] = mfu(tokens_per_s, params_total, trainable, card.peak_bf16_dense_flops)
    out["peak_flops"] = card.peak_bf16_dense_flops
    out["peak_flops_source"] = f"catalog ({card.source}): {card.name}, dense {precision} peak"
    out["flops_per_token"] = fpt
    out["flops_formula"] = formula
    return out


def count_params(model: Any) -> tuple[int, int]:
    """All parameters and the trainable ones (``requires_grad``)."""
    params = list(model.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


@dataclass(frozen=True)
class TimedBlock:
    """Validation or checkpoint passes: how many, and how long each took (device synced around them)."""

    durations_s: tuple[float, ...] = ()
    bytes: tuple[int, ...] = ()
    source: str = ""

    def to_manifest(self) -> dict[str, Any]:
        if not self.durations_s:
            return {"skipped": "none ran while the Recorder was recording"}
        d = self.durations_s
        out: dict[str, Any] = {"count": len(d), "duration_s": sum(d) / len(d), "duration_max_s": max(d),
                               "duration_total_s": sum(d), "durations_s": list(d), "timing": self.source}
        if self.bytes:
            out["size_bytes"] = self.bytes[-1]
        return out


@dataclass(frozen=True)
class RecorderResult:
    """What one process measured (warm-up steps kept apart)."""

    device: str
    device_name: str
    clock: str
    warmup_steps: int
    warmup_step_time_s: tuple[float, ...]
    step_time_s: tuple[float, ...]
    data_wait_s: tuple[float, ...]
    loss: tuple[float, ...]
    tokens: tuple[int, ...]
    stats: StepStats | None
    memory: MemoryReading
    throughput: dict[str, Any] = field(default_factory=dict)
    validation: TimedBlock = TimedBlock()
    checkpoint: TimedBlock = TimedBlock()

    def stats_table(self) -> dict[str, Any]:
        if self.stats is None:
            return {"skipped": "no measured steps completed"}
        out = self.stats.to_manifest()
        out["clock"] = self.clock
        out.update(self.throughput)
        if self.loss:  # a NaN or infinite loss: the steps ran, but not as a run anyone would book
            bad = first_nonfinite(self.loss)
            out["loss_finite"] = bad is None
            if bad is not None:
                out["loss_first_nonfinite_step"] = bad
        return out

    def steps_table(self) -> dict[str, Any]:
        out: dict[str, Any] = {"step_time_s": list(self.step_time_s), "data_wait_s": list(self.data_wait_s),
                               "warmup_step_time_s": list(self.warmup_step_time_s), "clock": self.clock}
        if self.loss:
            out["loss"] = list(self.loss)
        if self.tokens:
            out["tokens"] = list(self.tokens)
        return out


class Recorder:
    """Context manager around a training loop (see the module docstring).

    ``device``: the torch device the loop runs on (default: CUDA when available, else CPU).
    ``warmup_steps``: the first steps, measured but left out of the statistics.
    ``tokens_per_step``: this process's tokens per step when :meth:`step` is not told.
    ``precision``: ``"bf16"``, ``"fp16"``, ``"fp32"``...; MFU needs ``bf16``/``fp16``.
    ``model`` (or ``params_total``/``params_trainable``): for MFU and the manifest.
    ``run``: extra ``[trial.run]`` fields (a framework's batch, accumulation, model revision).
    """

    def __init__(self, device: Any = None, *, warmup_steps: int = 0, tokens_per_step: int | None = None,
                 precision: str | None = None, model: Any = None, params_total: int | None = None,
                 params_trainable: int | None = None, run: Mapping[str, Any] | None = None, catalog: Any = None,
                 memory: DeviceMemory | None = None, expected_steps: int = 0) -> None:
        import torch

        if device is None:
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.device = torch.device(device)
        if warmup_steps < 0:
            raise ValueError("warmup_steps must be >= 0")
        if tokens_per_step is not None and tokens_per_step <= 0:
            raise ValueError("tokens_per_step must be > 0")
        self.warmup_steps = warmup_steps
        self.tokens_per_step = tokens_per_step
        self.precision = precision
        if model is not None and params_total is None:
            params_total, params_trainable = count_params(model)
        self.params_total, self.params_trainable = params_total, params_trainable
        self.run: dict[str, Any] = dict(run or {})
        self.catalog = catalog
        self.memory = memory or DeviceMemory(self.device)
        self._expected = expected_steps
        self._clock: StepClock | None = None
        self._step_marks: list[bool] = []  # per clock mark: True where it ends a step
        self._last_mark_host_s = 0.0
        self._waits: list[float] = []
        self._wait_now = 0.0
        self._tokens: list[int] = []
        self._losses: list[Any] = []
        self._val: list[float] = []
        self._ckpt: list[float] = []
        self._ckpt_bytes: list[int] = []
        self._result: RecorderResult | None = None
        self.validation_timing = SYNCED_TIMING
        """How validation passes were timed (a framework callback says what it saw)."""
        self.checkpoint_timing = SYNCED_TIMING
        self.steps = 0
        """Steps marked so far, warm-up included."""

    # ------------------------------------------------------------------ recording

    @property
    def measured_steps(self) -> int:
        """Steps marked so far after the warm-up: stop your loop on this one."""
        return max(0, self.steps - self.warmup_steps)

    @property
    def recording(self) -> bool:
        return self._clock is not None and self._result is None

    def start(self) -> "Recorder":
        """Begin recording (what ``with Recorder(...)`` does on entry)."""
        self.memory.reset_peaks()
        self._clock = make_clock(self.device, self._expected)
        self._mark(False)
        return self

    def __enter__(self) -> "Recorder":
        return self.start()

    def _mark(self, ends_step: bool) -> None:
        assert self._clock is not None, "use Recorder as a context manager (or call start())"
        self._clock.mark()
        self._step_marks.append(ends_step)
        self._last_mark_host_s = time.perf_counter()

    def batches(self, iterable: Iterable[T]) -> Iterator[T]:
        """Yield from ``iterable``, adding the time each ``next()`` blocked to the current step."""
        it = iter(iterable)
        clock = time.perf_counter
        while True:
            t0 = clock()
            try:
                item = next(it)
            except StopIteration:
                return
            self._wait_now += clock() - t0
            yield item

    def add_data_wait(self, seconds: float) -> None:
        """Add host time spent waiting for input to the current step (for loops that fetch elsewhere)."""
        self._wait_now += max(0.0, float(seconds))

    @property
    def last_mark_s(self) -> float:
        """``perf_counter()`` at the last step boundary or resume (host time)."""
        return self._last_mark_host_s

    def since_last_mark_s(self) -> float:
        """Host seconds since the last step boundary or resume (callbacks use it as data wait)."""
        return time.perf_counter() - self._last_mark_host_s

    def step(self, tokens: int | None = None, loss: Any = None) -> None:
        """Mark the end of one training step (after the optimizer step). ``loss`` may be a device
        tensor: it is read after the loop, so this never waits for the device."""
        self._mark(True)
        self._waits.append(self._wait_now)
        self._wait_now = 0.0
        if tokens is None:
            tokens = self.tokens_per_step
        if tokens is not None:
            self._tokens.append(int(tokens))
        if loss is not None:
            self._losses.append(loss.detach() if hasattr(loss, "detach") else loss)
        self.steps += 1

    def resume(self) -> None:
        """Start the next step's clock here: the time since the last boundary is not a step."""
        self._mark(False)

    def synced_now(self) -> float:
        """``perf_counter()`` after the device has finished its queued work (no sync on a CPU)."""
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def add_validation(self, seconds: float) -> None:
        """Record a validation pass that took ``seconds`` and leave it out of the step times."""
        self._val.append(float(seconds))
        if self.recording:
            self.resume()

    def add_checkpoint(self, seconds: float, path: str | os.PathLike[str] | None = None) -> None:
        """Record a checkpoint save (``path``: its file or folder, for the size) and leave it out
        of the step times."""
        self._ckpt.append(float(seconds))
        if path is not None:
            size = tree_bytes(path)
            if size is not None:
                self._ckpt_bytes.append(size)
        if self.recording:
            self.resume()

    @contextlib.contextmanager
    def validation(self) -> Iterator[None]:
        """``with rec.validation(): evaluate()``: timed with the device synced on both sides."""
        t0 = self.synced_now()
        try:
            yield
        finally:
            self.add_validation(self.synced_now() - t0)

    @contextlib.contextmanager
    def checkpoint(self, path: str | os.PathLike[str] | None = None) -> Iterator[None]:
        """``with rec.checkpoint("ckpt/"): save()``: timed with the device synced on both sides."""
        t0 = self.synced_now()
        try:
            yield
        finally:
            self.add_checkpoint(self.synced_now() - t0, path)

    def stop(self, exc: BaseException | None = None) -> RecorderResult:
        """End recording and compute the result (what leaving the ``with`` block does)."""
        assert self._clock is not None, "use Recorder as a context manager (or call start())"
        if self._result is not None:
            return self._result
        try:
            intervals = self._clock.durations_s()
        except Exception:  # the loop failed on the device: keep what the host knows
            if exc is None:
                raise
            intervals = []
        durations = [d for d, ends in zip(intervals, self._step_marks[1:]) if ends]
        durations = durations[: len(self._waits)]
        n = len(durations)
        losses = [float(x.float().item()) if hasattr(x, "item") else float(x) for x in self._losses]
        w = self.warmup_steps
        measured, waits = durations[w:], self._waits[w:n]
        tokens = self._tokens[w:n] if len(self._tokens) >= n else []
        stats = summarize(measured, waits, tokens or None) if measured else None
        name = device_name(self.device)
        throughput: dict[str, Any] = {}
        if stats is not None:
            throughput = throughput_fields(stats.tokens_per_s, self.params_total, self.params_trainable, self.precision,
                                           name, self.catalog if self.catalog is not None else _default_catalog())
        self._result = RecorderResult(
            device=str(self.device), device_name=name, clock=self._clock.kind, warmup_steps=min(w, n),
            warmup_step_time_s=tuple(durations[:w]), step_time_s=tuple(measured), data_wait_s=tuple(waits),
            loss=tuple(losses[w:n]), tokens=tuple(tokens), stats=stats, memory=self.memory.read(),
            throughput=throughput, validation=TimedBlock(tuple(self._val), source=self.validation_timing),
            checkpoint=TimedBlock(tuple(self._ckpt), tuple(self._ckpt_bytes), self.checkpoint_timing),
        )
        return self._result

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.stop(exc)

    @property
    def result(self) -> RecorderResult:
        if self._result is None:
            raise RuntimeError("the result exists once the `with Recorder(...)` block has ended")
        return self._result

    # ------------------------------------------------------------------ the manifest

    def trial_table(self) -> dict[str, Any]:
        """The ``[trial]`` table for this process's loop (no config: the loop is the user's)."""
        r = self.result
        run: dict[str, Any] = {"device": r.device, "device_name": r.device_name, "warmup_steps": r.warmup_steps,
                               "measured_steps": len(r.step_time_s)}
        if self.params_total is not None:
            run["params_total"] = self.params_total
        if self.params_trainable is not None:
            run["params_trainable"] = self.params_trainable
        if self.precision:
            run["precision"] = {"dtype": self.precision}
        run.update({k: v for k, v in self.run.items() if k != "config_source"})
        return {"config_source": str(self.run.get("config_source", "recorder (the user's own training loop)")),
                "run": run, "memory": {"measured": r.memory.to_manifest()}, "steps": r.steps_table(),
                "stats": r.stats_table(), "validation": r.validation.to_manifest(),
                "checkpoint": r.checkpoint.to_manifest()}

    def write_manifest(self, path: str | os.PathLike[str] | None, key: str | os.PathLike[str] | None = None,
                       principal: str | None = None, options: Any = None, report: bool = True,
                       trackers: Sequence[Any] = ()) -> Path | None:
        """Fingerprint this machine, add the ``[trial]`` table and write it signed (``key``: the
        default key, created on first use, unless given), with ``<path>.html`` beside it.

        Under ``torch.distributed`` call it on every rank: rank 0 writes one manifest for all and
        returns its path, the other ranks return None. Under ``capture exec`` the figures also go
        to exec's side file; ``path=None`` then writes only that. ``trackers``: objects from
        :mod:`capture.integrations.trackers` that get the manifest and the step figures.
        """
        from capture.fingerprint import collect
        from capture.integrations import distributed, exec_side
        from capture.probes import ProbeOptions

        if path is None and not exec_side.active():
            raise ValueError("write_manifest: a path is needed outside `capture exec`")
        manifest = collect(options or ProbeOptions(progress=False), kind="trial")
        trial = self.trial_table()
        ranks = distributed.gather(self.result, trial, manifest)
        if ranks is not None and not ranks.is_writer:
            return None
        if ranks is not None:
            trial["distributed"] = ranks.table
            trial["run"].update(ranks.run_fields)
            for warning in ranks.warnings:
                sys.stderr.write(f"capture: warning: {warning}\n")
        manifest["trial"] = trial
        exec_side.publish(trial)
        if path is None:
            return None
        out = Path(path)
        if report:
            from capture.integrations.html import report_table

            trial["report"] = report_table(manifest, out.with_suffix(".html"))
        else:
            trial["report"] = {"skipped": "report=False"}
        _write_signed(out, manifest, key, principal)
        for tracker in trackers:
            tracker.log(out, trial)
        return out


def _write_signed(path: Path, manifest: dict[str, Any], key: str | os.PathLike[str] | None, principal: str | None) -> None:
    from capture import manifest as mf
    from capture import signing

    key_path = Path(key) if key else signing.ensure_default_key()
    signing.write_signed(path, mf.dumps(manifest), key_path, principal)


_CATALOG: Any = None


def _default_catalog() -> Any:
    global _CATALOG
    if _CATALOG is None:
        from capture.trial.fit import load_catalog

        try:
            _CATALOG = load_catalog()
        except Exception as exc:  # a broken user catalog must not lose a finished measurement
            sys.stderr.write(f"capture: accelerator catalog not read ({exc}); MFU not computed\n")
            return None
    return _CATALOG

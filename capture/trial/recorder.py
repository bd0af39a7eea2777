"""The trial's measurements around a training loop we did not write.

::

    from capture.trial.recorder import Recorder

    with Recorder(device="cuda", warmup_steps=3) as rec:
        for batch in rec.batches(loader):           # times how long next(loader) blocks
            loss = train_one_step(batch)            # your forward, backward, optimizer step
            rec.step(tokens=batch.numel(), loss=loss)   # a step boundary; no host sync
            if rec.steps == 23:
                break
    print(rec.result.stats.step_time_median_s)
    rec.write_manifest("run.toml")                  # fingerprint + [trial], signed

It gives the same statistics as ``capture trial``: per-step time (CUDA events on a GPU, read
once at the end; perf_counter on a CPU), data-loader wait, median/p90/p99/CV, stall share,
tokens/s, MFU where the device's peak is in the catalog, peak allocated and reserved memory and
the device's own figure (NVML/amdsmi; peak RSS on a CPU). The runner uses it for its own steps.
"""

from __future__ import annotations

import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, TypeVar

from capture.trial.devmem import DeviceMemory, MemoryReading
from capture.trial.measure import StepClock, StepStats, flops_per_token, make_clock, mfu, summarize

T = TypeVar("T")


def device_name(device: Any) -> str:
    """The accelerator's name as torch reports it, or the host CPU's model."""
    if getattr(device, "type", device) == "cuda":
        import torch

        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            m = re.search(r"^model name\s*:\s*(.+)$", f.read(), re.M)
        if m:
            return f"CPU: {m.group(1).strip()}"
    except OSError:
        pass
    return "CPU"


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
    fpt, formula = flops_per_token(params_total, params_trainable if params_trainable is not None else params_total)
    out["mfu"] = mfu(tokens_per_s, params_total, params_trainable if params_trainable is not None else params_total,
                     card.peak_bf16_dense_flops)
    out["peak_flops"] = card.peak_bf16_dense_flops
    out["peak_flops_source"] = f"catalog ({card.source}): {card.name}, dense {precision} peak"
    out["flops_per_token"] = fpt
    out["flops_formula"] = formula
    return out


@dataclass(frozen=True)
class RecorderResult:
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

    def stats_table(self) -> dict[str, Any]:
        if self.stats is None:
            return {"skipped": "no measured steps completed"}
        out = self.stats.to_manifest()
        out["clock"] = self.clock
        out.update(self.throughput)
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
    """Context manager around a training loop. See the module docstring."""

    def __init__(self, device: Any = None, *, warmup_steps: int = 0, precision: str | None = None,
                 model: Any = None, params_total: int | None = None, params_trainable: int | None = None,
                 catalog: Any = None, memory: DeviceMemory | None = None, expected_steps: int = 0) -> None:
        import torch

        if device is None:
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.device = torch.device(device)
        if warmup_steps < 0:
            raise ValueError("warmup_steps must be >= 0")
        self.warmup_steps = warmup_steps
        self.precision = precision
        if model is not None and params_total is None:
            from capture.trial.workload import count_params

            params_total, params_trainable = count_params(model)
        self.params_total, self.params_trainable = params_total, params_trainable
        self.catalog = catalog
        self.memory = memory or DeviceMemory(self.device)
        self._expected = expected_steps
        self._clock: StepClock | None = None
        self._waits: list[float] = []
        self._wait_now = 0.0
        self._tokens: list[int] = []
        self._losses: list[Any] = []
        self._result: RecorderResult | None = None
        self.steps = 0

    def __enter__(self) -> "Recorder":
        self.memory.reset_peaks()
        self._clock = make_clock(self.device, self._expected)
        self._clock.mark()
        return self

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

    def step(self, tokens: int | None = None, loss: Any = None) -> None:
        """Mark the end of one training step (after the optimizer step). ``loss`` may be a device
        tensor: it is read after the loop, so this never waits for the device."""
        assert self._clock is not None, "use Recorder as a context manager"
        self._clock.mark()
        self._waits.append(self._wait_now)
        self._wait_now = 0.0
        if tokens is not None:
            self._tokens.append(int(tokens))
        if loss is not None:
            self._losses.append(loss.detach() if hasattr(loss, "detach") else loss)
        self.steps += 1

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        assert self._clock is not None
        try:
            durations = self._clock.durations_s()
        except Exception:  # the loop failed on the device: keep what the host knows
            if exc is None:
                raise
            durations = []
        durations = durations[: len(self._waits)]
        losses = [float(x.float().item()) if hasattr(x, "item") else float(x) for x in self._losses]
        w = self.warmup_steps
        measured, waits = durations[w:], self._waits[w:len(durations)]
        tokens = self._tokens[w:len(durations)] if len(self._tokens) >= len(durations) else []
        stats = summarize(measured, waits, tokens or None) if measured else None
        name = device_name(self.device)
        throughput = {}
        if stats is not None:
            throughput = throughput_fields(stats.tokens_per_s, self.params_total, self.params_trainable,
                                           self.precision, name, self.catalog if self.catalog is not None else _default_catalog())
        self._result = RecorderResult(
            device=str(self.device), device_name=name, clock=self._clock.kind, warmup_steps=min(w, len(durations)),
            warmup_step_time_s=tuple(durations[:w]), step_time_s=tuple(measured), data_wait_s=tuple(waits),
            loss=tuple(losses[w:len(durations)]), tokens=tuple(tokens), stats=stats, memory=self.memory.read(),
            throughput=throughput,
        )

    @property
    def result(self) -> RecorderResult:
        if self._result is None:
            raise RuntimeError("the result exists once the `with Recorder(...)` block has ended")
        return self._result

    def trial_table(self) -> dict[str, Any]:
        """The ``[trial]`` table for a recorded loop (no config: the loop is the user's)."""
        r = self.result
        run: dict[str, Any] = {"device": r.device, "device_name": r.device_name, "warmup_steps": r.warmup_steps,
                               "measured_steps": len(r.step_time_s)}
        if self.params_total is not None:
            run["params_total"] = self.params_total
        if self.params_trainable is not None:
            run["params_trainable"] = self.params_trainable
        if self.precision:
            run["precision"] = {"dtype": self.precision}
        return {"config_source": "recorder (the user's own training loop)", "run": run,
                "memory": {"measured": r.memory.to_manifest()}, "steps": r.steps_table(), "stats": r.stats_table()}

    def write_manifest(self, path: str | os.PathLike[str], key: str | os.PathLike[str] | None = None,
                       principal: str | None = None, options: Any = None) -> Path:
        """Fingerprint this machine, add the ``[trial]`` table and write it signed
        (key: ``key`` or the default key, created on first use)."""
        from capture.trial.runner import write_manifest

        from capture.fingerprint import collect
        from capture.probes import ProbeOptions

        manifest = collect(options or ProbeOptions(progress=False), kind="trial")
        manifest["trial"] = self.trial_table()
        return write_manifest(Path(path), manifest, key, principal)


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

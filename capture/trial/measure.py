"""Step clocks and step statistics.

On CUDA/ROCm a step is timed by CUDA events recorded at step boundaries on the current stream:
the host returns from a launch long before the device finishes it, and a synchronize per step
would both slow the run and change what is measured. The events are read once, after one
synchronize at the end. On a CPU the wall clock (perf_counter) is the step time.

Data-loader wait is always host time: how long ``next(loader)`` blocked.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Sequence

PERCENTILE_METHOD = "linear interpolation between closest ranks (numpy's default)"


class StepClock:
    """Marks step boundaries; :meth:`durations_s` gives the time between consecutive marks."""

    kind = "perf_counter"

    def __init__(self) -> None:
        self._marks: list[float] = []

    def mark(self) -> None:
        self._marks.append(time.perf_counter())

    def durations_s(self) -> list[float]:
        m = self._marks
        return [m[i + 1] - m[i] for i in range(len(m) - 1)]

    @property
    def marks(self) -> int:
        return len(self._marks)


class CudaStepClock(StepClock):
    """Boundaries as CUDA events (``enable_timing=True``); no host sync until :meth:`durations_s`."""

    kind = "cuda_events"

    def __init__(self, device: Any, expected_steps: int = 0) -> None:
        import torch

        self._torch, self._device = torch, device
        # Events created up front, so the loop only records; more are made if the loop runs longer.
        self._pool = [torch.cuda.Event(enable_timing=True) for _ in range(expected_steps + 1)]
        self._events: list[Any] = []

    def mark(self) -> None:
        ev = self._pool.pop() if self._pool else self._torch.cuda.Event(enable_timing=True)
        ev.record()
        self._events.append(ev)

    def durations_s(self) -> list[float]:
        self._torch.cuda.synchronize(self._device)
        e = self._events
        return [e[i].elapsed_time(e[i + 1]) / 1e3 for i in range(len(e) - 1)]

    @property
    def marks(self) -> int:
        return len(self._events)


def make_clock(device: Any, expected_steps: int = 0) -> StepClock:
    return CudaStepClock(device, expected_steps) if getattr(device, "type", device) == "cuda" else StepClock()


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), linear interpolation between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class StepStats:
    """Statistics of the measured steps (warm-up excluded)."""

    steps: int
    step_time_median_s: float
    step_time_mean_s: float
    step_time_p90_s: float
    step_time_p99_s: float
    step_time_min_s: float
    step_time_max_s: float
    step_time_cv: float
    """Coefficient of variation: population standard deviation / mean."""
    data_wait_total_s: float
    stall_share: float
    """Data-loader wait / total step time."""
    tokens_per_step: int | None
    tokens_per_s: float | None
    """Tokens of all measured steps / their total time (so stalls count against it)."""

    def to_manifest(self) -> dict[str, Any]:
        return {
            "measured_steps": self.steps,
            "step_time_median_s": self.step_time_median_s,
            "step_time_mean_s": self.step_time_mean_s,
            "step_time_p90_s": self.step_time_p90_s,
            "step_time_p99_s": self.step_time_p99_s,
            "step_time_min_s": self.step_time_min_s,
            "step_time_max_s": self.step_time_max_s,
            "step_time_cv": self.step_time_cv,
            "data_wait_total_s": self.data_wait_total_s,
            "stall_share": self.stall_share,
            "tokens_per_step": self.tokens_per_step,
            "tokens_per_s": self.tokens_per_s,
            "percentile_method": PERCENTILE_METHOD,
        }


def summarize(step_times_s: Sequence[float], data_wait_s: Sequence[float],
              tokens: Sequence[int] | None = None) -> StepStats:
    """Median, p90, p99, CV, stall share and throughput of measured steps."""
    n = len(step_times_s)
    if n == 0:
        raise ValueError("no measured steps")
    if len(data_wait_s) != n:
        raise ValueError("one data-wait value per step is needed")
    total = float(sum(step_times_s))
    mean = total / n
    std = math.sqrt(sum((t - mean) ** 2 for t in step_times_s) / n)
    wait = float(sum(data_wait_s))
    per_step = None
    tok_s = None
    if tokens is not None:
        if len(tokens) != n:
            raise ValueError("one token count per step is needed")
        per_step = int(tokens[0]) if len(set(tokens)) == 1 else None
        tok_s = float(sum(tokens)) / total if total > 0 else None
    return StepStats(
        steps=n, step_time_median_s=percentile(step_times_s, 50), step_time_mean_s=mean,
        step_time_p90_s=percentile(step_times_s, 90), step_time_p99_s=percentile(step_times_s, 99),
        step_time_min_s=min(step_times_s), step_time_max_s=max(step_times_s),
        step_time_cv=std / mean if mean > 0 else 0.0, data_wait_total_s=wait,
        stall_share=wait / total if total > 0 else 0.0, tokens_per_step=per_step, tokens_per_s=tok_s,
    )


def flops_per_token(params_total: int, params_trainable: int) -> tuple[float, str]:
    """Training FLOPs per token: forward 2N, backward 2N for activation gradients plus 2N_trainable
    for weight gradients (6N for a full fine-tune; ~4N for LoRA). Attention-score FLOPs excluded."""
    return (4.0 * params_total + 2.0 * params_trainable,
            "4 x params_total + 2 x params_trainable (6N for a full fine-tune; attention scores not counted)")


def mfu(tokens_per_s: float, params_total: int, params_trainable: int, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved training FLOP/s over the device's peak."""
    return tokens_per_s * flops_per_token(params_total, params_trainable)[0] / peak_flops


def first_nonfinite(values: Any) -> int | None:
    """The 1-based position of the first value that is not a finite number (a NaN or infinite
    loss), or None. Manifests write NaN and infinity as the strings ``"nan"``, ``"inf"``: those count."""
    if not isinstance(values, (list, tuple)):
        return None
    for i, v in enumerate(values):
        if isinstance(v, bool):
            continue
        try:
            f = float(v)
        except (TypeError, ValueError, OverflowError):
            continue
        if not math.isfinite(f):
            return i + 1
    return None

"""Wall time per phase, the cost of the whole trial, and a projection on the tested card.

The rental window includes everything (guide section 7): loading, the estimate, the steps,
validation, the checkpoint write and the restore checks are all phases of the trial's wall time.
The cost of a successful output divides the *whole* trial's cost by the tokens of optimizer steps
that completed (packed sequences, so no padding counts), never by a theoretical peak.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any, Iterator


class PhaseTimer:
    """Wall time of named phases, and of the whole run since ``t0``."""

    def __init__(self, t0: float | None = None) -> None:
        self.t0 = time.perf_counter() if t0 is None else t0
        self.phases: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        from capture.trial.scratch import pause_point

        pause_point(name)  # test-only: wait for a signal here when the environment asks (capture.trial.scratch)
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - start

    def total_s(self) -> float:
        return time.perf_counter() - self.t0

    def to_manifest(self) -> dict[str, float]:
        return {f"{k}_s": v for k, v in self.phases.items()}


@dataclass(frozen=True)
class Price:
    per_hour: float
    """Price of one device for one hour, in ``currency``."""
    source: str
    currency: str | None = None


def resolve_price(cli_price: float | None, tested_card: Any, currency: str | None = None) -> Price | None:
    """``--price-per-hour`` (in ``currency``, else the catalog's), else the tested card's catalog price."""
    if cli_price is not None:
        return Price(cli_price, "--price-per-hour", currency or _catalog_currency(None))
    if tested_card is not None and getattr(tested_card, "price_per_hour", None):
        return Price(tested_card.price_per_hour, f"catalog ({tested_card.source}): {tested_card.name}",
                     getattr(tested_card, "currency", None) or _catalog_currency(None))
    return None


def _catalog_currency(card: Any) -> str | None:
    if card is not None and getattr(card, "currency", None):
        return str(card.currency)
    from capture.costs import default_currency

    return default_currency()


@dataclass(frozen=True)
class Projection:
    """What a full run of ``target_tokens`` would take on the tested device at the measured rates."""

    target_tokens: int
    target_source: str
    steps: int
    train_s: float
    validation_s: float
    checkpoint_s: float
    fixed_s: float

    @property
    def total_s(self) -> float:
        return self.train_s + self.validation_s + self.checkpoint_s + self.fixed_s

    def to_manifest(self, price: Price | None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "target_tokens": self.target_tokens, "target_source": self.target_source, "optimizer_steps": self.steps,
            "train_s": self.train_s, "validation_s": self.validation_s, "checkpoint_s": self.checkpoint_s,
            "fixed_s": self.fixed_s, "total_s": self.total_s, "total_h": self.total_s / 3600,
            "basis": "measured mean step time, validation and checkpoint durations and load time of this trial, "
                     "on the tested device only",
        }
        if price is not None:
            out["cost"] = self.total_s / 3600 * price.per_hour
        return out


def project(target_tokens: int, target_source: str, tokens_per_step: int, step_time_mean_s: float,
            validation_s: float | None, validation_every_steps: int, checkpoint_s: float | None,
            checkpoint_every_steps: int, fixed_s: float) -> Projection:
    """Steps to reach the target, times the measured step time, plus validations and checkpoints
    at the configured schedule (one final checkpoint always) and the measured fixed costs."""
    steps = math.ceil(target_tokens / tokens_per_step)
    vals = steps // validation_every_steps if validation_s is not None else 0
    ckpts = (steps // checkpoint_every_steps if checkpoint_every_steps else 0) + 1 if checkpoint_s is not None else 0
    return Projection(target_tokens, target_source, steps, steps * step_time_mean_s,
                      vals * (validation_s or 0.0), ckpts * (checkpoint_s or 0.0), fixed_s)


def cost_table(*, timer: PhaseTimer, wall_total_s: float, price: Price | None, trained_tokens: int,
               completed_steps: int, projection: Projection | None, device_name: str) -> dict[str, Any]:
    """The ``[trial.cost]`` table."""
    out: dict[str, Any] = {
        "wall_total_s": wall_total_s,
        "phases": timer.to_manifest(),
        "wall_unaccounted_s": max(0.0, wall_total_s - sum(timer.phases.values())),
        "trained_tokens": trained_tokens,
        "trained_tokens_note": "tokens of completed optimizer steps (warm-up and measured), packed: no padding",
        "completed_optimizer_steps": completed_steps,
        "device": device_name,
    }
    if price is None:
        out["price_note"] = "no price: pass --price-per-hour or add price_per_hour to your accelerator catalog"
    else:
        total = wall_total_s / 3600 * price.per_hour
        out.update(price_per_hour=price.per_hour, price_source=price.source, trial_cost=total)
        if price.currency:
            out["currency"] = price.currency
        if trained_tokens:
            out["cost_per_million_trained_tokens"] = total / (trained_tokens / 1e6)
    if projection is not None:
        out["projection"] = projection.to_manifest(price)
    return out

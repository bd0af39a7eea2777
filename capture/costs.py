"""The one cost vocabulary (DESIGN decision 8; docs/decide.md, "Three cost figures").

Every reader takes its cost figures from here, under these names and with their currency:
`capture decide` (terminal, ``--json``, site), `capture show`, `capture compare`, the trial report
and the results index.

- **trial cost** (:data:`TRIAL_COST`): what the trial itself cost, its whole wall time at the price
  per device-hour (``[trial.cost] trial_cost``), and that divided by the tokens it trained
  (guide point 8: the full trial cost over the successful output).
- **cost per million tokens at steady state** (:data:`STEADY_COST`): price per device-hour ×
  devices ÷ measured tokens/s, for a million tokens.
- **projected cost and time to the target** (:data:`PROJECTED`): optimizer steps to the target ×
  the measured mean step time, plus validation and checkpoints at the configured schedule and the
  measured fixed costs (:func:`capture.trial.cost.project`), at the price × devices. One target for
  every reader: ``--target-tokens`` where a command takes it, else :data:`DEFAULT_TARGET_TOKENS`;
  a manifest's own recorded projection is never mixed in.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from capture.fmt import MISSING, number_str, seconds_str
from capture.manifest import dig, table_at
from capture.trial.cost import Projection, project

TRIAL_COST = "trial cost"
STEADY_COST = "cost per million tokens at steady state"
PROJECTED = "projected cost and time to the target"
NAMES = (TRIAL_COST, STEADY_COST, PROJECTED)
DEFAULT_TARGET_TOKENS = 1_000_000_000
FALLBACK_CURRENCY = "USD"


def default_currency() -> str:
    """The catalog's currency (shipped, then ``~/.config/capture/accelerators.toml``)."""
    from capture.errors import CaptureError
    from capture.trial.fit import load_catalog

    try:
        return load_catalog().currency
    except CaptureError:  # a broken personal catalog must not stop a reader; decide reports it
        return FALLBACK_CURRENCY


def _num(v: Any) -> float | None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    return float(v) if ok else None


# --------------------------------------------------------------------------- flags


def parse_tokens(text: str) -> int:
    """``--target-tokens``: a whole positive number, written ``1e9``, ``2e9``, ``1_000_000_000`` or ``1000000000``."""
    s = text.strip()
    try:
        value = int(s)
    except ValueError:
        try:
            f = float(s)
        except ValueError:
            f = math.nan
        value = int(f) if math.isfinite(f) and f.is_integer() else -1
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number of tokens above 0, e.g. 1e9 or 2000000000")
    return value


def parse_positive(text: str) -> float:
    """``--target-epochs`` and prices: a finite number above 0 (``3``, ``0.5``, ``2e9``)."""
    try:
        f = float(text)
    except ValueError:
        f = math.nan
    if not (math.isfinite(f) and f > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number above 0, e.g. 3 or 1.5")
    return f


# --------------------------------------------------------------------------- values


def money_str(v: float | None, currency: str | None = None) -> str:
    """``16.28 USD``, ``0.01489 USD``, ``1,628 USD``: four significant digits below 1, cents above."""
    if v is None:
        return MISSING
    a = abs(v)
    if a >= 1000:
        s = f"{v:,.0f}"
    elif a >= 1:
        s = f"{v:,.2f}"
    elif a == 0:
        s = "0"
    else:
        s = f"{v:.{3 - math.floor(math.log10(a))}f}"
    return f"{s} {currency}" if currency else s


@dataclass(frozen=True)
class Price:
    per_device_hour: float
    source: str
    """Where it came from: ``--price H200=3.5``, ``catalog (FILE): NAME``, ``manifest (--price-per-hour)``."""
    currency: str


@dataclass(frozen=True)
class Target:
    tokens: int
    source: str
    """``--target-tokens``, ``the default target``, ``--target-epochs 2 x 983,040 training tokens``."""

    def text(self) -> str:
        return f"{self.tokens:,} tokens ({self.source})"


def default_target() -> Target:
    return Target(DEFAULT_TARGET_TOKENS, "the default target")


def manifest_price(data: Mapping[str, Any], currency: str | None = None) -> Price | None:
    """The price the trial recorded, in its recorded currency (else ``currency``, else the catalog's)."""
    own = _num(dig(data, "trial.cost.price_per_hour"))
    if not own or own <= 0:
        return None
    cur = dig(data, "trial.cost.currency")
    cur = cur if isinstance(cur, str) and cur else (currency or default_currency())
    return Price(own, f"manifest ({dig(data, 'trial.cost.price_source') or 'recorded price'})", cur)


def recorded_currency(data: Mapping[str, Any]) -> str:
    """The currency of a manifest's own figures: recorded with its price, else the catalog's."""
    cur = dig(data, "trial.cost.currency")
    return cur if isinstance(cur, str) and cur else default_currency()


# --------------------------------------------------------------------------- the three figures


@dataclass(frozen=True)
class CostFigures:
    """The three figures of one configuration (a manifest's single-device run, or one of its
    ``[scaling]`` strategies) at one price, target and currency."""

    currency: str
    price: Price | None
    devices: int
    tokens_per_s: float | None
    trial_cost: float | None
    trial_wall_s: float | None
    trained_tokens: float | None
    steady_cost_per_million_tokens: float | None
    target: Target
    projection: Projection | None
    projected_cost: float | None
    note: str | None = None
    """Why a figure is missing (no price, a price in another currency, no measured tokens/s)."""

    @property
    def projected_time_s(self) -> float | None:
        return self.projection.total_s if self.projection else None

    @property
    def trial_cost_per_million_trained_tokens(self) -> float | None:
        if self.trial_cost is None or not self.trained_tokens:
            return None
        return self.trial_cost / (self.trained_tokens / 1e6)

    def money(self, v: float | None) -> str:
        return money_str(v, self.currency)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "currency": self.currency, "devices": self.devices,
            "trial_cost": self.trial_cost,
            "trial_cost_per_million_trained_tokens": self.trial_cost_per_million_trained_tokens,
            "steady_cost_per_million_tokens": self.steady_cost_per_million_tokens,
            "target_tokens": self.target.tokens, "target_source": self.target.source,
            "projected_cost": self.projected_cost, "projected_time_s": self.projected_time_s,
            "cost_note": self.note,
        }
        if self.price:
            out.update(price_per_device_hour=self.price.per_device_hour, price_source=self.price.source)
        return {k: v for k, v in out.items() if v is not None}

    def _unpriced(self, what: str, with_note: bool) -> str:
        return f"{what} ({self.note})" if self.note and with_note else what if self.note else MISSING

    def trial_text(self, with_note: bool = True) -> str:
        if self.trial_cost is None:
            return self._unpriced("not priced", with_note)
        per = self.trial_cost_per_million_trained_tokens
        wall = f", {seconds_str(self.trial_wall_s)}" if self.trial_wall_s is not None else ""
        return (f"{self.money(self.trial_cost)} for the whole trial{wall}"
                + (f"; {self.money(per)} per million trained tokens" if per is not None else ""))

    def steady_text(self, with_note: bool = True) -> str:
        if self.steady_cost_per_million_tokens is None:
            return self._unpriced("not priced", with_note)
        p = self.price
        assert p is not None
        devices = f"{self.devices} device" + ("s" if self.devices != 1 else "")
        return (f"{self.money(self.steady_cost_per_million_tokens)} per million tokens "
                f"({p.per_device_hour:g} {self.currency} per device-hour x {devices} "
                f"at {number_str(self.tokens_per_s)} tokens/s)")

    def projected_text(self, with_note: bool = True) -> str:
        if self.projection is None:
            return self._unpriced("not projected", with_note)
        time = seconds_str(self.projected_time_s)
        cost = f"{self.money(self.projected_cost)} and " if self.projected_cost is not None else ""
        unpriced = ("; no cost" + (f": {self.note}" if with_note else "")) if self.projected_cost is None and self.note else ""
        return f"{cost}{time} to {self.target.text()}{unpriced}"

    def texts(self, note: bool = True) -> list[tuple[str, str]]:
        """The three figures as (name, text), in the vocabulary's order. Why a figure is missing
        (``note``) is said once, at the first figure it leaves out; ``note=False``: never (a caller
        that said it already)."""
        out = []
        for name, text in ((TRIAL_COST, self.trial_text), (STEADY_COST, self.steady_text), (PROJECTED, self.projected_text)):
            full = text(note)
            out.append((name, full))
            if note and self.note and self.note in full:
                note = False
        return out

    def projection_rows(self) -> list[list[str]]:
        """The projection as a table: each part's time and cost ([part, time, cost])."""
        pr = self.projection
        if pr is None:
            return []
        rate = self.price.per_device_hour * self.devices / 3600 if self.price and self.projected_cost is not None else None
        parts = [(f"training: {pr.steps:,} optimizer steps", pr.train_s), ("validation at the configured schedule", pr.validation_s),
                 ("checkpoints at the configured schedule", pr.checkpoint_s),
                 ("fixed: framework import, device context, load", pr.fixed_s),
                 (f"total to {pr.target_tokens:,} tokens", pr.total_s)]
        return [[name, seconds_str(s), money_str(s * rate) if rate is not None else MISSING] for name, s in parts]


class _Own:
    """The default of :func:`figures`' arguments: read it from the manifest."""


OWN: Any = _Own()


def figures(data: Mapping[str, Any], *, price: Price | None = OWN, currency: str | None = None,
            target: Target | None = None, devices: int = 1, tokens_per_s: float | None = OWN,
            tokens_per_step: float | None = OWN, step_time_mean_s: float | None = OWN) -> CostFigures:
    """The three figures of a manifest. Defaults read the single-device run at the manifest's own
    price and currency and :func:`default_target`; a scaling strategy passes its own devices,
    tokens/s and tokens per step (its step time follows). ``price=None``: no price."""
    stats = table_at(data, "trial.stats")
    tps = _num(stats.get("tokens_per_s") if tokens_per_s is OWN else tokens_per_s)
    per_step = _num(stats.get("tokens_per_step") if tokens_per_step is OWN else tokens_per_step)
    step_mean = _num(stats.get("step_time_mean_s") if step_time_mean_s is OWN else step_time_mean_s)
    if price is OWN:
        price = manifest_price(data, currency)
    currency = currency or (price.currency if price else recorded_currency(data))
    target = target or default_target()
    note = None
    if price is not None and price.currency != currency:
        note = f"the price is in {price.currency}, not {currency}: give --price CARD=PRICE in {currency}"
        price = None
    elif price is None:
        note = "no price: give --price (decide) or --price-per-hour (trial), or a catalog price_per_hour"
    if tps is None and note is None:
        note = "no measured tokens/s"
    wall = _num(dig(data, "trial.cost.wall_total_s"))
    trained = _num(dig(data, "trial.cost.trained_tokens"))
    trial_cost = None
    if price is not None and wall is not None:
        recorded = _num(dig(data, "trial.cost.trial_cost"))
        same = _num(dig(data, "trial.cost.price_per_hour")) == price.per_device_hour
        trial_cost = recorded if (same and recorded is not None) else wall / 3600 * price.per_device_hour
    steady = price.per_device_hour * devices / 3600 / tps * 1e6 if (price is not None and tps) else None
    proj = projection(data, target, per_step, step_mean)
    cost = proj.total_s / 3600 * price.per_device_hour * devices if (proj is not None and price is not None) else None
    return CostFigures(currency, price, devices, tps, trial_cost, wall, trained, steady, target, proj, cost, note)


def projection(data: Mapping[str, Any], target: Target, tokens_per_step: float | None,
               step_time_mean_s: float | None) -> Projection | None:
    """Time to ``target`` from the manifest's own measured figures, as `capture trial` projects."""
    if not tokens_per_step or not step_time_mean_s:
        return None
    phases = table_at(data, "trial.cost.phases")
    fixed = sum(_num(phases.get(k)) or 0.0 for k in ("import_framework_s", "device_context_s", "load_s"))
    val_every = _num(dig(data, "trial.run.validation_schedule.every_steps")) \
        or _num(dig(data, "trial.validation.every_steps")) or 0
    ckpt_every = _num(dig(data, "trial.run.checkpoint_schedule.every_steps")) \
        or _num(dig(data, "trial.checkpoint.every_steps")) or 0
    return project(target.tokens, target.source, int(tokens_per_step), step_time_mean_s,
                   _num(dig(data, "trial.validation.duration_s")), int(val_every) or 1 << 62,
                   _num(dig(data, "trial.checkpoint.duration_s")), int(ckpt_every), fixed)

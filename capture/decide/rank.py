"""Groups of runs with one definition, their tested configurations, and the ranking.

A configuration is a card × count × strategy that a trial measured: the single-device run itself
(``single``) and, where the manifest holds ``[scaling]``, each strategy at the world size. Its
figures are the manifest's own; the three cost figures come from :mod:`capture.costs` (the one cost
vocabulary) at a price with its source and at ONE target for the whole decision: a manifest's
own recorded projection is never mixed in. Untested cards get no speed figures (settled decision
5): a memory fit at most, marked estimate.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from capture import costs
from capture.costs import CostFigures, Price, Target
from capture.decide.runs import Run, RunDefinition
from capture.errors import UsageError
from capture.manifest import dig, table_at
from capture.results.compare import significant
from capture.trial.fit import Catalog
from capture.trial.measure import first_nonfinite
from capture.trial.report.checks import HIGH_CV

log = logging.getLogger(__name__)

DEFAULT_TARGET_TOKENS = costs.DEFAULT_TARGET_TOKENS
MAX_REASONS = 6
"""Differences named in a group's left-out reason (``--json`` has every setting)."""


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def parse_prices(items: Sequence[str]) -> dict[str, float]:
    """``--price CARD=PRICE`` flags (per device and hour)."""
    out: dict[str, float] = {}
    for item in items:
        card, sep, price = item.partition("=")
        try:
            value = float(price)
        except ValueError:
            value = -1.0
        if not sep or not card.strip() or not value > 0 or value == float("inf"):
            raise UsageError(f"--price {item}: expected CARD=PRICE with a positive price per device and hour",
                             "e.g. --price H200=3.50 --price 'A100 80GB SXM=1.80'")
        out[card.strip()] = value
    return out


def resolve_price(device_name: str, catalog: Catalog, prices: Mapping[str, float],
                  data: Mapping[str, Any], currency: str) -> Price | None:
    """``--price`` first (the flag's CARD matched as the catalog does, or as a substring; in the
    decision's currency), then the catalog file's price (in its currency), then the manifest's own."""
    card = catalog.match(device_name)
    for name, value in prices.items():
        if (card is not None and name.lower() == card.name.lower()) or name.lower() in device_name.lower() \
                or (card is not None and name.lower() in card.name.lower()):
            return Price(value, f"--price {name}={value:g}", currency)
    if card is not None and card.price_per_hour:
        return Price(card.price_per_hour, f"catalog ({card.source}): {card.name}", card.currency)
    return costs.manifest_price(data, catalog.currency)


@dataclass(frozen=True)
class Config:
    """One tested configuration of one run."""

    run: Run
    card: str
    count: int
    strategy: str
    """``single``, ``ddp`` or ``fsdp``."""
    tokens_per_s: float | None
    step_time_median_s: float | None
    step_time_cv: float | None
    efficiency: float | None
    peak_memory_bytes: float | None
    memory_per_device_bytes: float | None
    recovery: str | None
    preflight: str | None
    cost: CostFigures
    """The three cost figures (:mod:`capture.costs`) at the decision's price, currency and target."""
    notes: tuple[str, ...] = ()
    rank_cost: int | None = None
    rank_time: int | None = None
    within_noise_of_best: bool | None = None
    loss_nonfinite_step: int | None = None
    """The first measured step whose loss was NaN or infinite: such a run is listed, never ranked."""

    @property
    def label(self) -> str:
        return f"{self.card} x{self.count} {self.strategy}"

    @property
    def run_id(self) -> str:
        return self.run.slug

    @property
    def price(self) -> Price | None:
        return self.cost.price

    @property
    def target(self) -> Target:
        return self.cost.target

    @property
    def target_tokens(self) -> int:
        return self.cost.target.tokens

    @property
    def time_to_target_s(self) -> float | None:
        return self.cost.projected_time_s

    @property
    def cost_to_target(self) -> float | None:
        return self.cost.projected_cost

    @property
    def headroom_fraction(self) -> float | None:
        if self.peak_memory_bytes is None or not self.memory_per_device_bytes:
            return None
        return 1 - self.peak_memory_bytes / self.memory_per_device_bytes

    @property
    def trusted(self) -> bool:
        return self.run.trusted

    def to_json(self) -> dict[str, Any]:
        skip = ("run", "cost")
        out = {k: v for k, v in self.__dict__.items() if k not in skip and v is not None}
        out.update(path=self.run.path, run_id=self.run_id, signature=self.run.file.state, label=self.label,
                   headroom_fraction=self.headroom_fraction, notes=list(self.notes))
        out.update(self.cost.to_json())
        return {k: v for k, v in out.items() if v is not None}


def target_for(run: Run, target_tokens: int | None, target_epochs: float | None) -> Target | None:
    """The decision's one target for this run: ``--target-tokens``, ``--target-epochs`` × the run's
    training tokens (None when it recorded none), else the default."""
    if target_tokens:
        return Target(int(target_tokens), "--target-tokens")
    if target_epochs:
        train = dig(run.data, "trial.run.data.train_tokens")
        if not isinstance(train, int) or train <= 0:
            return None
        return Target(int(target_epochs * train), f"--target-epochs {target_epochs:g} x {train:,} training tokens")
    return costs.default_target()


_UNRESUMABLE = {"beyond_band": "diverged", "state_differs": "state differs"}
"""Recovery verdict kinds of a run that could not be resumed as it stands, and the column's word."""


def configs_of(run: Run, catalog: Catalog, prices: Mapping[str, float], target_tokens: int | None = None,
               target_epochs: float | None = None, currency: str | None = None) -> list[Config]:
    d = run.data
    currency = currency or catalog.currency
    device = str(dig(d, "trial.run.device_name") or dig(d, "accelerator.model") or "unknown device")
    card_entry = catalog.match(device)
    card = card_entry.name if card_entry else device
    count_dev = dig(d, "accelerator.count")
    price = resolve_price(device, catalog, prices, d, currency)
    target = target_for(run, target_tokens, target_epochs)
    mem_dev = _num(dig(d, "accelerator.memory_per_device_bytes")) or _num(dig(d, "trial.memory.measured.device_total_bytes"))
    preflight = dig(d, "preflight.verdict")
    diverged = dig(d, "trial.stats.loss_first_nonfinite_step")
    if not isinstance(diverged, int) or isinstance(diverged, bool):
        diverged = first_nonfinite(dig(d, "trial.steps.loss"))  # manifests from before the field
    out: list[Config] = []

    def make(strategy: str, count: int, tps: float | None, median: float | None, cv: float | None,
             eff: float | None, peak: float | None, recovery: str | None, tokens_per_step: float | None,
             step_mean: float | None, notes: list[str]) -> Config:
        figs = costs.figures(d, price=price, currency=currency, target=target or costs.default_target(),
                             devices=count, tokens_per_s=tps, tokens_per_step=tokens_per_step,
                             step_time_mean_s=step_mean)
        if target is None:
            notes.append("not projected: --target-epochs needs the run's training tokens (trial.run.data.train_tokens)")
            figs = costs.CostFigures(figs.currency, figs.price, figs.devices, figs.tokens_per_s, figs.trial_cost,
                                     figs.trial_wall_s, figs.trained_tokens, figs.steady_cost_per_million_tokens,
                                     figs.target, None, None, figs.note)
        if figs.price is None and figs.note and tps is not None:
            notes.append(figs.note)
        if cv is not None and cv > HIGH_CV:
            notes.append(f"noisy: step-time CV {cv * 100:.1f} % (above {HIGH_CV * 100:.0f} %)")
        if not run.trusted:
            notes.append(f"not ranked: signature {run.file.state}")
        if run.command is not None and run.command.failed:
            notes.append(f"not ranked: the command {run.command.status}")
        if tps is None:
            notes.append("not ranked: no measured tokens/s")
        if diverged is not None:
            notes.append(f"not ranked: the loss is not finite from measured step {diverged}")
        return Config(run, card, count, strategy, tps, median, cv, eff, peak, mem_dev, recovery,
                      str(preflight) if preflight else None, figs, tuple(notes), loss_nonfinite_step=diverged)

    stats = table_at(d, "trial.stats")
    tps = _num(stats.get("tokens_per_s"))
    fits = dig(d, "trial.fit.fits") is not False
    # A run that did not fit has no peak to show nor headroom: what it held when it stopped is not a step's peak.
    peak = (_num(dig(d, "trial.fit.measured_bytes")) or _num(dig(d, "trial.memory.measured.device_used_bytes"))
            or _num(dig(d, "trial.memory.measured.peak_reserved_bytes"))) if fits else None
    notes: list[str] = []
    if isinstance(count_dev, int) and count_dev > 1:
        notes.append(f"single-device run on a machine with {count_dev} devices")
    if not fits:
        verdict = str(dig(d, "trial.fit.verdict") or "out of memory")
        notes.append(verdict if verdict.startswith("does not fit") else "does not fit: " + verdict)
    recovery = dig(d, "trial.recovery.verdict") or (f"skipped: {dig(d, 'trial.recovery.skipped')}"
                                                   if dig(d, "trial.recovery.skipped") else None)
    kind = dig(d, "trial.recovery.verdict_kind")
    if isinstance(recovery, str) and (recovery.startswith("failed") or kind in _UNRESUMABLE):
        # Ranked on its speed and cost, which stand; but the run could not be resumed as it stands.
        notes.append("recovery " + (recovery if len(recovery) <= 120 else recovery[:119] + "…"))
        recovery = f"{_UNRESUMABLE.get(str(kind), 'failed')} (see notes)"  # the column stays narrow
    out.append(make("single", 1, tps, _num(stats.get("step_time_median_s")), _num(stats.get("step_time_cv")),
                    1.0 if tps else None, peak, recovery, _num(stats.get("tokens_per_step")),
                    _num(stats.get("step_time_mean_s")), notes))
    scaling = table_at(d, "scaling")
    world = scaling.get("world_size")
    for strategy in ("ddp", "fsdp"):
        s = scaling.get(strategy)
        if not isinstance(s, Mapping) or not isinstance(world, int):
            continue
        stps = _num(s.get("throughput_tokens_per_s"))
        per_step = _num(s.get("tokens_per_optimizer_step"))
        rec = table_at(s, "recovery")
        out.append(make(strategy, world, stps, _num(s.get("step_time_median_s")), _num(s.get("step_time_cv")),
                        _num(s.get("efficiency")), _num(s.get("peak_memory_per_rank_bytes")),
                        rec.get("verdict"), per_step, per_step / stps if per_step and stps else None,
                        ["fixed costs, validation and checkpoint times taken from the single-device run"]))
    return out


@dataclass(frozen=True)
class UntestedCard:
    name: str
    memory_bytes: int
    fits: bool | None
    basis: str


@dataclass
class Group:
    definition: RunDefinition
    runs: list[Run]
    configs: list[Config] = field(default_factory=list)
    untested: list[UntestedCard] = field(default_factory=list)
    left_out_reason: str | None = None
    """For every group but the first: why it is not ranked against the first."""

    @property
    def ranked(self) -> list[Config]:
        return [c for c in self.configs if c.rank_cost is not None or c.rank_time is not None]

    @property
    def cheapest(self) -> Config | None:
        return next((c for c in self.configs if c.rank_cost == 1), None)

    @property
    def fastest(self) -> Config | None:
        return next((c for c in self.configs if c.rank_time == 1), None)


def _rank(configs: list[Config]) -> list[Config]:
    """#cost: by projected cost to the target (priced configurations only); #time: by projected
    time to the target. Only trusted configurations with measured tokens/s are ranked."""
    from dataclasses import replace

    ok = [c for c in configs if c.trusted and c.tokens_per_s and not (c.run.command and c.run.command.failed)
          and c.loss_nonfinite_step is None]
    by_cost = sorted((c for c in ok if c.cost_to_target is not None),
                     key=lambda c: (c.cost_to_target, c.time_to_target_s or 0))
    by_time = sorted((c for c in ok if c.time_to_target_s is not None), key=lambda c: c.time_to_target_s or 0.0)
    rank_cost = {id(c): i + 1 for i, c in enumerate(by_cost)}
    rank_time = {id(c): i + 1 for i, c in enumerate(by_time)}
    best = by_cost[0] if by_cost else by_time[0] if by_time else None
    out = []
    for c in configs:
        if id(c) not in rank_cost and id(c) not in rank_time:
            out.append(c)
            continue
        noise = None
        if best is not None and c is not best:
            sig = significant(best.tokens_per_s, c.tokens_per_s, best.step_time_cv, c.step_time_cv)
            noise = None if sig is None else not sig
        out.append(replace(c, rank_cost=rank_cost.get(id(c)), rank_time=rank_time.get(id(c)),
                           within_noise_of_best=noise))
    return sorted(out, key=lambda c: (c.rank_cost is None, c.rank_cost or 0, c.rank_time is None, c.rank_time or 0,
                                      c.run.created_utc))


def untested_cards(configs: list[Config], catalog: Catalog, headroom: float = 0.10) -> list[UntestedCard]:
    tested = {c.card for c in configs}
    peaks = [c.peak_memory_bytes for c in configs if c.strategy == "single" and c.peak_memory_bytes and c.trusted]
    out = []
    for card in catalog.cards:
        if card.name in tested:
            continue
        if peaks:
            need = max(peaks)
            out.append(UntestedCard(card.name, card.memory_bytes, need <= card.memory_bytes * (1 - headroom),
                                    f"estimate: measured peak {need / 2**30:.2f} GiB with {headroom:.0%} headroom; "
                                    "no speed figures for a card that was not tested"))
        else:
            out.append(UntestedCard(card.name, card.memory_bytes, None, "no trusted memory measurement"))
    return out


def _configs_or_none(run: Run, catalog: Catalog, prices: Mapping[str, float], target_tokens: int | None,
                     target_epochs: float | None, currency: str | None) -> list[Config]:
    """:func:`configs_of`, or nothing for a run whose figures have types no trial writes (a signed
    file can hold anything the schema allows): it is listed, not ranked, and decide goes on."""
    try:
        return configs_of(run, catalog, prices, target_tokens, target_epochs, currency)
    except (TypeError, ValueError, ArithmeticError, AttributeError, KeyError, IndexError) as exc:
        log.warning("%s: not ranked, a figure has a type no trial writes (%s)", run.path, exc)
        return []


def decide(runs: list[Run], catalog: Catalog, prices: Mapping[str, float], target_tokens: int | None = None,
           target_epochs: float | None = None, currency: str | None = None) -> list[Group]:
    """Group by run definition (largest group first), rank each group's configurations against
    one target (``target_tokens``, ``target_epochs`` of each run's data, else the default) in one
    currency (``currency``, else the catalog's)."""
    by_def: dict[RunDefinition, list[Run]] = {}
    for r in sorted(runs, key=lambda r: (r.created_utc, r.path)):
        by_def.setdefault(r.definition, []).append(r)
    groups = sorted((Group(k, v) for k, v in by_def.items()),
                    key=lambda g: (-sum(r.trusted for r in g.runs), -len(g.runs), g.runs[0].created_utc))
    for g in groups:
        configs = [c for r in g.runs for c in _configs_or_none(r, catalog, prices, target_tokens, target_epochs, currency)]
        g.configs = _rank(configs)
        g.untested = untested_cards(g.configs, catalog)
    if groups:
        first = groups[0].definition
        for g in groups[1:]:
            diffs = g.definition.differences(first)
            shown = diffs[:MAX_REASONS] + ([f"{len(diffs) - MAX_REASONS} more settings (--json lists them)"]
                                           if len(diffs) > MAX_REASONS else [])
            g.left_out_reason = "not ranked against group 1 (a different run definition): " + "; ".join(shown)
    return groups


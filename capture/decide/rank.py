"""Groups of runs with one definition, their tested configurations, and the ranking.

A configuration is a card × count × strategy that a trial measured: the single-device run itself
(``single``) and, where the manifest holds ``[scaling]``, each strategy at the world size. Its
figures are the manifest's own; cost and time to a target are computed here from those figures
and a price with its source, the same way ``capture trial`` projects (:func:`capture.trial.cost.project`).
Untested cards get no speed figures (settled decision 5): a memory fit at most, marked estimate.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from capture.decide.runs import Run, RunDefinition
from capture.errors import UsageError
from capture.results.compare import HIGH_CV, significant
from capture.results.summary import dig
from capture.trial.cost import project
from capture.trial.fit import Catalog

log = logging.getLogger(__name__)

DEFAULT_TARGET_TOKENS = 1_000_000_000


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _count(v: Any) -> int:
    """A step count read from a signed file that may hold any type there: a positive int, else 0."""
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0


@dataclass(frozen=True)
class Price:
    per_device_hour: float
    source: str


def parse_prices(items: Sequence[str]) -> dict[str, float]:
    """``--price CARD=PRICE`` flags (per device and hour)."""
    out: dict[str, float] = {}
    for item in items:
        card, sep, price = item.partition("=")
        try:
            value = float(price)
        except ValueError:
            value = -1.0
        if not sep or not card.strip() or value <= 0:
            raise UsageError(f"--price {item}: expected CARD=PRICE with a positive price per device and hour",
                             "e.g. --price H200=3.50 --price 'A100 80GB SXM=1.80'")
        out[card.strip()] = value
    return out


def resolve_price(device_name: str, catalog: Catalog, prices: Mapping[str, float],
                  data: Mapping[str, Any]) -> Price | None:
    """``--price`` first (the flag's CARD matched as the catalog does, or as a substring), then the
    catalog file's price, then the manifest's own."""
    card = catalog.match(device_name)
    for name, value in prices.items():
        if (card is not None and name.lower() == card.name.lower()) or name.lower() in device_name.lower() \
                or (card is not None and name.lower() in card.name.lower()):
            return Price(value, f"--price {name}={value:g}")
    if card is not None and card.price_per_hour:
        return Price(card.price_per_hour, f"catalog ({card.source}): {card.name}")
    own = _num(dig(data, "trial.cost.price_per_hour"))
    if own:
        return Price(own, f"manifest ({dig(data, 'trial.cost.price_source') or 'recorded price'})")
    return None


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
    price: Price | None
    target_tokens: int
    target_source: str
    time_to_target_s: float | None
    cost_to_target: float | None
    cost_per_million_tokens: float | None
    trial_cost_per_million_tokens: float | None
    """The whole trial's cost / its trained tokens (guide point 8), single-device only."""
    notes: tuple[str, ...] = ()
    rank_cost: int | None = None
    rank_time: int | None = None
    within_noise_of_best: bool | None = None

    @property
    def label(self) -> str:
        return f"{self.card} x{self.count} {self.strategy}"

    @property
    def headroom_fraction(self) -> float | None:
        if self.peak_memory_bytes is None or not self.memory_per_device_bytes:
            return None
        return 1 - self.peak_memory_bytes / self.memory_per_device_bytes

    @property
    def trusted(self) -> bool:
        return self.run.trusted

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k not in ("run", "price") and v is not None}
        out.update(path=self.run.path, signature=self.run.file.state, label=self.label,
                   headroom_fraction=self.headroom_fraction, notes=list(self.notes))
        if self.price:
            out.update(price_per_device_hour=self.price.per_device_hour, price_source=self.price.source)
        return {k: v for k, v in out.items() if v is not None}


def _target(run: Run, target_tokens: int | None, target_epochs: float | None) -> tuple[int, str]:
    if target_tokens:
        return int(target_tokens), "--target-tokens"
    train = dig(run.data, "trial.run.data.train_tokens")
    if target_epochs and isinstance(train, int) and train > 0:
        return int(target_epochs * train), f"--target-epochs {target_epochs:g} x {train:,} training tokens"
    own = dig(run.data, "trial.cost.projection.target_tokens")
    if isinstance(own, int) and own > 0 and not target_epochs:
        return own, "the manifest's own target"
    return DEFAULT_TARGET_TOKENS, "the default; set --target-tokens"


def _projection(run: Run, target: int, source: str, tokens_per_step: float | None, step_mean_s: float | None):
    if not tokens_per_step or not step_mean_s:
        return None
    d = run.data
    phases = dig(d, "trial.cost.phases") or {}
    fixed = sum(_num(phases.get(k)) or 0.0 for k in ("import_framework_s", "device_context_s", "load_s")) \
        if isinstance(phases, Mapping) else 0.0
    val_every = dig(d, "trial.run.validation_schedule.every_steps") or dig(d, "trial.validation.every_steps") or 0
    ckpt_every = dig(d, "trial.run.checkpoint_schedule.every_steps") or dig(d, "trial.checkpoint.every_steps") or 0
    val_s = _num(dig(d, "trial.validation.duration_s"))
    ckpt_s = _num(dig(d, "trial.checkpoint.duration_s"))
    return project(target, source, int(tokens_per_step), step_mean_s, val_s, _count(val_every) or 1 << 62,
                   ckpt_s, _count(ckpt_every), fixed)


def configs_of(run: Run, catalog: Catalog, prices: Mapping[str, float], target_tokens: int | None = None,
               target_epochs: float | None = None) -> list[Config]:
    d = run.data
    device = str(dig(d, "trial.run.device_name") or dig(d, "accelerator.model") or "unknown device")
    card_entry = catalog.match(device)
    card = card_entry.name if card_entry else device
    count_dev = dig(d, "accelerator.count")
    price = resolve_price(device, catalog, prices, d)
    target, source = _target(run, target_tokens, target_epochs)
    mem_dev = _num(dig(d, "accelerator.memory_per_device_bytes")) or _num(dig(d, "trial.memory.measured.device_total_bytes"))
    preflight = dig(d, "preflight.verdict")
    out: list[Config] = []

    def make(strategy: str, count: int, tps: float | None, median: float | None, cv: float | None,
             eff: float | None, peak: float | None, recovery: str | None, tokens_per_step: float | None,
             step_mean: float | None, trial_cpm: float | None, notes: list[str]) -> Config:
        proj = _projection(run, target, source, tokens_per_step, step_mean)
        total_s = proj.total_s if proj else None
        cost = total_s / 3600 * price.per_device_hour * count if (total_s is not None and price) else None
        if cv is not None and cv > HIGH_CV:
            notes.append(f"noisy: step-time CV {cv * 100:.1f} % (above {HIGH_CV * 100:.0f} %)")
        if not run.trusted:
            notes.append(f"not ranked: signature {run.file.state}")
        if tps is None:
            notes.append("not ranked: no measured tokens/s")
        return Config(run, card, count, strategy, tps, median, cv, eff, peak, mem_dev, recovery,
                      str(preflight) if preflight else None, price, target, source, total_s, cost,
                      cost / target * 1e6 if cost is not None else None, trial_cpm, tuple(notes))

    stats = dig(d, "trial.stats") or {}
    tps = _num(stats.get("tokens_per_s")) if isinstance(stats, Mapping) else None
    wall = _num(dig(d, "trial.cost.wall_total_s"))
    trained = _num(dig(d, "trial.cost.trained_tokens"))
    count1 = 1
    trial_cpm = (wall / 3600 * price.per_device_hour * count1 / (trained / 1e6)
                 if wall and trained and price else None)
    peak = _num(dig(d, "trial.fit.measured_bytes")) or _num(dig(d, "trial.memory.measured.device_used_bytes")) \
        or _num(dig(d, "trial.memory.measured.peak_reserved_bytes"))
    notes: list[str] = []
    if isinstance(count_dev, int) and count_dev > 1:
        notes.append(f"single-device run on a machine with {count_dev} devices")
    if dig(d, "trial.fit.fits") is False:
        notes.append("does not fit: " + str(dig(d, "trial.fit.verdict") or "out of memory"))
    out.append(make("single", 1, tps, _num(stats.get("step_time_median_s")) if isinstance(stats, Mapping) else None,
                    _num(stats.get("step_time_cv")) if isinstance(stats, Mapping) else None, 1.0 if tps else None, peak,
                    dig(d, "trial.recovery.verdict") or (f"skipped: {dig(d, 'trial.recovery.skipped')}"
                                                        if dig(d, "trial.recovery.skipped") else None),
                    _num(stats.get("tokens_per_step")) if isinstance(stats, Mapping) else None,
                    _num(stats.get("step_time_mean_s")) if isinstance(stats, Mapping) else None, trial_cpm, notes))
    scaling = d.get("scaling") if isinstance(d.get("scaling"), Mapping) else {}
    world = scaling.get("world_size")
    for strategy in ("ddp", "fsdp"):
        s = scaling.get(strategy)
        if not isinstance(s, Mapping) or not isinstance(world, int):
            continue
        stps = _num(s.get("throughput_tokens_per_s"))
        per_step = _num(s.get("tokens_per_optimizer_step"))
        rec = s.get("recovery") if isinstance(s.get("recovery"), Mapping) else {}
        out.append(make(strategy, world, stps, _num(s.get("step_time_median_s")), _num(s.get("step_time_cv")),
                        _num(s.get("efficiency")), _num(s.get("peak_memory_per_rank_bytes")),
                        rec.get("verdict"), per_step, per_step / stps if per_step and stps else None, None,
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
        return [c for c in self.configs if c.rank_cost is not None]


def _rank(configs: list[Config]) -> list[Config]:
    from dataclasses import replace

    ok = [c for c in configs if c.trusted and c.tokens_per_s]
    by_cost = sorted(ok, key=lambda c: (c.cost_per_million_tokens is None, c.cost_per_million_tokens or 0,
                                        c.time_to_target_s or 0))
    by_time = sorted(ok, key=lambda c: (c.time_to_target_s is None, c.time_to_target_s or 0))
    rank_cost = {id(c): i + 1 for i, c in enumerate(by_cost)}
    rank_time = {id(c): i + 1 for i, c in enumerate(by_time)}
    best = by_cost[0] if by_cost else None
    out = []
    for c in configs:
        if id(c) not in rank_cost:
            out.append(c)
            continue
        noise = None
        if best is not None and c is not best:
            sig = significant(best.tokens_per_s, c.tokens_per_s, best.step_time_cv, c.step_time_cv)
            noise = None if sig is None else not sig
        out.append(replace(c, rank_cost=rank_cost[id(c)], rank_time=rank_time[id(c)], within_noise_of_best=noise))
    return sorted(out, key=lambda c: (c.rank_cost is None, c.rank_cost or 0, c.run.created_utc))


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
                     target_epochs: float | None) -> list[Config]:
    """:func:`configs_of`, or nothing for a run whose figures have types no trial writes (a signed
    file can hold anything the schema allows): it is listed, not ranked, and decide goes on."""
    try:
        return configs_of(run, catalog, prices, target_tokens, target_epochs)
    except (TypeError, ValueError, ArithmeticError, AttributeError, KeyError, IndexError) as exc:
        log.warning("%s: not ranked, a figure has a type no trial writes (%s)", run.path, exc)
        return []


def decide(runs: list[Run], catalog: Catalog, prices: Mapping[str, float], target_tokens: int | None = None,
           target_epochs: float | None = None) -> list[Group]:
    """Group by run definition (largest group first), rank each group's configurations."""
    by_def: dict[RunDefinition, list[Run]] = {}
    for r in sorted(runs, key=lambda r: (r.created_utc, r.path)):
        by_def.setdefault(r.definition, []).append(r)
    groups = sorted((Group(k, v) for k, v in by_def.items()),
                    key=lambda g: (-sum(r.trusted for r in g.runs), -len(g.runs), g.runs[0].created_utc))
    for g in groups:
        configs = [c for r in g.runs for c in _configs_or_none(r, catalog, prices, target_tokens, target_epochs)]
        g.configs = _rank(configs)
        g.untested = untested_cards(g.configs, catalog)
    if groups:
        first = groups[0].definition
        for g in groups[1:]:
            g.left_out_reason = ("not ranked against group 1 (a different run definition): "
                                 + "; ".join(g.definition.differences(first)))
    return groups


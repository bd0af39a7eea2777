"""Fit and headroom: out-of-memory as a result, the largest micro-batch, the accelerator catalog.

An out-of-memory step is an answer ("does not fit"), never a crash: :func:`is_oom` recognises
``torch.OutOfMemoryError`` (``torch.cuda.OutOfMemoryError``), ``MemoryError`` and the CPU
allocator's ``RuntimeError`` ("can't allocate memory"). :func:`find_max_batch` searches, with
real full training steps, for the largest micro-batch that leaves the configured headroom free.

The catalog (capture/data/accelerators.toml, overridable) names memory and dense peak FLOP/s per
card. Untested cards get memory-fit answers only, never speed figures (DESIGN decision 5).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from capture._toml import TomlError
from capture._toml import loads as toml_loads
from capture._safe_read import read_overlays
from capture.errors import ConfigError
from capture.paths import config_dir
from capture.trial.state import release_memory  # between candidates and after an out-of-memory step

if TYPE_CHECKING:
    from capture.trial.workload import Workload

DEFAULT_HEADROOM = 0.10


def user_catalog_path() -> Path:
    """``accelerators.toml`` in the config folder (:func:`capture.paths.config_dir`)."""
    return config_dir() / "accelerators.toml"


# --------------------------------------------------------------------------- catalog


@dataclass(frozen=True)
class Card:
    name: str
    vendor: str
    match: str
    """Case-insensitive regular expression searched in the device name."""
    memory_bytes: int
    peak_bf16_dense_flops: float | None = None
    price_per_hour: float | None = None
    source: str = "shipped"
    currency: str = "USD"
    """The currency of ``price_per_hour``: the entry's ``currency``, else its file's header ``currency``."""

    def matches(self, device_name: str) -> bool:
        return re.search(self.match, device_name, re.I) is not None


@dataclass(frozen=True)
class Catalog:
    cards: tuple[Card, ...]
    sources: tuple[str, ...]
    currency: str = "USD"
    """The currency prices are stated in (the last catalog file's header ``currency``)."""

    def match(self, device_name: str | None) -> Card | None:
        if not device_name:
            return None
        return next((c for c in self.cards if c.matches(device_name)), None)

    def get(self, name: str) -> Card | None:
        return next((c for c in self.cards if c.name == name), None)

    def find(self, name: str) -> list[Card]:
        """The card ``name`` means: its exact name, else every card whose name contains it,
        ignoring case, spaces and dashes ("h200" → "H200 141GB"; "80GB" → two cards)."""
        exact = self.get(name)
        if exact is not None:
            return [exact]
        key = re.sub(r"[\s_-]+", "", name).lower()
        return [c for c in self.cards if key and key in re.sub(r"[\s_-]+", "", c.name).lower()]


_CURRENCY = re.compile(r"[A-Za-z][A-Za-z0-9 ._$€£¥-]{0,15}")


def _currency(value: Any, where: str, hint: str) -> str:
    if not isinstance(value, str) or not _CURRENCY.fullmatch(value):
        raise ConfigError(f"{where}: must be a short currency name such as \"USD\" or \"EUR\", got {value!r}", hint)
    return value


def _parse_catalog(text: str, source: str, currency: str = "USD") -> tuple[list[Card], str | None]:
    """The cards of one catalog file, and its header ``currency`` (None when it has none)."""
    hint = f"fix {source}; see capture/data/accelerators.toml for the format"
    try:
        doc = toml_loads(text)
    except TomlError as exc:
        raise ConfigError(f"{source}: not valid TOML ({exc})", hint) from None
    unknown = [k for k in doc if k not in ("accelerator", "currency")]
    if unknown:
        raise ConfigError(f"{source}: {unknown[0]}: unknown key (the file holds a currency and [[accelerator]] tables)",
                          hint)
    header = _currency(doc["currency"], f"{source}: currency", hint) if "currency" in doc else None
    currency = header or currency
    entries = doc.get("accelerator", [])
    if not isinstance(entries, list):
        raise ConfigError(f"{source}: accelerator must be an array of tables ([[accelerator]])", hint)
    known = {"name", "vendor", "match", "memory_bytes", "peak_bf16_dense_flops", "price_per_hour", "currency"}
    cards = []
    for i, e in enumerate(entries):
        where = f"{source}: accelerator[{i}]"
        extra = sorted(set(e) - known)
        if extra:
            raise ConfigError(f"{where}.{extra[0]}: unknown key; known: {', '.join(sorted(known))}", hint)
        name = e.get("name")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where}.name: required (a string)", hint)
        mem = e.get("memory_bytes")
        if isinstance(mem, bool) or not isinstance(mem, int) or mem <= 0:
            raise ConfigError(f"{where}.memory_bytes: must be a positive integer, got {mem!r}", hint)
        match = e.get("match", re.escape(name))
        try:
            re.compile(match)
        except (re.error, TypeError) as exc:
            raise ConfigError(f"{where}.match: not a regular expression ({exc})", hint) from None
        numbers = {}
        for key in ("peak_bf16_dense_flops", "price_per_hour"):
            v = e.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
                raise ConfigError(f"{where}.{key}: must be a positive number, got {v!r}", hint)
            numbers[key] = float(v) if v is not None else None
        own = _currency(e["currency"], f"{where}.currency", hint) if "currency" in e else currency
        cards.append(Card(name=name, vendor=str(e.get("vendor", "")), match=match, memory_bytes=mem,
                          source=source, currency=own, **numbers))
    return cards, header


def load_catalog(path: str | os.PathLike[str] | None = None) -> Catalog:
    """The shipped catalog, overlaid by ~/.config/capture/accelerators.toml and then ``path``
    (entries with the same name replace earlier ones; new names are added)."""
    shipped = (resources.files("capture") / "data" / "accelerators.toml").read_text(encoding="utf-8")
    cards, header = _parse_catalog(shipped, "capture/data/accelerators.toml")
    currency = header or "USD"
    by_name: dict[str, Card] = {c.name: c for c in cards}
    sources = ["capture/data/accelerators.toml"]
    for p, text in read_overlays(user_catalog_path(), path, "accelerators.toml"):
        cards, header = _parse_catalog(text, p, currency)
        for card in cards:
            by_name[card.name] = card
        currency = header or currency
        sources.append(p)
    return Catalog(tuple(by_name.values()), tuple(sources), currency)


def cards_fit(measured_bytes: int, headroom: float, catalog: Catalog, tested: Card | None, basis: str) -> list[dict[str, Any]]:
    """Which catalog cards hold ``measured_bytes`` with ``headroom`` left free (memory only)."""
    out = []
    for c in catalog.cards:
        usable = int(c.memory_bytes * (1 - headroom))
        free = c.memory_bytes - measured_bytes
        out.append({"name": c.name, "memory_bytes": c.memory_bytes, "usable_bytes": usable,
                    "fits": measured_bytes <= usable, "margin_bytes": usable - measured_bytes,
                    "headroom_bytes": free, "headroom_fraction": free / c.memory_bytes,
                    "tested": tested is not None and c.name == tested.name, "basis": basis})
    return out


# --------------------------------------------------------------------------- out of memory


def is_oom(exc: BaseException) -> bool:
    """Is this the device (or host) running out of memory?"""
    import torch

    oom_types: tuple[type[BaseException], ...] = (MemoryError,)
    for holder in (torch, torch.cuda):
        t = getattr(holder, "OutOfMemoryError", None)
        if isinstance(t, type):
            oom_types += (t,)
    if isinstance(exc, oom_types):
        return True
    if isinstance(exc, RuntimeError):
        msg = str(exc)
        return any(s in msg for s in ("can't allocate memory", "CUDA out of memory", "HIP out of memory",
                                      "out of memory", "Cannot allocate memory"))
    return False


def oom_text(exc: BaseException) -> str:
    """The first line of the error, without the allocator's long advice."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    text = lines[0] if lines else type(exc).__name__
    text = text.split(" If reserved but unallocated")[0]
    return f"{type(exc).__name__}: {text}"[:400]


# --------------------------------------------------------------------------- search


@dataclass(frozen=True)
class Candidate:
    micro_batch: int
    fits: bool
    device_used_bytes: int | None
    reason: str

    def to_manifest(self) -> dict[str, Any]:
        return {"micro_batch": self.micro_batch, "fits": self.fits, "device_used_bytes": self.device_used_bytes,
                "reason": self.reason}


def try_micro_batch(config: Any, device: Any, micro_batch: int, usable_bytes: int, steps: int = 2,
                    memory: Any = None) -> Candidate:
    """Build the workload at ``micro_batch`` and run ``steps`` full training steps (the first
    creates the optimizer state); fits when no step ran out of memory and the device used no
    more than ``usable_bytes``."""
    from capture.trial.devmem import DeviceMemory
    from capture.trial.workload import build_workload

    cfg = config.with_overrides(micro_batch_size=micro_batch)
    dm = memory if memory is not None else DeviceMemory(device)
    release_memory(device)
    wl = None
    try:
        dm.reset_peaks()
        wl = build_workload(cfg, device)
        for _ in range(steps):
            wl.train_step_async()
        if device.type == "cuda":
            import torch

            torch.cuda.synchronize(device)
        reading = dm.read()
    except Exception as exc:
        if not is_oom(exc):
            raise
        wl = None
        return Candidate(micro_batch, False, None, f"does not fit: {oom_text(exc)}")
    finally:
        del wl
        release_memory(device)
    used = reading.device_used_bytes
    if used is None and reading.peak_reserved_bytes is not None:
        used = reading.peak_reserved_bytes
    if used is not None and used > usable_bytes:
        return Candidate(micro_batch, False, used, f"used {used} bytes, more than the {usable_bytes} usable with headroom")
    return Candidate(micro_batch, True, used, "completed full steps within the headroom")


def _per_sample_bytes_estimate(wl: Any, config: Any, device: Any) -> int:
    """What one more sequence in the micro-batch costs, by the memory estimate (capture.trial.memory)."""
    from capture.trial import memory

    plan = memory.plan_for(config, device.type)
    return max(1, memory.estimate_plan(plan, 2, expandable=False).total_bytes
                 - memory.estimate_plan(plan, 1, expandable=False).total_bytes)


class _Search:
    """One workload, built once; each candidate is one full training step at that micro-batch."""

    def __init__(self, config: Any, device: Any, usable: int, memory: Any) -> None:
        from capture.trial.devmem import DeviceMemory
        from capture.trial.workload import build_workload

        self.device, self.usable = device, usable
        self.accum = config.batch.grad_accum
        self.dm = memory if memory is not None else DeviceMemory(device)
        release_memory(device)
        self.wl: Workload | None = build_workload(config.with_overrides(micro_batch_size=1), device)  # None once closed
        self.sample = next(self.wl.loader)  # one real sequence; a candidate's batch repeats it
        self.slope = _per_sample_bytes_estimate(self.wl, config, device)
        self.slope_source = "memory estimate"
        self.tried: dict[int, Candidate] = {}

    def step(self, mb: int) -> int | None:
        import itertools

        assert self.wl is not None, "the search is closed"
        ids = self.sample.repeat(mb)
        self.wl.train_step_async(itertools.repeat(ids, self.accum))
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)
        reading = self.dm.read()
        used = reading.device_used_bytes
        if used is None and reading.peak_reserved_bytes is not None:
            used = reading.peak_reserved_bytes
        return used

    def attempt(self, mb: int, steps: int = 1) -> Candidate:
        release_memory(self.device)
        try:
            self.dm.reset_peaks()
            used = None
            for _ in range(steps):
                used = self.step(mb)
        except Exception as exc:
            if not is_oom(exc):
                raise
            assert self.wl is not None, "the search is closed"
            self.wl.optimizer.zero_grad(set_to_none=True)
            c = Candidate(mb, False, None, f"does not fit: {oom_text(exc)}")
        else:
            if used is not None and used > self.usable:
                c = Candidate(mb, False, used, f"used {used} bytes, more than the {self.usable} usable with headroom")
            else:
                c = Candidate(mb, True, used, "completed a full step within the headroom")
        finally:
            release_memory(self.device)
        self.tried[mb] = c
        self._learn()
        return c

    def _learn(self) -> None:
        """Once two micro-batches are measured, their difference replaces the estimate's slope."""
        measured = sorted((mb, c.device_used_bytes) for mb, c in self.tried.items() if c.device_used_bytes)
        if len(measured) >= 2:
            (b0, u0), (b1, u1) = measured[0], measured[-1]
            if b1 > b0 and u1 > u0:
                self.slope, self.slope_source = max(1, (u1 - u0) // (b1 - b0)), "measured"

    def predicted_max(self, ceiling: int) -> int:
        """The largest micro-batch the memory measured at micro-batch 1 plus the slope says fits."""
        base = self.tried[1].device_used_bytes if 1 in self.tried else None
        if base is None:
            return 1
        return max(1, min(ceiling, 1 + (self.usable - base) // self.slope))

    def close(self) -> None:
        self.wl = None
        release_memory(self.device)


def find_max_batch(config: Any, device: Any, limit_bytes: int, limit_source: str, headroom: float,
                   max_batch: int = 1024, progress: Callable[[str], None] | None = None,
                   memory: Any = None) -> dict[str, Any]:
    """The largest micro-batch that completes a full training step with ``headroom`` of
    ``limit_bytes`` free, searched on one workload built once.

    Micro-batch 1 runs two steps (the first creates the optimizer state, the second is the
    steady-state peak); every other candidate runs one step, with a batch of that many copies of a
    real sequence (the content does not change the memory a step needs). The search starts where
    the memory measured at 1, plus what the memory estimate says each further sequence costs,
    reaches the limit, and never tries beyond ``max_batch``. From there, interpolation on the
    measured figures (bisection where it stalls) closes the gap to one: the largest micro-batch
    that fits and the next, which does not. A candidate is only tried where the figures so far say
    it is at or just past the limit, so the search's own memory stays near the limit it searches
    under. ``capped`` is true when ``max_batch`` itself fits: the real limit is higher.
    """
    usable = int(limit_bytes * (1 - headroom))
    fraction_set = False
    if device.type == "cuda":
        import torch

        total = torch.cuda.get_device_properties(device).total_memory
        if limit_bytes < total:  # emulate a smaller card: the allocator fails at the limit
            torch.cuda.set_per_process_memory_fraction(limit_bytes / total, device)
            fraction_set = True
    search: _Search | None = None
    start = None

    def report(c: Candidate) -> None:
        if progress:
            progress(f"micro-batch {c.micro_batch}: {'fits' if c.fits else 'does not fit'}"
                     + (f" ({c.device_used_bytes / 2**20:.0f} MiB)" if c.device_used_bytes else ""))

    good, bad = 0, None
    try:
        try:
            search = _Search(config, device, usable, memory)
        except Exception as exc:
            if not is_oom(exc):
                raise
            search = None
        if search is not None:
            first = search.attempt(1, steps=2)
            report(first)
            if first.fits:
                good = 1
                start = search.predicted_max(max_batch)
                mb, gap = start, None
                for _ in range(64):  # never reached: the gap at least halves every other round
                    if mb <= good or (bad is not None and mb >= bad):
                        break
                    c = search.attempt(mb)
                    report(c)
                    if c.fits:
                        good = mb
                    else:
                        bad = mb
                    if bad is None:  # still growing
                        if good >= max_batch:
                            break
                        guess = search.predicted_max(max_batch)
                        mb = guess if guess > good else min(max_batch, good * 2)
                        continue
                    if bad - good <= 1:
                        break
                    guess = search.predicted_max(bad - 1)
                    halving = gap is None or bad - good <= gap // 2
                    mb = guess if halving and good < guess < bad else (good + bad) // 2
                    gap = bad - good
            else:
                bad = 1
    finally:
        if search is not None:
            search.close()
        if fraction_set:
            import torch

            torch.cuda.set_per_process_memory_fraction(1.0, device)
    tried = search.tried if search is not None else {}
    result: dict[str, Any] = {
        "limit_bytes": limit_bytes, "limit_source": limit_source, "headroom": headroom, "usable_bytes": usable,
        "steps_per_candidate": 1, "first_candidate_steps": 2, "grad_accum": config.batch.grad_accum,
        "max_micro_batch_searched": max_batch,
        "candidates": [tried[k].to_manifest() for k in sorted(tried)],
    }
    if start is not None:
        result["start_micro_batch"] = start
        result["start_basis"] = "memory measured at micro-batch 1 plus the memory estimate's cost per sequence"
    if search is not None:
        result["slope_bytes_per_sequence"] = search.slope
        result["slope_source"] = search.slope_source
    capped = good >= max_batch
    if good:
        result["max_micro_batch"] = good
        result["headline"] = (f"capped at {max_batch}: the --max-batch bound fits, the real limit is higher"
                              if capped else f"largest micro-batch {good} (micro-batch {good + 1} does not fit)")
    else:
        result["max_micro_batch_note"] = "not even a micro-batch of 1 fits"
        result["headline"] = "not even a micro-batch of 1 fits"
    if capped:
        result["capped"] = True
    if progress:
        progress(f"max-batch search: {result['headline']}")
    return result

"""``capture estimate``: the trial's memory estimate for a config, before anyone rents a card.

The model is built on the meta device from its config (no weights, no GPU), the run is replayed
as allocation events (:mod:`capture.trial.memory`), and the device total is set against every
card of the accelerator catalog: does the configured micro-batch fit with the headroom, and
what is the largest micro-batch that does. These are the numbers ``capture trial`` prints before
its first step (there, with the CUDA context it measured instead of the H200 reference figure).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from capture.trial import memory


@dataclass(frozen=True)
class CardFit:
    name: str
    memory_bytes: int
    usable_bytes: int
    fits: bool
    margin_bytes: int
    max_micro_batch: int | None
    capped: bool

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "memory_bytes": self.memory_bytes, "usable_bytes": self.usable_bytes,
                "fits": self.fits, "margin_bytes": self.margin_bytes, "max_micro_batch": self.max_micro_batch,
                "max_micro_batch_capped": self.capped, "basis": "estimate (no card was tested)"}


class Curve:
    """Device total by micro-batch, each point replayed once (shared by every card)."""

    def __init__(self, at: Callable[[int], int]) -> None:
        self.at = at
        self.seen: dict[int, int] = {}

    def __call__(self, mb: int) -> int:
        if mb not in self.seen:
            self.seen[mb] = self.at(mb)
        return self.seen[mb]


def largest_fitting(curve: Curve, usable: int, ceiling: int) -> tuple[int | None, bool]:
    """The largest micro-batch whose estimate stays within ``usable`` (None: not even 1), and
    whether ``ceiling`` itself fits. Memory grows with the micro-batch, nearly in a line (the
    allocator's reserve moves in steps), so the search brackets the answer with every point
    already replayed (for any card), interpolates inside the bracket and checks the guess's
    neighbour; where an interpolation did not halve the bracket, the next step bisects."""
    if curve(1) > usable:
        return None, False
    halve = False
    while True:
        good, bad = _bracket(curve, usable)
        if good >= ceiling:
            return ceiling, True
        if bad is not None and bad - good <= 1:
            return good, False
        if bad is None:  # beyond every point: extrapolate along the last two that fit
            lower = max((mb for mb in curve.seen if mb < good), default=None)
            slope = max(1, (curve(good) - curve(lower)) // (good - lower)) if lower else max(1, curve(good + 1) - curve(good))
            guess = min(ceiling, good + max(1, (usable - curve(good)) // slope))
        elif halve:
            guess = (good + bad) // 2
        else:
            guess = good + (usable - curve(good)) * (bad - good) // max(1, curve(bad) - curve(good))
            guess = min(bad - 1, max(good + 1, guess))
        width = None if bad is None else bad - good
        if curve(guess) <= usable:
            curve(min(ceiling, guess + 1))  # on a straight curve the neighbour closes the bracket
        elif guess - 1 > good:
            curve(guess - 1)
        new_good, new_bad = _bracket(curve, usable)
        halve = width is not None and new_bad is not None and new_bad - new_good > width // 2


def _bracket(curve: Curve, usable: int) -> tuple[int, int | None]:
    """The largest replayed micro-batch that fits and the smallest that does not (None: none)."""
    good = max(mb for mb, v in curve.seen.items() if v <= usable)
    bad = min((mb for mb, v in curve.seen.items() if v > usable), default=None)
    return good, bad


def estimate_config(config: Any, device_type: str = "cuda", micro_batch: int | None = None,
                    overhead_bytes: int | None = None, overhead_source: str = "") -> tuple[memory.Plan, memory.MemoryEstimate]:
    plan = memory.plan_for(config, device_type)
    mb = micro_batch or config.batch.micro_batch_size
    return plan, memory.estimate_plan(plan, mb, overhead_bytes, overhead_source)


def card_fits(plan: memory.Plan, catalog: Any, names: list[str] | None, headroom: float, micro_batch: int,
              ceiling: int = 1024, known: dict[int, int] | None = None) -> list[CardFit]:
    """Each catalog card (or the named ones) against the estimate's device total. ``known``:
    device totals already estimated, by micro-batch."""
    curve = Curve(lambda mb: memory.estimate_plan(plan, mb, expandable=False).total_bytes)
    curve.seen.update(known or {})
    cards = [c for c in catalog.cards if not names or c.name in names]
    out = []
    for c in cards:
        usable = int(c.memory_bytes * (1 - headroom))
        need = curve(micro_batch)
        best, capped = largest_fitting(curve, usable, ceiling)
        out.append(CardFit(c.name, c.memory_bytes, usable, need <= usable, usable - need, best, capped))
    return out


def to_json(config: Any, plan: memory.Plan, est: memory.MemoryEstimate, fits: list[CardFit], micro_batch: int,
            headroom: float) -> dict[str, Any]:
    return {"config": config.source, "micro_batch": micro_batch, "seq_len": plan.seq, "device_type": plan.device_type,
            "estimate": est.to_manifest(), "headroom": headroom, "cards": [f.to_json() for f in fits],
            "note": "estimate: no card was tested; the CUDA context and library figures are the H200 reference's"}


def render_text(config: Any, plan: memory.Plan, est: memory.MemoryEstimate, fits: list[CardFit], micro_batch: int,
                headroom: float, width: int = 100) -> str:
    """The terms, the totals and the card table, within ``width`` columns."""
    from capture.fmt import bytes_str

    total = est.total_bytes
    head, shape = f"memory estimate for {config.source}:", f"micro-batch {micro_batch} x {plan.seq} tokens (estimate, no card tested)"
    # a path is never cut: past the width it stands on a line of its own, the shape below it
    lines = [f"{head} {shape}"] if len(head) + 1 + len(shape) <= width else [head, f"  {shape}"]
    lines.append("")
    lines.append(f"  {'term':<26}{'bytes':>12}  {'share':>6}  formula")
    for t in est.terms:
        if not t.bytes:
            continue
        share = f"{t.bytes / total * 100:5.1f}%" if total else ""
        room = max(10, width - 50)
        formula = t.formula if len(t.formula) <= room else t.formula[: room - 1] + "…"
        lines.append(f"  {t.name:<26}{bytes_str(t.bytes):>12}  {share:>6}  {formula}")
    lines.append("")
    lines.append(f"  peak of allocated tensors   {bytes_str(est.allocator_bytes):>12}  ({est.peak_phase or 'n/a'})")
    lines.append(f"  reserved by the allocator   {bytes_str(est.reserved_bytes):>12}")
    lines.append(f"  device total                {bytes_str(total):>12}")
    if est.expandable_bytes is not None:
        lines.append(f"  with expandable_segments    {bytes_str(est.expandable_bytes):>12}  (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)")
    if fits:
        lines.append("")
        lines.append(f"  {'card':<16}{'memory':>12}{'usable':>12}  {'fits mb ' + str(micro_batch):<12}{'largest mb':>11}")
        for f in fits:
            verdict = "yes" if f.fits else "no"
            most = "none" if f.max_micro_batch is None else (f"{f.max_micro_batch}+" if f.capped else str(f.max_micro_batch))
            lines.append(f"  {f.name:<16}{bytes_str(f.memory_bytes):>12}{bytes_str(f.usable_bytes):>12}  {verdict:<12}{most:>11}")
        lines.append(f"  usable: memory less {headroom:.0%} headroom; memory only, no speed claims for untested cards")
    return "\n".join(lines) + "\n"

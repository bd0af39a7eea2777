"""The result of a preflight: named checks, each pass/warn/fail/skipped with a one-line reason.

The ``[preflight]`` manifest table (the shared contract in docs/preflight.md)::

    [preflight]
    mode = "quick"            # or "full"
    verdict = "pass"          # worst of the checks: pass | warn | fail
    duration_s = 12.3
    device_kind = "cuda"      # cuda | rocm | cpu
    [[preflight.checks]]
    name = "gemm_bf16"
    device = 0                # absent for host-wide checks
    verdict = "pass"          # pass | warn | fail | skipped
    reason = "one line"
    value = 790.1             # float, int or string
    unit = "TFLOP/s"
    expected = "700-989 TFLOP/s (H200 SXM, datasheet dense bf16 989)"
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PASS, WARN, FAIL, SKIPPED = "pass", "warn", "fail", "skipped"
VERDICTS = (PASS, WARN, FAIL, SKIPPED)
_RANK = {SKIPPED: 0, PASS: 1, WARN: 2, FAIL: 3}
MODES = ("quick", "full")
DEVICE_KINDS = ("cuda", "rocm", "cpu")


@dataclass(frozen=True)
class Check:
    """One check on one device (``device`` None: host-wide)."""

    name: str
    verdict: str
    reason: str
    device: int | None = None
    value: float | int | str | None = None
    unit: str | None = None
    expected: str | None = None

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"unknown verdict {self.verdict!r}")

    def to_manifest(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name}
        if self.device is not None:
            out["device"] = self.device
        out["verdict"] = self.verdict
        out["reason"] = " ".join(self.reason.split())
        for key in ("value", "unit", "expected"):
            v = getattr(self, key)
            if v is not None:
                out[key] = v
        return out


def worst(verdicts: list[str] | tuple[str, ...]) -> str:
    """The overall verdict: fail over warn over pass; only skipped checks (or none) pass."""
    top = max((_RANK[v] for v in verdicts), default=_RANK[PASS])
    return PASS if top <= _RANK[PASS] else (WARN if top == _RANK[WARN] else FAIL)


@dataclass(frozen=True)
class PreflightResult:
    mode: str
    device_kind: str
    duration_s: float
    checks: tuple[Check, ...] = field(default_factory=tuple)

    @property
    def verdict(self) -> str:
        return worst([c.verdict for c in self.checks])

    @property
    def failed(self) -> tuple[Check, ...]:
        return tuple(c for c in self.checks if c.verdict == FAIL)

    @property
    def warned(self) -> tuple[Check, ...]:
        return tuple(c for c in self.checks if c.verdict == WARN)

    def to_manifest(self) -> dict[str, Any]:
        return {"mode": self.mode, "verdict": self.verdict, "duration_s": round(self.duration_s, 3),
                "device_kind": self.device_kind, "checks": [c.to_manifest() for c in self.checks]}

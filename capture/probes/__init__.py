"""Probes: one module per source of facts.

Each module exposes ``probe(options: ProbeOptions) -> Section`` where ``Section`` is a frozen
dataclass with ``to_manifest() -> dict`` (the TOML table it contributes) or a :class:`Skipped`
when its source is absent (no GPU, no git, no amdsmi). A probe never raises on a missing
source; :func:`capture.fingerprint.collect` still guards every call, so a probe bug becomes
``skipped = "probe failed: ..."`` instead of a crashed fingerprint.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Skipped:
    """A probe that could not run, and why. Stored as ``skipped = "reason"`` in its table."""

    reason: str

    def to_manifest(self) -> dict[str, Any]:
        return {"skipped": self.reason}


@dataclass(frozen=True)
class ProbeOptions:
    """What the user asked the fingerprint to cover."""

    models: tuple[str, ...] = ()
    """``REPO[@REV]`` or a local directory, one per ``--model``."""
    datasets: tuple[str, ...] = ()
    """``REPO[@REV]`` or a local directory, one per ``--dataset``."""
    code: Path | None = None
    """The code directory (a git work tree or a plain folder); None: the current directory."""
    verify_artifacts: bool = False
    """Re-hash every model/dataset blob (slow; reads every byte)."""
    deep: bool = False
    """Import torch to report what is actually loaded (cuDNN, NCCL, devices); costs seconds."""
    hf_cache: Path | None = None
    """The hub cache folder; None: huggingface_hub's default (HF_HUB_CACHE / HF_HOME)."""
    progress: bool = True
    """Show progress bars on stderr for long steps."""
    extra: dict[str, Any] = field(default_factory=dict)


def as_table(section: Any) -> dict[str, Any]:
    """The TOML table a probe result contributes."""
    if hasattr(section, "to_manifest"):
        return section.to_manifest()
    if dataclasses.is_dataclass(section) and not isinstance(section, type):
        return dataclasses.asdict(section)
    return dict(section)

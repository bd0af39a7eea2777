"""The environment as this process found it at start, before torch or any library set variables.

``capture/__init__.py`` imports this module first, so the snapshot is taken when the package is
first imported: at the CLI's entry, or when a program imports capture (the trial recorder, a
library user) before it imports torch. Torch sets ``TORCHINDUCTOR_CACHE_DIR`` and similar inside
the process; a manifest records what the user's shell gave the run, not what a library wrote
later, so two back-to-back runs on one machine never differ in variables nobody set.
"""

from __future__ import annotations

import os
from types import MappingProxyType
from typing import Mapping

_snapshot: Mapping[str, str] = MappingProxyType(dict(os.environ))


def environ_at_start() -> Mapping[str, str]:
    """A read-only copy of ``os.environ`` taken when ``capture`` was first imported."""
    return _snapshot


def retake() -> None:
    """Take the snapshot again from the current ``os.environ`` (for tests that set variables)."""
    global _snapshot
    _snapshot = MappingProxyType(dict(os.environ))

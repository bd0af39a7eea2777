"""Folder listings shared by the probes: a folder read by two probes (site-packages, by the
packages and the framework probe) is listed once per process."""

from __future__ import annotations

import os
import threading

_lock = threading.Lock()
_listings: dict[str, tuple[str, ...]] = {}


def listdir(path: str | os.PathLike[str]) -> tuple[str, ...]:
    """``sorted(os.listdir(path))``, remembered; raises OSError like ``os.listdir``."""
    key = os.fspath(path)
    with _lock:
        cached = _listings.get(key)
    if cached is not None:
        return cached
    names = tuple(sorted(os.listdir(key)))
    with _lock:
        _listings[key] = names
    return names


def forget() -> None:
    """Drop every remembered listing (a new fingerprint in the same process lists afresh)."""
    with _lock:
        _listings.clear()

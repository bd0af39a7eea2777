"""Folder listings shared by the probes: a folder read by two probes (site-packages, by the
packages and the framework probe) is listed once per fingerprint. The import path's folders are
listed before the probes fan out (:func:`prime`), so that forked probes inherit the listings
instead of each reading them again."""

from __future__ import annotations

import os
import threading
from typing import Iterable

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


def prime(paths: Iterable[str]) -> None:
    """List each folder of ``paths`` now (the import path: ``""`` is the current folder); a
    missing or unreadable one is left for the probe that needs it to find out."""
    for entry in paths:
        try:
            listdir(entry or os.getcwd())
        except (OSError, ValueError):
            continue

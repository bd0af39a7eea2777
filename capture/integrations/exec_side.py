"""The side channel between ``capture exec`` and a Recorder inside the command it runs.

exec sets ``CAPTURE_EXEC_DIR`` to a private folder for the child; a Recorder that writes its
manifest (rank 0 under torch.distributed) also writes its ``[trial]`` table there as JSON, and
exec merges it into its own manifest before signing. Outside exec nothing is written.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

ENV = "CAPTURE_EXEC_DIR"
PREFIX = "recorder-"


def active() -> bool:
    return bool(os.environ.get(ENV))


def publish(trial: Mapping[str, Any]) -> Path | None:
    """Write ``trial`` for exec to merge (no-op outside exec)."""
    folder = os.environ.get(ENV)
    if not folder:
        return None
    from capture import manifest as mf
    from capture._atomic import atomic_write

    path = Path(folder) / f"{PREFIX}{os.getpid()}.json"
    atomic_write(path, json.dumps(mf.to_toml_value(dict(trial)), sort_keys=True).encode("utf-8"))
    return path


MAX_FILES = 64
"""At most this many Recorder tables are read (the newest); the rest of the folder is not looked at."""
MAX_ENTRIES = 10_000
"""At most this many folder entries are looked at: the command may leave anything there."""
MAX_BYTES = 16 * 1024 * 1024
"""A table larger than a manifest may be (:data:`capture._safe_read.MANIFEST_MAX_BYTES`) is skipped."""
MAX_DEPTH = 16
"""Nesting deeper than this is no Recorder table (the manifest schema allows 24 levels in all)."""
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NOCTTY", 0)


def _depth(value: Any, limit: int) -> int:
    if limit < 0:
        return 0
    if isinstance(value, dict):
        return 1 + max((_depth(v, limit - 1) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v, limit - 1) for v in value), default=0)
    return 0


def _read_table(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path`` if it is a regular file (links are not followed: the command could
    point one at any file capture may read), small enough, and a table a Recorder writes."""
    import stat

    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_BYTES:
            return None
        raw = os.read(fd, MAX_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(raw) > MAX_BYTES:
        return None
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or _depth(data, MAX_DEPTH + 1) > MAX_DEPTH:
        return None
    return data


def collect(folder: Path) -> list[dict[str, Any]]:
    """Every table Recorders wrote into ``folder``, oldest first. Whatever else the command left there
    (a FIFO, a dangling link, a link to /dev/zero, JSON nested beyond any table, a thousand files) is
    skipped: never waited on, never read whole, never followed."""
    import itertools
    import stat

    found: list[tuple[int, str]] = []
    try:
        with os.scandir(folder) as entries:
            for entry in itertools.islice(entries, MAX_ENTRIES):
                if not (entry.name.startswith(PREFIX) and entry.name.endswith(".json")):
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    found.append((st.st_mtime_ns, entry.name))
    except OSError:
        return []
    out = []
    for _, name in sorted(found)[-MAX_FILES:]:
        table = _read_table(Path(folder) / name)
        if table is not None:
            out.append(table)
    return out

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


def collect(folder: Path) -> list[dict[str, Any]]:
    """Every table Recorders wrote into ``folder``, oldest first (unreadable files are skipped)."""
    out = []
    for path in sorted(folder.glob(f"{PREFIX}*.json"), key=lambda p: p.stat().st_mtime_ns):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            out.append(data)
    return out

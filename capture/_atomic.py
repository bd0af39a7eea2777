"""Write files so that a reader sees the old content or the new, never half of either."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def atomic_write(path: str | os.PathLike[str], data: bytes, mode: int | None = None) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder: write, fsync, rename.

    ``mode`` (e.g. 0o600) is applied to the temporary file before any byte is written, so a
    private key is never readable by others, not even for an instant. Without it, an existing
    file keeps its mode and a new one gets ``0o666 & ~umask``, as with ``open()``.
    """
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    if mode is None:
        # mkstemp makes 0600 files; keep an existing file's mode, else what open() would give.
        try:
            mode = path.stat().st_mode & 0o7777
        except FileNotFoundError:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    try:
        dir_fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)

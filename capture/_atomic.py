"""Write files so that a reader sees the old content or the new, never half of either."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str], mode: int | None = None) -> Iterator[BinaryIO]:
    """A binary file to stream into; on a clean exit it becomes ``path`` (flush, fsync, rename,
    fsync of the folder), on an exception it is removed and ``path`` is left as it was.

    The file is a temporary one in the same folder; its ``name`` is that temporary path, so a
    caller can check what it wrote before the rename. ``mode`` (e.g. 0o600) is applied before any
    byte is written, so a private key is never readable by others, not even for an instant.
    Without it, an existing file keeps its mode and a new one gets ``0o666 & ~umask``, as with
    ``open()``.
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
    import tempfile  # ~6 ms of imports (shutil, random, bz2, lzma): only when a file is written

    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    try:
        os.fchmod(fd, mode)
        # the opener hands over mkstemp's descriptor, so f.name is the temporary path
        with open(tmp, "wb", opener=lambda _path, _flags: fd) as f:
            yield f
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


def atomic_write(path: str | os.PathLike[str], data: bytes, mode: int | None = None) -> None:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_open`)."""
    with atomic_open(path, mode) as f:
        f.write(data)

"""Write files so that a reader sees the old content or the new, never half of either.

A write replaces only a regular file, or makes a new one: a path that is a symlink, a folder, a FIFO,
a device node or a socket is refused (:func:`check_target`, exit 2), so ``-o /dev/null`` as root can
never swap a device node for a regular file and ``-o link`` never replaces a link. Commands call
:func:`check_target` for their ``-o`` before any work starts; :func:`atomic_open` checks again.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from capture.errors import UsageError

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISLNK, "a symlink"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def check_target(path: str | os.PathLike[str], flag: str = "-o", follow_link: bool = False) -> Path:
    """``path`` if a write may go there: a regular file (replaced) or a new path in an existing folder.
    Anything else is a :class:`UsageError` (exit 2) naming what it is. ``follow_link``: a symlink is
    followed (a config file kept in a dotfiles repository) and its target is checked instead."""
    p = Path(path)
    shown = f"{flag} {path}" if flag else str(path)
    if follow_link and p.is_symlink():
        p = Path(os.path.realpath(p))
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        folder = p.parent if str(p.parent) else Path(".")
        if not folder.is_dir():
            where = f"{flag}:" if flag else f"{path}:"
            raise UsageError(f"{where} folder {folder} does not exist", "create it first or choose another path") from None
        return p
    except OSError as exc:
        raise UsageError(f"{shown}: cannot check it ({exc.strerror})", "choose another path") from None
    if stat.S_ISREG(st.st_mode):
        return p
    kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a regular file")
    raise UsageError(f"{shown}: is {kind}; capture writes only a regular file or a new path",
                     "name a new file (or an existing regular file to replace)")


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str], mode: int | None = None, follow_link: bool = False) -> Iterator[BinaryIO]:
    """A binary file to stream into; on a clean exit it becomes ``path`` (flush, fsync, rename,
    fsync of the folder), on an exception it is removed and ``path`` is left as it was.

    The file is a temporary one in the same folder; its ``name`` is that temporary path, so a
    caller can check what it wrote before the rename. ``mode`` (e.g. 0o600) is applied before any
    byte is written, so a private key is never readable by others, not even for an instant.
    Without it, an existing file keeps its mode and a new one gets ``0o666 & ~umask``, as with
    ``open()``. Only a regular file or a new path is written (:func:`check_target`).
    """
    path = check_target(path, "", follow_link)
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
    fsync_dir(folder)


def fsync_dir(folder: str | os.PathLike[str]) -> None:
    """Make a rename or a new entry in ``folder`` durable; where the folder cannot be opened or
    synced (some filesystems refuse), the entry is left as the filesystem keeps it."""
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


def atomic_write(path: str | os.PathLike[str], data: bytes, mode: int | None = None, follow_link: bool = False) -> None:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_open`)."""
    with atomic_open(path, mode, follow_link) as f:
        f.write(data)

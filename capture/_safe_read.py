"""Read a small input file safely: a regular file only, never more than a documented limit.

Every file capture reads on a user's behalf (manifests, allowed-signers files, policy files, key
files, trial configs) goes through :func:`read_regular`, so that a symlink to ``/dev/zero`` is not
read until memory runs out, a FIFO does not block forever, and a huge file is refused after
``limit_bytes + 1`` bytes instead of being loaded whole.

- The file is opened with ``O_NONBLOCK`` (opening a FIFO returns at once) and checked with
  ``fstat`` on the open descriptor (no race between the check and the read): anything but a
  regular file is refused.
- ``FileNotFoundError``, ``IsADirectoryError`` and ``PermissionError`` are raised unchanged, so each
  caller keeps its own one-line message for them; every other problem (not a regular file, over
  the limit, another OS error) raises ``error(message, hint)``, the caller's :class:`CaptureError`.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from capture.errors import CaptureError, ConfigError, ManifestError

KIB = 1024
MIB = 1024 * KIB

MANIFEST_MAX_BYTES = 16 * MIB
"""A manifest larger than this is refused (exit 3). Real ones are 20-40 KiB; a trial with scaling
runs and every file of a model listed stays well under 1 MiB."""
ALLOWED_SIGNERS_MAX_BYTES = 4 * MIB
"""An allowed-signers file larger than this is refused (exit 2): about 40,000 signer lines."""
CONFIG_MAX_BYTES = 1 * MIB
"""Policy files and trial configs (exit 2)."""
KEY_MAX_BYTES = 64 * KIB
"""Key files (exit 2); an Ed25519 private key in OpenSSH format is about 400 bytes."""

_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0)
"""Read-only, never blocking on a FIFO's open, not inherited by programs started later, never a
controlling terminal."""

_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _kind(mode: int) -> str:
    for test, name in _KINDS:
        if test(mode):
            return name
    return "not a regular file"


def size_str(n: int) -> str:
    return f"{n // MIB} MiB" if n % MIB == 0 else f"{n // KIB} KiB"


def read_regular(path: str | os.PathLike[str], limit_bytes: int,
                 error: type[CaptureError] = ManifestError, what: str = "file") -> bytes:
    """The bytes of the regular file at ``path`` (symlinks followed), at most ``limit_bytes``."""
    shown = os.fspath(path)
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        raise
    except OSError as exc:
        raise error(f"{shown}: cannot open the {what} ({exc.strerror or exc})", "check the path") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", shown)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{shown}: is {_kind(st.st_mode)}, not a regular file; refusing to read it as a {what}",
                        f"name a regular {what}")
        if st.st_size > limit_bytes:
            raise error(f"{shown}: {what} is {st.st_size} bytes, over the {size_str(limit_bytes)} limit",
                        f"a {what} this large is not one capture wrote; check the path")
        chunks: list[bytes] = []
        total = 0
        while True:  # the size can change under us (a file still being written): read at most limit + 1
            chunk = os.read(fd, min(1 * MIB, limit_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit_bytes:
                raise error(f"{shown}: {what} is over the {size_str(limit_bytes)} limit",
                            f"a {what} this large is not one capture wrote; check the path")
        return b"".join(chunks)
    except (IsADirectoryError, CaptureError):
        raise
    except OSError as exc:
        raise error(f"{shown}: cannot read the {what} ({exc.strerror or exc})", "check the path and the disk") from None
    finally:
        os.close(fd)


def read_if_present(path: str | os.PathLike[str], limit_bytes: int, error: type[CaptureError], what: str,
                    hint: str) -> bytes | None:
    """:func:`read_regular` for a file that may not be there yet: ``None`` where it is missing; a
    folder or a file this user cannot read is ``error`` with ``hint``, like every other refusal."""
    try:
        return read_regular(path, limit_bytes, error, what)
    except FileNotFoundError:
        return None
    except (IsADirectoryError, PermissionError) as exc:
        raise error(f"{os.fspath(path)}: cannot read the {what} ({exc.strerror})", hint) from None


def read_prefix(path: str | os.PathLike[str], limit_bytes: int, follow_symlinks: bool = True) -> bytes | None:
    """Up to ``limit_bytes`` from the start of the regular file at ``path``; None where it is
    missing, unreadable or not a regular file (a FIFO, a device), or a symlink where
    ``follow_symlinks`` is false. For facts a probe reads from files that other programs own
    (package metadata, build configs): never raises, never blocks, never reads more than the limit."""
    try:
        fd = os.open(path, _OPEN_FLAGS if follow_symlinks else _OPEN_FLAGS | getattr(os, "O_NOFOLLOW", 0))
    except (OSError, ValueError):
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        chunks: list[bytes] = []
        total = 0
        while total < limit_bytes:
            chunk = os.read(fd, limit_bytes - total)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


def read_overlays(user_file: Path, named: str | os.PathLike[str] | None, what: str) -> list[tuple[str, str]]:
    """``(path, text)`` of each file laid over a shipped data file: the user's file in the config
    folder where there is one, then ``named`` (the ``--catalog`` file, which must be a file). Each
    is read as a config: a regular file of at most :data:`CONFIG_MAX_BYTES`, UTF-8; anything else
    is a :class:`ConfigError` (exit 2)."""
    layers = [(user_file, False)] + ([(Path(named), True)] if named is not None else [])
    out: list[tuple[str, str]] = []
    for p, required in layers:
        if not p.is_file():
            if required:
                raise ConfigError(f"--catalog: {p} is not a file", f"name the {what} to lay over the shipped one")
            continue
        try:
            text = read_regular(p, CONFIG_MAX_BYTES, ConfigError, what).decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{p}: cannot read ({exc})", "check the file") from None
        out.append((str(p), text))
    return out


def tree_bytes(path: str | os.PathLike[str]) -> int | None:
    """The bytes of ``path``: a regular file's size, or the sum over the regular files below a
    folder. ``path`` itself is followed when it is a link (the caller named it); nothing below it
    is (a link inside a checkpoint folder may lead anywhere, or back into the folder), and entries
    that cannot be read are skipped. ``None`` when ``path`` itself cannot be read; the one walk
    behind every size capture records (checkpoint files and folders, a dead trial's scratch)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if stat.S_ISREG(st.st_mode):
        return st.st_size
    if not stat.S_ISDIR(st.st_mode):
        return None
    total, stack = 0, [os.fspath(path)]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                entries = list(it)
        except OSError:
            continue
        for e in entries:
            try:
                if e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
                elif e.is_file(follow_symlinks=False):
                    total += e.stat(follow_symlinks=False).st_size
            except OSError:
                continue
    return total

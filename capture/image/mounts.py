"""What ``capture run`` may bind into a container, checked before anything is created.

A bind mount hands the container whatever the path names, read-write for ``--out``: the host's
root, a system folder, the home folder, the Docker socket (a read-only bind does not stop
``connect()``) or a device node would give the trial, or anything it runs, the host. So every
mount source is resolved first (symlinks and ``..`` included, also for a path that does not exist
yet) and refused when it is, or contains, one of those; ``--out`` and ``--cache`` must be
disjoint; a key or allowed-signers file must be a regular file, never a folder mounted whole.

Also refused (issue 25's hostile-mount corpus, tests/test_image_run.py): a folder that is, holds or
lies inside one of the home folder's credential folders (``~/.ssh``, ``~/.docker`` with its socket
and registry logins, ``~/.aws``, ``~/.kube``, ``~/.gnupg``, ...) or capture's own key folder
(``~/.config/capture``); ``/tmp`` itself (every user's files and sockets); a folder with a socket at
its top (a Docker socket outside ``/run``); and a read-write ``--out`` that is, or holds, anything
mounted read-only (the code folder and its git folders, the key, its ``.pub``, the allowed signers),
which would let the trial rewrite them. What Docker is given is always the resolved path, never an
alias such as ``/proc/self/cwd`` that the daemon would resolve in its own process.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from capture.errors import UsageError
from capture.paths import config_dir

SYSTEM_FOLDERS = (
    "/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/run", "/sbin",
    "/sys", "/usr", "/var", "/snap",
)
"""Folders that are the host's, not a user's: refused as a mount source, and anything inside them."""
SHARED_FOLDERS = ("/tmp",)
"""Folders every user writes into: refused themselves (a folder of your own inside is fine)."""
CREDENTIAL_FOLDERS = (".ssh", ".gnupg", ".docker", ".aws", ".azure", ".kube", ".config/gcloud", ".config/gh",
                      ".password-store", ".local/share/keyrings")
"""Folders of the home folder that hold credentials: never mounted, nor anything holding them or inside them."""


def resolved(path: Path | str) -> Path:
    """The real absolute path: symlinks and ``..`` resolved, also where the tail does not exist yet.
    A link that cannot be read (``/proc/1/cwd`` of another user's process) is a usage error."""
    try:
        return Path(os.path.realpath(os.path.abspath(os.path.expanduser(str(path)))))
    except OSError as exc:
        raise UsageError(f"{path}: cannot resolve it ({exc.strerror or exc})",
                         "name a folder of your own by its real path") from None


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _home() -> Path | None:
    try:
        return resolved(Path.home())
    except (RuntimeError, KeyError):
        return None


def _refuse_host_folder(flag: str, given: Path | str, real: Path, inside_system: bool = False) -> None:
    shown = f"{flag} {given}" + ("" if str(given) == str(real) else f" (= {real})")
    if real == Path("/"):
        raise UsageError(f"{shown}: refusing to mount the host's root folder", "name a folder of your own, e.g. ./out")
    for folder in SYSTEM_FOLDERS:
        sysdir = resolved(folder)
        if inside_system and real in (Path(folder), sysdir):
            raise UsageError(f"{shown}: refusing to mount a system folder ({folder})", "name the project's own folder")
        if not inside_system and (_inside(real, Path(folder)) or _inside(real, sysdir)):
            raise UsageError(f"{shown}: refusing to mount a system folder ({folder})", "name a folder of your own, e.g. ./out")
    home = _home()
    if home is not None and home != Path("/") and _inside(home, real):
        what = "the home folder" if real == home else f"a folder that holds the home folder ({home})"
        raise UsageError(f"{shown}: refusing to mount {what}", "name a folder inside it instead, e.g. ~/capture-out")


def _refuse_credentials(flag: str, given: Path | str, real: Path) -> None:
    shown = f"{flag} {given}" + ("" if str(given) == str(real) else f" (= {real})")
    home = _home()
    secret = [resolved(config_dir())]
    if home is not None and home != Path("/"):
        secret += [home / c for c in CREDENTIAL_FOLDERS]
    for s in secret:
        if _inside(real, s) or _inside(s, real):
            what = "capture's key folder" if s == secret[0] else f"a credential folder ({s})"
            rel = "is" if real == s else "lies inside" if _inside(real, s) else "holds"
            raise UsageError(f"{shown}: refusing to mount: it {rel} {what}",
                             "name a folder of your own that holds no keys, e.g. ./out")
    for shared in SHARED_FOLDERS:
        if real in (Path(shared), resolved(shared)):
            raise UsageError(f"{shown}: refusing to mount {shared} itself: every user's files and sockets are there",
                             f"name a folder of your own inside it, e.g. {shared}/capture-out")


def _refuse_sockets(flag: str, given: Path | str, real: Path) -> None:
    try:
        with os.scandir(real) as entries:
            for entry in entries:
                try:
                    if stat.S_ISSOCK(entry.stat(follow_symlinks=True).st_mode):
                        raise UsageError(f"{flag} {given}: refusing to mount a folder that holds a socket ({entry.path}); "
                                         "a Docker socket gives the container the host", "mount a folder without sockets")
                except OSError:
                    continue
    except (NotADirectoryError, FileNotFoundError, PermissionError):
        return


def writable_apart(out: Path, read_only: dict[str, Path | None]) -> None:
    """The read-write ``--out`` may not be, nor hold, anything mounted read-only: through it the
    container could rewrite the code, its git folders, the key or the allowed signers."""
    for flag, path in read_only.items():
        if path is not None and _inside(path, out):
            raise UsageError(f"--out {out} {'is' if path == out else 'holds'} {flag} {path}, which is mounted read-only; "
                             "read-write there would let the trial change it", "write the results to a folder of their own, e.g. ./out")


def _refuse_special(flag: str, given: Path | str, real: Path) -> os.stat_result | None:
    try:
        st = os.stat(real)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise UsageError(f"{flag} {given}: cannot read ({exc.strerror})", "check the path and its permissions") from None
    kind = ("a socket" if stat.S_ISSOCK(st.st_mode) else "a device file" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
            else "a FIFO" if stat.S_ISFIFO(st.st_mode) else None)
    if kind:
        raise UsageError(f"{flag} {given}: refusing to mount {kind}", "mount folders and regular files only")
    return st


def folder(flag: str, given: Path | str, *, must_exist: bool, inside_system: bool = False) -> Path:
    """A folder to bind: resolved, not the root/home/system, not special; may not exist yet unless ``must_exist``.

    ``inside_system``: a folder inside a system folder is allowed (read-only code in
    ``/var/lib/ci/workspace``, say), the system folder itself is not.
    """
    real = resolved(given)
    _refuse_host_folder(flag, given, real, inside_system)
    _refuse_credentials(flag, given, real)
    st = _refuse_special(flag, given, real)
    if st is not None and stat.S_ISDIR(st.st_mode):
        _refuse_sockets(flag, given, real)
    if st is None:
        if must_exist:
            raise UsageError(f"{flag} {given}: no such folder", "check the path")
        return real
    if not stat.S_ISDIR(st.st_mode):
        raise UsageError(f"{flag} {given}: not a folder", "name a folder")
    return real


def regular_file(flag: str, given: Path | str) -> Path:
    """A file to bind: resolved, and a regular file (never a folder mounted whole)."""
    real = resolved(given)
    _refuse_host_folder(flag, given, real)
    st = _refuse_special(flag, given, real)
    if st is None:
        raise UsageError(f"{flag} {given}: no such file", "check the path")
    if not stat.S_ISREG(st.st_mode):
        raise UsageError(f"{flag} {given}: not a regular file", f"{flag} names one file, not a folder")
    return real


def disjoint(out: Path, cache: Path | None) -> None:
    """``--out`` (read-write) and ``--cache`` (read-only) must not overlap."""
    if cache is None:
        return
    if out == cache:
        raise UsageError(f"--out and --cache are the same folder ({out})", "write the results somewhere else, e.g. ./out")
    if _inside(out, cache):
        raise UsageError(f"--out {out} is inside --cache {cache}", "write the results outside the hub cache")
    if _inside(cache, out):
        raise UsageError(f"--cache {cache} is inside --out {out}", "keep the hub cache outside the output folder")

"""Which allowed-signers file decides trust: the verifier's choice, never a file beside the data.

One trust root per verification (shared/DESIGN.md, decision 6), in this order:

1. ``--allowed-signers FILE`` (or ``--trust-from REV``: the results repository's file as it is at a
   git revision, :func:`from_revision`);
2. ``$CAPTURE_ALLOWED_SIGNERS``;
3. inside a results repository: its root's ``.capture/allowed_signers``, and only that one;
4. the personal file, ``~/.config/capture/allowed_signers``.

A *results repository* is a folder inside a git work tree that holds ``.capture/results.toml`` or
``.capture/allowed_signers``; its *root* is the outermost such folder between the manifest and the
top of the work tree, so a subfolder can never put itself forward as the root. Outside a git work
tree there is no results repository: a folder handed over with an ``allowed_signers`` in it (a
download, a bundle, ``/tmp``) decides nothing. As git refuses a repository another user owns
(``safe.directory``), a root or trust file owned by another user (neither you nor root) is not
used. Every other ``allowed_signers`` or ``.capture/allowed_signers`` in the manifest's folder or
above it is reported as ignored, once per file (a warning naming it and the file used).

This mirrors OpenSSH and git: ``ssh-keygen -Y verify -f FILE`` and git's
``gpg.ssh.allowedSignersFile`` take the verifier's file, never one found next to the signed data.
"""

from __future__ import annotations

import logging
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from capture._escape import printable
from capture.errors import TrustError, UsageError
from capture.paths import personal_allowed_signers
from capture.signing.trust import AllowedSigners

log = logging.getLogger(__name__)

MARKERS = (PurePosixPath(".capture/results.toml"), PurePosixPath(".capture/allowed_signers"))
"""Files that make a folder a results repository (the first is what `capture init` writes)."""
TRUST_FILE = PurePosixPath(".capture/allowed_signers")
"""A results repository's trust file, relative to its root: the only one used there."""
CANDIDATES = ("allowed_signers", ".capture/allowed_signers")
"""Names that used to be picked up beside a manifest; now reported as ignored when not chosen."""


@dataclass(frozen=True)
class TrustRoot:
    """The allowed signers chosen for one verification, and why."""

    path: Path | None
    """The file (None: no file, nobody is trusted)."""
    source: str
    """``--allowed-signers``, ``$CAPTURE_ALLOWED_SIGNERS``, ``results repository``, ``personal file``
    or ``none``."""
    results_root: Path | None = None
    ignored: tuple[Path, ...] = field(default=())

    def describe(self) -> str:
        if self.path is None:
            return "no allowed-signers file (nobody is trusted)"
        if self.source.startswith(("--", "$", "results", "personal")):
            return f"{self.path} ({self.source})"
        return self.source  # a git revision: REV:path


def _owned_by_us(path: Path) -> bool:
    """Owned by the user running capture, or by root (git's ``safe.directory`` rule, root allowed)."""
    try:
        uid = path.lstat().st_uid
        real_uid = path.stat().st_uid
    except OSError:
        return False
    me = os.geteuid()
    return uid in (me, 0) and real_uid in (me, 0)


def _ancestors(folder: str) -> list[str]:
    out = [folder]
    while True:
        parent = os.path.dirname(folder)
        if parent == folder:
            return out
        out.append(parent)
        folder = parent


def work_tree_top(path: str | os.PathLike[str]) -> Path | None:
    """The nearest folder at or above ``path`` holding ``.git`` (a folder or a gitfile); None outside git."""
    for candidate in _ancestors(os.path.abspath(path)):
        if os.path.lexists(os.path.join(candidate, ".git")):
            return Path(candidate)
    return None


_MARKER_NAMES = tuple(str(m) for m in MARKERS)


def results_root(path: str | os.PathLike[str]) -> Path | None:
    """The results repository holding ``path`` (a folder or a file): the outermost marked folder
    between ``path`` and the top of its git work tree; None when there is none."""
    p = os.path.abspath(path)
    start = p if os.path.isdir(p) else os.path.dirname(p)
    found = None
    for folder in _ancestors(start):
        if any(os.path.isfile(os.path.join(folder, m)) for m in _MARKER_NAMES):
            found = folder
        if os.path.lexists(os.path.join(folder, ".git")):
            return Path(found) if found is not None else None
    return None  # no work tree above: no results repository


def _refuse_escaping_link(candidate: Path, folder: Path) -> None:
    """The trust file (or its ``.capture`` folder) may be a link only to somewhere inside the root."""
    links = [p for p in (candidate.parent, candidate) if p != folder and p.is_symlink()]
    if not links:
        return
    real, root = Path(os.path.realpath(candidate)), Path(os.path.realpath(folder))
    if real != root and root not in real.parents:
        raise TrustError(f"{links[0]}: is a symlink to {real}, outside {folder}; "
                         "refusing to trust signers from outside the results repository",
                         f"replace the link with a regular file holding the allowed signers, committed in {folder}")


def repository_trust_file(root: Path) -> Path | None:
    """``root/.capture/allowed_signers`` when it can decide trust; None when absent or owned by
    another user (with a warning). A link leading outside ``root`` is refused (exit 4)."""
    path = root / TRUST_FILE
    if not path.is_file():
        return None
    _refuse_escaping_link(path, root)
    if not (_owned_by_us(root) and _owned_by_us(path.parent) and _owned_by_us(path)):
        _warn_once(path, f"ignored {path}: owned by another user, so it cannot decide whom you trust "
                         "(as git refuses a repository another user owns)")
        return None
    return path


def _candidates(manifest_path: str | os.PathLike[str]) -> list[Path]:
    p = os.path.abspath(manifest_path)
    folder = p if os.path.isdir(p) else os.path.dirname(p)
    return [Path(d, name) for d in _ancestors(folder) for name in CANDIDATES if os.path.isfile(os.path.join(d, name))]


def choose(manifest_path: str | os.PathLike[str], explicit: str | os.PathLike[str] | None = None,
           warn: bool = True, source: str = "--allowed-signers") -> TrustRoot:
    """The trust root for ``manifest_path`` (see the module docstring for the order); ``source``
    says where an ``explicit`` file comes from (the flag, or ``--trust-from``'s revision).
    :attr:`TrustRoot.results_root` is always filled in."""
    results = results_root(manifest_path)
    if explicit:
        root = TrustRoot(Path(explicit), source, results)
    elif os.environ.get("CAPTURE_ALLOWED_SIGNERS"):
        root = TrustRoot(Path(os.environ["CAPTURE_ALLOWED_SIGNERS"]).expanduser(), "$CAPTURE_ALLOWED_SIGNERS", results)
    else:
        repo_file = repository_trust_file(results) if results is not None else None
        if repo_file is not None:
            root = TrustRoot(repo_file, "results repository", results)
        else:
            personal = personal_allowed_signers()
            root = (TrustRoot(personal, "personal file", results) if personal.is_file()
                    else TrustRoot(None, "none", results))
    chosen = os.path.abspath(root.path) if root.path is not None else None
    ignored = tuple(p for p in _candidates(manifest_path) if os.path.abspath(p) != chosen)
    if warn:
        for p in ignored:
            _warn_once(p, f"ignored {p}: trust comes from the verifier, never from a file beside the data; "
                          f"using {root.describe()}")
    return TrustRoot(root.path, root.source, root.results_root, ignored)


_WARNED: set[str] = set()


def _warn_once(path: Path, message: str) -> None:
    key = os.path.abspath(path)
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning("%s", printable(message))


# --------------------------------------------------------------------------- --trust-from REV


def _git(top: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    try:
        return subprocess.run(["git", "-C", str(top), *args], capture_output=True, timeout=60)
    except FileNotFoundError:
        raise UsageError("--trust-from: git is not installed", "install git, or pass --allowed-signers FILE") from None
    except subprocess.TimeoutExpired:
        raise UsageError("--trust-from: git did not answer within 60 s", "check the repository") from None


@dataclass(frozen=True)
class RevisionTrust:
    """A results repository's allowed signers at a git revision (the base of a pull request)."""

    allowed: AllowedSigners
    revision: str
    rel_path: str
    """The trust file, relative to the top of the work tree."""
    root: Path
    present: bool


def from_revision(paths: list[str] | tuple[str, ...], revision: str) -> RevisionTrust:
    """``root/.capture/allowed_signers`` as it is at ``revision``, for the results repository that
    holds ``paths``; a file absent at that revision trusts nobody. Exit 2 when ``paths`` are in no
    results repository (or in several), or when git does not know ``revision``."""
    roots = {results_root(p) for p in paths}
    if None in roots or not roots:
        raise UsageError(f"--trust-from {revision}: {', '.join(map(str, paths))} is in no results repository "
                         "(a git work tree with .capture/allowed_signers or .capture/results.toml)",
                         "name the results repository folder, or use --allowed-signers FILE")
    if len(roots) > 1:
        raise UsageError(f"--trust-from {revision}: the paths span {len(roots)} results repositories",
                         "verify one results repository at a time")
    root = roots.pop()
    assert root is not None
    top = work_tree_top(root)
    assert top is not None
    rel = (PurePosixPath(Path(os.path.relpath(root, top)).as_posix()) / TRUST_FILE).as_posix()
    rel = rel.removeprefix("./")
    commit = _git(top, "rev-parse", "--verify", "--quiet", "--end-of-options", f"{revision}^{{commit}}")
    if commit.returncode != 0:
        raise UsageError(f"--trust-from {revision}: not a commit in {top}",
                         "name a revision git knows (fetch it first: `git fetch origin BRANCH`; in CI check out "
                         "with fetch-depth: 0)")
    sha = commit.stdout.decode().strip()
    label = f"{revision}:{rel}"
    blob = _git(top, "cat-file", "blob", f"{sha}:{rel}")
    if blob.returncode != 0:
        return RevisionTrust(AllowedSigners(f"{label} (absent: nobody is trusted)", ()), revision, rel, root, False)
    from capture._safe_read import ALLOWED_SIGNERS_MAX_BYTES

    if len(blob.stdout) > ALLOWED_SIGNERS_MAX_BYTES:
        raise UsageError(f"{label}: allowed-signers file is over the {ALLOWED_SIGNERS_MAX_BYTES // (1 << 20)} MiB limit",
                         "a file this large is not an allowed-signers file")
    return RevisionTrust(AllowedSigners.from_bytes(blob.stdout, label), revision, rel, root, True)

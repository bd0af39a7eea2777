"""The code: git remote (credentials stripped), commit, branch, dirty state, and a hash of the
exact working tree, computed without writing anything into the repository.

Tree hash (``capture-tree-v2``), the same for git work trees and plain folders:

1. The files: in a git work tree ``git ls-files -z --cached --others --exclude-standard``
   (tracked files, plus untracked files that are not ignored); in a plain folder every file
   below it. Paths are relative, as bytes, sorted bytewise, each once.
2. One entry per path: ``KIND SP DIGEST SP PATH NUL`` where KIND is ``F`` (regular file),
   ``X`` (executable regular file), ``L`` (symlink), ``S`` (a submodule: DIGEST is its
   checked-out commit, or the commit recorded in the index when it is not checked out), ``D``
   (tracked but deleted; DIGEST is ``-``) or ``O`` (anything else; ``-``). For ``F``/``X``/``L``
   DIGEST is the git blob id of the content (``sha1("blob <size>\\0" + content)``; for a symlink
   the content is the link target text), so a clean file's digest is the id git already holds.
3. ``tree_hash = "sha256:" + sha256(b"capture-tree-v2\\0" + entries)``.

Speed: ``git status`` (which compares stat data and re-reads racily clean files, as git itself
does) tells which tracked files still match the index; their blob ids come from
``git ls-files --stage`` and are not re-read. Only modified and untracked files are hashed.
(A file under a clean/smudge filter such as git-lfs or autocrlf therefore contributes the id of
its filtered form while clean, and of its raw bytes while modified: the hash stays exact, but
staging such a file changes it.)

Files: ``[code.files]`` maps each path (as text) to its DIGEST above, so a comparison can name
the files that changed, were added or were removed. Bounded: at most :data:`FILES_LIMIT` paths
(the first in byte order) are listed; ``files_total`` counts them all and ``files_truncated`` is
true when the map stops short (the tree hash still covers every file).

Git is read with plain ``git`` subprocesses, all started at once so they overlap (no GitPython:
its import alone costs ~75 ms and runs ``git version``).

Read-only by construction: only ``ls-files``, ``status`` and ``rev-parse``-like reads run, with
``GIT_OPTIONAL_LOCKS=0`` so ``git status`` does not refresh and rewrite ``.git/index``; nothing is
staged, no tree object is written.
"""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from capture.probes import ProbeOptions, Skipped
from capture.redact import redact_text, redact_url

FILES_LIMIT = 5000
"""Most paths listed in ``[code.files]``; past it ``files_truncated = true``."""
TREE_HASH_HEADER = b"capture-tree-v2\0"


@dataclass(frozen=True)
class TreeHash:
    digest: str
    """``sha256:<hex>``."""
    file_count: int
    size_bytes: int
    deleted: tuple[str, ...] = ()
    files: Mapping[str, str] = field(default_factory=dict)
    """Path -> DIGEST for every entry that exists (``D`` entries are left out), in byte order."""


def git_blob_id(data: bytes) -> str:
    """The id git gives a blob with this content."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # noqa: S324 - git's own id


def _file_blob_id(path: str, size: int) -> str:
    h = hashlib.sha1(b"blob %d\0" % size)  # noqa: S324 - git's own id
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


_INDEX_KIND = {b"100644": "F", b"100755": "X", b"120000": "L"}


def hash_tree(root: Path, paths: Iterable[bytes], gitlinks: dict[bytes, str] | None = None,
              known: dict[bytes, tuple[str, str]] | None = None) -> TreeHash:
    """The ``capture-tree-v2`` hash of ``paths`` (relative, bytes) under ``root``.

    ``known``: path -> (KIND, blob id) for files whose work-tree content git has confirmed to be
    the indexed one; they are not re-read.
    """
    gitlinks = gitlinks or {}
    known = known or {}
    outer = hashlib.sha256(TREE_HASH_HEADER)
    count = size = 0
    deleted: list[str] = []
    files: dict[str, str] = {}
    base = os.fsencode(root)
    for rel in sorted(set(paths)):
        full = os.path.join(base, rel)
        try:
            st = os.lstat(full)
        except FileNotFoundError:
            kind, digest = "D", "-"
            deleted.append(os.fsdecode(rel))
        else:
            if rel in known and (stat.S_ISLNK(st.st_mode) or stat.S_ISREG(st.st_mode)):
                kind, digest = known[rel]
                size += st.st_size if stat.S_ISREG(st.st_mode) else 0
            elif stat.S_ISLNK(st.st_mode):
                kind, digest = "L", git_blob_id(os.readlink(full))
            elif stat.S_ISREG(st.st_mode):
                kind = "X" if st.st_mode & 0o111 else "F"
                digest = _file_blob_id(os.fsdecode(full), st.st_size)
                size += st.st_size
            elif stat.S_ISDIR(st.st_mode) and rel in gitlinks:
                kind, digest = "S", _submodule_commit(os.fsdecode(full)) or gitlinks[rel]
            else:
                kind, digest = "O", "-"
            count += 1
            files[os.fsdecode(rel)] = digest
        outer.update(f"{kind} {digest} ".encode() + rel + b"\0")
    return TreeHash(f"sha256:{outer.hexdigest()}", count, size, tuple(deleted), files)


def list_directory(root: Path) -> list[bytes]:
    """Every file and symlink below ``root`` (symlinked folders are not entered), relative, as bytes."""
    base = os.fsencode(root)
    out: list[bytes] = []
    for folder, dirs, files in os.walk(base, followlinks=False):
        for name in dirs:
            if os.path.islink(os.path.join(folder, name)):
                files.append(name)
        for name in files:
            out.append(os.path.relpath(os.path.join(folder, name), base))
    return out


def _submodule_commit(path: str) -> str | None:
    """The checked-out commit of a submodule; None when it is not checked out (use the index)."""
    try:
        proc = subprocess.run(["git", "-C", path, "rev-parse", "-q", "--verify", "HEAD"], capture_output=True,
                              env=_git_env(), stdin=subprocess.DEVNULL, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    out = proc.stdout.decode(errors="replace").strip()
    return out if proc.returncode == 0 and out else None


@dataclass(frozen=True)
class CodeInfo:
    path: str
    source: str
    """``git`` (a work tree) or ``directory`` (a plain folder)."""
    tree_hash: str
    file_count: int
    size_bytes: int
    remote_name: str | None = None
    remote_url: str | None = None
    """Credentials removed (:func:`capture.redact.redact_url`)."""
    commit: str | None = None
    branch: str | None = None
    detached: bool | None = None
    dirty: bool | None = None
    modified_count: int | None = None
    """Tracked paths that differ from HEAD (staged or not, deletions included)."""
    untracked_count: int | None = None
    """Untracked, not ignored files (they are part of tree_hash)."""
    files: Mapping[str, str] = field(default_factory=dict)
    """Path -> digest (git blob id; submodule commit; ``-``), at most :data:`FILES_LIMIT` of them."""
    files_total: int = 0
    files_truncated: bool = False

    def to_manifest(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "files"}
        out["files"] = dict(self.files)
        return out


def _bounded(tree: TreeHash) -> dict[str, Any]:
    listed = dict(list(tree.files.items())[:FILES_LIMIT])
    return {"files": listed, "files_total": len(tree.files), "files_truncated": len(tree.files) > FILES_LIMIT}


# --------------------------------------------------------------------------- git, as subprocesses


def _git_env() -> dict[str, str]:
    return {**os.environ, "GIT_OPTIONAL_LOCKS": "0", "GIT_TERMINAL_PROMPT": "0", "LC_ALL": "C"}


class GitFailed(Exception):
    """A git command exited non-zero; ``detail`` is the last line of its stderr (credentials removed)."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class _Git:
    """Start several read-only git commands at once in one work tree; collect each when needed."""

    def __init__(self, cwd: Path) -> None:
        self.cwd = str(cwd)
        self.env = _git_env()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, key: str, *args: str) -> None:
        self.procs[key] = subprocess.Popen(["git", *args], cwd=self.cwd, env=self.env, stdin=subprocess.DEVNULL,
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def result(self, key: str, check: bool = True) -> tuple[int, bytes]:
        proc = self.procs.pop(key)
        out, err = proc.communicate()
        if check and proc.returncode != 0:
            lines = err.decode(errors="replace").strip().splitlines()
            raise GitFailed(redact_text(lines[-1] if lines else f"git exited {proc.returncode}"))
        return proc.returncode, out

    def close(self) -> None:
        for proc in self.procs.values():
            proc.kill()
            proc.communicate()
        self.procs.clear()


def _work_tree(folder: Path) -> tuple[Path | None, str | None]:
    """(work tree root, None), or (None, why not) when ``folder`` is not inside a work tree."""
    try:
        proc = subprocess.run(["git", "rev-parse", "--is-bare-repository", "--show-toplevel"], cwd=folder,
                              env=_git_env(), capture_output=True, stdin=subprocess.DEVNULL, timeout=60)
    except FileNotFoundError:
        return None, "no-git"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, str(exc)
    lines = proc.stdout.decode(errors="surrogateescape").splitlines()
    if proc.returncode != 0 or len(lines) < 2 or lines[0] == "true":
        return None, "not-a-work-tree"
    return Path(lines[1]), None


@dataclass(frozen=True)
class _Status:
    """What one ``git status --porcelain=v2 --branch -z`` says."""

    commit: str | None
    """None: no commit yet (``# branch.oid (initial)``)."""
    branch: str | None
    """None: detached (``# branch.head (detached)``)."""
    modified: int
    untracked: int
    unsure: frozenset[bytes]
    """Paths whose work-tree content may differ from the index."""


def _status(raw: bytes) -> _Status:
    """Parse porcelain v2 (``-z``): headers ``# branch.oid`` / ``# branch.head``; entries ``1`` (changed),
    ``2`` (renamed or copied: the source path follows as its own field), ``u`` (unmerged), ``?``
    (untracked), ``!`` (ignored). XY uses ``.`` for unmodified."""
    commit = branch = None
    modified = untracked = 0
    unsure: set[bytes] = set()
    fields = raw.split(b"\0")
    i = 0
    while i < len(fields):
        entry = fields[i]
        i += 1
        kind = entry[:2]
        if entry.startswith(b"# branch.oid "):
            oid = entry[len(b"# branch.oid "):].decode(errors="replace")
            commit = None if oid == "(initial)" else oid
        elif entry.startswith(b"# branch.head "):
            head = entry[len(b"# branch.head "):].decode(errors="replace")
            branch = None if head == "(detached)" else head
        elif kind == b"? ":
            untracked += 1
        elif kind in (b"1 ", b"2 ", b"u "):
            parts = entry.split(b" ", 10 if kind == b"u " else 9 if kind == b"2 " else 8)
            xy, path = parts[1], parts[-1]
            modified += 1
            if kind == b"2 ":
                i += 1  # the rename/copy source follows as its own field
            if kind == b"u " or xy[1:2] != b".":  # a conflict, or the work tree differs from the index
                unsure.add(path)
    return _Status(commit, branch, modified, untracked, frozenset(unsure))


def _index(raw: bytes) -> tuple[dict[bytes, str], dict[bytes, tuple[str, str]]]:
    """(submodule path -> commit, file path -> (KIND, blob id)) from ``git ls-files --stage``."""
    gitlinks: dict[bytes, str] = {}
    blobs: dict[bytes, tuple[str, str]] = {}
    for entry in raw.split(b"\0"):
        meta, _, path = entry.partition(b"\t")
        parts = meta.split(b" ")
        if len(parts) != 3:
            continue
        mode, sha, stage = parts
        if mode == b"160000":
            gitlinks[path] = sha.decode()
        elif stage == b"0" and mode in _INDEX_KIND:
            blobs[path] = (_INDEX_KIND[mode], sha.decode())
    return gitlinks, blobs


def _remote(raw: bytes) -> tuple[str | None, str | None]:
    """``origin`` if it exists, else the first remote by name; from ``git config -z --get-regexp``."""
    urls: dict[str, str] = {}
    for entry in raw.split(b"\0"):
        key, _, value = entry.decode(errors="replace").partition("\n")
        if key.startswith("remote.") and key.endswith(".url"):
            urls.setdefault(key[len("remote."):-len(".url")], value)
    if not urls:
        return None, None
    name = "origin" if "origin" in urls else sorted(urls)[0]
    # git never uses a URL's #fragment: whatever is there (a token pasted after the URL) is dropped
    return redact_text(name), redact_url(urls[name].split("#", 1)[0])


def _start_reads(root: Path) -> _Git:
    """Start every read at once in ``root``; they run side by side and are collected when needed."""
    g = _Git(root)
    try:
        g.start("status", "status", "--porcelain=v2", "--branch", "--no-ahead-behind", "-z",
                "--untracked-files=all", "--ignore-submodules=none")
        g.start("remotes", "config", "-z", "--get-regexp", r"^remote\..*\.url$")
        g.start("listing", "ls-files", "-z", "--cached", "--others", "--exclude-standard")
        g.start("index", "ls-files", "-z", "--stage")
    except BaseException:
        g.close()
        raise
    return g


def _probe_git(root: Path, g: _Git | None = None) -> CodeInfo:
    """The work tree at ``root``, from the reads ``g`` started there (started now when None)."""
    g = g or _start_reads(root)
    try:
        _, raw_status = g.result("status")
        _, out = g.result("remotes", check=False)  # exit 1: no remote
        remote_name, remote_url = _remote(out)
        _, listing = g.result("listing")
        _, raw_index = g.result("index")
    finally:
        g.close()
    status = _status(raw_status)
    gitlinks, blobs = _index(raw_index)
    known = {p: v for p, v in blobs.items() if p not in status.unsure}
    tree = hash_tree(root, [p for p in listing.split(b"\0") if p], gitlinks, known)
    return CodeInfo(
        path=str(root), source="git", tree_hash=tree.digest, file_count=tree.file_count,
        size_bytes=tree.size_bytes, remote_name=remote_name, remote_url=remote_url, commit=status.commit,
        branch=status.branch, detached=status.branch is None, dirty=bool(status.modified or status.untracked),
        modified_count=status.modified, untracked_count=status.untracked, **_bounded(tree),
    )


def probe_directory(folder: Path) -> CodeInfo:
    root = folder.resolve()
    tree = hash_tree(root, list_directory(root))
    return CodeInfo(path=str(root), source="directory", tree_hash=tree.digest, file_count=tree.file_count,
                    size_bytes=tree.size_bytes, **_bounded(tree))


def probe(options: ProbeOptions) -> CodeInfo | Skipped:
    explicit = options.code is not None
    folder = Path(options.code) if options.code is not None else Path.cwd()
    if not folder.exists():
        return Skipped(f"no such folder: {folder}")
    if not folder.is_dir():
        return Skipped(f"not a folder: {folder}")
    # A folder holding .git is usually the top of its work tree: its reads start now, beside the
    # rev-parse that says where the top is, and are kept when that is this folder (one git
    # start-up less to wait for); otherwise they are dropped and started again at the top.
    early = None
    if os.path.lexists(folder / ".git"):
        try:
            early = _start_reads(folder)
        except OSError:
            early = None
    try:
        root, why = _work_tree(folder)
    except BaseException:
        if early is not None:
            early.close()
        raise
    if early is not None and (root is None or os.path.realpath(folder) != os.path.realpath(root)):
        early.close()
        early = None
    if root is None:
        if why == "no-git" and (folder / ".git").exists():
            return Skipped("git is not installed; the code folder is a git work tree but cannot be read without it")
        if not explicit:
            # Hashing whatever folder we happen to run in (a home directory?) could take hours.
            return Skipped("the current folder is not a git work tree; pass --code DIR to hash a plain folder")
        return probe_directory(folder)
    try:
        return _probe_git(root, early)
    except GitFailed as exc:
        return Skipped(f"git failed in {folder}: {exc.detail}")

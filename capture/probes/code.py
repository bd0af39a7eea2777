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

Read-only by construction: only ``ls-files``, ``status`` and ``rev-parse``-like reads run, with
``GIT_OPTIONAL_LOCKS=0`` so ``git status`` does not refresh and rewrite ``.git/index``; nothing is
staged, no tree object is written.
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from capture.probes import ProbeOptions, Skipped
from capture.probes.packages import strip_url_credentials

TREE_HASH_HEADER = b"capture-tree-v2\0"


@dataclass(frozen=True)
class TreeHash:
    digest: str
    """``sha256:<hex>``."""
    file_count: int
    size_bytes: int
    deleted: tuple[str, ...] = ()


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
        outer.update(f"{kind} {digest} ".encode() + rel + b"\0")
    return TreeHash(f"sha256:{outer.hexdigest()}", count, size, tuple(deleted))


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
    try:
        import git

        return git.Repo(path).head.commit.hexsha
    except Exception:  # not checked out, or not a repository: fall back to the index
        return None


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
    commit: str | None = None
    branch: str | None = None
    detached: bool | None = None
    dirty: bool | None = None
    modified_count: int | None = None
    """Tracked paths that differ from HEAD (staged or not, deletions included)."""
    untracked_count: int | None = None
    """Untracked, not ignored files (they are part of tree_hash)."""

    def to_manifest(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _status(repo: Any) -> tuple[int, int, set[bytes]]:
    """(modified count, untracked count, paths whose work-tree content may differ from the index)."""
    raw: bytes = repo.git.status("--porcelain=v1", "-z", "--untracked-files=all", "--ignore-submodules=none",
                                 stdout_as_string=False)
    modified = untracked = 0
    unsure: set[bytes] = set()
    fields = raw.split(b"\0")
    i = 0
    while i < len(fields):
        entry = fields[i]
        i += 1
        if len(entry) < 4:
            continue
        xy, path = entry[:2], entry[3:]
        if xy == b"??":
            untracked += 1
        elif xy != b"!!":
            modified += 1
            if entry[:1] in (b"R", b"C"):
                i += 1  # the rename/copy source follows as its own field
        if xy[1:2] != b" " or b"U" in xy or xy in (b"AA", b"DD"):  # work tree differs, or a conflict
            unsure.add(path)
    return modified, untracked, unsure


def _index(repo: Any) -> tuple[dict[bytes, str], dict[bytes, tuple[str, str]]]:
    """(submodule path -> commit, file path -> (KIND, blob id)) from ``git ls-files --stage``."""
    raw: bytes = repo.git.ls_files("-z", "--stage", stdout_as_string=False)
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


def _remote(repo: Any) -> tuple[str | None, str | None]:
    names = sorted(r.name for r in repo.remotes)
    if not names:
        return None, None
    name = "origin" if "origin" in names else names[0]
    reader = repo.config_reader()
    try:
        url = reader.get_value(f'remote "{name}"', "url")
    except Exception:
        return name, None
    return name, strip_url_credentials(str(url))


def _probe_git(repo: Any) -> CodeInfo:
    repo.git.update_environment(GIT_OPTIONAL_LOCKS="0", GIT_TERMINAL_PROMPT="0")
    root = Path(repo.working_tree_dir)
    try:
        commit: str | None = repo.head.commit.hexsha
    except ValueError:  # no commits yet
        commit = None
    detached = repo.head.is_detached
    branch = None if detached else repo.head.reference.name
    remote_name, remote_url = _remote(repo)
    listing: bytes = repo.git.ls_files("-z", "--cached", "--others", "--exclude-standard", stdout_as_string=False)
    modified, untracked, unsure = _status(repo)
    gitlinks, blobs = _index(repo)
    known = {p: v for p, v in blobs.items() if p not in unsure}
    tree = hash_tree(root, [p for p in listing.split(b"\0") if p], gitlinks, known)
    return CodeInfo(
        path=str(root), source="git", tree_hash=tree.digest, file_count=tree.file_count,
        size_bytes=tree.size_bytes, remote_name=remote_name, remote_url=remote_url, commit=commit,
        branch=branch, detached=detached, dirty=bool(modified or untracked),
        modified_count=modified, untracked_count=untracked,
    )


def probe_directory(folder: Path) -> CodeInfo:
    root = folder.resolve()
    tree = hash_tree(root, list_directory(root))
    return CodeInfo(path=str(root), source="directory", tree_hash=tree.digest, file_count=tree.file_count,
                    size_bytes=tree.size_bytes)


def probe(options: ProbeOptions) -> CodeInfo | Skipped:
    explicit = options.code is not None
    folder = Path(options.code) if explicit else Path.cwd()
    if not folder.exists():
        return Skipped(f"no such folder: {folder}")
    if not folder.is_dir():
        return Skipped(f"not a folder: {folder}")
    try:
        import git
    except ImportError:
        git = None  # type: ignore[assignment]
    repo = None
    if git is not None:
        try:
            repo = git.Repo(folder, search_parent_directories=True)
        except (git.InvalidGitRepositoryError, git.NoSuchPathError):
            repo = None
    if repo is None or repo.bare:
        if not explicit:
            # Hashing whatever folder we happen to run in (a home directory?) could take hours.
            return Skipped("the current folder is not a git work tree; pass --code DIR to hash a plain folder")
        return probe_directory(folder)
    try:
        return _probe_git(repo)
    except git.GitCommandNotFound:
        return Skipped("git is not installed; the code folder is a git work tree but cannot be read without it")
    except git.GitCommandError as exc:
        detail = (exc.stderr or "").strip().splitlines()
        return Skipped(f"git failed in {folder}: {detail[-1] if detail else exc}")
    finally:
        repo.close()

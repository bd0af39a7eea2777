"""Models and datasets: hub revisions resolved offline against the local cache, or local folders.

Nothing here touches the network. ``REPO[@REV]`` is looked up in the hub cache layout
(``models--org--name/refs/<rev>``, ``snapshots/<commit>/``, ``blobs/<id>``); REV is a branch or tag
in ``refs/`` or a commit hash (full or a unique prefix) and defaults to ``main``.

Hashes:
- hub snapshot: ``content_hash = "sha256:" + sha256(b"capture-hf-snapshot-v1\\0" + entries)``,
  one entry ``BLOB_ID SP PATH NUL`` per file, sorted by path. Blob ids are content hashes
  (sha256 for LFS files, git blob sha1 otherwise), so this names the content without reading it.
- local folder: ``content_hash = "sha256:" + sha256(b"capture-dir-v1\\0" + entries)``, one entry
  ``SHA256 SP PATH NUL`` per file (symlinks followed), sorted by relative path bytes.
- a single local file (a data set as one ``.jsonl``): ``content_hash = "sha256:" +
  sha256(b"capture-file-v1\\0" + SHA256 SP NAME NUL)``, NAME its file name.

``verify_artifacts`` re-reads every blob and checks it against its id (sha256 for LFS blobs,
git's ``sha1("blob <size>\\0" + content)`` otherwise), in parallel threads (hashlib releases the
GIL), with a progress bar on stderr.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from capture._escape import printable
from capture._safe_read import read_prefix
from capture.errors import ArtifactMismatch, UsageError
from capture import paths
from capture.probes import ProbeOptions

_SHA256 = re.compile(r"[0-9a-f]{64}")
_SHA1 = re.compile(r"[0-9a-f]{40}")
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
_HEX_PREFIX = re.compile(r"[0-9a-f]{4,40}")
_COMMIT = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
"""What a hub cache's ``refs/<name>`` file holds: a git commit hash (SHA-1; SHA-256 for a repository
in git's newer object format)."""
_CHUNK = 1 << 20


@dataclass(frozen=True)
class ArtifactFile:
    path: str
    size_bytes: int
    blob_id: str | None = None
    """The blob file's name in the hub cache (its content hash)."""
    lfs: bool | None = None
    """True when blob_id is a 64-hex sha256 (an LFS file); False for git-sha1 blobs."""
    sha256: str | None = None
    """Local folders only: the file's sha256."""

    def to_manifest(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class ArtifactInfo:
    spec: str
    kind: str
    """``model`` or ``dataset``."""
    source: str
    """``hf-cache`` or ``local-dir``."""
    content_hash: str
    size_bytes: int
    files: tuple[ArtifactFile, ...]
    repo_id: str | None = None
    revision: str | None = None
    """As asked for (default ``main``)."""
    commit: str | None = None
    path: str | None = None
    """The local folder (``local-dir`` only)."""
    missing_files: tuple[str, ...] = ()
    """Snapshot entries whose blob is not in the cache (an interrupted download)."""
    verified: bool | None = None
    mismatches: tuple[str, ...] = ()
    mismatch_blobs: tuple[str, ...] = ()
    """The blob files behind ``mismatches`` (absolute paths; for the error message, not the manifest)."""

    def to_manifest(self) -> dict[str, Any]:
        return {
            "spec": self.spec, "repo_id": self.repo_id, "revision": self.revision, "commit": self.commit,
            "source": self.source, "path": self.path, "content_hash": self.content_hash,
            "size_bytes": self.size_bytes, "file_count": len(self.files),
            "missing_files": list(self.missing_files) or None, "verified": self.verified,
            "mismatches": list(self.mismatches) if self.verified is not None else None,
            "files": [f.to_manifest() for f in self.files],
        }


# --------------------------------------------------------------------------- cache location


def hub_cache_dir(options: ProbeOptions) -> Path:
    """options.hf_cache, else :func:`capture.paths.hub_cache_dir` (HF_HUB_CACHE, HF_HOME, ...)."""
    return paths.hub_cache_dir(options.hf_cache)


def _repo_folder(cache: Path, kind: str, repo_id: str) -> Path:
    return cache / f"{kind}s--{repo_id.replace('/', '--')}"


# --------------------------------------------------------------------------- hashing


def git_blob_sha1(path: str | os.PathLike[str], on_bytes: Callable[[int], None] | None = None) -> str:
    size = os.stat(path).st_size
    h = hashlib.sha1(b"blob %d\0" % size)
    _feed(path, h, on_bytes)
    return h.hexdigest()


def file_sha256(path: str | os.PathLike[str], on_bytes: Callable[[int], None] | None = None) -> str:
    h = hashlib.sha256()
    _feed(path, h, on_bytes)
    return h.hexdigest()


def _feed(path: str | os.PathLike[str], h: Any, on_bytes: Callable[[int], None] | None) -> None:
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            if on_bytes is not None:
                on_bytes(len(chunk))


def _progress(total: int, desc: str, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, file=sys.stderr,
                disable=not enabled, leave=False)


def _parallel(jobs: Iterable[tuple[str, Callable[[Callable[[int], None]], str]]], total: int, desc: str,
              enabled: bool) -> dict[str, str]:
    """Run ``fn(on_bytes)`` for each (key, fn) in threads; returns {key: result}."""
    jobs = list(jobs)
    with _progress(total, desc, enabled) as bar, ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        futures = {key: pool.submit(fn, bar.update) for key, fn in jobs}
        return {key: fut.result() for key, fut in futures.items()}


# --------------------------------------------------------------------------- hub cache


def parse_spec(spec: str) -> tuple[str, str]:
    """``REPO[@REV]`` -> (repo_id, revision); REV defaults to ``main``."""
    repo_id, sep, rev = spec.rpartition("@")
    if not sep:
        repo_id, rev = spec, "main"
    if not _REPO_ID.fullmatch(repo_id) or not rev or ".." in rev or rev.startswith("/"):
        raise UsageError(f"{spec!r} is neither a hub repo id (ORG/NAME[@REV]) nor an existing folder or file",
                         "name a repo such as EleutherAI/gpt-j-6B@main, or a local folder or file that exists")
    return repo_id, rev


def _not_cached(spec: str, kind: str, repo_id: str, rev: str, cache: Path, why: str) -> UsageError:
    repo_type = " --repo-type dataset" if kind == "dataset" else ""
    return UsageError(f"{kind} {spec} is not in the hub cache at {cache} ({why})",
                      f"hf download {repo_id}{repo_type} --revision {rev}")


def resolve_commit(cache: Path, kind: str, repo_id: str, rev: str, spec: str) -> tuple[Path, str]:
    """(repo folder, commit) for ``rev``: a ref name in refs/ or a commit hash or prefix."""
    folder = _repo_folder(cache, kind, repo_id)
    if not folder.is_dir():
        raise _not_cached(spec, kind, repo_id, rev, cache, f"no {folder.name}")
    ref = folder / "refs" / rev
    if ref.is_file():
        text = (read_prefix(ref, 256) or b"").decode("ascii", "replace").strip()
        if not _COMMIT.fullmatch(text):  # a snapshot folder is named by it: never "../..", never a path
            raise _not_cached(spec, kind, repo_id, rev, cache,
                              f"ref {rev} holds {printable(text)[:60]!r}, not a commit hash")
        commit = text
    elif _HEX_PREFIX.fullmatch(rev):
        try:
            snapshots = sorted(p.name for p in (folder / "snapshots").iterdir() if p.name.startswith(rev))
        except OSError:
            snapshots = []
        if len(snapshots) > 1:
            raise UsageError(f"{kind} {spec}: revision {rev} matches {len(snapshots)} cached commits "
                             f"({', '.join(s[:12] for s in snapshots)})", "give more characters of the commit hash")
        if not snapshots:
            raise _not_cached(spec, kind, repo_id, rev, cache, f"no ref or snapshot {rev}")
        commit = snapshots[0]
    else:
        raise _not_cached(spec, kind, repo_id, rev, cache, f"no ref {rev}")
    if not (folder / "snapshots" / commit).is_dir():
        raise _not_cached(spec, kind, repo_id, rev, cache, f"ref {rev} points to {commit[:12]}, which is not downloaded")
    return folder, commit


def _snapshot_files(folder: Path, commit: str) -> tuple[list[ArtifactFile], dict[str, Path], list[str], list[str]]:
    """Files of a snapshot, the blob path behind each, missing blobs, copies without a blob id."""
    snapshot = folder / "snapshots" / commit
    blobs = (folder / "blobs").resolve()
    files: list[ArtifactFile] = []
    blob_paths: dict[str, Path] = {}
    missing: list[str] = []
    copies: list[str] = []
    for dirpath, _dirs, names in os.walk(snapshot):
        for name in names:
            full = Path(dirpath, name)
            rel = full.relative_to(snapshot).as_posix()
            target = full.resolve()
            if not target.exists():
                missing.append(rel)
                continue
            size = target.stat().st_size
            if full.is_symlink() and target.parent == blobs:
                blob_id = target.name
                files.append(ArtifactFile(rel, size, blob_id, bool(_SHA256.fullmatch(blob_id))))
                blob_paths[rel] = target
            else:  # a cache made without symlinks holds plain copies
                copies.append(rel)
                files.append(ArtifactFile(rel, size))
                blob_paths[rel] = target
    files.sort(key=lambda f: f.path.encode())
    return files, blob_paths, sorted(missing), copies


def _hub_artifact(spec: str, kind: str, options: ProbeOptions) -> ArtifactInfo:
    repo_id, rev = parse_spec(spec)
    cache = hub_cache_dir(options)
    folder, commit = resolve_commit(cache, kind, repo_id, rev, spec)
    files, blob_paths, missing, copies = _snapshot_files(folder, commit)
    if copies:  # no blob id to name them by: hash the content instead (sha256, like an LFS id)
        by_path = {f.path: f for f in files}
        digests = _parallel(((p, functools.partial(file_sha256, blob_paths[p])) for p in copies),
                            sum(by_path[p].size_bytes for p in copies), f"hash {spec}", options.progress)
        files = [ArtifactFile(f.path, f.size_bytes, digests[f.path], True) if f.path in digests else f for f in files]
    entries = b"".join(f"{f.blob_id} ".encode() + f.path.encode() + b"\0" for f in files)
    content_hash = "sha256:" + hashlib.sha256(b"capture-hf-snapshot-v1\0" + entries).hexdigest()
    verified: bool | None = None
    mismatches: list[str] = []
    mismatch_blobs: list[str] = []
    if options.verify_artifacts:
        unique: dict[str, tuple[Path, bool]] = {}
        for f in files:
            if f.blob_id is not None:
                unique.setdefault(f.blob_id, (blob_paths[f.path], bool(f.lfs)))

        def check(blob_path: Path, lfs: bool) -> Callable[[Callable[[int], None]], str]:
            return lambda cb: file_sha256(blob_path, cb) if lfs else git_blob_sha1(blob_path, cb)

        total = sum(os.stat(p).st_size for p, _ in unique.values())
        actual = _parallel(((blob, check(p, lfs)) for blob, (p, lfs) in unique.items()), total,
                           f"verify {spec}", options.progress)
        mismatches = [f.path for f in files if f.blob_id is not None and actual[f.blob_id] != f.blob_id]
        mismatch_blobs = sorted({str(blob_paths[p]) for p in mismatches})
        verified = not mismatches and not missing
    return ArtifactInfo(
        spec=spec, kind=kind, source="hf-cache", content_hash=content_hash,
        size_bytes=sum(f.size_bytes for f in files), files=tuple(files), repo_id=repo_id, revision=rev,
        commit=commit, missing_files=tuple(missing), verified=verified, mismatches=tuple(mismatches),
        mismatch_blobs=tuple(mismatch_blobs),
    )


def check_verified(info: ArtifactInfo) -> None:
    """Raise :class:`ArtifactMismatch` (exit 6) naming the first bad file when ``--verify-artifacts`` failed."""
    if info.verified is not False:
        return
    repo_type = " --repo-type dataset" if info.kind == "dataset" else ""
    again = f"hf download {info.repo_id}{repo_type} --revision {info.revision}"
    if info.mismatches:
        blob = info.mismatch_blobs[0] if info.mismatch_blobs else info.mismatches[0]
        more = f" (and {len(info.mismatches) - 1} more)" if len(info.mismatches) > 1 else ""
        raise ArtifactMismatch(
            f"{info.kind} {info.spec}: {info.mismatches[0]} does not match its blob id: {blob}{more}",
            f"the cached file is corrupt: delete {blob} and run `{again}`")
    more = f" (and {len(info.missing_files) - 1} more)" if len(info.missing_files) > 1 else ""
    raise ArtifactMismatch(f"{info.kind} {info.spec}: {info.missing_files[0]} is missing from the hub cache{more}",
                           f"the download was interrupted: run `{again}`")


# --------------------------------------------------------------------------- local folders


def _local_artifact(spec: str, folder: Path, kind: str, options: ProbeOptions) -> ArtifactInfo:
    root = folder.resolve()
    paths: list[str] = []
    seen: set[tuple[int, int]] = set()
    for dirpath, dirs, names in os.walk(root, followlinks=True):
        st = os.stat(dirpath)
        if (st.st_dev, st.st_ino) in seen:  # a symlink loop, or a folder linked twice
            dirs[:] = []
            continue
        seen.add((st.st_dev, st.st_ino))
        for name in names:
            full = Path(dirpath, name)
            if full.is_file():
                paths.append(full.relative_to(root).as_posix())
    paths.sort(key=str.encode)
    sizes = {p: (root / p).stat().st_size for p in paths}
    digests = _parallel(((p, functools.partial(file_sha256, root / p)) for p in paths), sum(sizes.values()),
                        f"hash {spec}", options.progress)
    entries = b"".join(f"{digests[p]} ".encode() + p.encode() + b"\0" for p in paths)
    return ArtifactInfo(
        spec=spec, kind=kind, source="local-dir",
        content_hash="sha256:" + hashlib.sha256(b"capture-dir-v1\0" + entries).hexdigest(),
        size_bytes=sum(sizes.values()), files=tuple(ArtifactFile(p, sizes[p], sha256=digests[p]) for p in paths),
        path=str(root),
    )


def _local_file(spec: str, file: Path, kind: str, options: ProbeOptions) -> ArtifactInfo:
    """One regular file (a data set kept as a single .jsonl or .parquet)."""
    path = file.resolve()
    size = path.stat().st_size
    digest = _parallel([(path.name, lambda cb: file_sha256(path, cb))], size, f"hash {spec}", options.progress)[path.name]
    entry = f"{digest} ".encode() + path.name.encode() + b"\0"
    return ArtifactInfo(
        spec=spec, kind=kind, source="local-file",
        content_hash="sha256:" + hashlib.sha256(b"capture-file-v1\0" + entry).hexdigest(),
        size_bytes=size, files=(ArtifactFile(path.name, size, sha256=digest),), path=str(path),
    )


# --------------------------------------------------------------------------- probes


def probe_artifact(spec: str, kind: str, options: ProbeOptions) -> ArtifactInfo:
    """One ``--model`` / ``--dataset`` value. Raises :class:`UsageError` (exit 2) when it cannot be found."""
    local = Path(spec).expanduser()
    if local.is_dir():
        return _local_artifact(spec, local, kind, options)
    if local.is_file():
        return _local_file(spec, local, kind, options)
    return _hub_artifact(spec, kind, options)


def probe_models(options: ProbeOptions) -> list[ArtifactInfo]:
    return [probe_artifact(spec, "model", options) for spec in options.models]


def probe_datasets(options: ProbeOptions) -> list[ArtifactInfo]:
    return [probe_artifact(spec, "dataset", options) for spec in options.datasets]

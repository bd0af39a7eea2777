"""`capture pin`: verify signed manifests, then commit them into a results repository.

Layout of a results repository (a git work tree, or a folder inside one)::

    .capture/allowed_signers          who may pin here (the ONLY trust source pin uses,
                                      committed; chosen by the door, capture/verify/trust_root.py)
    .capture/results.toml             optional: layout = 1
    index.json, index.md              one row per pinned run
    <accelerator-slug>/<YYYY-MM-DD>/<content id>.toml

The content id is the first 12 hex digits of sha256 over the file's bytes, so a path names
exactly one content: pinning the same bytes again is a no-op, and a different file is never
written over one that is already there.

Atomicity (``capture/results/_publish.py``). Pins into one repository take turns (an flock on
``.git/capture-pin.lock``; a second pin waits). Nothing a user can see changes until every manifest
is verified, the new commit exists and the files, the next index and a journal
(``.git/capture-pin.journal``) are prepared inside ``.git``. A detached child holding the lock then
renames the files into place, takes git's ``index.lock`` holding the new index, moves HEAD with a
compare-and-swap (``update-ref HEAD NEW OLD``) and installs the index: killing `capture pin` at any
moment leaves the repository as it was or with the pin complete. If the child is killed too, the
next pin repairs first, finishing the pin if HEAD moved and undoing it if not, touching only what
the journal proves a pin of ours wrote.

Paths: every path pin writes is checked to be inside the repository with no symlinked component
(a git-ignored symlinked folder is refused), and the allowed-signers file may not be a symlink
leading outside the results folder.
"""

from __future__ import annotations

import datetime as _dt
import io
import logging
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

from capture._toml import TomlError
from capture._toml import loads as toml_loads
from capture.errors import ManifestError, TrustError, UsageError
from capture.results import _publish
from capture.results import index as _index
from capture.results._publish import _git, hook as _hook
from capture.verify.open import SignatureStatus, load_allowed, open_manifest, trust_root
from capture._escape import printable
from capture._safe_read import CONFIG_MAX_BYTES, MANIFEST_MAX_BYTES, read_if_present, read_regular
from capture.fmt import number_str
from capture.results.summary import RunSummary, accelerator_slug, content_id, summarize

log = logging.getLogger(__name__)
_T = TypeVar("_T")
_PINNED = re.compile(r"[a-z0-9][a-z0-9-]*/[0-9]{4}-[0-9]{2}-[0-9]{2}/[0-9a-f]{12}\.toml")
"""The path :func:`pin_path` gives a manifest: no "..", no leading "/", nothing else."""
_RESTORE = "remove or restore it and pin again"
"""The hint where a path pin compares against (a pinned manifest, the index) cannot be read as a file."""

TRUST_FILE = trust_root.TRUST_FILE
"""Where a results repository keeps its trusted signers, relative to its root."""
CONFIG = PurePosixPath(".capture/results.toml")
LAYOUT_VERSION = 1
_TEST_HOOK = _publish.HOOK_ENV


@dataclass(frozen=True)
class PinnedRun:
    source: str
    """The file as given on the command line."""
    path: str
    """Where it is (or already was) in the results repository, relative to its root."""
    summary: RunSummary
    already_pinned: bool


@dataclass(frozen=True)
class PinResult:
    runs: tuple[PinnedRun, ...]
    commit: str | None
    """The new commit, or None when every manifest was already pinned."""
    tags: tuple[str, ...] = ()
    message: str | None = None


@dataclass
class _Plan:
    files: dict[str, bytes] = field(default_factory=dict)
    """Repository-relative path (from the git top level) → bytes to write."""


def created_date(data: dict, source: str) -> str:
    """``YYYY-MM-DD`` of ``created_utc`` (RFC 3339); the folder a run is filed under."""
    created = data.get("created_utc", "")
    try:
        return _dt.date.fromisoformat(str(created)[:10]).isoformat()
    except ValueError:
        raise ManifestError(f"{source}: created_utc {created!r} is not an RFC 3339 time",
                            "regenerate the manifest; capture writes e.g. 2026-12-02T11:30:00Z") from None


def pin_path(data: dict, raw: bytes, source: str = "manifest") -> str:
    """``<accelerator-slug>/<YYYY-MM-DD>/<content id>.toml``, relative to the results root."""
    return f"{accelerator_slug(data)}/{created_date(data, source)}/{content_id(raw)}.toml"


def open_results_repo(root: str | os.PathLike[str]):
    """The git repository holding ``root``; refuses a missing folder, a non-repo, a bare repo."""
    import git

    path = Path(root)
    if not path.is_dir():
        raise UsageError(f"{path}: no such folder", f"create it as a results repository: `git init {path}`")
    try:
        repo = git.Repo(path, search_parent_directories=True)
    except git.InvalidGitRepositoryError:
        raise UsageError(f"{path}: not a git repository",
                         f"make it one: `git init {path}`, add .capture/allowed_signers and commit it") from None
    if repo.bare or repo.working_tree_dir is None:
        raise UsageError(f"{path}: is a bare git repository", "pin into a clone with a work tree")
    return repo


def _head(repo) -> str | None:
    try:
        return repo.head.commit.hexsha
    except ValueError:  # unborn branch: a fresh `git init`
        return None


def _check_clean(repo, rel_root: str) -> None:
    status = _git(repo, "status", "--porcelain", "--untracked-files=all", "--", rel_root or ".")
    if status.strip():
        first = status.splitlines()[0][3:]
        more = len(status.splitlines()) - 1
        raise UsageError(
            f"{Path(repo.working_tree_dir) / rel_root}: results repository has uncommitted changes ({first}"
            + (f" and {more} more" if more else "") + ")",
            "commit or remove them first (`git status`), so a pin commits only the runs it names")


def _check_layout(root: Path) -> None:
    cfg = root / CONFIG
    if not cfg.exists():
        return
    try:
        layout = toml_loads(read_regular(cfg, CONFIG_MAX_BYTES, UsageError, "results-repository setting").decode("utf-8")).get("layout", LAYOUT_VERSION)
    except (OSError, UnicodeDecodeError, TomlError) as exc:
        raise UsageError(f"{cfg}: cannot read ({str(exc).splitlines()[0]})", "fix or remove the file") from None
    if layout != LAYOUT_VERSION:
        raise UsageError(f"{cfg}: layout {layout!r} is not one this capture writes ({LAYOUT_VERSION})",
                         "upgrade capture to pin into this repository")


def _trust_file(repo, root: Path, rel_root: str) -> Path:
    """The repository's own allowed-signers file, committed; never the user's personal one."""
    path = root / TRUST_FILE
    legacy = root / "allowed_signers"
    if not path.is_file() and legacy.is_file():
        raise TrustError(f"{legacy}: a results repository's signers are in {TRUST_FILE}, at its root, and only there",
                         f"move it: `git -C {root} mv allowed_signers {TRUST_FILE} && git -C {root} commit -m 'trust file'`")
    found = trust_root.repository_trust_file(root)  # a link out of the repository is refused (exit 4)
    if found is None:
        why = "owned by another user" if path.is_file() else "no allowed-signers file"
        raise TrustError(
            f"{path}: {why}, so no signer is trusted in this results repository",
            f"add `PRINCIPAL ssh-ed25519 AAAA...` lines (the public key from `capture keygen`) to {path} and commit it")
    rel = (PurePosixPath(rel_root) / TRUST_FILE).as_posix() if rel_root else TRUST_FILE.as_posix()
    if _head(repo) is None or not _git(repo, "ls-files", "--", rel).strip():
        raise TrustError(f"{path}: the allowed-signers file is not committed",
                         f"commit it first: `git -C {root} add {TRUST_FILE} && git -C {root} commit -m 'trust signers'`")
    return path


def _verify(files: Sequence[str], allowed) -> list[tuple[str, bytes, dict[str, Any], SignatureStatus]]:
    out = []
    for f in files:
        # Through the door: signature over the exact bytes, signer trusted by THIS repository, parse.
        opened = open_manifest(f, allowed, require_trusted=True)
        out.append((f, opened.raw, opened.data, opened.signature))
    return out


def commit_message(runs: Sequence[PinnedRun], subject: str | None = None) -> str:
    """A subject that says what was pinned and one body line per new run with its key figures."""
    new = [r for r in runs if not r.already_pinned]
    if subject is None:
        if len(new) == 1:
            s = new[0].summary
            subject = f"pin {s.kind or 'run'} {s.content_id}: {s.accelerator}, {s.created_utc or ''}".rstrip(", ")
        else:
            accs = sorted({r.summary.accelerator for r in new})
            subject = f"pin {len(new)} runs: {', '.join(accs)}"
    lines = [subject, ""]
    for r in new:
        s = r.summary
        f = s.figures
        stack = ", ".join(x for x in (
            f"driver {s.driver_version}" if s.driver_version else "",
            f"{s.runtime} {s.runtime_version}" if s.runtime not in (None, "cpu") and s.runtime_version else "",
            f"torch {s.torch_version}" if s.torch_version else "",
            ", ".join(s.models)) if x)
        figs = ", ".join(x for x in (
            f"{number_str(f.tokens_per_s)} tokens/s" if f.tokens_per_s is not None else "",
            f"step median {number_str(f.step_time_median_s)} s" if f.step_time_median_s is not None else "",
            f"recovery {f.recovery_verdict}" if f.recovery_verdict else "",
            f"trial cost {s.costs.money(s.costs.trial_cost)}" if s.costs and s.costs.trial_cost is not None else "")
            if x)
        lines.append(f"- {r.path}: {s.accelerator}" + (f"; {stack}" if stack else "") + (f"; {figs}" if figs else "")
                     + (f"; signed by {s.signer}" if s.signer else ""))
    return "\n".join(lines).rstrip() + "\n"


def pin(files: Sequence[str], repo_dir: str | os.PathLike[str], message: str | None = None,
        tag: bool = False) -> PinResult:
    """Verify ``files`` and commit the new ones into the results repository at ``repo_dir``."""
    if not files:
        raise UsageError("no manifest to pin", "name one or more signed manifest files")
    return _with_lock(repo_dir, lambda repo, top, root, rel_root, allowed:
                      _pin_locked(repo, top, root, rel_root, allowed, files, message, tag))


def _with_lock(repo_dir: str | os.PathLike[str], work: Callable[[Any, Path, Path, str, Any], _T]) -> _T:
    """``work(repo, top, root, rel_root, allowed)`` holding the repository's pin lock, after
    repairing an interrupted pin and checking the layout, a clean work tree and the committed trust
    file (``allowed``, its signers); nothing is visible until ``work`` commits."""
    repo = open_results_repo(repo_dir)
    top = Path(repo.working_tree_dir).resolve()
    root = Path(repo_dir).resolve()
    rel_root = root.relative_to(top).as_posix() if root != top else ""
    git_dir = Path(repo.git_dir)
    try:
        with _publish.PinLock(git_dir, top):
            done = _publish.recover(repo, top, git_dir)
            if done:
                print(f"capture pin: {done} an interrupted pin in {top} first", file=sys.stderr)
            _hook("locked")
            _check_layout(root)
            _check_clean(repo, rel_root)
            return work(repo, top, root, rel_root, load_allowed(_trust_file(repo, root, rel_root)))
    except OSError as exc:  # .git not writable, a full disk: nothing of this pin is visible yet
        where = exc.filename or git_dir
        raise UsageError(f"{top}: pin cannot write {where} ({exc.strerror or exc}); the repository was left as it was",
                         "pin as a user who can write the repository's .git folder, or free space there") from None


@dataclass(frozen=True)
class ReindexResult:
    rows: int
    """Rows in the index (one per pinned manifest)."""
    changed: tuple[str, ...]
    """The paths whose row this capture computes differently from the one in the index."""
    commit: str | None
    """The new commit, or None when the index was already what this capture writes."""


def reindex(repo_dir: str | os.PathLike[str], message: str | None = None) -> ReindexResult:
    """Recompute every row of the index from the manifest it lists, and commit the index if any
    row (or index.md's layout) changed: rows that an older capture wrote then read as this one's.
    Every listed manifest is read through the door and must be signed by a signer this
    repository trusts and named by its content id, as at pin time; one that is absent, untrusted
    or renamed stops the reindex with nothing changed. Manifests the index does not list are not
    added (`capture pin` adds them)."""
    return _with_lock(repo_dir, lambda repo, top, root, rel_root, allowed:
                      _reindex_locked(repo, top, root, rel_root, allowed, message))


def _reindex_locked(repo, top: Path, root: Path, rel_root: str, allowed, message: str | None) -> ReindexResult:
    old_rows = _index.load_rows(root) or []
    rows, changed = [], []
    for old in old_rows:
        rel = old["path"]
        if not _PINNED.fullmatch(rel):
            raise ManifestError(f"{root / _index.INDEX_JSON}: lists {printable(rel)[:200]!r}, not a pinned file's path "
                                "(<accelerator>/<YYYY-MM-DD>/<content id>.toml); the index was left as it was",
                                f"restore it from git (`git checkout -- {_index.INDEX_JSON}`)")
        source = _publish.check_write_path(top, _repo_path(rel_root, rel))  # no symlinked folder
        if not source.is_file():
            raise ManifestError(f"{source}: listed in {_index.INDEX_JSON} but absent; the index was left as it was",
                                f"restore it from git (`git checkout -- {rel}`), or remove its row with the commit that removed it")
        opened = open_manifest(str(source), allowed, require_trusted=True)
        named = pin_path(opened.data, opened.raw, str(source))
        if named != rel:
            raise TrustError(f"{source}: pinned files are named <accelerator>/<date>/<content id>.toml, and this one "
                             f"would be {named}; the index was left as it was",
                             f"restore it from git (`git checkout -- {rel}`)")
        row = summarize(opened.data, opened.raw, rel, opened.signature.principal, opened.signature.fingerprint).to_json()
        rows.append(row)
        if row != old:
            changed.append(rel)
    rows = _index.merge_rows([], rows)
    plan = _Plan()
    for name, data in ((_index.INDEX_JSON, _index.render_json(rows)), (_index.INDEX_MD, _index.render_markdown(rows))):
        path = _publish.check_write_path(top, _repo_path(rel_root, name))
        if read_if_present(path, _index.INDEX_MAX_BYTES, ManifestError, "index", _RESTORE) != data:
            plan.files[_repo_path(rel_root, name)] = data
    if not plan.files:
        return ReindexResult(len(rows), tuple(changed), None)
    from capture import __version__

    subject = message or f"reindex: {len(changed)} of {len(rows)} rows recomputed by capture {__version__}"
    body = "".join(f"- {rel}\n" for rel in changed)
    commit = _commit_atomically(repo, top, plan, subject + ("\n\n" + body if body else "\n"), ())
    return ReindexResult(len(rows), tuple(changed), commit)


def _pin_locked(repo, top: Path, root: Path, rel_root: str, allowed, files: Sequence[str], message: str | None,
                tag: bool) -> PinResult:

    verified = _verify(files, allowed)
    runs: list[PinnedRun] = []
    plan = _Plan()
    in_this_call: set[str] = set()
    for source, raw, data, info in verified:
        rel = pin_path(data, raw, source)
        summary = summarize(data, raw, rel, info.principal, info.fingerprint)
        if rel in in_this_call:  # the same bytes named twice on one command line
            runs.append(PinnedRun(source, rel, summary, already_pinned=True))
            continue
        in_this_call.add(rel)
        _publish.check_write_path(top, _repo_path(rel_root, rel))
        existing = read_if_present(root / rel, MANIFEST_MAX_BYTES, ManifestError, "pinned manifest", _RESTORE)
        if existing is not None and existing != raw:
            raise UsageError(f"{root / rel}: a different file is already pinned at this path; refusing to overwrite it",
                             "the content ids collide; check the repository with `capture verify` and `git log -- PATH`")
        runs.append(PinnedRun(source, rel, summary, already_pinned=existing is not None))
        if existing is None:
            plan.files[_repo_path(rel_root, rel)] = raw

    new_runs = [r for r in runs if not r.already_pinned]
    if not new_runs:
        return PinResult(tuple(runs), None)
    for name in (_index.INDEX_JSON, _index.INDEX_MD):
        _publish.check_write_path(top, _repo_path(rel_root, name))
    rows = _index.merge_rows(_index.load_rows(root) or [], (r.summary.to_json() for r in new_runs))
    plan.files[_repo_path(rel_root, _index.INDEX_JSON)] = _index.render_json(rows)
    plan.files[_repo_path(rel_root, _index.INDEX_MD)] = _index.render_markdown(rows)

    tags = tuple(f"run/{r.summary.content_id}" for r in new_runs) if tag else ()
    for t in tags:
        if _git(repo, "tag", "--list", t).strip():
            raise UsageError(f"tag {t} already exists in {top}", f"delete it (`git tag -d {t}`) or pin without --tag")
    msg = commit_message(runs, message)
    commit = _commit_atomically(repo, top, plan, msg, tags)
    return PinResult(tuple(runs), commit, tags, msg)


def _repo_path(rel_root: str, rel: str) -> str:
    return f"{rel_root}/{rel}" if rel_root else rel


def _commit_atomically(repo, top: Path, plan: _Plan, message: str, tags: tuple[str, ...]) -> str:
    from gitdb.base import IStream

    git_dir = Path(repo.git_dir)
    old = _head(repo)
    assert old is not None  # _trust_file required a commit holding the allowed-signers file
    tmp_index = git_dir / f"capture-pin-{os.getpid()}.index"
    try:
        # Objects and a commit that nothing points to yet (built in a temporary index).
        env = {"GIT_INDEX_FILE": str(tmp_index)}
        _git(repo, "read-tree", old, env=env)
        entries = []
        for rel, data in plan.files.items():
            sha = repo.odb.store(IStream("blob", len(data), io.BytesIO(data))).hexsha.decode()
            entries += ["--cacheinfo", f"100644,{sha},{rel}"]
        _git(repo, "update-index", "--add", *entries, env=env)
        tree = _git(repo, "write-tree", env=env).strip()
        commit = _git(repo, "commit-tree", tree, "-p", old, "-m", message).strip()
        _hook("before-commit")
    finally:
        tmp_index.unlink(missing_ok=True)
    _publish.publish(repo, top, plan.files, old, commit, message, tags)
    return commit

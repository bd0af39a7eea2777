"""`capture pin`: verify signed manifests, then commit them into a results repository.

Layout of a results repository (a git work tree, or a folder inside one)::

    .capture/allowed_signers          who may pin here (the ONLY trust source pin uses;
                                      ``allowed_signers`` at the root is accepted instead)
    .capture/results.toml             optional: layout = 1
    index.json, index.md              one row per pinned run
    <accelerator-slug>/<YYYY-MM-DD>/<content id>.toml

The content id is the first 12 hex digits of sha256 over the file's bytes, so a path names
exactly one content: pinning the same bytes again is a no-op, and a different file is never
written over one that is already there.

Atomicity. Nothing a user can see changes until the new commit exists:

1. verify every manifest (signature, then trust against the repository's own allowed signers,
   then the body parses) — any failure stops here with the repository untouched;
2. write the new blobs into git's object store and build the commit in a temporary index
   (``GIT_INDEX_FILE``); objects nobody references are invisible and garbage-collected later;
3. take ``.git/index.lock`` (so no other git process changes the index meanwhile), write the
   files into the work tree, move HEAD with ``git update-ref HEAD NEW OLD`` (fails if HEAD moved)
   and install the new index by renaming it over the old one.

A failure in step 3 undoes what step 3 did (files removed or restored, HEAD moved back). A
SIGKILL before step 3 leaves the repository exactly as it was; step 3 itself takes
milliseconds and is the only window in which a kill can leave a half-updated work tree.
"""

from __future__ import annotations

import datetime as _dt
import io
import logging
import os
import shutil
import signal
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from capture.errors import CaptureError, ManifestError, TrustError, UsageError
from capture.results import index as _index
from capture.verify.open import load_allowed, open_manifest
from capture.results.summary import RunSummary, accelerator_slug, content_id, fmt_number, summarize

log = logging.getLogger(__name__)

TRUST_FILES = (PurePosixPath(".capture/allowed_signers"), PurePosixPath("allowed_signers"))
"""Where a results repository keeps its trusted signers (exactly one of them may exist)."""
CONFIG = PurePosixPath(".capture/results.toml")
LAYOUT_VERSION = 1
_TEST_HOOK = "_CAPTURE_TEST_PIN_HOOK"
"""Test-only: ``kill:STAGE`` makes the process SIGKILL itself at STAGE, ``fail:STAGE`` raises."""


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


def _hook(stage: str) -> None:
    want = os.environ.get(_TEST_HOOK)
    if not want:
        return
    action, _, at = want.partition(":")
    if at != stage:
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "fail":
        raise OSError(f"test hook: failing at {stage}")


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


def _git(repo, *args: str, env: dict[str, str] | None = None) -> str:
    import git
    try:
        return repo.git.execute(["git", *args], env=env)
    except git.GitCommandError as exc:
        stderr = (exc.stderr or "").strip().replace("\n", " ").removeprefix("stderr: ").strip(" '")
        hint = None
        if "tell me who you are" in stderr or "empty ident" in stderr:
            hint = 'set a committer: `git config user.name "..."` and `git config user.email ...` in the results repository'
        raise UsageError(f"git {args[0]} failed: {stderr or exc}", hint) from None


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
        layout = tomllib.loads(cfg.read_text(encoding="utf-8")).get("layout", LAYOUT_VERSION)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise UsageError(f"{cfg}: cannot read ({str(exc).splitlines()[0]})", "fix or remove the file") from None
    if layout != LAYOUT_VERSION:
        raise UsageError(f"{cfg}: layout {layout!r} is not one this capture writes ({LAYOUT_VERSION})",
                         "upgrade capture to pin into this repository")


def _trust_file(repo, root: Path, rel_root: str) -> Path:
    """The repository's own allowed-signers file, never the user's personal one."""
    present = [c for c in TRUST_FILES if (root / c).is_file()]
    if not present:
        path = root / TRUST_FILES[0]
        raise TrustError(
            f"{path}: no allowed-signers file, so no signer is trusted in this results repository",
            f"add `PRINCIPAL ssh-ed25519 AAAA...` lines (the public key from `capture keygen`) to {path} and commit it")
    if len(present) > 1:
        raise UsageError(f"{root}: both {TRUST_FILES[0]} and {TRUST_FILES[1]} exist; which signers are trusted is ambiguous",
                         "keep one allowed-signers file in the results repository and commit the removal of the other")
    path = root / present[0]
    rel = (PurePosixPath(rel_root) / present[0]).as_posix() if rel_root else present[0].as_posix()
    if _head(repo) is None or not _git(repo, "ls-files", "--", rel).strip():
        raise TrustError(f"{path}: the allowed-signers file is not committed",
                         f"commit it first: `git -C {root} add {present[0]} && git -C {root} commit -m 'trust signers'`")
    return path


def _verify(files: Sequence[str], allowed) -> list[tuple[str, bytes, dict, object]]:
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
            f"{fmt_number(f.tokens_per_s)} tokens/s" if f.tokens_per_s is not None else "",
            f"step median {fmt_number(f.step_time_median_s)} s" if f.step_time_median_s is not None else "",
            f"recovery {f.recovery_verdict}" if f.recovery_verdict else "",
            f"cost {fmt_number(f.cost_per_million_tokens)} per M tokens"
            if f.cost_per_million_tokens is not None else "") if x)
        lines.append(f"- {r.path}: {s.accelerator}" + (f"; {stack}" if stack else "") + (f"; {figs}" if figs else "")
                     + (f"; signed by {s.signer}" if s.signer else ""))
    return "\n".join(lines).rstrip() + "\n"


def pin(files: Sequence[str], repo_dir: str | os.PathLike[str], message: str | None = None,
        tag: bool = False) -> PinResult:
    """Verify ``files`` and commit the new ones into the results repository at ``repo_dir``."""
    if not files:
        raise UsageError("no manifest to pin", "name one or more signed manifest files")
    repo = open_results_repo(repo_dir)
    top = Path(repo.working_tree_dir).resolve()
    root = Path(repo_dir).resolve()
    rel_root = root.relative_to(top).as_posix() if root != top else ""
    _check_layout(root)
    _check_clean(repo, rel_root)
    allowed = load_allowed(_trust_file(repo, root, rel_root))

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
        try:
            existing = (root / rel).read_bytes()
        except FileNotFoundError:
            existing = None
        if existing is not None and existing != raw:
            raise UsageError(f"{root / rel}: a different file is already pinned at this path; refusing to overwrite it",
                             "the content ids collide; check the repository with `capture verify` and `git log -- PATH`")
        runs.append(PinnedRun(source, rel, summary, already_pinned=existing is not None))
        if existing is None:
            plan.files[_repo_path(rel_root, rel)] = raw

    new_runs = [r for r in runs if not r.already_pinned]
    if not new_runs:
        return PinResult(tuple(runs), None)
    rows = _index.merge_rows(_index.load_rows(root), (r.summary.to_json() for r in new_runs))
    plan.files[_repo_path(rel_root, _index.INDEX_JSON)] = _index.render_json(rows)
    plan.files[_repo_path(rel_root, _index.INDEX_MD)] = _index.render_markdown(rows)

    tags = tuple(f"run/{r.summary.content_id}" for r in new_runs) if tag else ()
    for t in tags:
        if _git(repo, "tag", "--list", t).strip():
            raise UsageError(f"tag {t} already exists in {top}", f"delete it (`git tag -d {t}`) or pin without --tag")
    msg = commit_message(runs, message)
    commit = _commit_atomically(repo, top, plan, msg)
    for t in tags:
        _git(repo, "tag", "-a", t, "-m", msg, commit)
    return PinResult(tuple(runs), commit, tags, msg)


def _repo_path(rel_root: str, rel: str) -> str:
    return f"{rel_root}/{rel}" if rel_root else rel


def _commit_atomically(repo, top: Path, plan: _Plan, message: str) -> str:
    from gitdb.base import IStream

    git_dir = Path(repo.git_dir)
    old = _head(repo)
    assert old is not None  # _trust_file required a commit holding the allowed-signers file
    _remove_stale_temp_indexes(git_dir)
    tmp_index = git_dir / f"capture-pin-{os.getpid()}.index"
    new_index = git_dir / f"capture-pin-{os.getpid()}.next-index"
    try:
        # Step 2: objects and a commit that nothing points to yet.
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
        # Step 3: publish, under the index lock.
        _publish(repo, top, git_dir, plan, entries, old, commit, new_index)
        return commit
    finally:
        for p in (tmp_index, new_index):
            try:
                p.unlink()
            except FileNotFoundError:
                pass


def _remove_stale_temp_indexes(git_dir: Path) -> None:
    """Temporary indexes left by a pin that was killed (invisible to git, but litter)."""
    for p in git_dir.glob("capture-pin-*.*index"):
        try:
            pid = int(p.name.split("-")[2].split(".")[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            p.unlink(missing_ok=True)
        except (ValueError, IndexError, PermissionError, OSError):
            continue


def _publish(repo, top: Path, git_dir: Path, plan: _Plan, entries: list[str], old: str,
             commit: str, new_index: Path) -> None:
    lock = git_dir / "index.lock"
    try:
        fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        raise UsageError(f"{lock} exists: another git process is working in {top}",
                         "wait for it to finish and pin again (remove the lock only if no git process is running)") from None
    os.close(fd)
    written: list[Path] = []
    previous: dict[Path, bytes] = {}
    made_dirs: list[Path] = []
    head_moved = False
    try:
        # The real index may hold other people's staged work outside the results folder: keep it.
        if (git_dir / "index").exists():
            shutil.copyfile(git_dir / "index", new_index)
        _git(repo, "update-index", "--add", *entries, env={"GIT_INDEX_FILE": str(new_index)})
        from capture._atomic import atomic_write
        for rel, data in plan.files.items():
            dest = top / rel
            for parent in reversed(dest.relative_to(top).parents):
                d = top / parent
                if not d.exists():
                    d.mkdir()
                    made_dirs.append(d)
            if dest.exists():
                previous[dest] = dest.read_bytes()
            atomic_write(dest, data)
            written.append(dest)
        _hook("after-files")
        _git(repo, "update-ref", "-m", "capture pin", "HEAD", commit, old)
        head_moved = True
        _hook("after-update-ref")
        os.replace(new_index, lock)
        os.replace(lock, git_dir / "index")
    except OSError as exc:
        _undo(repo, written, previous, made_dirs, head_moved, old, commit)
        raise UsageError(f"{top}: pin failed while writing ({exc}); the repository was left as it was",
                         "check free space and permissions in the results repository, then pin again") from None
    except BaseException:
        _undo(repo, written, previous, made_dirs, head_moved, old, commit)
        raise
    finally:
        try:
            lock.unlink()
        except FileNotFoundError:
            pass


def _undo(repo, written, previous, made_dirs, head_moved, old, commit) -> None:
    from capture._atomic import atomic_write
    errors = []
    if head_moved:
        try:
            _git(repo, "update-ref", "-m", "capture pin: undo", "HEAD", old, commit)
        except CaptureError as exc:
            errors.append(exc.message)
    for p in written:
        try:
            if p in previous:
                atomic_write(p, previous[p])
            else:
                p.unlink()
        except OSError as exc:
            errors.append(f"{p}: {exc}")
    for d in reversed(made_dirs):
        try:
            d.rmdir()
        except OSError:
            pass
    if errors:
        log.error("could not fully undo the interrupted pin: %s", "; ".join(errors))

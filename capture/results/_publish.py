"""Publish a prepared commit into a results repository so that killing `capture pin` at any
instant leaves the repository as it was or with the pin complete, and so that concurrent pins wait.

The protocol (every step is a test-hook point, see ``hook``)::

    flock .git/capture-pin.lock          pins wait for each other; the file itself stays
    recover()                            repair what a killed pin of ours left (below)
    ... the caller verifies and plans; the commit is built in a temporary index ...
    phase A, invisible (all inside .git):
      files    .git/capture-pin-PID.files/N, fsynced   (mid-file)
      next-index  a copy of .git/index plus the new entries      (after-next-index)
      journal  .git/capture-pin.journal: old HEAD, new commit, every path and blob, staged names
                                                                  (after-journal)
    phase B, in a detached child (own session, holding the flock; it finishes even if `capture pin`
    is killed, and the pin waits for it and reports what it did):
      rename each staged file into the work tree                 (after-files)
      link next-index -> .git/index.lock (git's own lock, taken atomically with our content)
                                                                  (after-index-lock)
      update-ref HEAD NEW OLD           compare-and-swap: fails if HEAD moved  (after-update-ref)
      rename index.lock -> index                                  (after-index)
      tags, then the journal and the staged files are removed    (after-tags)

Killing `capture pin` (the process a user, a scheduler or a terminal signals) before phase B starts
changes nothing anyone can see (what it left in .git is removed by the next pin); from then on the
pin completes. Killing both processes (a whole cgroup) inside phase B leaves a state the next pin
repairs first: ``recover`` runs under the flock, so no other pin is running; it removes only what
the journal proves is ours: an ``index.lock`` that is the same inode as our next-index file, staged
and temporary files whose names the journal lists, work-tree files whose bytes equal the blobs the
journal names. If the new commit is HEAD, the pin is finished (the index installed, tags made);
otherwise it is undone (files restored from HEAD or removed, folders we made removed when empty).
When .git lies on another file system than the work tree (a linked work tree elsewhere), files are
written beside their destination in phase B instead.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import io
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from capture._atomic import fsync_dir
from capture.errors import CaptureError, UsageError

HOOK_ENV = "_CAPTURE_TEST_PIN_HOOK"
"""Test-only: ``kill:STEP`` SIGKILLs the pin at STEP (in phase B both processes, as a cgroup kill
would), ``killparent:STEP`` only the `capture pin` process (phase B goes on), ``fail:STEP`` raises
OSError."""
STEPS = ("locked", "before-commit", "mid-file", "after-next-index", "after-journal", "after-files",
         "after-index-lock", "after-update-ref", "after-index", "after-tags")
PHASE_B = STEPS[STEPS.index("after-files"):]
"""Steps run by the detached child."""
_IN_CHILD = False
LOCK_NAME = "capture-pin.lock"
JOURNAL_NAME = "capture-pin.journal"
LOCK_WAIT_S = 600.0


DELAY_ENV = "_CAPTURE_TEST_PIN_STEP_DELAY_S"
"""Test-only: sleep this long at every step, so that a kill at a random moment lands between steps."""


def hook(step: str) -> None:
    delay = os.environ.get(DELAY_ENV)
    if delay:
        time.sleep(float(delay))
    want = os.environ.get(HOOK_ENV)
    if not want:
        return
    action, _, at = want.partition(":")
    if at != step:
        return
    if action in ("kill", "killparent") and _IN_CHILD:
        os.kill(os.getppid(), signal.SIGKILL)
        if action == "killparent":
            return
    if action in ("kill", "killparent"):
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "fail":
        raise OSError(f"test hook: failing at {step}")


# --------------------------------------------------------------------------- paths


def check_write_path(top: Path, rel: str) -> Path:
    """``top/rel``, refusing a symlink in any component (a git-ignored symlinked folder would make
    pin write outside the repository) and any path that resolves outside ``top``."""
    p = top
    for part in PurePosixPath(rel).parts:
        if part in ("", ".", ".."):
            raise UsageError(f"{top}: refusing to write {rel!r} (not a plain relative path)",
                             "pin writes only plain relative paths inside the repository")
        p = p / part
        if p.is_symlink():
            raise UsageError(f"{p}: is a symlink; pin writes only real files and folders inside {top}",
                             "replace the link with a real folder (or remove it) and pin again")
    real = Path(os.path.realpath(p))
    if real != top and top not in real.parents:
        raise UsageError(f"{p}: resolves to {real}, outside the results repository {top}",
                         "pin writes only inside the repository")
    return p


# --------------------------------------------------------------------------- lock


class PinLock:
    """An exclusive flock on ``.git/capture-pin.lock``: a second pin waits (saying so on stderr)."""

    def __init__(self, git_dir: Path, top: Path, wait_s: float = LOCK_WAIT_S) -> None:
        self.path = git_dir / LOCK_NAME
        self.top = top
        self.wait_s = wait_s
        self.fd: int | None = None

    def __enter__(self) -> PinLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                os.close(fd)
                raise
            print(f"capture pin: waiting for another pin in {self.top} to finish", file=sys.stderr, flush=True)
            deadline = time.monotonic() + self.wait_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        os.close(fd)
                        raise UsageError(f"{self.top}: another capture pin has held {self.path} for "
                                         f"{self.wait_s:.0f} s", "wait for it to finish, then pin again") from None
                    time.sleep(0.05)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            os.close(self.fd)  # releases the flock
            self.fd = None


# --------------------------------------------------------------------------- journal


@dataclass(frozen=True)
class Journal:
    pid: int
    old: str
    new: str
    files: dict[str, str]
    """repository path (from the top level) -> blob sha we write there."""
    tmp: dict[str, str]
    """repository path -> the temporary file name used to write it (same folder)."""
    dirs: list[str]
    """folders we create, outermost first."""
    next_index: str
    tags: list[str]
    message: str
    staging: str = ""
    """Folder in .git holding the files to publish (``N`` per path, see :attr:`staged`); "" when
    .git is on another file system and files are written beside their destination."""
    staged: dict[str, str] | None = None
    """repository path -> its staged file's name in :attr:`staging`."""
    index_sha: str = ""
    """sha256 of .git/index as next-index was built from it ("" when there was none)."""

    def dump(self) -> bytes:
        return json.dumps(self.__dict__, indent=1, sort_keys=True).encode()

    @classmethod
    def load(cls, data: bytes) -> Journal:
        d = json.loads(data)
        return cls(int(d["pid"]), d["old"], d["new"], dict(d["files"]), dict(d["tmp"]), list(d["dirs"]),
                   d["next_index"], list(d["tags"]), d["message"], str(d.get("staging", "")),
                   dict(d.get("staged") or {}), str(d.get("index_sha", "")))


def _git(repo, *args: str, env: dict[str, str] | None = None, check: bool = True) -> str:
    import git
    try:
        return repo.git.execute(["git", *args], env=env)
    except git.GitCommandError as exc:
        if not check:
            return ""
        stderr = (exc.stderr or "").strip().replace("\n", " ").removeprefix("stderr: ").strip(" '")
        hint = None
        if "tell me who you are" in stderr or "empty ident" in stderr:
            hint = 'set a committer: `git config user.name "..."` and `git config user.email ...` in the results repository'
        raise UsageError(f"git {args[0]} failed: {stderr or exc}", hint) from None


def _head(repo) -> str | None:
    out = _git(repo, "rev-parse", "-q", "--verify", "HEAD^{commit}", check=False).strip()
    return out or None


def _blob(repo, spec: str) -> bytes | None:
    try:
        return repo.git.execute(["git", "cat-file", "blob", spec], stdout_as_string=False, strip_newline_in_stdout=False)
    except Exception:  # noqa: BLE001 - absent path: None
        return None


def _write_journal(git_dir: Path, journal: Journal) -> None:
    tmp = git_dir / f"{JOURNAL_NAME}.{journal.pid}.tmp"
    with open(tmp, "wb") as f:
        f.write(journal.dump())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, git_dir / JOURNAL_NAME)
    fsync_dir(git_dir)


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --------------------------------------------------------------------------- recovery


def recover(repo, top: Path, git_dir: Path) -> str | None:
    """Repair what a killed pin left; call only under :class:`PinLock`. Returns what was done."""
    journal_path = git_dir / JOURNAL_NAME
    done = None
    if journal_path.exists():
        try:
            journal = Journal.load(journal_path.read_bytes())
        except (OSError, ValueError, KeyError, TypeError):
            journal = None
        # We hold the pin lock, and a pin removes its journal before it lets go of the lock: so the
        # pin that wrote this one is dead (or failed after publishing); the lock is the proof.
        if journal is not None:
            done = _repair(repo, top, git_dir, journal)
        journal_path.unlink(missing_ok=True)
    # temporary files of dead pins in .git (invisible to git, but litter); we hold the lock, so
    # no pin that could own them is running
    leftovers = [*git_dir.glob("capture-pin-*.*index"), *git_dir.glob(f"{JOURNAL_NAME}.*.tmp"),
                 *git_dir.glob("capture-pin-*.files")]
    for p in leftovers:
        try:
            pid = int(p.name.split("-")[2].split(".")[0]) if p.name.startswith("capture-pin-") else int(p.name.split(".")[2])
        except (ValueError, IndexError):
            continue
        if not _pid_alive(pid):
            if p.is_dir() and not p.is_symlink():
                import shutil

                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
    return done


def _ours_lock(git_dir: Path, journal: Journal) -> bool:
    lock, mine = git_dir / "index.lock", git_dir / journal.next_index
    try:
        return lock.exists() and mine.exists() and os.path.samefile(lock, mine)
    except OSError:
        return False


def _repair(repo, top: Path, git_dir: Path, journal: Journal) -> str:
    # temporary work-tree files we were writing: ours by name (pid inside) and by content (a prefix)
    head = _head(repo)
    for rel, name in journal.tmp.items():
        tmp = top / PurePosixPath(rel).parent / name
        try:
            data = tmp.read_bytes()
        except OSError:
            continue
        ours = _blob(repo, journal.files[rel]) or b""
        before = (_blob(repo, f"{head}:{rel}") if head else None) or b""
        if ours.startswith(data) or before.startswith(data):
            tmp.unlink()
    published = head is not None and (head == journal.new or _is_ancestor(repo, journal.new, head))
    lock = git_dir / "index.lock"
    if published:
        if head == journal.new and _ours_lock(git_dir, journal):
            os.replace(lock, git_dir / "index")  # our next index, built before HEAD moved: finish the pin
        elif _ours_lock(git_dir, journal):
            lock.unlink()
        if head == journal.new:
            _fix_index(repo, git_dir, journal)
        for t in journal.tags:
            if not _git(repo, "tag", "--list", t, check=False).strip():
                _git(repo, "tag", "-a", t, "-m", journal.message, journal.new, check=False)
        (git_dir / journal.next_index).unlink(missing_ok=True)
        _remove_staging(git_dir, journal)
        return "finished"
    if _ours_lock(git_dir, journal):
        lock.unlink()
    (git_dir / journal.next_index).unlink(missing_ok=True)
    for rel, sha in journal.files.items():
        path = top / rel
        try:
            data = path.read_bytes()
        except OSError:
            continue
        if hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() != sha:
            continue  # not what we wrote: not ours to touch
        at_head = _blob(repo, f"{head}:{rel}") if head else None
        if at_head is not None:
            _write_file(path, at_head, journal.tmp[rel], first=False)
        elif not _git(repo, "ls-files", "--", rel, check=False).strip():
            path.unlink()
    for d in reversed(journal.dirs):
        try:
            (top / d).rmdir()
        except OSError:
            pass
    _remove_staging(git_dir, journal)
    return "undone"


def _remove_staging(git_dir: Path, journal: Journal) -> None:
    if journal.staging and "/" not in journal.staging and journal.staging.startswith("capture-pin-"):
        import shutil

        shutil.rmtree(git_dir / journal.staging, ignore_errors=True)


def _is_ancestor(repo, a: str, b: str) -> bool:
    import git
    try:
        repo.git.execute(["git", "merge-base", "--is-ancestor", a, b])
        return True
    except git.GitCommandError:
        return False


def _fix_index(repo, git_dir: Path, journal: Journal) -> None:
    """HEAD is our commit but the index may lack our entries (killed before the rename): add them."""
    staged = _git(repo, "ls-files", "-s", "--", *journal.files, check=False)
    have = {line.split("\t", 1)[1]: line.split()[1] for line in staged.splitlines() if "\t" in line}
    missing = [rel for rel, sha in journal.files.items() if have.get(rel) != sha]
    if missing:
        entries = [x for rel in missing for x in ("--cacheinfo", f"100644,{journal.files[rel]},{rel}")]
        _git(repo, "update-index", "--add", *entries)


# --------------------------------------------------------------------------- publish


def _write_file(dest: Path, data: bytes, tmp_name: str, first: bool) -> None:
    tmp = dest.parent / tmp_name
    with open(tmp, "wb") as f:
        half = len(data) // 2
        f.write(data[:half])
        if first:
            f.flush()
            hook("mid-file")
        f.write(data[half:])
        f.flush()
        os.fsync(f.fileno())
    try:
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(dest.parent)


def _same_device(a: Path, b: Path) -> bool:
    try:
        return os.stat(a).st_dev == os.stat(b).st_dev
    except OSError:
        return False


def _digest(path: Path) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except FileNotFoundError:
        return ""


def _build_next_index(repo, git_dir: Path, journal: Journal) -> str:
    """next-index: .git/index as it is now plus our entries; returns the digest of what it copied."""
    index, next_index = git_dir / "index", git_dir / journal.next_index
    seen = index.read_bytes() if index.exists() else None
    next_index.unlink(missing_ok=True)
    if seen is not None:
        next_index.write_bytes(seen)
    entries = [x for rel, sha in journal.files.items() for x in ("--cacheinfo", f"100644,{sha},{rel}")]
    _git(repo, "update-index", "--add", *entries, env={"GIT_INDEX_FILE": str(next_index)})
    return hashlib.sha256(seen).hexdigest() if seen is not None else ""


def publish(repo, top: Path, files: dict[str, bytes], old: str, commit: str, message: str,
            tags: tuple[str, ...]) -> None:
    """Make ``commit`` (a child of ``old`` whose tree adds ``files``) HEAD, with work tree and index."""
    from gitdb.base import IStream

    git_dir = Path(repo.git_dir)
    pid = os.getpid()
    shas = {rel: repo.odb.store(IStream("blob", len(data), io.BytesIO(data))).hexsha.decode()
            for rel, data in files.items()}
    dirs: list[str] = []
    for rel in files:
        for parent in reversed(PurePosixPath(rel).parents):
            if str(parent) != "." and not (top / parent).exists() and str(parent) not in dirs:
                dirs.append(str(parent))
    staging = git_dir / f"capture-pin-{pid}.files"
    in_git = _same_device(git_dir, top)
    journal = Journal(pid, old, commit, shas, {rel: f".{PurePosixPath(rel).name}.capture-pin-{pid}.tmp" for rel in files},
                      dirs, f"capture-pin-{pid}.next-index", list(tags), message,
                      staging.name if in_git else "", {rel: str(k) for k, rel in enumerate(files)} if in_git else {})
    # Phase A: everything inside .git, invisible to git and to anyone looking at the work tree.
    try:
        if in_git:
            staging.mkdir()
            for k, (rel, data) in enumerate(files.items()):
                assert journal.staged is not None
                _write_file(staging / journal.staged[rel], data, f"{journal.staged[rel]}.part", first=k == 0)
        journal = Journal(**{**journal.__dict__, "index_sha": _build_next_index(repo, git_dir, journal)})
        hook("after-next-index")
        _write_journal(git_dir, journal)
    except BaseException as exc:
        _remove_staging(git_dir, journal)
        (git_dir / journal.next_index).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise UsageError(f"{top}: pin failed while preparing ({exc}); the repository was left as it was",
                             "check free space and permissions in the results repository, then pin again") from None
        raise
    hook("after-journal")
    # Phase B: a detached child makes it visible; it finishes even if this process is killed.
    _detached(lambda: _finish(repo, top, git_dir, files, journal))


def _finish(repo, top: Path, git_dir: Path, files: dict[str, bytes], journal: Journal) -> None:
    try:
        _publish_steps(repo, top, git_dir, files, journal)
    except BaseException as exc:
        _undo(repo, top, git_dir, journal)
        if isinstance(exc, OSError):
            raise UsageError(f"{top}: pin failed while writing ({exc}); the repository was left as it was",
                             "check free space and permissions in the results repository, then pin again") from None
        raise
    try:
        hook("after-index")
        for t in journal.tags:
            _git(repo, "tag", "-a", t, "-m", journal.message, journal.new)
        hook("after-tags")
    except (OSError, CaptureError) as exc:
        raise UsageError(f"{top}: committed {journal.new[:12]} but could not finish the pin ({exc})",
                         "pin again: the next pin finishes it (tags) before doing anything else") from None
    (git_dir / JOURNAL_NAME).unlink(missing_ok=True)
    _remove_staging(git_dir, journal)


def _detached(work) -> None:
    """Run ``work`` in a forked child in its own session (so a signal to `capture pin`'s process
    group, or a kill of this process, does not stop it), wait for it, and re-raise its error here."""
    global _IN_CHILD
    sys.stdout.flush()
    sys.stderr.flush()
    r, w = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child; its effects are what the tests check
        os.close(r)
        _IN_CHILD = True
        status = 0
        message: dict[str, Any]
        try:
            os.setsid()
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            work()
            message = {"ok": True}
        except CaptureError as exc:
            message = {"error": exc.message, "hint": exc.hint}
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
            message = {"error": f"pin failed while publishing: {type(exc).__name__}: {exc}", "hint": None}
        try:
            os.write(w, json.dumps(message).encode())
        except OSError:
            status = 1  # the parent is gone: nobody to tell
        os._exit(status)
    os.close(w)
    chunks = []
    while True:
        try:
            chunk = os.read(r, 65536)
        except KeyboardInterrupt:  # the child finishes either way: wait for it and say what it did
            continue
        if not chunk:
            break
        chunks.append(chunk)
    os.close(r)
    while True:
        try:
            os.waitpid(child, 0)
            break
        except KeyboardInterrupt:
            continue
        except ChildProcessError:
            break
    try:
        message = json.loads(b"".join(chunks) or b"{}")
    except ValueError:
        message = {}
    if message.get("ok"):
        return
    raise UsageError(message.get("error") or "pin was interrupted while publishing; the next pin finishes or undoes it",
                     message.get("hint") or "run `capture pin` again")


def _publish_steps(repo, top: Path, git_dir: Path, files: dict[str, bytes], journal: Journal) -> None:
    for d in journal.dirs:
        check_write_path(top, d)
        (top / d).mkdir(exist_ok=True)
    for k, (rel, data) in enumerate(files.items()):
        dest = check_write_path(top, rel)
        if journal.staging and journal.staged:
            os.replace(git_dir / journal.staging / journal.staged[rel], dest)
        else:
            _write_file(dest, data, journal.tmp[rel], first=False)
    for folder in {(top / rel).parent for rel in files}:
        fsync_dir(folder)
    hook("after-files")
    next_index = git_dir / journal.next_index
    lock = git_dir / "index.lock"
    index = git_dir / "index"
    seen = journal.index_sha
    for _attempt in range(5):
        if _digest(index) != seen:  # someone staged something meanwhile: rebuild from the index as it is
            seen = _build_next_index(repo, git_dir, journal)
        try:
            os.link(next_index, lock)  # git's index lock, taken atomically, holding our content
        except FileExistsError:
            raise UsageError(f"{lock} exists: another git process is working in {top}",
                             "wait for it to finish and pin again (remove the lock only if no git process is running)") from None
        if _digest(index) == seen:
            break
        lock.unlink()
    else:
        raise UsageError(f"{top}: the git index keeps changing; pin could not take it", "pin again when git is idle")
    hook("after-index-lock")
    _git(repo, "update-ref", "-m", "capture pin", "HEAD", journal.new, journal.old)
    hook("after-update-ref")
    os.replace(lock, git_dir / "index")
    next_index.unlink(missing_ok=True)


def _undo(repo, top: Path, git_dir: Path, journal: Journal) -> None:
    """An in-process failure while publishing: move HEAD back if it moved, then undo like recovery."""
    errors = []
    if _head(repo) == journal.new:
        try:
            _git(repo, "update-ref", "-m", "capture pin: undo", "HEAD", journal.old, journal.new)
        except CaptureError as exc:
            errors.append(exc.message)
    try:
        _repair(repo, top, git_dir, journal)
        (git_dir / JOURNAL_NAME).unlink(missing_ok=True)
    except (OSError, CaptureError) as exc:
        errors.append(str(exc))
    if errors:
        print(f"capture pin: could not fully undo the interrupted pin (the next pin repairs it): {'; '.join(errors)}",
              file=sys.stderr)

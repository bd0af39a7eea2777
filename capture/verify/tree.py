"""Verify a whole tree of manifests: a results repository, a glob, or several files.

One line per manifest, then a summary; the exit code is the worst found (4 > 3 > 1 > 0). With
``stack=False`` only signature and trust are checked (what the CI of a results repository with
no GPU can check); with ``stack=True`` each manifest is also compared with this machine, probed
once per distinct way of probing (``[probe]`` table) rather than once per file.

Speed: each file is read once, its trailer parsed once, and each allowed-signers file is found
once per folder and parsed once (``benchmarks/verify_tree.py`` measures it).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from capture._escape import printable
from capture.errors import EXIT_DRIFT, EXIT_MALFORMED, EXIT_OK, EXIT_SIGNATURE, CaptureError, ManifestError, SignatureError, UsageError
from capture.results.summary import content_id
from capture.signing.trust import AllowedSigners
import capture.verify.pinned as pinned
import capture.verify.trust_root as trust_root
import capture.verify.walk as walk
from capture.verify.open import OpenedManifest, load_allowed, open_manifest
from capture.verify.trust_root import TrustRoot
from capture.verify.policy import Policy
from capture.verify.single import STATUSES, TRIAL_NOTE, LiveStack, Verdict, judge

TreeEntry = Verdict
"""A row of the tree report is the very verdict `verify FILE` gives."""
_SEVERITY = {EXIT_SIGNATURE: 4, EXIT_MALFORMED: 3, EXIT_DRIFT: 1, EXIT_OK: 0}


def worst_exit_code(codes: Iterable[int]) -> int:
    """4 > 3 > 1 > 0; any other code (2: a usage problem met on the way) ranks just below 4."""
    worst = EXIT_OK
    for c in codes:
        if _SEVERITY.get(c, 3.5) > _SEVERITY.get(worst, 3.5):
            worst = c
    return worst


@dataclass(frozen=True)
class TreeReport:
    entries: tuple[Verdict, ...]
    seconds: float
    stack_checked: bool
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def exit_code(self) -> int:
        return worst_exit_code(e.exit_code for e in self.entries)

    @property
    def counts(self) -> dict[str, int]:
        c = Counter(e.status for e in self.entries)
        return {s: c.get(s, 0) for s in STATUSES}

    def summary_line(self) -> str:
        counts = ", ".join(f"{n} {s}" for s, n in self.counts.items() if n or s in ("OK",))
        checked = "signature, trust and live stack" if self.stack_checked else "signature and trust only"
        return (f"{len(self.entries)} manifest(s): {counts} ({checked}; {self.seconds:.2f} s) "
                f"-> exit {self.exit_code}")

    def to_json(self) -> dict[str, Any]:
        return {
            "manifests": [e.to_json() for e in self.entries],
            "summary": {"total": len(self.entries), **{s.lower(): n for s, n in self.counts.items()},
                        "exit_code": self.exit_code, "stack_checked": self.stack_checked,
                        "seconds": round(self.seconds, 3), "notes": list(self.notes)},
        }


def is_results_repo(path: str | os.PathLike[str]) -> bool:
    """A folder laid out by `capture pin` (an empty one verifies as "0 manifests", not an error)."""
    p = Path(path)
    return p.is_dir() and any((p / m).is_file() for m in (*trust_root.MARKERS, "index.json"))


def expand(paths: Sequence[str | os.PathLike[str]]) -> list[str]:
    """Files to check: folders are walked for ``*.toml`` (hidden folders such as ``.git`` and
    ``.capture`` skipped, links to folders not followed), globs are expanded (each folder entered
    once, links followed), files are taken as given (even if absent, so that a missing file is
    reported as MALFORMED rather than silently dropped). Bounded: :mod:`capture.verify.walk`."""
    return walk.expand(paths)


_Opened = OpenedManifest | CaptureError
_Signer = tuple[str, str, str] | None
"""(principal, public key, fingerprint) of a signature found valid, for a report that names them."""
_PerFile = AllowedSigners | TrustRoot | CaptureError


def _open_one(path: str, trust: _PerFile, keep_data: bool) -> tuple[_Opened, str | None, _Signer]:
    if isinstance(trust, CaptureError):  # the folder's trust root itself was refused
        return trust, None, None
    try:
        opened = open_manifest(path, trust, require_trusted=True, skip_other=True)
    except (ManifestError, SignatureError) as exc:
        status = getattr(exc, "status", None)
        signer = (status.principal, status.public_key, status.fingerprint) if status and status.principal else None
        return exc, None, signer
    # Only what the judgment needs crosses back from a worker process.
    return (OpenedManifest(opened.path, b"", b"", opened.data if keep_data else {}, opened.signature),
            content_id(opened.raw), None)


def _check_chunk(job: tuple[list[tuple[str, _PerFile]], bool]) -> list[tuple[_Opened, str | None, str | None, _Signer]]:
    items, keep_data = job
    out = []
    for p, trust in items:
        r, cid, signer = _open_one(p, trust, keep_data)
        # exceptions lose their hint when pickled: carry it beside them
        out.append((r, r.hint if isinstance(r, CaptureError) else None, cid, signer))
    return out


PARALLEL_MIN_FILES = 100
"""Below this many files a process pool costs more than it saves."""


def _check_all(items: list[tuple[str, _PerFile]], keep_data: bool,
               jobs: int | None) -> list[tuple[_Opened, str | None, str | None, _Signer]]:
    jobs = jobs if jobs is not None else (os.cpu_count() or 1)
    if jobs <= 1 or len(items) < PARALLEL_MIN_FILES:
        return _check_chunk((items, keep_data))
    # Parsing TOML dominates (pure Python); chunks keep order and amortise the pickling.
    n_chunks = jobs * 4
    size = -(-len(items) // n_chunks)
    chunks = [(items[i:i + size], keep_data) for i in range(0, len(items), size)]
    try:
        from concurrent.futures import ProcessPoolExecutor
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            return [r for part in pool.map(_check_chunk, chunks) for r in part]
    except (OSError, ImportError, NotImplementedError):  # no working multiprocessing here
        return _check_chunk((items, keep_data))


def _trust_per_file(files: list[str], explicit: str | os.PathLike[str] | None,
                    revision: trust_root.RevisionTrust | None) -> tuple[list[_PerFile], list[Path | None]]:
    """The trust root of each file and the results repository holding it, chosen here once per
    folder (warnings about ignored files are given once, in this process)."""
    by_folder: dict[str, tuple[_PerFile, Path | None]] = {}
    fixed: AllowedSigners | None = None
    if explicit is not None:
        fixed = load_allowed(explicit)  # a bad --allowed-signers is one usage error, not a row per file
    elif revision is not None:
        fixed = revision.allowed
    trust: list[_PerFile] = []
    roots: list[Path | None] = []
    for path in files:
        folder = os.path.dirname(os.path.abspath(path))
        if folder not in by_folder:
            try:
                if revision is not None:
                    chosen = trust_root.choose(path, revision.root / trust_root.TRUST_FILE, source=revision.allowed.path or "")
                else:
                    chosen = trust_root.choose(path, explicit)
                by_folder[folder] = (fixed if fixed is not None else chosen, chosen.results_root)
            except SignatureError as exc:
                by_folder[folder] = (exc, trust_root.results_root(path))
        t, r = by_folder[folder]
        trust.append(t)
        roots.append(r)
    return trust, roots


def verify_tree(paths: Sequence[str | os.PathLike[str]], allowed_signers: str | os.PathLike[str] | None = None,
                policy: Policy | None = None, stack: bool = False, jobs: int | None = None,
                code_dir: str | os.PathLike[str] | None = None, verify_artifacts: bool = False,
                trust_from: str | None = None, staged: bool = False) -> TreeReport:
    """Check every manifest under ``paths``; never raises for a bad manifest (it becomes a row).

    Each row is :func:`capture.verify.single.judge` with the same flags `verify FILE` would use
    (``code_dir`` is ``--code``, ``verify_artifacts`` is ``--verify-artifacts``). In a results
    repository the pinned-file checks follow (:mod:`capture.verify.pinned`).
    ``trust_from``: the allowed signers are the results repository's as they are at that git
    revision (:func:`capture.verify.trust_root.from_revision`); a manifest signed by a signer the
    change adds is named with that signer. ``staged``: what git's index holds is verified, not the
    work tree (:mod:`capture.verify.staged`).
    ``jobs``: worker processes for the signature/parse stage (default: one per CPU once there
    are :data:`PARALLEL_MIN_FILES` files or more; 1 keeps everything in this process).
    """
    if allowed_signers is not None and trust_from is not None:
        raise UsageError("--allowed-signers and --trust-from both name the trust root", "pass one of them")
    revision = trust_root.from_revision([str(p) for p in paths], trust_from) if trust_from is not None else None
    if staged:
        from capture.verify import staged as _staged

        with _staged.snapshot(paths) as (snap_paths, into, back):
            if revision is not None:  # the trust file this commit would hold is the staged one
                revision = dataclasses.replace(revision, root=into(revision.root))
            return back(_verify(snap_paths, allowed_signers, policy, stack, jobs, code_dir, verify_artifacts, revision))
    return _verify(paths, allowed_signers, policy, stack, jobs, code_dir, verify_artifacts, revision)


def _verify(paths: Sequence[str | os.PathLike[str]], allowed_signers: str | os.PathLike[str] | None,
            policy: Policy | None, stack: bool, jobs: int | None, code_dir: str | os.PathLike[str] | None,
            verify_artifacts: bool, revision: trust_root.RevisionTrust | None) -> TreeReport:
    t0 = time.perf_counter()
    files = expand(paths)
    if not files and not all(is_results_repo(p) for p in paths):
        raise UsageError(f"no manifest (*.toml) found in {', '.join(map(str, paths))}",
                         "name a results repository folder, a glob such as 'runs/**/*.toml', or manifest files")
    trust, roots = _trust_per_file(files, allowed_signers, revision)
    policy = policy or Policy.default()
    live = LiveStack(code_dir, verify_artifacts) if stack else None
    entries: list[Verdict] = []
    cids: list[str | None] = []
    signers: list[_Signer] = []
    for path, (opened, hint, cid, signer) in zip(files, _check_all(list(zip(files, trust)), stack, jobs)):
        if isinstance(opened, CaptureError) and hint is not None and opened.hint is None:
            opened.hint = hint
        entries.append(judge(opened, path, policy, stack, live))
        cids.append(cid)
        signers.append(signer)
    notes: list[str] = []
    if revision is not None:
        entries, added = _name_added_signers(entries, signers, revision, paths)
        notes += added
    entries = pinned.check(entries, cids, roots, {Path(os.path.abspath(p)) for p in paths if os.path.isdir(p)})
    if stack and any(e.status in ("OK", "DRIFT") for e in entries):
        notes.append(TRIAL_NOTE)
    return TreeReport(tuple(entries), time.perf_counter() - t0, stack, tuple(notes))


def _name_added_signers(entries: list[Verdict], signers: list[_Signer], revision: trust_root.RevisionTrust,
                        paths: Sequence[str | os.PathLike[str]]) -> tuple[list[Verdict], list[str]]:
    """Rows refused at the base revision whose signer the change itself adds to the trust file:
    say so, naming the signer and the file (trust changes are reviewed apart from results)."""
    current_path = revision.root / trust_root.TRUST_FILE
    try:
        current = load_allowed(current_path) if current_path.is_file() else None
    except CaptureError:
        current = None
    if current is None:
        return entries, []
    out: list[Verdict] = []
    added: dict[str, list[str]] = {}
    for e, signer in zip(entries, signers):
        if e.status == "UNTRUSTED" and signer is not None and current.is_trusted(signer[0], signer[1]):
            who = f"{signer[0]} ({signer[2]})"
            added.setdefault(who, []).append(e.path)
            e = dataclasses.replace(
                e, reason=f"signed by {who}, a signer this change adds to {revision.rel_path} (not trusted at "
                          f"{revision.revision}): a change may not add a signer and results signed by it together",
                hint="land the allowed-signers change on its own first (reviewed by itself), then these manifests")
        out.append(e)
    notes = [f"this change adds signer {who} to {revision.rel_path} together with {len(files)} manifest(s) signed "
             f"by it ({', '.join(files[:3])}{', ...' if len(files) > 3 else ''}); trust changes are reviewed apart "
             "from the results they admit" for who, files in added.items()]
    return out, notes


def verify_paths(paths: Sequence[str | os.PathLike[str]], allowed_signers: str | os.PathLike[str] | None = None,
                 policy: Policy | None = None, stack: bool = False, json_out: bool = False,
                 out: TextIO | None = None, jobs: int | None = None,
                 code_dir: str | os.PathLike[str] | None = None, verify_artifacts: bool = False,
                 trust_from: str | None = None, staged: bool = False) -> int:
    """`capture verify DIR | GLOB | FILE...`: print one line per manifest and a summary; return
    the worst exit code (4 > 3 > 1 > 0)."""
    out = out or sys.stdout
    report = verify_tree(paths, allowed_signers, policy, stack, jobs, code_dir, verify_artifacts, trust_from, staged)
    if json_out:
        out.write(json.dumps(report.to_json(), indent=2, default=str) + "\n")
    else:
        width = max((len(e.status) for e in report.entries), default=2)
        for e in report.entries:
            out.write(e.line(width) + "\n")
        out.write(report.summary_line() + "\n")
        for n in report.notes:
            sys.stderr.write(f"note: {printable(n)}\n")
    return report.exit_code

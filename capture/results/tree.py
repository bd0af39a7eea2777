"""Verify a whole tree of manifests: a results repository, a glob, or several files.

One line per manifest, then a summary; the exit code is the worst found (4 > 3 > 1 > 0). With
``stack=False`` only signature and trust are checked (what the CI of a results repository with
no GPU can check); with ``stack=True`` each manifest is also compared with this machine, probed
once per distinct way of probing (``[probe]`` table) rather than once per file.

Speed: each file is read once, its trailer parsed once, and each allowed-signers file is found
once per folder and parsed once (``benchmarks/verify_tree.py`` measures it).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from capture.errors import (EXIT_DRIFT, EXIT_MALFORMED, EXIT_OK, EXIT_SIGNATURE, CaptureError,
                            ManifestError, SignatureError, TrustError, UsageError)
from capture.manifest import TRAILER_LINE, parse_body, read_bytes, split_signed
from capture.results._sig import _short, load_allowed

STATUSES = ("OK", "DRIFT", "MALFORMED", "UNSIGNED", "UNTRUSTED", "INVALID", "ERROR")
_SEVERITY = {EXIT_SIGNATURE: 4, EXIT_MALFORMED: 3, EXIT_DRIFT: 1, EXIT_OK: 0}


def worst_exit_code(codes: Iterable[int]) -> int:
    """4 > 3 > 1 > 0; any other code (2: a usage problem met on the way) ranks just below 4."""
    worst = EXIT_OK
    for c in codes:
        if _SEVERITY.get(c, 3.5) > _SEVERITY.get(worst, 3.5):
            worst = c
    return worst


@dataclass(frozen=True)
class TreeEntry:
    path: str
    status: str
    """One of :data:`STATUSES`."""
    exit_code: int
    reason: str | None = None
    hint: str | None = None
    principal: str | None = None
    fingerprint: str | None = None
    differences: tuple[Any, ...] = ()
    """:class:`capture.verify.Difference` items when the live stack drifts."""

    def line(self, width: int = 10) -> str:
        text = f"{self.status:<{width}} {self.path}"
        if self.status == "OK":
            return text + (f"  ({self.principal}, {self.fingerprint})" if self.principal else "")
        if self.status == "DRIFT":
            shown = "; ".join(d.line() for d in self.differences[:3])
            more = f"; and {len(self.differences) - 3} more" if len(self.differences) > 3 else ""
            return f"{text}  {len(self.differences)} field(s) differ: {shown}{more}"
        return f"{text}  {self.reason}"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"path": self.path, "status": self.status.lower(), "exit_code": self.exit_code}
        if self.reason:
            out["reason"] = self.reason
        if self.hint:
            out["hint"] = self.hint
        if self.principal:
            out["signer"] = {"principal": self.principal, "fingerprint": self.fingerprint}
        if self.differences:
            from capture.verify import ABSENT
            out["differences"] = [{"field": d.field, "recorded": None if d.recorded is ABSENT else d.recorded,
                                   "live": None if d.live is ABSENT else d.live, "rule": d.rule}
                                  for d in self.differences]
        return out


@dataclass(frozen=True)
class TreeReport:
    entries: tuple[TreeEntry, ...]
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
    return p.is_dir() and ((p / ".capture" / "results.toml").is_file() or (p / "index.json").is_file())


def _hidden(name: str) -> bool:
    return name.startswith(".")


def expand(paths: Sequence[str | os.PathLike[str]]) -> list[str]:
    """Files to check: folders are walked for ``*.toml`` (hidden folders such as ``.git`` and
    ``.capture`` skipped), globs are expanded, files are taken as given (even if absent, so that
    a missing file is reported as MALFORMED rather than silently dropped)."""
    import glob

    out: list[str] = []
    for raw in paths:
        p = str(raw)
        if os.path.isdir(p):
            found = []
            for folder, dirs, files in os.walk(p):
                dirs[:] = sorted(d for d in dirs if not _hidden(d))
                found.extend(os.path.join(folder, f) for f in files if f.endswith(".toml") and not _hidden(f))
            out.extend(sorted(found))
        elif any(c in p for c in "*?[") and not os.path.exists(p):
            matches = sorted(m for m in glob.glob(p, recursive=True) if os.path.isfile(m))
            if not matches:
                raise UsageError(f"{p}: the pattern matches no file", "check the glob, or quote it for the shell")
            out.extend(matches)
        else:
            out.append(p)
    seen: set[str] = set()
    return [f for f in out if not (f in seen or seen.add(f))]


class _Trust:
    """Allowed signers per folder: found once per folder, parsed once per file."""

    def __init__(self, explicit) -> None:
        self.explicit = explicit
        self._by_folder: dict[str, Any] = {}

    def __call__(self, path: str):
        from capture.signing import find_allowed_signers

        folder = os.path.dirname(os.path.abspath(path))
        if folder not in self._by_folder:
            found = find_allowed_signers(path, self.explicit)
            self._by_folder[folder] = load_allowed(found) if found is not None else None
        return self._by_folder[folder]


@dataclass(frozen=True)
class _Verified:
    """A manifest whose signature, trust and body all passed; ``data`` kept only for a stack check."""

    path: str
    principal: str
    fingerprint: str
    data: dict[str, Any] | None


def _unsigned(path: str, raw: bytes) -> TreeEntry:
    parse_body(raw, path)  # malformed (3) beats unsigned (4) for a file that is no manifest at all
    return TreeEntry(path, "UNSIGNED", EXIT_SIGNATURE, "not signed (no [signature] table)",
                     f"sign it: capture sign {path} --key KEY")


def _check_signed(path: str, trust: _Trust, keep_data: bool) -> TreeEntry | _Verified:
    from capture.signing import verify_signed_bytes

    raw = b""
    try:
        raw = read_bytes(path)
        if TRAILER_LINE not in raw:  # a byte search: cheaper than splitting lines twice
            return _unsigned(path, raw)
        # (1) signature over the exact bytes, (2) trust, and only then (3) parse.
        info, body = verify_signed_bytes(raw, trust(path), path)
        data = parse_body(body, path)
    except TrustError as exc:
        return TreeEntry(path, "UNTRUSTED", exc.exit_code, _short(exc.message, path), exc.hint)
    except SignatureError as exc:
        try:
            if split_signed(raw)[1] is None:  # "[signature]" occurs, but not as a line of its own
                return _unsigned(path, raw)
        except SignatureError:
            pass
        except ManifestError as inner:
            return TreeEntry(path, "MALFORMED", inner.exit_code, _short(inner.message, path), inner.hint)
        return TreeEntry(path, "INVALID", exc.exit_code, _short(exc.message, path), exc.hint)
    except ManifestError as exc:
        return TreeEntry(path, "MALFORMED", exc.exit_code, _short(exc.message, path), exc.hint)
    return _Verified(path, info.principal, info.fingerprint, data if keep_data else None)


def _check_chunk(job: tuple[list[str], Any, bool]) -> list[TreeEntry | _Verified]:
    paths, explicit, keep_data = job
    trust = _Trust(explicit)
    return [_check_signed(p, trust, keep_data) for p in paths]


PARALLEL_MIN_FILES = 100
"""Below this many files a process pool costs more than it saves."""


def _check_all(files: list[str], explicit, keep_data: bool, jobs: int | None) -> list[TreeEntry | _Verified]:
    jobs = jobs if jobs is not None else (os.cpu_count() or 1)
    if jobs <= 1 or len(files) < PARALLEL_MIN_FILES:
        return _check_chunk((files, explicit, keep_data))
    # Parsing TOML dominates (pure Python); chunks keep order and amortise the pickling.
    n_chunks = jobs * 4
    size = -(-len(files) // n_chunks)
    chunks = [(files[i:i + size], explicit, keep_data) for i in range(0, len(files), size)]
    try:
        from concurrent.futures import ProcessPoolExecutor
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            return [r for part in pool.map(_check_chunk, chunks) for r in part]
    except (OSError, ImportError, NotImplementedError):  # no working multiprocessing here
        return _check_chunk((files, explicit, keep_data))


class _LiveStack:
    """This machine's fingerprint, probed once per distinct way a manifest was probed."""

    def __init__(self, policy) -> None:
        self.policy = policy
        self._live: dict[str, tuple[dict[str, Any] | None, CaptureError | None]] = {}

    def check(self, v: _Verified) -> TreeEntry:
        from capture.verify import compare_manifests, live_fingerprint

        data = v.data or {}
        signer = dict(principal=v.principal, fingerprint=v.fingerprint)
        key = json.dumps([data.get("probe") or {}, (data.get("code") or {}).get("path")], sort_keys=True, default=str)
        if key not in self._live:
            try:
                self._live[key] = (live_fingerprint(data)[0], None)
            except CaptureError as exc:
                self._live[key] = (None, exc)
        live, error = self._live[key]
        if error is not None:
            return TreeEntry(v.path, "ERROR", error.exit_code, f"live stack not checked: {error.message}", error.hint, **signer)
        diffs, _compared = compare_manifests(data, live, self.policy)
        if diffs:
            return TreeEntry(v.path, "DRIFT", EXIT_DRIFT, differences=tuple(diffs), **signer)
        return TreeEntry(v.path, "OK", EXIT_OK, **signer)


def verify_tree(paths: Sequence[str | os.PathLike[str]], allowed_signers: str | os.PathLike[str] | None = None,
                policy=None, stack: bool = False, jobs: int | None = None) -> TreeReport:
    """Check every manifest under ``paths``; never raises for a bad manifest (it becomes a row).

    ``jobs``: worker processes for the signature/parse stage (default: one per CPU once there
    are :data:`PARALLEL_MIN_FILES` files or more; 1 keeps everything in this process).
    """
    t0 = time.perf_counter()
    files = expand(paths)
    if not files and not all(is_results_repo(p) for p in paths):
        raise UsageError(f"no manifest (*.toml) found in {', '.join(map(str, paths))}",
                         "name a results repository folder, a glob such as 'runs/**/*.toml', or manifest files")
    if allowed_signers is not None:
        load_allowed(allowed_signers)  # a bad --allowed-signers is one usage error, not a row per file
    if stack and policy is None:
        from capture.verify import Policy
        policy = Policy.default()
    live = _LiveStack(policy) if stack else None
    entries: list[TreeEntry] = []
    for r in _check_all(files, allowed_signers, stack, jobs):
        if isinstance(r, TreeEntry):
            entries.append(r)
        elif live is not None:
            entries.append(live.check(r))
        else:
            entries.append(TreeEntry(r.path, "OK", EXIT_OK, principal=r.principal, fingerprint=r.fingerprint))
    notes = ()
    if stack and any(e.status in ("OK", "DRIFT") for e in entries):
        notes = ("trial results are signed facts about the recorded run; only the stack is compared",)
    return TreeReport(tuple(entries), time.perf_counter() - t0, stack, notes)


def verify_paths(paths: list[str], allowed_signers: str | os.PathLike[str] | None = None, policy=None,
                 stack: bool = False, json_out: bool = False, out: TextIO | None = None,
                 jobs: int | None = None) -> int:
    """`capture verify DIR | GLOB | FILE...`: print one line per manifest and a summary; return
    the worst exit code (4 > 3 > 1 > 0)."""
    out = out or sys.stdout
    report = verify_tree(paths, allowed_signers, policy, stack, jobs)
    if json_out:
        out.write(json.dumps(report.to_json(), indent=2, default=str) + "\n")
    else:
        width = max((len(e.status) for e in report.entries), default=2)
        for e in report.entries:
            out.write(e.line(width) + "\n")
        out.write(report.summary_line() + "\n")
        for n in report.notes:
            sys.stderr.write(f"note: {n}\n")
    return report.exit_code

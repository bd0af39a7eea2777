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

from capture._escape import printable
from capture.errors import EXIT_DRIFT, EXIT_MALFORMED, EXIT_OK, EXIT_SIGNATURE, CaptureError, ManifestError, SignatureError, UsageError
from capture.signing.trust import AllowedSigners, find_allowed_signers
from capture.verify.open import OpenedManifest, load_allowed, open_manifest
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
            found: list[str] = []
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
    return list(dict.fromkeys(out))  # each file once, in order


class _Trust:
    """Allowed signers per folder: found once per folder, parsed once per file (:func:`load_allowed`)."""

    def __init__(self, explicit: str | os.PathLike[str] | None) -> None:
        self.explicit = explicit
        self._by_folder: dict[str, AllowedSigners | None] = {}

    def __call__(self, path: str) -> AllowedSigners | None:
        folder = os.path.dirname(os.path.abspath(path))
        if folder not in self._by_folder:
            found = find_allowed_signers(path, self.explicit)
            self._by_folder[folder] = load_allowed(found) if found is not None else None
        return self._by_folder[folder]


_Opened = OpenedManifest | CaptureError


def _open_one(path: str, trust: _Trust, keep_data: bool) -> _Opened:
    try:
        opened = open_manifest(path, trust(path), require_trusted=True)
    except (ManifestError, SignatureError) as exc:
        return exc
    # Only what the judgment needs crosses back from a worker process.
    return OpenedManifest(opened.path, b"", b"", opened.data if keep_data else {}, opened.signature)


def _check_chunk(job: tuple[list[str], str | os.PathLike[str] | None, bool]) -> list[tuple[_Opened, str | None]]:
    paths, explicit, keep_data = job
    trust = _Trust(explicit)
    out: list[tuple[_Opened, str | None]] = []
    for p in paths:
        r = _open_one(p, trust, keep_data)
        # exceptions lose their hint when pickled: carry it beside them
        out.append((r, r.hint if isinstance(r, CaptureError) else None))
    return out


PARALLEL_MIN_FILES = 100
"""Below this many files a process pool costs more than it saves."""


def _check_all(files: list[str], explicit: str | os.PathLike[str] | None, keep_data: bool,
               jobs: int | None) -> list[tuple[_Opened, str | None]]:
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


def verify_tree(paths: Sequence[str | os.PathLike[str]], allowed_signers: str | os.PathLike[str] | None = None,
                policy: Policy | None = None, stack: bool = False, jobs: int | None = None,
                code_dir: str | os.PathLike[str] | None = None, verify_artifacts: bool = False) -> TreeReport:
    """Check every manifest under ``paths``; never raises for a bad manifest (it becomes a row).

    Each row is :func:`capture.verify.single.judge` with the same flags `verify FILE` would use
    (``code_dir`` is ``--code``, ``verify_artifacts`` is ``--verify-artifacts``).
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
    policy = policy or Policy.default()
    live = LiveStack(code_dir, verify_artifacts) if stack else None
    entries: list[Verdict] = []
    for path, (opened, hint) in zip(files, _check_all(files, allowed_signers, stack, jobs)):
        if isinstance(opened, CaptureError) and hint is not None and opened.hint is None:
            opened.hint = hint
        entries.append(judge(opened, path, policy, stack, live))
    notes: tuple[str, ...] = ()
    if stack and any(e.status in ("OK", "DRIFT") for e in entries):
        notes = (TRIAL_NOTE,)
    return TreeReport(tuple(entries), time.perf_counter() - t0, stack, notes)


def verify_paths(paths: Sequence[str | os.PathLike[str]], allowed_signers: str | os.PathLike[str] | None = None,
                 policy: Policy | None = None, stack: bool = False, json_out: bool = False,
                 out: TextIO | None = None, jobs: int | None = None,
                 code_dir: str | os.PathLike[str] | None = None, verify_artifacts: bool = False) -> int:
    """`capture verify DIR | GLOB | FILE...`: print one line per manifest and a summary; return
    the worst exit code (4 > 3 > 1 > 0)."""
    out = out or sys.stdout
    report = verify_tree(paths, allowed_signers, policy, stack, jobs, code_dir, verify_artifacts)
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

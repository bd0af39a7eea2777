"""`capture verify DIR --staged`: verify what a commit would hold (git's index), not the work tree.

The pre-commit hook runs this: a staged unsigned manifest must not be committed just because a
signed copy sits in the work tree. The index entries under the named paths are written by
``git checkout-index`` (exactly the staged bytes, links as links) into a private temporary folder
laid out like the work tree, verified there, and the report names the work-tree paths.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from capture.errors import UsageError
from capture.verify.trust_root import work_tree_top

if TYPE_CHECKING:
    from capture.verify.tree import TreeReport


def _git(top: Path, *args: str, stdin: bytes | None = None) -> bytes:
    try:
        done = subprocess.run(["git", "-C", str(top), *args], input=stdin, capture_output=True, timeout=300)
    except FileNotFoundError:
        raise UsageError("--staged: git is not installed", "install git") from None
    except subprocess.TimeoutExpired:
        raise UsageError("--staged: git did not answer within 300 s", "check the repository") from None
    if done.returncode != 0:
        why = done.stderr.decode("utf-8", "replace").strip().splitlines()
        raise UsageError(f"--staged: git {args[0]} failed ({why[-1] if why else done.returncode})", "check the repository")
    return done.stdout


@contextlib.contextmanager
def snapshot(paths: Sequence[str | os.PathLike[str]]) -> Iterator[tuple[list[str], Callable[[Path], Path],
                                                                        Callable[[TreeReport], TreeReport]]]:
    """The staged content under ``paths`` in a temporary folder: (the paths there, a function that
    maps a work-tree path into it, one that maps a report made there back to work-tree paths).
    The folder is removed afterwards."""
    tops = {work_tree_top(p) for p in paths}
    if None in tops or len(tops) != 1:
        raise UsageError(f"--staged: {', '.join(map(str, paths))} must lie in one git work tree",
                         "run it inside the repository the commit is made in")
    top = tops.pop()
    assert top is not None
    rels = [os.path.relpath(os.path.abspath(p), top) for p in paths]
    if any(r == ".." or r.startswith(".." + os.sep) for r in rels):
        raise UsageError("--staged: the paths must lie inside the work tree", "name folders inside the repository")
    listed = _git(top, "ls-files", "--cached", "-z", "--", *rels)
    tmp = Path(tempfile.mkdtemp(prefix="capture-staged-"))
    try:
        (tmp / ".git").mkdir()  # the snapshot stands for a work tree (results repositories live in one)
        if listed:
            _git(top, "checkout-index", "-z", "--stdin", f"--prefix={tmp}/", stdin=listed)
        for r in rels:  # a named folder with nothing staged in it still exists, as in the work tree
            if os.path.isdir(top / r):
                (tmp / r).mkdir(parents=True, exist_ok=True)
        inside = [str(tmp / r) if r != "." else str(tmp) for r in rels]
        prefix, real = str(tmp), str(top)

        def back(report: TreeReport) -> TreeReport:
            def fix(text: str | None) -> str | None:
                return text.replace(prefix, real) if text else text

            entries = tuple(dataclasses.replace(e, path=fix(e.path) or e.path, reason=fix(e.reason), hint=fix(e.hint))
                            for e in report.entries)
            return dataclasses.replace(report, entries=entries, notes=tuple(fix(n) or n for n in report.notes))

        def into(path: Path) -> Path:
            return tmp / os.path.relpath(os.path.abspath(path), top)

        yield inside, into, back
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

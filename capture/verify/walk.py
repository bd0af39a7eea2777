"""Which files a tree command looks at: folders walked, globs expanded, with bounded work.

Used by `verify DIR | GLOB` (:func:`capture.verify.tree.expand`) and by `decide`. A folder is
walked for ``*.toml`` without following links into other folders; a glob (``runs/**/*.toml``) is
matched while walking from its fixed prefix, following links to folders but never into a folder it
has already been in (a folder that links to itself, or two links to one place, is walked once), so
it ends. Either way the walk stops with a usage error (exit 2) after :data:`MAX_FILES` matching files
or :data:`MAX_ENTRIES` entries looked at, so memory and time stay bounded.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Iterator, Sequence

from capture.errors import UsageError

MAX_FILES = 100_000
"""At most this many files from one command line (more: exit 2, narrow the pattern)."""
MAX_ENTRIES = 1_000_000
"""At most this many folder entries looked at while walking (more: exit 2)."""
_MAGIC = re.compile(r"[*?\[]")


def has_magic(text: str) -> bool:
    return _MAGIC.search(text) is not None


class _Budget:
    def __init__(self, what: str) -> None:
        self.what = what
        self.files = 0
        self.entries = 0

    def look(self, n: int) -> None:
        self.entries += n
        if self.entries > MAX_ENTRIES:
            raise UsageError(f"{self.what}: more than {MAX_ENTRIES:,} entries to look through; stopped",
                             "name a smaller folder or a narrower pattern")

    def take(self) -> None:
        self.files += 1
        if self.files > MAX_FILES:
            raise UsageError(f"{self.what}: more than {MAX_FILES:,} files match; stopped",
                             "verify a smaller folder or a narrower pattern at a time")


def _translate(parts: Sequence[str]) -> re.Pattern[str]:
    """A glob's components (after its fixed prefix) as one regular expression over ``/``-joined
    relative paths: ``**`` is any number of folders, ``*`` and ``?`` stay within one component,
    ``[...]`` is a class; none of them matches a leading ``.`` (as :mod:`glob` does)."""
    out: list[str] = []
    for k, part in enumerate(parts):
        last = k == len(parts) - 1
        if part == "**":
            out.append(r"(?:(?!\.)[^/]*/)*" if not last else r"(?:(?!\.)[^/]*(?:/|$))*")
            continue
        piece = "" if part.startswith((".", "[.")) else r"(?!\.)"
        i = 0
        while i < len(part):
            c = part[i]
            if c == "*":
                piece += "[^/]*"
            elif c == "?":
                piece += "[^/]"
            elif c == "[":
                j = part.find("]", i + 2 if part[i + 1:i + 2] in ("!", "]") else i + 1)
                if j < 0:
                    piece += re.escape(c)
                else:
                    body = part[i + 1:j]
                    neg = body.startswith("!")
                    body = body[1:] if neg else body
                    piece += "[" + ("^" if neg else "") + body.replace("\\", "\\\\") + "]"
                    i = j
            else:
                piece += re.escape(c)
            i += 1
        out.append(piece + ("" if last else "/"))
    return re.compile("".join(out))


def _split_glob(pattern: str) -> tuple[str, list[str]]:
    parts = pattern.split("/")
    fixed: list[str] = []
    for k, part in enumerate(parts):
        if has_magic(part):
            rest = parts[k:]
            break
        fixed.append(part)
    else:  # pragma: no cover - callers pass patterns with magic
        return pattern, []
    base = "/".join(fixed) if fixed else "."
    if pattern.startswith("/") and not base:
        base = "/"
    return base or "/", rest


def glob_files(pattern: str, budget: _Budget | None = None) -> Iterator[str]:
    """Files matching ``pattern``, sorted per folder, each folder entered once (links followed)."""
    budget = budget or _Budget(pattern)
    base, rest = _split_glob(pattern)
    regex = _translate(rest)
    hidden_ok = any(p.startswith(".") for p in rest)
    recursive = "**" in rest
    max_depth = None if recursive else len(rest) - 1
    seen: set[tuple[int, int]] = set()
    try:
        st = os.stat(base)
    except OSError:
        return
    seen.add((st.st_dev, st.st_ino))
    prefix = "" if base == "." else base.rstrip("/") + "/"
    for folder, dirs, files in os.walk(base, followlinks=True):
        rel_folder = os.path.relpath(folder, base)
        depth = 0 if rel_folder == "." else rel_folder.count(os.sep) + 1
        budget.look(len(dirs) + len(files))
        keep = []
        for d in sorted(dirs):
            if d.startswith(".") and not hidden_ok:
                continue
            if max_depth is not None and depth >= max_depth:
                continue
            try:
                dst = os.stat(os.path.join(folder, d))
            except OSError:
                continue
            if (dst.st_dev, dst.st_ino) in seen:  # a link back, or a second link to one folder
                continue
            seen.add((dst.st_dev, dst.st_ino))
            keep.append(d)
        dirs[:] = keep
        for f in sorted(files):
            rel = f if rel_folder == "." else f"{rel_folder}/{f}".replace(os.sep, "/")
            if regex.fullmatch(rel):
                path = prefix + rel
                if os.path.isfile(path):
                    budget.take()
                    yield path


def walk_folder(folder: str, skip_dirs: Collection[str] = (), budget: _Budget | None = None) -> list[str]:
    """Every ``*.toml`` below ``folder`` (hidden files and folders and ``skip_dirs`` left out; links to
    folders not followed), sorted."""
    budget = budget or _Budget(folder)
    found: list[str] = []
    for root, dirs, files in os.walk(folder):
        budget.look(len(dirs) + len(files))
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in skip_dirs)
        for f in files:
            if f.endswith(".toml") and not f.startswith("."):
                budget.take()
                found.append(os.path.join(root, f))
    return sorted(found)


def expand(paths: Sequence[str | os.PathLike[str]], skip_dirs: Collection[str] = (), missing_ok: bool = True,
           glob_suffix: str | None = None) -> list[str]:
    """Files to check: folders are walked for ``*.toml``, globs are expanded, files are taken as given.

    ``missing_ok``: a file that does not exist is kept (verify reports it as MALFORMED) rather than
    refused (exit 2). ``glob_suffix``: keep only glob matches ending with it (decide: ``.toml``).
    Each file once, in order.
    """
    budget = _Budget(", ".join(map(str, paths)) or "no path")
    out: list[str] = []
    for raw in paths:
        p = os.fspath(raw)
        if os.path.isdir(p):
            out.extend(walk_folder(p, skip_dirs, budget))
        elif has_magic(p) and not os.path.lexists(p):
            matches = sorted(m for m in glob_files(p, budget) if glob_suffix is None or m.endswith(glob_suffix))
            if not matches:
                raise UsageError(f"{p}: the pattern matches no file", "check the glob, or quote it for the shell")
            out.extend(matches)
        elif missing_ok or os.path.lexists(p):
            out.append(p)
        else:
            raise UsageError(f"{p}: no such file or folder", "name a results folder or manifest files")
    return list(dict.fromkeys(out))

"""What `verify DIR` checks about a results repository beyond each manifest's signature.

`capture pin` names every file by its content (``<content id>.toml``: the first 12 hex digits of
sha256 over its bytes) and lists it in ``index.json``. So in a results repository:

- a manifest whose file name is not its content id was changed after it was pinned, or copied in
  without `capture pin` (INVALID, exit 4);
- a manifest that ``index.json`` does not list was not pinned (INVALID, exit 4);
- a row of ``index.json`` whose file is absent names a run that is not there (MALFORMED, exit 3;
  checked when the repository's root itself is verified).

Only manifests whose signature is valid and trusted are checked here: the others already fail.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

from capture.errors import EXIT_MALFORMED, EXIT_SIGNATURE, ManifestError
from capture.results.index import INDEX_JSON, load_rows
from capture.verify.single import Verdict


def _rel(path: str, root: Path) -> str:
    return Path(os.path.relpath(os.path.abspath(path), root)).as_posix()


def check(entries: Sequence[Verdict], content_ids: Sequence[str | None], roots: Sequence[Path | None],
          whole_roots: set[Path]) -> list[Verdict]:
    """``entries`` with the pinned-file checks applied (same order), then one row per index.json
    problem. ``roots[i]`` is the results repository holding ``entries[i]`` (None: not in one);
    ``whole_roots``: repositories verified as a whole, whose index must list nothing absent."""
    indexes: dict[Path, set[str] | ManifestError | None] = {}
    for present in {r for r in roots if r is not None}:
        try:
            rows = load_rows(present)
            indexes[present] = None if rows is None else {r["path"] for r in rows}
        except ManifestError as exc:
            indexes[present] = exc
    out: list[Verdict] = []
    seen: dict[Path, set[str]] = {}
    for entry, cid, root in zip(entries, content_ids, roots):
        if root is None:
            out.append(entry)
            continue
        rel = _rel(entry.path, root)
        seen.setdefault(root, set()).add(rel)
        if entry.status not in ("OK", "DRIFT") or cid is None:
            out.append(entry)
            continue
        listed = indexes[root]
        if Path(entry.path).stem != cid:
            out.append(dataclasses.replace(
                entry, status="INVALID", exit_code=EXIT_SIGNATURE,
                reason=f"pinned files are named by their content id, and this one's is {cid}: changed after it "
                       f"was pinned, or copied in without `capture pin`",
                hint=f"restore it from git (`git checkout -- {rel}`), or pin the manifest with `capture pin FILE --repo {root}`"))
        elif not isinstance(listed, ManifestError) and (listed is None or rel not in listed):
            out.append(dataclasses.replace(
                entry, status="INVALID", exit_code=EXIT_SIGNATURE,
                reason=f"not listed in {INDEX_JSON}: not pinned by `capture pin`",
                hint=f"pin it with `capture pin FILE --repo {root}` (which lists it) instead of copying it in"))
        else:
            out.append(entry)
    for root, listed in sorted(indexes.items(), key=lambda kv: str(kv[0])):
        index_path = str(root / INDEX_JSON)
        if isinstance(listed, ManifestError):
            out.append(Verdict(index_path, "MALFORMED", EXIT_MALFORMED,
                               listed.message.removeprefix(f"{index_path}: "), listed.hint))
            continue
        if root not in whole_roots or not listed:
            continue
        for rel in sorted(listed - seen.get(root, set())):
            if not os.path.lexists(root / rel):
                out.append(Verdict(str(root / rel), "MALFORMED", EXIT_MALFORMED,
                                   f"listed in {INDEX_JSON} but absent",
                                   "restore it from git, or remove its row with the commit that removed it"))
    return out

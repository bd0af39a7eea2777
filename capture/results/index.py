"""The index of a results repository: ``index.json`` for programs, ``index.md`` for people.

One row per pinned manifest (see :class:`capture.results.summary.RunSummary`), sorted by
creation time then path, so that the file only grows at the end for runs pinned in order and
a git diff of the index shows exactly the runs a commit added.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from capture import _json
from capture._safe_read import MIB, read_if_present
from capture.errors import ManifestError
from capture.costs import DEFAULT_TARGET_TOKENS, money_str
from capture.fmt import bytes_str, number_str, percent_str, seconds_str
from capture.manifest import table_at

INDEX_JSON = "index.json"
INDEX_MD = "index.md"
INDEX_SCHEMA_VERSION = 1


INDEX_MAX_BYTES = 64 * MIB
"""index.json larger than this is refused (about 100,000 runs)."""


def load_rows(root: Path) -> list[dict[str, Any]] | None:
    """Rows of ``root/index.json``, ``None`` when there is none: the one reader of the index, for
    `pin` (which adds rows) and `verify DIR` (which checks that each pinned file is listed). The
    file is read as hostile input (a FIFO, a link to /dev/zero, 5,000-digit numbers): any problem is
    one :class:`ManifestError` (exit 3)."""
    path = root / INDEX_JSON
    hint = f"restore it from git (`git checkout -- {INDEX_JSON}`) and pin again"
    raw = read_if_present(path, INDEX_MAX_BYTES, ManifestError, "index", hint)
    if raw is None:
        return None
    try:
        doc = _json.loads(raw)
    except _json.JsonError as exc:  # bad JSON, an integer of 5,000 digits, nesting too deep
        raise ManifestError(f"{path}: cannot read the index (not JSON: {exc.reason})", hint) from None
    runs = doc.get("runs") if isinstance(doc, dict) else None
    if not isinstance(runs, list) or not all(isinstance(r, dict) and isinstance(r.get("path"), str) for r in runs):
        raise ManifestError(f"{path}: not a capture index (expected {{\"runs\": [{{\"path\": ...}}, ...]}})", hint)
    version = doc.get("schema_version", 1)
    if type(version) is not int:
        raise ManifestError(f"{path}: not a capture index (schema_version {str(version)[:40]!r} is not an integer)", hint)
    if version > INDEX_SCHEMA_VERSION:
        raise ManifestError(f"{path}: index schema_version {version} is newer than this capture",
                            "upgrade capture to pin into this repository")
    return runs


def merge_rows(existing: Iterable[Mapping[str, Any]], new: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Existing rows plus new ones (a new row replaces one with the same path), in index order."""
    by_path = {r["path"]: dict(r) for r in existing}
    for r in new:
        by_path[r["path"]] = dict(r)
    return sorted(by_path.values(), key=lambda r: (str(r.get("created_utc", "")), r["path"]))


def render_json(rows: list[dict[str, Any]]) -> bytes:
    doc = {"schema_version": INDEX_SCHEMA_VERSION, "runs": rows}
    return (json.dumps(doc, indent=1, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


_MD_COLUMNS = (
    ("created (UTC)", lambda r: r.get("created_utc", "-")),
    ("kind", lambda r: r.get("kind", "-")),
    ("accelerator", lambda r: r.get("accelerator", "-")),
    ("driver", lambda r: r.get("driver_version", "-")),
    ("CUDA/ROCm", lambda r: f"{r['runtime']} {r.get('runtime_version', '')}".strip() if r.get("runtime") not in (None, "cpu") else "-"),
    ("torch", lambda r: r.get("torch_version", "-")),
    ("model@revision", lambda r: ", ".join(r.get("models") or ()) or "-"),
    ("method", lambda r: r.get("method", "-")),
    ("scaling", lambda r: r.get("scaling", "-")),
    ("tokens/s", lambda r: number_str(r.get("tokens_per_s"))),
    ("step median", lambda r: seconds_str(r.get("step_time_median_s"))),
    ("step CV", lambda r: percent_str(r.get("step_time_cv"), 2)),
    ("peak memory", lambda r: bytes_str(r.get("peak_memory_bytes"))),
    ("MFU", lambda r: percent_str(r.get("mfu"))),
    ("recovery", lambda r: r.get("recovery_verdict", "-")),
    ("trial cost", lambda r: _cost(r, "trial_cost")),
    ("steady cost / M tokens", lambda r: _cost(r, "steady_cost_per_million_tokens")),
    (f"projected to {DEFAULT_TARGET_TOKENS:,} tokens", lambda r: _projected(r)),
    ("command (exec)", lambda r: _command(r)),
    ("signer", lambda r: r.get("signer", "-")),
    ("manifest", lambda r: f"[{r['content_id']}]({r['path']})"),
)


def _cost(r: Mapping[str, Any], key: str) -> str:
    """One of the three cost figures (docs/decide.md) with its currency; a row pinned before they
    existed shows its trial cost per million trained tokens under that name."""
    c = table_at(r, "costs")
    if c.get(key) is not None:
        return money_str(c[key], c.get("currency"))
    if key == "trial_cost" and r.get("cost_per_million_tokens") is not None:
        return f"{money_str(r['cost_per_million_tokens'])} per million trained tokens"
    return "-"


def _projected(r: Mapping[str, Any]) -> str:
    c = table_at(r, "costs")
    if c.get("projected_time_s") is None:
        return "-"
    cost = f"{money_str(c['projected_cost'], c.get('currency'))}, " if c.get("projected_cost") is not None else ""
    return f"{cost}{seconds_str(c['projected_time_s'])}"


def _command(r: Mapping[str, Any]) -> str:
    e = r.get("exec") if isinstance(r.get("exec"), Mapping) else None
    if e is None:
        return "-"
    code = e.get("exit_code")
    status = ("FAILED" if e.get("failed") else "ok") + (f" (signal {e['signal']})" if e.get("signal") else
                                                        f" (exit {code})")
    wall = f" in {seconds_str(e['wall_time_s'])}" if isinstance(e.get("wall_time_s"), (int, float)) else ""
    outs = e.get("outputs") or []
    return f"{e.get('command', '?')}: {status}{wall}, {len(outs)} output(s)"


def _cell(value: Any) -> str:
    # Values come from manifests other people signed: keep them from breaking the table.
    return str(value).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def render_markdown(rows: list[dict[str, Any]]) -> bytes:
    lines = [
        "# Pinned runs",
        "",
        "Written by `capture pin`; do not edit by hand (index.json holds the same rows for programs).",
        "Verify every manifest here with `capture verify .`.",
        "",
        "| " + " | ".join(name for name, _ in _MD_COLUMNS) + " |",
        "|" + "|".join(" --- " for _ in _MD_COLUMNS) + "|",
    ]
    for r in rows:
        lines.append("| " + " | ".join(_cell(get(r)) for _, get in _MD_COLUMNS) + " |")
    if not rows:
        lines.append("")
        lines.append("No runs pinned yet.")
    return ("\n".join(lines) + "\n").encode("utf-8")

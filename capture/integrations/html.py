"""The one place the Recorder reaches the trial report's HTML writer.

The trial report renders the ``[trial]`` tables; the Recorder adds a per-rank table for
distributed runs (the report has no section for ``trial.distributed`` yet). When the report's
entry points move, re-point :func:`write_report_html` and nothing else.
"""

from __future__ import annotations

import hashlib
import html
from pathlib import Path
from typing import Any, Mapping

from capture import fmt

_RANK_COLUMNS = (("rank", "rank"), ("hostname", "host"), ("step_time_median_s", "step median"),
                 ("step_time_mean_s", "step mean"), ("data_wait_total_s", "data wait"),
                 ("peak_allocated_bytes", "peak allocated"), ("device_used_bytes", "device used"),
                 ("stack_sha256", "stack"))


def _cell(key: str, value: Any) -> str:
    if value is None:
        return fmt.MISSING
    if key.endswith("_s") and isinstance(value, (int, float)):
        return fmt.seconds_str(value)
    if key.endswith("_bytes") and isinstance(value, (int, float)):
        return fmt.bytes_str(value)
    if key == "stack_sha256":
        return str(value)[:12]
    return str(value)


def ranks_html(manifest: Mapping[str, Any]) -> str:
    """A ``Ranks`` section for ``trial.distributed`` (empty when the run had one process)."""
    dist = (manifest.get("trial") or {}).get("distributed")
    if not isinstance(dist, Mapping) or not dist.get("ranks"):
        return ""
    e = html.escape
    out = ["<h2>Ranks</h2>"]
    if dist.get("stack_differences"):
        out.append('<p class="status bad">stacks differ: ' + e("; ".join(dist["stack_differences"])) + "</p>")
    else:
        out.append('<p class="status ok">' + e(f"{dist.get('world_size')} ranks on {dist.get('node_count')} node(s), "
                                             "identical stacks") + "</p>")
    out.append("<table><tr>" + "".join(f"<th>{e(h)}</th>" for _, h in _RANK_COLUMNS) + "</tr>")
    for r in dist["ranks"]:
        out.append("<tr>" + "".join(f"<td>{e(_cell(k, r.get(k)))}</td>" for k, _ in _RANK_COLUMNS) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def write_report_html(manifest: Mapping[str, Any], path: Path) -> Path:
    """The trial report's HTML page for ``manifest``, with the ranks section, written atomically."""
    from capture._atomic import atomic_write
    from capture.trial import report

    page = report.render_html(manifest)
    extra = ranks_html(manifest)
    if extra:
        page = page.replace("\n</body></html>", "\n" + extra + "\n</body></html>", 1)
    atomic_write(Path(path), page.encode("utf-8"))
    return Path(path)


def report_table(manifest: Mapping[str, Any], html_path: Path) -> dict[str, Any]:
    """Write the report beside the manifest; the ``[trial.report]`` table that names it."""
    try:
        write_report_html(manifest, html_path)
    except OSError as exc:
        return {"skipped": f"HTML report not written ({exc})"}
    return {"html": html_path.name, "html_sha256": hashlib.sha256(html_path.read_bytes()).hexdigest()}

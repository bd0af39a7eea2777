"""`capture show FILE`: one manifest, readable, for people who would rather not read TOML.

The trial part is the trial report's own terminal report (:func:`capture.trial.report.render_terminal`):
the verdict panel, then every section in run order (preflight, run, memory, steps, validation,
checkpoint, fit, recovery, scaling, cost), wrapped to the terminal; where the report cannot be
imported, a short table of the key figures.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from capture._escape import printable, printable_lines
from capture.fmt import bytes_str, number_str, percent_str, seconds_str
from capture.manifest import dig
from capture.results.summary import RunSummary, summarize
from capture.verify.open import SignatureStatus, open_manifest

log = logging.getLogger(__name__)
_RUNTIME_NAMES = {"cuda": "CUDA", "rocm": "ROCm"}


@dataclass(frozen=True)
class Shown:
    path: str
    summary: RunSummary
    signature: SignatureStatus
    data: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "signature": self.signature.to_json(), "summary": self.summary.to_json()}


def load(path: str, allowed_signers: str | os.PathLike[str] | None = None) -> Shown:
    """Open through the door without requiring trust; the header says the signature state first."""
    opened = open_manifest(path, allowed_signers, require_trusted=False)
    status = opened.signature
    return Shown(path, summarize(opened.data, opened.raw, path, status.principal, status.fingerprint), status,
                 opened.data)


def _kv(rows: list[tuple[str, str | None]], width: int | None = None) -> list[str]:
    """``key  value`` lines, values wrapped at spaces to the terminal's width under a hanging indent."""
    from capture.termtable import wrap
    from capture.trial.report.terminal import terminal_width

    rows = [(k, v) for k, v in rows if v]
    key_w = max(len(k) for k, _ in rows)
    total = width or terminal_width()
    out: list[str] = []
    for k, v in rows:
        out += wrap(printable(v), total, f"{k:<{key_w}}  ", " " * (key_w + 2))
    return out


def _join(*parts: Any, sep: str = ", ") -> str | None:
    text = sep.join(str(p) for p in parts if p not in (None, "", ()))
    return text or None


def render(shown: Shown) -> str:
    s, d = shown.summary, shown.data
    acc = s.accelerator
    if s.memory_per_device_bytes:
        acc += f" ({bytes_str(s.memory_per_device_bytes)} each)"
    code = None
    if dig(d, "code.commit"):
        code = _join(f"commit {s.code_commit}", dig(d, "code.branch") and f"branch {dig(d, 'code.branch')}",
                     "dirty work tree" if s.code_dirty else None, dig(d, "code.remote_url"))
    elif isinstance(dig(d, "code.skipped"), str):
        code = f"not recorded ({dig(d, 'code.skipped')})"
    lines = _kv([
        ("manifest", shown.path),
        ("kind", _join(s.kind, f"created {s.created_utc}", f"content id {s.content_id}")),
        ("signature", shown.signature.label),
        ("accelerator", acc),
        ("driver", _join(s.driver_version, dig(d, "nvidia.cuda_driver_version")
                         and f"CUDA driver API {dig(d, 'nvidia.cuda_driver_version')}")),
        ("runtime", _join(_RUNTIME_NAMES.get(s.runtime or "", s.runtime), s.runtime_version, sep=" ")),
        ("framework", _join(s.torch_version and f"torch {s.torch_version}", s.cudnn_version and f"cuDNN {s.cudnn_version}",
                            s.nccl_version and f"NCCL/RCCL {s.nccl_version}")),
        ("python", _join(s.python_version, s.package_count is not None and f"{s.package_count} packages")),
        ("host", _join(dig(d, "host.os"), dig(d, "host.kernel"), dig(d, "host.cpu_model"))),
        ("image", s.image),
        ("code", code),
        ("models", ", ".join(s.models) or None),
        ("datasets", ", ".join(s.datasets) or None),
        ("not probed", ", ".join(sorted(k for k, v in d.items() if isinstance(v, dict) and set(v) == {"skipped"}))
         or None),
        *_exec_rows(s),
    ])
    if "trial" in d:
        lines.append("")
        lines.append(_trial_report(d, s, shown.signature.label))
    return "\n".join(lines)


def _trial_report(data: dict[str, Any], s: RunSummary, signature: str | None = None) -> str:
    from capture.trial.report import render_terminal

    try:
        return printable_lines(render_terminal(data, signature=signature).rstrip())
    except Exception as exc:  # a manifest from another version must still be viewable
        log.warning("the trial report could not render this manifest (%s); showing the key figures only",
                    type(exc).__name__)
        log.debug("trial report failure", exc_info=True)
    f = s.figures
    return "trial\n" + "\n".join("  " + line for line in _kv([
        ("tokens/s", number_str(f.tokens_per_s)),
        ("step time median", seconds_str(f.step_time_median_s)),
        ("step time p90", seconds_str(f.step_time_p90_s)),
        ("peak memory", _join(bytes_str(f.peak_memory_bytes), f.peak_memory_source and f"({f.peak_memory_source})", sep=" ")),
        ("MFU", percent_str(f.mfu)),
        ("checkpoint write", seconds_str(f.checkpoint_write_s)),
        ("recovery", f.recovery_verdict or "-"),
        *(s.costs.texts() if s.costs is not None else []),
    ]))


def _exec_rows(s: RunSummary) -> list[tuple[str, str | None]]:
    """What a `capture exec` manifest's command did; a failed command says FAILED first."""
    e = s.exec
    if e is None:
        return []
    return [("command", e.command), ("exit status", e.status),
            ("wall time", seconds_str(e.wall_time_s) if e.wall_time_s is not None else None),
            ("outputs", e.outputs_text())]

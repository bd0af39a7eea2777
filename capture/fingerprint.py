"""Run every probe and assemble the fingerprint part of a manifest."""

from __future__ import annotations

import functools
import importlib
import logging
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from capture.errors import ArtifactMismatch, CaptureError
from capture.manifest import new_manifest, section_text, to_toml_value
from capture.probes import ProbeOptions, Skipped, as_table
from capture.redact import redact_text, redact_value

log = logging.getLogger(__name__)

# (manifest section, module under capture.probes, function). Order = manifest order.
PROBES: tuple[tuple[str, str, str], ...] = (
    ("nvidia", "nvidia", "probe"),
    ("amd", "amd", "probe"),
    ("topology", "topology", "probe"),
    ("framework", "framework", "probe"),
    ("python", "packages", "probe"),
    ("host", "host", "probe"),
    ("toolchain", "toolchain", "probe"),
    ("container", "container", "probe"),
    ("environment", "environment", "probe"),
    ("code", "code", "probe"),
    ("models", "artifacts", "probe_models"),
    ("datasets", "artifacts", "probe_datasets"),
)


def _run_probe(section: str, module: str, func: str, options: ProbeOptions, raise_user_errors: bool) -> Any:
    try:
        fn: Callable[[ProbeOptions], Any] = getattr(importlib.import_module(f"capture.probes.{module}"), func)
    except (ImportError, AttributeError) as exc:
        return Skipped(f"probe unavailable: {exc}")
    try:
        return fn(options)
    except CaptureError as exc:
        exc.message = redact_text(exc.message)
        exc.hint = redact_text(exc.hint) if exc.hint else exc.hint
        if raise_user_errors:  # e.g. --model names a repo that is not in the cache: the user must know
            raise
        return Skipped(exc.message)
    except Exception as exc:  # a probe bug must never crash the fingerprint
        log.debug("probe %s failed: %s", section, redact_text(f"{type(exc).__name__}: {exc}"))
        return Skipped(redact_text(f"probe failed: {type(exc).__name__}: {exc}"))


def _table(result: Any) -> Any:
    """The TOML-ready table: what a reader of the written manifest would get back, with every
    string passed through :func:`capture.redact.redact_value` (a last net behind each probe's own
    structural redaction: a token in a value no probe expected still never reaches the manifest)."""
    if isinstance(result, list):
        return [redact_value(to_toml_value(as_table(r))) for r in result]
    return redact_value(to_toml_value(as_table(result)))


def accelerator_summary(sections: dict[str, Any]) -> dict[str, Any]:
    """The few facts `verify` compares first: which accelerator, how many, which driver/runtime."""
    fw = sections.get("framework") or {}
    for vendor, name_key, mem_key, runtime, rt_key in (
        ("nvidia", "name", "memory_total_bytes", "cuda", "cuda_version"),
        ("amd", "market_name", "vram_total_bytes", "rocm", "hip_version"),
    ):
        sec = sections.get(vendor) or {}
        devices = [d for d in sec.get("devices", []) if d.get("visible", True)]
        if not devices:
            continue
        names = Counter(str(d.get(name_key, "unknown")) for d in devices)
        mems = sorted({d[mem_key] for d in devices if isinstance(d.get(mem_key), int)})
        out: dict[str, Any] = {
            "vendor": vendor,
            "model": " + ".join(names) if len(names) > 1 else next(iter(names)),
            "count": len(devices),
            "driver_version": sec.get("driver_version"),
            "runtime": runtime,
            "runtime_version": fw.get(rt_key),
        }
        if len(mems) == 1:
            out["memory_per_device_bytes"] = mems[0]
        return out
    return {"vendor": "none", "model": "cpu", "count": 0, "runtime": "cpu"}


START_FIRST = ("nvidia", "topology", "code", "python", "toolchain", "framework", "amd")
"""Started first, longest first (H200 figures): NVML's start-up, git, reading every installed
distribution, the compilers' own start-up."""


@dataclass
class Timings:
    """What ``--timings`` prints: each probe's own time, and how they ran side by side."""

    probes: dict[str, float] = field(default_factory=dict)
    """Section -> seconds the probe itself took (they overlap)."""
    wall_s: float = 0.0
    """From the first probe's start to the last one's result."""
    mode: str = ""
    """``fork`` (one child process a probe) or ``threads``."""
    why: str = ""
    """Why that mode (:func:`capture.probes._fanout.choose`)."""


def _start_order(entry: tuple[str, str, str]) -> int:
    return START_FIRST.index(entry[0]) if entry[0] in START_FIRST else len(START_FIRST)


def format_timings(timings: Timings, total_s: float | None = None) -> str:
    """The ``--timings`` table: each probe's own time, their sum, and the wall time of all of them.

    Probes run concurrently (one forked process each, or one thread each: see
    :mod:`capture.probes._fanout`), so their own times overlap and add up to more than the wall
    time; to see where a serial run would spend its time use
    ``benchmarks/fingerprint_vs_collect_env.py --profile``.
    """
    from capture.fmt import seconds_str

    how = (f"one forked process each, {len(timings.probes)} side by side" if timings.mode == "fork"
           else "one thread each")
    lines = [f"probes run concurrently ({how}; {timings.why}): their own times overlap; wall time is what you wait",
             f"{'probe':14s} {'own time':>10s}"]
    lines += [f"{name:14s} {seconds_str(secs):>10s}" for name, secs in timings.probes.items()]
    lines.append(f"{'sum of probes':14s} {seconds_str(sum(timings.probes.values())):>10s}")
    lines.append(f"{'wall, probes':14s} {seconds_str(timings.wall_s):>10s}")
    if total_s is not None:
        lines.append(f"{'wall, total':14s} {seconds_str(total_s):>10s}   (from the start of the command to the manifest's bytes)")
    return "\n".join(lines) + "\n"


ARTIFACT_SECTIONS = ("models", "datasets")


def _section_table(section: str, result: Any) -> Any:
    """The section's TOML-ready table; a models/datasets probe that failed as a whole (a
    :class:`Skipped`) becomes a one-entry array saying so."""
    if section in ARTIFACT_SECTIONS and not isinstance(result, list):
        result = [result]
    return _table(result)


def _job(entry: tuple[str, str, str], options: ProbeOptions, raise_user_errors: bool,
         render: bool) -> tuple[Any, str | None, float]:
    """One probe, wherever the fan-out runs it: its table (plain values: it may cross a pipe), with
    ``render`` that table as TOML text (:func:`capture.manifest.section_text`; None for an array
    of tables, or without ``render``) and its own time. Raises what ``collect`` must raise: a user
    error, an artifact mismatch."""
    t0 = time.perf_counter()
    if entry[0] in ARTIFACT_SECTIONS and not getattr(options, entry[0]):
        return None, None, time.perf_counter() - t0  # none asked for: the section is left out, nothing imported
    result = _run_probe(*entry, options, raise_user_errors)
    if options.verify_artifacts and raise_user_errors and entry[0] in ARTIFACT_SECTIONS and isinstance(result, list):
        # ``--verify-artifacts``: a blob that does not match its id is an error (exit 6), not a quiet field.
        from capture.probes.artifacts import ArtifactInfo, check_verified

        for info in result:
            if isinstance(info, ArtifactInfo):
                check_verified(info)
    table = _section_table(entry[0], result)
    text = section_text(entry[0], table) if render and isinstance(table, dict) else None
    return table, text, time.perf_counter() - t0


def _first_error(outcomes: list[tuple[bool, Any]]) -> CaptureError | None:
    """The error ``collect`` raises: the first probe's own error in manifest order (a ``--model``
    not in the cache), else the first artifact mismatch. Anything else that failed (a probe's
    process that died) is not the user's to fix: its section says so instead."""
    errors = [value for ok, value in outcomes if not ok and isinstance(value, CaptureError)]
    own = [e for e in errors if not isinstance(e, ArtifactMismatch)]
    return own[0] if own else errors[0] if errors else None


def collect(options: ProbeOptions | None = None, kind: str = "fingerprint",
            timings: Timings | None = None, raise_user_errors: bool = True,
            fanout: str | None = None, rendered: dict[str, str] | None = None) -> dict[str, Any]:
    """Probe this machine and return a manifest dict (unsigned, not yet written).

    ``raise_user_errors``: a :class:`CaptureError` from a probe (a ``--model`` that is not in the
    cache) propagates, and so does :class:`ArtifactMismatch` (exit 6) when ``verify_artifacts``
    finds a blob that does not match its id; `verify` turns it off so that a missing or corrupt
    artifact is reported as drift.

    ``rendered``: filled with each section's TOML text, made where its probe ran; pass it to
    :func:`capture.manifest.dumps` with this manifest, unchanged, to write it without rendering
    those sections again.

    ``fanout``: ``auto``, ``fork`` or ``threads`` (:func:`capture.probes._fanout.choose`);
    None reads ``CAPTURE_FANOUT``, else ``auto``: forked processes on a machine with cores to
    spare, threads otherwise. Both give the same manifest.
    """
    options = options or ProbeOptions()
    from capture.probes import _fanout, _fs

    _fs.forget()  # each fingerprint lists folders afresh, once
    _fs.prime(sys.path)  # before the fan-out: the packages and framework probes both read these
    manifest = new_manifest(kind)
    manifest["probe"] = {
        "deep": options.deep,
        "verify_artifacts": options.verify_artifacts,
        "models": list(options.models),
        "datasets": list(options.datasets),
        "code": str(options.code) if options.code is not None else ".",
    }
    # Those that start subprocesses or load a driver library go first, so that their children
    # run while the other probes import and read; results are placed in PROBES order.
    order = sorted(PROBES, key=_start_order)
    t0 = time.perf_counter()
    render = rendered is not None  # only a caller that writes the manifest as collected wants the text
    ran, how, why = _fanout.run([functools.partial(_job, entry, options, raise_user_errors, render) for entry in order],
                                fanout)
    by_entry = dict(zip(order, ran))
    outcomes = [by_entry[entry] for entry in PROBES]
    if timings is not None:
        timings.wall_s, timings.mode, timings.why = time.perf_counter() - t0, how, why
    error = _first_error(outcomes)
    if error is not None:
        raise error
    sections: dict[str, Any] = {}
    for (section, _, _), (ok, value) in zip(PROBES, outcomes):
        if not ok:  # only unexpected failures are left (a probe's process died): say so in its table
            value = (_table(Skipped(redact_text(f"probe failed: {value}"))), None, 0.0)
        table, text, secs = value
        if timings is not None:
            timings.probes[section] = secs
        if table is not None:
            sections[section] = table
        if rendered is not None and text is not None:
            rendered[section] = text
    manifest["accelerator"] = accelerator_summary(sections)
    manifest.update(sections)
    return manifest

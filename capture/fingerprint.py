"""Run every probe and assemble the fingerprint part of a manifest."""

from __future__ import annotations

import importlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from collections import Counter
from typing import Any, Callable

from capture.errors import CaptureError
from capture.manifest import new_manifest, to_toml_value
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


START_FIRST = ("code", "toolchain", "framework", "nvidia", "amd")
"""Probes that start subprocesses or load a driver library: submitted first."""
WALL = "(wall)"
"""The key of ``collect``'s own wall time in its ``timings``."""


def _start_order(entry: tuple[str, str, str]) -> int:
    return START_FIRST.index(entry[0]) if entry[0] in START_FIRST else len(START_FIRST)


def format_timings(timings: dict[str, float], total_s: float | None = None) -> str:
    """The ``--timings`` table: each probe's own time, their sum, and the wall time of all of them.

    Probes run concurrently (one thread each), so their own times overlap and add up to more than
    the wall time; to see where a serial run would spend its time use
    ``benchmarks/fingerprint_vs_collect_env.py --profile``.
    """
    from capture.fmt import seconds_str

    own = {k: v for k, v in timings.items() if k != WALL}
    lines = ["probes run concurrently (one thread each): their own times overlap; wall time is what you wait",
             f"{'probe':14s} {'own time':>10s}"]
    lines += [f"{name:14s} {seconds_str(secs):>10s}" for name, secs in own.items()]
    lines.append(f"{'sum of probes':14s} {seconds_str(sum(own.values())):>10s}")
    if WALL in timings:
        lines.append(f"{'wall, probes':14s} {seconds_str(timings[WALL]):>10s}")
    if total_s is not None:
        lines.append(f"{'wall, total':14s} {seconds_str(total_s):>10s}   (from the start of the command to the manifest's bytes)")
    return "\n".join(lines) + "\n"


def _check_artifacts(results: list[tuple[Any, float]]) -> None:
    """``--verify-artifacts``: a blob that does not match its id is an error (exit 6), not a quiet field."""
    from capture.probes.artifacts import ArtifactInfo, check_verified

    for (section, _, _), (result, _secs) in zip(PROBES, results):
        if section in ("models", "datasets") and isinstance(result, list):
            for info in result:
                if isinstance(info, ArtifactInfo):
                    check_verified(info)


def collect(options: ProbeOptions | None = None, kind: str = "fingerprint",
            timings: dict[str, float] | None = None, raise_user_errors: bool = True) -> dict[str, Any]:
    """Probe this machine and return a manifest dict (unsigned, not yet written).

    ``raise_user_errors``: a :class:`CaptureError` from a probe (a ``--model`` that is not in the
    cache) propagates, and so does :class:`ArtifactMismatch` (exit 6) when ``verify_artifacts``
    finds a blob that does not match its id; `verify` turns it off so that a missing or corrupt
    artifact is reported as drift.
    """
    options = options or ProbeOptions()
    from capture.probes import _fs

    _fs.forget()  # each fingerprint lists folders afresh, once
    manifest = new_manifest(kind)
    manifest["probe"] = {
        "deep": options.deep,
        "verify_artifacts": options.verify_artifacts,
        "models": list(options.models),
        "datasets": list(options.datasets),
        "code": str(options.code) if options.code is not None else ".",
    }

    def timed(entry: tuple[str, str, str]) -> tuple[Any, float]:
        t0 = time.perf_counter()
        result = _run_probe(*entry, options, raise_user_errors)
        return result, time.perf_counter() - t0

    # Probes wait on the kernel, NVML, git and subprocesses far more than on Python, so they
    # run side by side; those that start subprocesses are started first, so that their children
    # run while the other probes import and read. Results are placed in PROBES order.
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(PROBES)) as pool:
        futures = {entry: pool.submit(timed, entry) for entry in sorted(PROBES, key=_start_order)}
        results = [futures[entry].result() for entry in PROBES]
    if timings is not None:
        timings[WALL] = time.perf_counter() - t0
    if options.verify_artifacts and raise_user_errors:
        _check_artifacts(results)
    sections: dict[str, Any] = {}
    for (section, _, _), (result, secs) in zip(PROBES, results):
        if timings is not None:
            timings[section] = secs
        if section in ("models", "datasets") and not isinstance(result, list):
            if isinstance(result, Skipped) and not getattr(options, section):
                continue
            result = [result]
        if section in ("models", "datasets") and not result:
            continue
        sections[section] = _table(result)
    manifest["accelerator"] = accelerator_summary(sections)
    manifest.update(sections)
    return manifest

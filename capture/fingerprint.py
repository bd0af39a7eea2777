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
    # run side by side; results are placed in PROBES order whatever order they finish in.
    with ThreadPoolExecutor(max_workers=len(PROBES)) as pool:
        results = list(pool.map(timed, PROBES))
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

"""The manifest schema: what types the fields capture writes (and reads back) must have.

:func:`validate` runs once, at the door (:func:`capture.verify.open.open_manifest`, and on the body
``capture sign`` is asked to sign), so that nothing downstream (show, compare, pin, export, the
verify comparison) ever meets a count that is a string, a ``nan``, a TOML date or a number where
a list belongs. A wrong type is exit 3, naming the field.

Rules, in order:

1. Structure: at most :data:`MAX_DEPTH` tables/arrays deep; no top-level ``signature`` key (a
   ``[signature]`` table in any other spelling than the exact trailer line is a disguised trailer);
   keys are plain text (no control characters).
2. Values: strings, integers, finite floats, booleans, arrays and tables only. capture writes
   times as RFC 3339 strings and non-finite floats as strings, so a TOML date/time or a
   ``nan``/``inf`` float is never something it wrote.
3. Fields: :data:`FIELDS` maps dotted paths (``*`` = any one key or array position) to the type
   the field must have when it is present. Fields not listed are free (new probes add fields).
4. Units in names: a scalar whose key ends in ``_bytes``, ``_s``, ``_count`` or ``_w`` is a number.
"""

from __future__ import annotations

import datetime as _dt
import math
import re
from collections.abc import Mapping
from typing import Any

from capture.errors import ManifestError

MAX_DEPTH = 24
"""Deepest nesting of tables and arrays accepted; capture's own manifests reach 8."""

STR, INT, NUM, BOOL, TABLE, ARRAY, TABLES, STRS = ("a string", "an integer", "a number", "a boolean",
                                                   "a table", "an array", "an array of tables",
                                                   "an array of strings")

_ARTIFACT = {
    "": TABLE, "spec": STR, "repo_id": STR, "revision": STR, "commit": STR, "content_hash": STR,
    "source": STR, "path": STR, "verified": BOOL, "skipped": STR, "files": TABLES,
    "files.*": TABLE, "files.*.path": STR, "files.*.blob_id": STR, "files.*.size_bytes": INT, "files.*.lfs": BOOL,
}

FIELDS: dict[str, str] = {
    "tool": TABLE, "tool.name": STR, "tool.version": STR,
    "probe": TABLE, "probe.models": STRS, "probe.datasets": STRS, "probe.code": STR, "probe.deep": BOOL,
    "probe.verify_artifacts": BOOL, "probe.hf_cache": STR,
    "accelerator": TABLE, "accelerator.vendor": STR, "accelerator.model": STR, "accelerator.count": INT,
    "accelerator.driver_version": STR, "accelerator.runtime": STR, "accelerator.runtime_version": STR,
    "accelerator.memory_per_device_bytes": INT,
    "nvidia": TABLE, "nvidia.driver_version": STR, "nvidia.cuda_driver_version": STR, "nvidia.devices": TABLES,
    "nvidia.devices.*.index": INT, "nvidia.devices.*.name": STR, "nvidia.devices.*.uuid": STR,
    "nvidia.devices.*.serial": STR, "nvidia.devices.*.pci_bus_id": STR, "nvidia.devices.*.compute_capability": STR,
    "nvidia.devices.*.vbios_version": STR, "nvidia.devices.*.ecc_enabled": BOOL, "nvidia.devices.*.mig_enabled": BOOL,
    "nvidia.devices.*.visible": BOOL, "nvidia.devices.*.cuda_index": INT, "nvidia.devices.*.mig_instances": TABLES,
    "nvidia.cuda_visible_devices": STR,
    "amd": TABLE, "amd.driver_version": STR, "amd.devices": TABLES, "amd.devices.*.index": INT,
    "amd.devices.*.market_name": STR, "amd.devices.*.gfx_target": STR, "amd.devices.*.uuid": STR,
    "amd.devices.*.bdf": STR, "amd.devices.*.vbios_version": STR, "amd.devices.*.visible": BOOL,
    "topology": TABLE, "topology.devices": TABLES, "topology.links": TABLES,
    "framework": TABLE, "framework.name": STR, "framework.version": STR, "framework.cuda_version": STR,
    "framework.hip_version": STR, "framework.git_version": STR, "framework.cudnn_version": STR,
    "framework.nccl_version": STR, "framework.miopen_version": STR, "framework.rccl_version": STR,
    "framework.loaded": TABLE,
    "python": TABLE, "python.version": STR, "python.implementation": STR, "python.packages": TABLE,
    "python.packages.*": TABLE, "python.packages.*.version": STR, "python.packages.*.source": STR,
    "python.packages.*.url": STR, "python.packages.*.commit": STR,
    "host": TABLE, "host.hostname": STR, "host.os": STR, "host.kernel": STR, "host.arch": STR,
    "host.cpu_model": STR, "host.cpu_count": INT, "host.memory_total_bytes": INT, "host.libc": STR,
    "toolchain": TABLE,
    "container": TABLE, "container.in_container": BOOL, "container.runtime": STR, "container.image_id": STR,
    "container.image_ref": STR, "container.labels": TABLE, "container.labels.*": STR,
    "environment": TABLE, "environment.variables": TABLE, "environment.variables.*": STR,
    "environment.redacted": STRS,
    "code": TABLE, "code.path": STR, "code.remote_url": STR, "code.commit": STR, "code.branch": STR,
    "code.detached": BOOL, "code.dirty": BOOL, "code.tree_hash": STR, "code.skipped": STR,
    "code.files": TABLE, "code.files.*": STR, "code.files_truncated": BOOL, "code.file_count": INT,
    "models": TABLES, "datasets": TABLES,
    **{f"{s}.*" + (f".{k}" if k else ""): t for s in ("models", "datasets") for k, t in _ARTIFACT.items()},
    "trial": TABLE, "trial.run": TABLE, "trial.run.model": TABLE, "trial.stats": TABLE, "trial.memory": TABLE,
    "trial.memory.measured": TABLE, "trial.checkpoint": TABLE, "trial.recovery": TABLE, "trial.cost": TABLE,
    "trial.recovery.verdict": STR, "trial.stats.mfu": NUM, "trial.cost.cost_per_million_trained_tokens": NUM,
    "trial.config_toml": STR, "trial.config_source": STR,
    "trial.run.model.architecture": STR, "trial.run.model.model_type": STR, "trial.run.model.source": STR,
    "trial.run.model.repo_id": STR, "trial.run.model.spec": STR, "trial.run.model.path": STR,
    "trial.run.model.commit": STR, "trial.run.model.revision": STR,
    "scaling": TABLE,
    "preflight": TABLE, "preflight.mode": STR, "preflight.verdict": STR, "preflight.duration_s": NUM,
    "preflight.device_kind": STR, "preflight.checks": TABLES, "preflight.checks.*.name": STR,
    "preflight.checks.*.device": INT, "preflight.checks.*.verdict": STR, "preflight.checks.*.reason": STR,
    "preflight.checks.*.unit": STR, "preflight.checks.*.expected": STR,
}
_UNIT_SUFFIXES = ("_bytes", "_s", "_count", "_w")


def _fail(source: str, where: str, message: str) -> ManifestError:
    return ManifestError(f"{source}: {where} {message}",
                         "the file was hand-edited or corrupted, or written by another tool; regenerate it")


def _type_name(v: Any) -> str:
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int):
        return "an integer"
    if isinstance(v, float):
        return f"the float {v}" if not math.isfinite(v) else "a float"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, Mapping):
        return "a table"
    if isinstance(v, list):
        return "an array"
    if isinstance(v, (_dt.datetime, _dt.date, _dt.time)):
        return f"the TOML date/time {v.isoformat()}"
    return type(v).__name__


def _is(v: Any, want: str) -> bool:
    if want == STR:
        return isinstance(v, str)
    if want == INT:
        return isinstance(v, int) and not isinstance(v, bool)
    if want == NUM:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if want == BOOL:
        return isinstance(v, bool)
    if want == TABLE:
        return type(v) is dict or isinstance(v, Mapping)
    if want == ARRAY:
        return isinstance(v, list)
    if want == TABLES:
        return isinstance(v, list) and all(type(x) is dict or isinstance(x, Mapping) for x in v)
    if want == STRS:
        return isinstance(v, list) and all(isinstance(x, str) for x in v)
    raise AssertionError(want)


# A trie of FIELDS: each node maps a key (or "*") to its child; "" holds the node's own type.
_Node = dict[str, Any]


def _trie(fields: Mapping[str, str]) -> _Node:
    root: _Node = {}
    for dotted, want in fields.items():
        node = root
        for part in dotted.split("."):
            node = node.setdefault(part, {})
        node[""] = want
    return root


_ROOT = _trie(FIELDS)
_NO_NODES: tuple[_Node, ...] = ()
_CONTROL = re.compile("[\x00-\x1f\x7f]")


def _children(nodes: tuple[_Node, ...], key: str) -> tuple[_Node, ...]:
    out = []
    for n in nodes:
        for k in (key, "*"):
            child = n.get(k)
            if child is not None:
                out.append(child)
    return tuple(out)


def _shown(path: tuple[str, ...]) -> str:
    out = ""
    for part in path:
        if part.isdigit() and out:
            out += f"[{part}]"
        else:
            out += ("." if out else "") + (part if part.isidentifier() or part.replace("-", "").replace("_", "").isalnum()
                                           else repr(part))
    return out


def validate(data: Mapping[str, Any], source: str = "manifest") -> None:
    """Raise :class:`ManifestError` (exit 3) naming the first field that breaks the schema."""
    if "signature" in data:
        raise ManifestError(
            f"{source}: the body holds a 'signature' table that is not the trailer (a line other than exactly "
            "[signature], a dotted key or an inline table): not a signed manifest",
            "a signed manifest ends with a line that reads exactly [signature]; re-sign it with `capture sign`")
    # Iterative walk: a hostile file must not exhaust the Python stack here either. It runs on every
    # manifest read (verify DIR, decide), so the common types are tested by `type(...) is` first and the
    # path of a value is only spelled out when it fails.
    stack: list[tuple[tuple[str, ...], Any, tuple[_Node, ...]]] = [((), data, (_ROOT,))]
    while stack:
        path, value, nodes = stack.pop()
        kind = type(value)
        if path:
            if len(path) > MAX_DEPTH:
                raise _fail(source, _shown(path[:MAX_DEPTH]), f"nests more than {MAX_DEPTH} tables or arrays deep")
            want = None
            for n in nodes:
                if "" in n:
                    want = n[""]
                    break
            if want is not None:
                if not _is(value, want):
                    raise _fail(source, _shown(path), f"must be {want}, found {_type_name(value)}")
            elif (path[-1].endswith(_UNIT_SUFFIXES) and not isinstance(value, (list, Mapping))
                  and not _is(value, NUM)):
                raise _fail(source, _shown(path), f"must be a number (its name carries a unit), found {_type_name(value)}")
        if kind is dict or (kind is not list and isinstance(value, Mapping)):
            for k, v in value.items():
                if not k.isprintable() and _CONTROL.search(k):  # printable text has no control characters
                    raise _fail(source, _shown(path) or "the file", f"has a key with control characters: {k!r}")
                stack.append((path + (k,), v, _children(nodes, k) if nodes else _NO_NODES))
        elif isinstance(value, list):
            for i, v in enumerate(value):
                stack.append((path + (str(i),), v, _children(nodes, str(i)) if nodes else _NO_NODES))
        elif kind is str or kind is int or kind is bool:
            pass
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise _fail(source, _shown(path), f"is {value}, which capture never writes (non-finite numbers are stored as strings)")
        elif not isinstance(value, (str, int)):
            raise _fail(source, _shown(path), f"is {_type_name(value)}; capture writes times as RFC 3339 strings")

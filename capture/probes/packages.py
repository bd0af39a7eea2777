"""The Python interpreter and every installed distribution, with where each came from (PEP 610).

Reads ``*.dist-info`` / ``*.egg-info`` folders on ``sys.path`` directly: only the header of
each METADATA file (up to the first blank line) and ``direct_url.json``. Parsing full METADATA
with the email parser costs ~1.5 ms a distribution; this costs a few microseconds.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

from capture._safe_read import read_prefix
from capture.probes import ProbeOptions
from capture.probes._fs import listdir
from capture.redact import redact_text, redact_url

strip_url_credentials = redact_url
"""Kept for callers outside the probes (``capture/image/build.py``): :func:`capture.redact.redact_url`."""


def normalize_name(name: str) -> str:
    """PEP 503: runs of ``-_.`` become one ``-``, lower case."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Package:
    name: str
    """PEP 503 normalised."""
    version: str
    source: str
    """``index`` (no direct_url.json), ``vcs``, ``local`` (a folder, editable or not), ``archive``
    (a wheel/sdist URL or file), ``unknown`` (direct_url.json unreadable)."""
    location: str
    """The sys.path entry it was found in."""
    url: str | None = None
    """From direct_url.json, credentials stripped."""
    vcs: str | None = None
    commit: str | None = None
    requested_revision: str | None = None
    editable: bool | None = None
    archive_hash: str | None = None
    """``sha256:<hex>`` of the archive it was installed from."""
    shadowed: tuple[str, ...] = ()
    """Other copies later on sys.path that import never sees: ``"VERSION in PATH"``."""

    def to_manifest(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "source": self.source,
            "url": self.url,
            "vcs": self.vcs,
            "commit": self.commit,
            "requested_revision": self.requested_revision,
            "editable": self.editable,
            "archive_hash": self.archive_hash,
            "shadowed": list(self.shadowed) or None,
        }


@dataclass(frozen=True)
class PythonInfo:
    version: str
    implementation: str
    packages: tuple[Package, ...]

    def get(self, name: str) -> Package | None:
        key = normalize_name(name)
        return next((p for p in self.packages if p.name == key), None)

    def to_manifest(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "implementation": self.implementation,
            "packages": {p.name: p.to_manifest() for p in self.packages},
        }


HEAD_BYTES = 8 * 1024
"""First read of a METADATA file: Name and Version are its second and third lines in practice."""
METADATA_MAX_BYTES = 1024 * 1024
"""Most read while looking for Name and Version in an unusually long header block."""
DIRECT_URL_MAX_BYTES = 64 * 1024
"""A direct_url.json over this is not one an installer wrote: recorded as ``unknown``."""


def _headers(text_lines: Iterable[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in text_lines:
        if not line.strip():
            break
        key, sep, value = line.partition(":")
        if sep and key in ("Name", "Version") and key not in out:
            out[key] = value.strip()
            if len(out) == 2:  # both come first in practice; the rest of the headers can be long
                break
    return out


def _read_headers(path: str) -> dict[str, str]:
    """Name and Version from the header block of a METADATA / PKG-INFO file (regular files only)."""
    data = read_prefix(path, HEAD_BYTES)
    if data is None:
        return {}
    heads = _headers(data.decode("utf-8", "replace").splitlines())
    if len(heads) < 2 and len(data) == HEAD_BYTES and b"\n\n" not in data and b"\n\r\n" not in data:
        data = read_prefix(path, METADATA_MAX_BYTES) or data  # a header block longer than the first read
        heads = _headers(data.decode("utf-8", "replace").splitlines())
    return heads


def _from_direct_url(text: str | None) -> dict[str, Any]:
    if text is None:
        return {"source": "index"}
    try:
        data = json.loads(text)
        url = redact_url(str(data["url"]))
    except (ValueError, KeyError, TypeError):
        return {"source": "unknown"}
    if isinstance(data.get("vcs_info"), dict):
        vcs = data["vcs_info"]
        revision = vcs.get("requested_revision")
        return {"source": "vcs", "url": url, "vcs": vcs.get("vcs"), "commit": vcs.get("commit_id"),
                "requested_revision": redact_text(revision) if isinstance(revision, str) else revision}
    if isinstance(data.get("archive_info"), dict):
        info = data["archive_info"]
        digest = None
        hashes = info.get("hashes")
        if isinstance(hashes, dict) and hashes.get("sha256"):
            digest = f"sha256:{hashes['sha256']}"
        elif isinstance(info.get("hash"), str) and "=" in info["hash"]:  # legacy "sha256=<hex>"
            algo, _, value = info["hash"].partition("=")
            digest = f"{algo}:{value}"
        return {"source": "archive", "url": url, "archive_hash": digest}
    if isinstance(data.get("dir_info"), dict):
        return {"source": "local", "url": url, "editable": bool(data["dir_info"].get("editable", False))}
    return {"source": "unknown", "url": url}


def _name_version_from_folder(folder: str) -> tuple[str, str]:
    stem = folder.rsplit(".", 1)[0]
    name, _, rest = stem.partition("-")
    return name, rest.split("-", 1)[0]


def _read_dist(entry: str, folder: str) -> tuple[str, str, str | None] | None:
    """(name, version, direct_url.json text) of one ``*.dist-info`` / ``*.egg-info`` folder."""
    if folder.endswith(".dist-info"):
        meta = os.path.join(entry, folder, "METADATA")
    else:
        meta = os.path.join(entry, folder)
        if os.path.isdir(meta):
            meta = os.path.join(meta, "PKG-INFO")
    heads = _read_headers(meta)
    guess_name, guess_version = _name_version_from_folder(folder)
    name = heads.get("Name") or guess_name
    version = heads.get("Version") or guess_version
    if not name or not version:
        return None
    raw = read_prefix(os.path.join(entry, folder, "direct_url.json"), DIRECT_URL_MAX_BYTES + 1)
    # an oversized file is read as "" and so recorded as `unknown`, like one that is not JSON
    direct = None if raw is None else "" if len(raw) > DIRECT_URL_MAX_BYTES else raw.decode("utf-8", "replace")
    return name, version, direct


SLOW_READ_S = 0.001
"""Mean time to read one distribution above which the rest are read by threads: on a network
or overlay filesystem each open waits on the server, and those waits then overlap. On a local
disk threads only add start-up and lock traffic (125 distributions: 6 ms read in turn, 16-32 ms
through 8 threads, on this project's 2-core machine)."""
_PROBE_FIRST = 16


def _scan_dir(entry: str) -> Iterator[tuple[str, str, str | None]]:
    """(name, version, direct_url.json text) for each distribution in one sys.path folder."""
    try:
        names = listdir(entry)
    except OSError:
        return
    folders = [n for n in names if n.endswith((".dist-info", ".egg-info"))]
    t0 = time.perf_counter()
    found = [_read_dist(entry, folder) for folder in folders[:_PROBE_FIRST]]
    rest = folders[_PROBE_FIRST:]
    if rest and time.perf_counter() - t0 > SLOW_READ_S * _PROBE_FIRST:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=8) as pool:
            found += pool.map(lambda folder: _read_dist(entry, folder), rest)
    else:
        found += [_read_dist(entry, folder) for folder in rest]
    for item in found:
        if item is not None:
            yield item


def _scan_zip(entry: str) -> Iterator[tuple[str, str, str | None]]:
    import importlib.metadata

    for dist in importlib.metadata.distributions(path=[entry]):
        name, version = dist.metadata["Name"], dist.version
        if name and version:
            yield name, version, dist.read_text("direct_url.json")


def _is_zip(path: str) -> bool:
    import zipfile  # rare on sys.path (zipapps, eggs): not worth importing for every fingerprint

    return zipfile.is_zipfile(path)


def inside_a_package(folder: str) -> bool:
    """Whether ``folder`` lies inside an importable package (its parent holds ``__init__.py``): a
    package's private copies of its dependencies, such as ``setuptools/_vendor``, which importing
    setuptools (``torch.utils.cpp_extension`` does, and so does inductor) appends to ``sys.path``.
    They are not installed in the environment: a fresh interpreter does not see them, so recording
    them made ``capture verify`` report every such package as drift."""
    parent = os.path.dirname(os.path.abspath(folder))
    return os.path.isfile(os.path.join(parent, "__init__.py"))


def scan(path: Iterable[str] | None = None) -> list[Package]:
    """Every distribution on ``path`` (default ``sys.path``); the first of a name wins, as in import.
    Entries inside a package (:func:`inside_a_package`) are not an installation and are skipped."""
    first: dict[str, dict[str, Any]] = {}
    shadowed: dict[str, list[str]] = {}
    for entry in (sys.path if path is None else path):
        where = entry or os.getcwd()
        if inside_a_package(where):
            continue
        if os.path.isdir(where):
            found: Iterable[tuple[str, str, str | None]] = _scan_dir(where)
        elif os.path.isfile(where) and _is_zip(where):
            found = _scan_zip(where)
        else:
            continue
        for name, version, direct in found:
            key = normalize_name(name)
            if key in first:
                shadowed.setdefault(key, []).append(f"{version} in {where}")
                continue
            first[key] = {"name": key, "version": version, "location": where, **_from_direct_url(direct)}
    return [Package(**fields, shadowed=tuple(shadowed.get(key, ()))) for key, fields in sorted(first.items())]


def probe(options: ProbeOptions, *, path: Iterable[str] | None = None) -> PythonInfo:
    return PythonInfo(
        version="%d.%d.%d" % sys.version_info[:3],
        implementation=sys.implementation.name.replace("cpython", "CPython").replace("pypy", "PyPy"),
        packages=tuple(scan(path)),
    )

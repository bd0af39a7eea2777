"""The manifest: TOML body written with tomli-w, read with tomllib, signed over its exact bytes.

A signed manifest is ``BODY + TRAILER`` (shared/DESIGN.md, decision 1): the trailer is the last
table and starts at a line that is exactly ``[signature]``. Nothing is re-serialised before a
signature check, so :func:`split_signed` works on bytes and :func:`parse_body` only runs after
the signature has been checked. The one place that reads, verifies and parses a manifest for a
command is :func:`capture.verify.open.open_manifest`; nothing else in the package parses signed
content (``tests/test_one_door.py`` checks it).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import enum
import math
import os
import re

from collections.abc import Mapping
from pathlib import Path, PurePath
from typing import Any

import tomli_w

from capture import __version__
from capture._atomic import atomic_write
from capture._safe_read import MANIFEST_MAX_BYTES, read_regular
from capture._toml import TomlError
from capture._toml import loads as toml_loads
from capture.errors import ManifestError, SignatureError
from capture.schema import validate



def _tomllib() -> Any:
    """The TOML parser, imported when first needed (writing a manifest never needs it): the
    compiled build of the parser tomllib was taken from, same results, about 2x faster; the
    standard library's where tomli is missing."""
    try:
        import tomli

        return tomli
    except ImportError:  # pragma: no cover - tomli is a dependency, the stdlib is the fallback
        import tomllib

        return tomllib


SCHEMA_VERSION = 1
KINDS = ("fingerprint", "trial")
TRAILER_LINE = b"[signature]"

# Top-level order of a manifest: facts about the stack first, results last, so that two
# captures of one machine diff section by section. Unknown sections follow, sorted.
SECTION_ORDER = (
    "schema_version",
    "kind",
    "created_utc",
    "tool",
    "probe",
    "accelerator",
    "nvidia",
    "amd",
    "topology",
    "framework",
    "python",
    "host",
    "toolchain",
    "container",
    "environment",
    "code",
    "models",
    "datasets",
    "trial",
    "scaling",
)


def dig(data: Any, dotted: str) -> Any:
    """``data["a"]["b"]`` for ``"a.b"``, or None where any step is missing or not a table."""
    for part in dotted.split("."):
        if not isinstance(data, Mapping) or part not in data:
            return None
        data = data[part]
    return data


def table_at(data: Any, dotted: str) -> Mapping[str, Any]:
    """The table :func:`dig` finds, or an empty one where it finds none or something else: a
    file, signed or not, may hold any type at any key."""
    value = dig(data, dotted)
    return value if isinstance(value, Mapping) else {}


def utc_now() -> str:
    """Creation time in UTC, second precision, RFC 3339 with a Z."""
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


def new_manifest(kind: str = "fingerprint") -> dict[str, Any]:
    """The header every manifest starts with."""
    if kind not in KINDS:
        raise ValueError(f"unknown manifest kind {kind!r}")
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": kind,
        "created_utc": utc_now(),
        "tool": {"name": "capture", "version": __version__},
    }


# --------------------------------------------------------------------------- writing


def to_toml_value(value: Any) -> Any:
    """Turn probe results (dataclasses, enums, paths, tuples) into TOML-safe values.

    ``None`` means "not known" and is dropped: TOML has no null. Dict keys are sorted so that
    output is stable whatever order a probe discovered things in.
    """
    kind = type(value)
    if kind is str or kind is int or kind is bool:  # most values: answered before any isinstance
        return value
    if kind is dict:
        return {str(k): v for k, v in ((k, to_toml_value(value[k])) for k in sorted(value, key=str)) if v is not None}
    if kind is list or kind is tuple:
        return [v for v in (to_toml_value(x) for x in value) if v is not None]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        if hasattr(value, "to_manifest"):
            return to_toml_value(value.to_manifest())
        return to_toml_value({f.name: getattr(value, f.name) for f in dataclasses.fields(value)})
    if isinstance(value, Mapping):
        out = {}
        for k in sorted(value, key=str):
            v = to_toml_value(value[k])
            if v is not None:
                out[str(k)] = v
        return out
    if isinstance(value, (list, tuple)):
        return [v for v in (to_toml_value(x) for x in value) if v is not None]
    if isinstance(value, (set, frozenset)):
        return sorted(to_toml_value(x) for x in value)
    if isinstance(value, enum.Enum):
        return to_toml_value(value.value)
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, bool) or isinstance(value, (int, str, _dt.datetime, _dt.date)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if value is None:
        return None
    if hasattr(value, "item"):  # numpy / torch scalars
        return to_toml_value(value.item())
    raise TypeError(f"cannot store {type(value).__name__} in a manifest: {value!r}")


def ordered(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """Normalise values and put top-level keys in :data:`SECTION_ORDER`."""
    if "signature" in manifest:
        raise ValueError("the [signature] table is written by `capture sign`, not by the body")
    norm = to_toml_value(manifest)
    rank = {k: i for i, k in enumerate(SECTION_ORDER)}
    keys = sorted(norm, key=lambda k: (rank.get(k, len(rank)), k))
    return {k: norm[k] for k in keys}


def section_text(name: str, table: Mapping[str, Any]) -> str:
    """One top-level table as TOML text, exactly as :func:`dumps` writes it inside a manifest.

    ``table`` must already be TOML-ready (:func:`to_toml_value`). tomli-w writes a document as its
    top-level plain values, then each table in order, one blank line between them; so a body is
    its plain values' text joined by ``"\\n"`` with each table's own text. The probes render their
    tables where they run (side by side), and :func:`dumps` only joins them."""
    return tomli_w.dumps({name: table}, multiline_strings=True)


def dumps(manifest: Mapping[str, Any], rendered: Mapping[str, str] | None = None) -> bytes:
    """The manifest body as UTF-8 TOML bytes; always ends with a newline.

    ``rendered``: section -> :func:`section_text` of that very section, made beforehand (by
    :func:`capture.fingerprint.collect`); the bytes are the same as without it. Where a top-level
    value is an array of tables (``[[models]]``), whose place tomli-w decides by its length, the
    whole body is written in one go instead."""
    data = ordered(manifest)
    if rendered and not any(isinstance(v, list) and any(isinstance(x, Mapping) for x in v) for v in data.values()):
        plain = {k: v for k, v in data.items() if not isinstance(v, Mapping)}
        pieces = [tomli_w.dumps(plain, multiline_strings=True)] if plain else []
        pieces += [rendered.get(k) or section_text(k, v) for k, v in data.items() if isinstance(v, Mapping)]
        text = "\n".join(pieces)
    else:
        text = tomli_w.dumps(data, multiline_strings=True)
    if TRAILER_LINE.decode() in text.splitlines():  # a value can never fake the trailer line
        raise ValueError("manifest body would contain a line that reads [signature]")
    return text.encode("utf-8")


def write(path: str | os.PathLike[str], manifest: Mapping[str, Any]) -> bytes:
    """Write an unsigned manifest atomically and return its bytes."""
    data = dumps(manifest)
    atomic_write(path, data)
    return data


# --------------------------------------------------------------------------- reading


def read_bytes(path: str | os.PathLike[str]) -> bytes:
    """Read a manifest file (a regular file of at most :data:`~capture._safe_read.MANIFEST_MAX_BYTES`),
    turning OS errors into one-line :class:`ManifestError`."""
    p = Path(path)
    try:
        data = read_regular(p, MANIFEST_MAX_BYTES, ManifestError, "manifest")
    except FileNotFoundError:
        raise ManifestError(f"{p}: no such file", "check the path; `ls` the folder to see what is there") from None
    except IsADirectoryError:
        raise ManifestError(f"{p}: is a folder, not a manifest file", "name a .toml manifest file") from None
    except PermissionError:
        raise ManifestError(f"{p}: permission denied", "make the file readable (chmod u+r) or run as its owner") from None
    if not data.strip():
        raise ManifestError(f"{p}: file is empty", "write a manifest with `capture fingerprint -o FILE`")
    return data


def split_signed(data: bytes) -> tuple[bytes, bytes | None]:
    """Split into ``(BODY, TRAILER)``; TRAILER is None for an unsigned manifest.

    The trailer starts at the first line that is exactly ``[signature]`` and must be the last
    table of the file; a second table after it means someone appended to a signed file.
    """
    m = _TRAILER_RE.search(data)
    if m is None:
        return data, None
    body, trailer = data[:m.start()], data[m.start():]
    for later in trailer.splitlines()[1:]:
        s = later.strip()
        if s.startswith(b"[") and not s.startswith(b"[=") and s != b"[":
            raise SignatureError(
                "content was added after the [signature] table",
                "the signature covers only what precedes it; re-sign with `capture sign`",
            )
    return body, trailer


_TRAILER_RE = re.compile(rb"^\[signature\]\r?$", re.MULTILINE)
_HEADER_RE = re.compile(rb"""^[ \t]*(?:["']?schema_version["']?[ \t]*=|\[signature\][ \t]*\r?$)""", re.MULTILINE)


def has_header(raw: bytes) -> bool:
    """Whether ``raw`` claims to be a manifest: a top-level ``schema_version = ...`` line or a
    ``[signature]`` table. A tree run skips other ``*.toml`` files (trial configs beside manifests)."""
    return _HEADER_RE.search(raw) is not None


def parse_body(body: bytes, source: str = "manifest") -> dict[str, Any]:
    """Parse and check a manifest body: UTF-8, TOML, header (:func:`check_schema`) and field types
    (:func:`capture.schema.validate`). Commands call it only through the door
    (:func:`capture.verify.open.open_manifest`), after the signature was checked."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ManifestError(
            f"{source}: not UTF-8 (byte {exc.start}: {body[exc.start:exc.start + 1]!r})",
            "a manifest is UTF-8 TOML; regenerate it with `capture fingerprint`",
        ) from None
    try:
        data: dict[str, Any] = toml_loads(text, _tomllib())
    except TomlError as exc:
        raise ManifestError(f"{source}: not valid TOML ({exc})",
                            "the file may be truncated or hand-edited; regenerate it") from None
    check_schema(data, source)
    validate(data, source)
    return data


def parse_trailer(trailer: bytes, source: str = "manifest") -> dict[str, Any]:
    """Parse the ``[signature]`` table."""
    try:
        data = toml_loads(trailer.decode("utf-8"), _tomllib())
    except (UnicodeDecodeError, TomlError) as exc:  # TomlError: also nested too deeply, or a 5,000-digit integer
        raise SignatureError(f"{source}: the [signature] table cannot be read ({str(exc).splitlines()[0]})",
                             "re-sign the manifest with `capture sign FILE --key KEY`") from None
    sig = data.get("signature")
    if not isinstance(sig, dict):
        raise SignatureError(f"{source}: the [signature] table is empty", "re-sign with `capture sign`")
    return sig


_EXPECTED_TYPES: dict[str, type | tuple[type, ...]] = {
    "tool": dict, "probe": dict, "accelerator": dict, "nvidia": dict, "amd": dict, "topology": dict,
    "framework": dict, "python": dict, "host": dict, "toolchain": dict, "container": dict, "environment": dict,
    "code": dict, "models": list, "datasets": list, "trial": dict, "scaling": dict,
}


def check_schema(data: Mapping[str, Any], source: str = "manifest") -> None:
    """Reject manifests this version cannot understand, naming the field."""
    version = data.get("schema_version")
    if version is None:
        raise ManifestError(f"{source}: no schema_version", "this is not a capture manifest; make one with `capture fingerprint`")
    if not isinstance(version, int) or isinstance(version, bool):
        raise ManifestError(f"{source}: schema_version must be an integer, found {type(version).__name__}",
                            "regenerate the manifest with `capture fingerprint`")
    if version > SCHEMA_VERSION:
        raise ManifestError(f"{source}: schema_version {version} is newer than this capture understands ({SCHEMA_VERSION})",
                            "upgrade capture (pip install -U capture-stack) to read it")
    if version < 1:
        raise ManifestError(f"{source}: schema_version {version} is not valid", "regenerate the manifest")
    kind = data.get("kind")
    if kind not in KINDS:
        raise ManifestError(f"{source}: kind must be one of {', '.join(KINDS)}, found {kind!r}",
                            "regenerate the manifest with `capture fingerprint` or `capture trial`")
    if not isinstance(data.get("created_utc"), str):
        raise ManifestError(f"{source}: created_utc missing or not a string", "regenerate the manifest")
    for key, typ in _EXPECTED_TYPES.items():
        if key in data and not isinstance(data[key], typ):
            want = "a table" if typ is dict else "an array of tables"
            raise ManifestError(f"{source}: [{key}] must be {want}, found {type(data[key]).__name__}",
                                "the file was hand-edited or corrupted; regenerate it")


@dataclasses.dataclass(frozen=True)
class LoadedManifest:
    """A manifest read from disk. ``data`` is only filled after parsing."""

    path: str
    raw: bytes
    body: bytes
    trailer: bytes | None
    data: dict[str, Any]


def load_unverified(path: str | os.PathLike[str]) -> LoadedManifest:
    """Read and parse without checking the signature: for tests and scripts only. Commands open
    manifests through :func:`capture.verify.open.open_manifest` (``require_trusted=False`` reads
    without requiring trust and still reports the signature state)."""
    raw = read_bytes(path)
    body, trailer = split_signed(raw)
    return LoadedManifest(str(path), raw, body, trailer, parse_body(body, str(path)))

"""Hash-locked requirements, one file per image flavour.

``locks/<flavour>.in`` holds the pinned top-level requirements; ``locks/<flavour>.txt`` is
generated from it (``capture image lock FLAVOUR``) and lists every wheel the image installs as
``name==version --hash=sha256:...``, resolved for the image's Python and platform, not the host's.
The images install with ``pip install --no-index --require-hashes``, so a wheel that is not in
the lock, or whose bytes differ, stops the build.

A requirement that could not be resolved where the lock was made (a GPU wheel whose index was
unreachable) is never guessed: it is written as a ``# missing: REQ (why)`` line, and a lock with
such a line refuses to prepare a wheelhouse until it is regenerated where the index answers.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence
from urllib.parse import unquote, urlsplit

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from capture._atomic import atomic_write
from capture.errors import UsageError

LOCK_DIR = Path(__file__).with_name("locks")


@dataclass(frozen=True)
class Flavour:
    """Where an image's Python packages must run: its interpreter and platform."""

    name: str
    python_version: str
    """The base image's ``python3`` (major.minor)."""
    glibc: tuple[int, int]
    """The base image's glibc: the newest manylinux tag its wheels may carry."""
    base_python: str
    """Where that interpreter comes from, for the lock header."""

    @property
    def platform(self) -> str:
        return f"manylinux_{self.glibc[0]}_{self.glibc[1]}_x86_64"

    @property
    def platforms(self) -> list[str]:
        """Every platform tag the image accepts, best first; pip does not expand these itself."""
        major, minor = self.glibc
        tags = [f"manylinux_{major}_{m}_x86_64" for m in range(minor, 16, -1)]
        return tags + ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]

    @property
    def abi(self) -> str:
        return "cp" + self.python_version.replace(".", "")

    def pip_target_args(self) -> list[str]:
        """pip flags that resolve for the image instead of this host."""
        return [
            "--only-binary=:all:",
            "--python-version", self.python_version,
            "--implementation", "cp",
            "--abi", self.abi,
            "--abi", "abi3",
            "--abi", "none",
            *[arg for p in self.platforms for arg in ("--platform", p)],
        ]


FLAVOURS: dict[str, Flavour] = {
    "cpu": Flavour("cpu", "3.11", (2, 36), "python:3.11-slim-bookworm (Debian 12)"),
    "cuda": Flavour("cuda", "3.12", (2, 39), "nvidia/cuda 13.0.3 on Ubuntu 24.04, python3 3.12"),
    "rocm": Flavour("rocm", "3.12", (2, 39), "rocm/dev-ubuntu-24.04 7.2.4, python3 3.12"),
}


def flavour(name: str) -> Flavour:
    try:
        return FLAVOURS[name]
    except KeyError:
        raise UsageError(f"unknown image flavour {name!r}",
                         f"use one of: {', '.join(FLAVOURS)}") from None


@dataclass(frozen=True)
class LockedWheel:
    name: str
    """Canonical (PEP 503) project name."""
    version: str
    sha256: str

    def line(self) -> str:
        return f"{self.name}=={self.version} --hash=sha256:{self.sha256}"


@dataclass(frozen=True)
class Lock:
    flavour: str
    path: Path
    wheels: tuple[LockedWheel, ...]
    missing: tuple[str, ...]
    """``REQ (why)`` for each requirement that could not be locked."""
    sha256: str
    """Of the lock file's bytes; the images carry it as the ``io.capture.lock.sha256`` label."""

    @property
    def complete(self) -> bool:
        return not self.missing

    def require_complete(self) -> None:
        if self.missing:
            raise UsageError(
                f"{self.path.name} is incomplete: {'; '.join(self.missing)}",
                f"regenerate it where that wheel's index answers: `capture image lock {self.flavour} "
                "--extra-index-url URL`, or build with `--lock cpu` to stand the CPU wheels in",
            )


def lock_path(name: str) -> Path:
    return LOCK_DIR / f"{flavour(name).name}.txt"


def input_path(name: str) -> Path:
    return LOCK_DIR / f"{flavour(name).name}.in"


_HASH = re.compile(r"--hash=sha256:([0-9a-f]{64})$")
_MISSING = "# missing: "


def parse_lock(data: bytes, path: Path, name: str) -> Lock:
    """Parse a lock file; a bad line is a one-line error naming it."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not UTF-8", f"regenerate it with `capture image lock {name}`") from None
    wheels: list[LockedWheel] = []
    missing: list[str] = []
    seen: set[str] = set()
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if line.startswith(_MISSING):
            missing.append(line[len(_MISSING):].strip())
            continue
        if not line or line.startswith("#"):
            continue
        where = f"{path}:{number}"
        parts = line.split()
        m = _HASH.match(parts[-1]) if len(parts) == 2 else None
        if not m:
            raise UsageError(f"{where}: expected `name==version --hash=sha256:<64 hex>`, found {line!r}",
                             f"regenerate the file with `capture image lock {name}`")
        try:
            req = Requirement(parts[0])
        except InvalidRequirement as exc:
            raise UsageError(f"{where}: {exc}", f"regenerate the file with `capture image lock {name}`") from None
        specs = list(req.specifier)
        if len(specs) != 1 or specs[0].operator != "==" or req.extras or req.marker or req.url:
            raise UsageError(f"{where}: {parts[0]!r} is not pinned with == alone",
                             "every line of a lock pins one exact version")
        key = canonicalize_name(req.name)
        if key in seen:
            raise UsageError(f"{where}: {key} is listed twice", f"regenerate the file with `capture image lock {name}`")
        seen.add(key)
        wheels.append(LockedWheel(key, specs[0].version, m.group(1)))
    if not wheels and not missing:
        raise UsageError(f"{path}: no locked wheels", f"generate it with `capture image lock {name}`")
    return Lock(name, path, tuple(wheels), tuple(missing), hashlib.sha256(data).hexdigest())


def read_lock(name: str, path: Path | None = None) -> Lock:
    """The lock of a flavour (the packaged one unless ``path`` names another)."""
    flavour(name)
    path = Path(path) if path else lock_path(name)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise UsageError(f"{path}: no such lock file", f"generate it with `capture image lock {name}`") from None
    except OSError as exc:
        raise UsageError(f"{path}: cannot read ({exc.strerror})", "check the path and its permissions") from None
    return parse_lock(data, path, name)


# --------------------------------------------------------------------------- generating


def _read_input(name: str, skip: Iterable[str], path: Path | None = None) -> tuple[list[str], list[str], bytes]:
    path = Path(path) if path else input_path(name)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise UsageError(f"{path}: cannot read ({exc.strerror})", "the pinned input ships with capture; reinstall it") from None
    skip_keys = {canonicalize_name(s) for s in skip}
    keep, skipped = [], []
    for raw in data.decode("utf-8").splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            req = Requirement(line)
        except InvalidRequirement as exc:
            raise UsageError(f"{path}: {exc}", "each line pins one requirement: name==version") from None
        if canonicalize_name(req.name) in skip_keys:
            skipped.append(line)
        else:
            keep.append(line)
    unknown = skip_keys - {canonicalize_name(Requirement(r).name) for r in keep + skipped}
    if unknown:
        raise UsageError(f"--skip {', '.join(sorted(unknown))}: not in {path.name}",
                         f"skip only requirements that {path.name} lists")
    return keep, skipped, data


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _wheel_hash(item: dict) -> str:
    info = item.get("download_info") or {}
    url = info.get("url", "")
    hashes = (info.get("archive_info") or {}).get("hashes") or {}
    if "sha256" in hashes:
        return hashes["sha256"]
    parts = urlsplit(url)
    if parts.scheme == "file":
        return _sha256_file(Path(unquote(parts.path)))
    name = (item.get("metadata") or {}).get("name", "?")
    raise UsageError(f"the index gave no sha256 for {name} ({url})",
                     "use an index that publishes hashes (PEP 503 #sha256= links)")


def _marker_env(fl: Flavour) -> dict[str, str]:
    return {
        "python_version": fl.python_version, "python_full_version": fl.python_version + ".0",
        "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
        "os_name": "posix", "implementation_name": "cpython", "platform_python_implementation": "CPython",
    }


def _needed(items: list[dict], top: Sequence[str], fl: Flavour) -> set[str]:
    """Names reachable from ``top`` through the resolved packages' dependencies (for the image)."""
    meta = {canonicalize_name(i["metadata"]["name"]): i["metadata"] for i in items}
    env = _marker_env(fl)
    seen: set[tuple[str, tuple[str, ...]]] = set()
    stack = [(Requirement(r), ("",)) for r in top]
    while stack:
        req, extras = stack.pop()
        if req.marker and not any(req.marker.evaluate({**env, "extra": e}) for e in extras):
            continue
        key = canonicalize_name(req.name)
        if key not in meta:
            continue
        wanted = ("",) + tuple(sorted(req.extras))
        if (key, wanted) in seen:
            continue
        seen.add((key, wanted))
        for dep in meta[key].get("requires_dist", []) or []:
            stack.append((Requirement(dep), wanted))
    return {k for k, _ in seen}


def resolve(name: str, requirements: Sequence[str], pip_args: Sequence[str] = (),
            python: str = sys.executable, skipped: Sequence[str] = ()) -> list[LockedWheel]:
    """Resolve ``requirements`` for the flavour's platform with pip and return the wheels it picks.

    pip's own resolver and index configuration do the work (``--dry-run --report``); nothing is
    installed. ``pip_args`` pass through (``--index-url``, ``--extra-index-url``, ``--find-links``).
    """
    fl = flavour(name)
    with tempfile.TemporaryDirectory(prefix="capture-lock-") as tmp:
        req_file = Path(tmp, "requirements.in")
        req_file.write_text("\n".join(requirements) + "\n", encoding="utf-8")
        report = Path(tmp, "report.json")
        cmd = [python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-cache-dir",
               "--target", str(Path(tmp, "target")), "--report", str(report),
               *fl.pip_target_args(), *pip_args, "-r", str(req_file)]
        sys.stderr.write(f"resolving {len(requirements)} requirements for {name} "
                         f"(cp{fl.abi[2:]}, {fl.platform}) with pip...\n")
        proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              env=environ_without_pip_target())
        if proc.returncode != 0:
            errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("ERROR")]
            reason = errors[0] if errors else (proc.stderr.strip().splitlines() or ["pip failed"])[-1]
            raise UsageError(f"pip could not resolve the {name} lock: {reason}",
                             "a wheel may live on another index: pass --extra-index-url URL or "
                             "--find-links DIR, or --skip NAME to leave it out as missing")
        data = json.loads(report.read_text(encoding="utf-8"))
    items = data.get("install", [])
    if skipped:
        # Another package may pull a skipped one in from the default index (peft needs torch, and
        # PyPI's torch is the CUDA build): keep only what the kept requirements need without it.
        drop = {canonicalize_name(Requirement(r).name) for r in skipped}
        kept = [i for i in items if canonicalize_name(i["metadata"]["name"]) not in drop]
        needed = _needed(kept, requirements, fl)
        items = [i for i in kept if canonicalize_name(i["metadata"]["name"]) in needed]
    wheels = []
    for item in items:
        meta = item.get("metadata") or {}
        wheels.append(LockedWheel(canonicalize_name(meta["name"]), meta["version"], _wheel_hash(item)))
    return sorted(wheels, key=lambda w: w.name)


def render(name: str, wheels: Sequence[LockedWheel], skipped: Sequence[str], input_data: bytes,
           skip_reason: str = "not resolved where this lock was made", input_name: str | None = None) -> bytes:
    fl = flavour(name)
    lines = [
        f"# capture image lock: {name}",
        f"# for {fl.base_python}: python {fl.python_version} ({fl.abi}), glibc {fl.glibc[0]}.{fl.glibc[1]} ({fl.platform} and older)",
        f"# input: {input_name or name + '.in'} sha256:{hashlib.sha256(input_data).hexdigest()}",
        f"# regenerate: capture image lock {name}",
    ]
    lines += [f"{_MISSING}{req} ({skip_reason})" for req in skipped]
    lines += [w.line() for w in wheels]
    return ("\n".join(lines) + "\n").encode("utf-8")


def generate(name: str, pip_args: Sequence[str] = (), skip: Sequence[str] = (),
             out: Path | None = None, skip_reason: str | None = None, input_file: Path | None = None) -> Lock:
    """Regenerate a flavour's lock from its pinned input and write it atomically."""
    requirements, skipped, input_data = _read_input(name, skip, input_file)
    wheels = resolve(name, requirements, pip_args, skipped=skipped)
    data = render(name, wheels, skipped, input_data, skip_reason or "not resolved where this lock was made",
                  input_name=Path(input_file).name if input_file else f"{name}.in")
    path = Path(out) if out else lock_path(name)
    atomic_write(path, data)
    return parse_lock(data, path, name)


def input_pins(name: str) -> dict[str, str]:
    """Top-level ``name -> version`` of a flavour's pinned input (for tests and the README)."""
    out = {}
    for line in _read_input(name, ())[0]:
        req = Requirement(line)
        out[canonicalize_name(req.name)] = next(iter(req.specifier)).version
    return out


def environ_without_pip_target() -> dict[str, str]:
    """The environment minus variables that would redirect pip's installs (e.g. PIP_TARGET)."""
    # PIP_REQUIRE_VIRTUALENV and friends stay: they are the user's pip configuration.
    return {k: v for k, v in os.environ.items() if k not in ("PIP_TARGET", "PIP_PREFIX", "PIP_USER")}

"""Hash-locked requirements, one file per image lock, generated from ``pyproject.toml``.

``pyproject.toml`` is the one source of truth: a lock holds the package's runtime dependencies and
the extras its image needs, resolved by uv for the image's Python and platform (not the host's)
and written with the sha256 of every wheel the image may install. A lock names the torch build
it pins (an override), or says that the base image provides torch (the ``rocm`` route on AMD's
``rocm/pytorch``): torch is then excluded from the resolution and nothing torch alone needs is
locked. The images install with ``pip install --no-index --require-hashes`` and run ``pip check``.

A requirement that cannot be resolved where the lock was made (a GPU wheel whose index is
unreachable) is never guessed: it is written as ``# missing: REQ (why)``, and such a lock refuses
to prepare a wheelhouse until it is regenerated where that index answers.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence
from urllib.parse import unquote, urlsplit

from packaging.markers import Marker
from packaging.requirements import InvalidRequirement, Requirement
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import (
    InvalidWheelFilename,
    canonicalize_name,
    parse_wheel_filename,
)

from capture._toml import TomlError
from capture._toml import loads as toml_loads
from capture._atomic import atomic_write
from capture.errors import UsageError

LOCK_DIR = Path(__file__).with_name("locks")


@dataclass(frozen=True)
class LockSpec:
    """One lock: where its packages run (Python, glibc), which extras, and where torch comes from."""

    name: str
    python_version: str
    """The base image's ``python3`` (major.minor)."""
    glibc: tuple[int, int]
    """The base image's glibc: the newest manylinux tag its wheels may carry."""
    base_python: str
    """Where that interpreter comes from, for the lock header."""
    extras: tuple[str, ...]
    """``[project.optional-dependencies]`` the image installs besides the runtime dependencies."""
    torch: str | None
    """The torch build the lock pins (``torch==2.13.0+cpu``); None: the base image provides torch."""

    @property
    def platform(self) -> str:
        return f"manylinux_{self.glibc[0]}_{self.glibc[1]}_x86_64"

    @property
    def uv_platform(self) -> str:
        return f"x86_64-manylinux_{self.glibc[0]}_{self.glibc[1]}"

    @property
    def platforms(self) -> list[str]:
        """Every platform tag the image accepts, best first; pip does not expand these itself."""
        major, minor = self.glibc
        tags = [f"manylinux_{major}_{m}_x86_64" for m in range(minor, 16, -1)]
        return tags + ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]

    @property
    def abi(self) -> str:
        return "cp" + self.python_version.replace(".", "")

    @property
    def base_provides_torch(self) -> bool:
        return self.torch is None

    def tags(self) -> set[Tag]:
        """The wheel tags an interpreter of the image accepts."""
        version = tuple(int(p) for p in self.python_version.split("."))
        return set(cpython_tags(version, [self.abi, "abi3", "none"], self.platforms)) | set(
            compatible_tags(version, self.abi, self.platforms))

    def pip_target_args(self) -> list[str]:
        """pip flags that download for the image instead of this host."""
        return [
            "--only-binary=:all:",
            "--python-version", self.python_version,
            "--implementation", "cp",
            "--abi", self.abi,
            "--abi", "abi3",
            "--abi", "none",
            *[arg for p in self.platforms for arg in ("--platform", p)],
        ]

    def marker_env(self) -> dict[str, str]:
        return {
            "python_version": self.python_version, "python_full_version": self.python_version + ".0",
            "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
            "os_name": "posix", "implementation_name": "cpython", "platform_python_implementation": "CPython",
            "platform_release": "", "platform_version": "", "implementation_version": self.python_version + ".0",
        }


_DEBIAN = "Debian 12 (python 3.11, glibc 2.36)"
_NOBLE = "Ubuntu 24.04 (python 3.12, glibc 2.39)"
LOCKS: dict[str, LockSpec] = {
    "cpu": LockSpec("cpu", "3.11", (2, 36), f"python:3.11-slim-bookworm, {_DEBIAN}", ("trial",), "torch==2.13.0+cpu"),
    "cuda": LockSpec("cuda", "3.12", (2, 39), f"nvidia/cuda 13.0.3 on {_NOBLE}", ("trial", "nvidia"), "torch==2.13.0"),
    "rocm": LockSpec("rocm", "3.12", (2, 39), f"rocm/pytorch on {_NOBLE}; torch, ROCm, MIOpen and RCCL come with the base",
                     ("trial", "amd"), None),
    "rocm-wheels": LockSpec("rocm-wheels", "3.12", (2, 39), f"rocm/dev-ubuntu-24.04 7.2.4, {_NOBLE}",
                            ("trial", "amd"), "torch==2.13.0+rocm7.2"),
    "standin": LockSpec("standin", "3.11", (2, 36), f"the CI stand-in for rocm/pytorch: {_DEBIAN}, torch from the base",
                        ("trial", "amd"), None),
}
"""``cpu``/``cuda``/``rocm`` are the flavours' default locks; ``rocm-wheels`` is the wheel route
(torch from the PyTorch ROCm wheel index, where it is reachable); ``standin`` is what the ``rocm``
route adds, for the local Debian stand-in base that CI builds the ROCm Dockerfile on."""

DEFAULT_LOCK = {"cpu": "cpu", "cuda": "cuda", "rocm": "rocm"}


def flavour(name: str) -> LockSpec:
    try:
        return LOCKS[name]
    except KeyError:
        raise UsageError(f"unknown image lock {name!r}", f"use one of: {', '.join(LOCKS)}") from None


@dataclass(frozen=True)
class LockedWheel:
    name: str
    """Canonical (PEP 503) project name."""
    version: str
    hashes: tuple[str, ...]
    """sha256 of each wheel of this version that the image accepts (pip takes any of them)."""

    def line(self) -> str:
        return f"{self.name}=={self.version} " + " ".join(f"--hash=sha256:{h}" for h in self.hashes)


@dataclass(frozen=True)
class Lock:
    flavour: str
    """The lock's name (``cpu``, ``rocm-wheels``, ...)."""
    path: Path
    wheels: tuple[LockedWheel, ...]
    missing: tuple[str, ...]
    """``REQ (why)`` for each requirement that could not be locked."""
    sha256: str
    """Of the lock file's bytes; the images carry it as the ``io.capture.lock.sha256`` label."""
    source_sha256: str | None = None
    """The ``# pyproject: ... sha256:`` header: what it was generated from (see :func:`source_digest`)."""

    @property
    def complete(self) -> bool:
        return not self.missing

    def versions(self) -> dict[str, str]:
        return {w.name: w.version for w in self.wheels}

    def require_complete(self) -> None:
        if self.missing:
            raise UsageError(
                f"{self.path.name} is incomplete: {'; '.join(self.missing)}",
                f"regenerate it where that wheel's index answers: `capture image lock {self.flavour} "
                "--extra-index-url URL`, or build the rocm flavour on AMD's rocm/pytorch base (the default lock)",
            )


def lock_path(name: str) -> Path:
    return LOCK_DIR / f"{flavour(name).name}.txt"


_HASH = re.compile(r"--hash=sha256:([0-9a-f]{64})")
_MISSING = "# missing: "
_SOURCE = re.compile(r"^# pyproject: .* sha256:([0-9a-f]{64})$")


def parse_lock(data: bytes, path: Path, name: str) -> Lock:
    """Parse a lock file; a bad line is a one-line error naming it."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not UTF-8", f"regenerate it with `capture image lock {name}`") from None
    wheels: list[LockedWheel] = []
    missing: list[str] = []
    seen: set[str] = set()
    source = None
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if line.startswith(_MISSING):
            missing.append(line[len(_MISSING):].strip())
            continue
        if m := _SOURCE.match(line):
            source = m.group(1)
        if not line or line.startswith("#"):
            continue
        where = f"{path}:{number}"
        parts = line.split()
        hashes = [_HASH.fullmatch(p) for p in parts[1:]]
        if len(parts) < 2 or not all(hashes):
            raise UsageError(f"{where}: expected `name==version --hash=sha256:<64 hex>...`, found {line!r}",
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
        wheels.append(LockedWheel(key, specs[0].version, tuple(h.group(1) for h in hashes if h)))
    if not wheels and not missing:
        raise UsageError(f"{path}: no locked wheels", f"generate it with `capture image lock {name}`")
    return Lock(name, path, tuple(wheels), tuple(missing), hashlib.sha256(data).hexdigest(), source)


def read_lock(name: str, path: Path | None = None) -> Lock:
    """The lock of that name (the packaged one unless ``path`` names another)."""
    flavour(name)
    path = Path(path) if path else lock_path(name)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise UsageError(f"{path}: no such lock file", f"generate it with `capture image lock {name}`") from None
    except OSError as exc:
        raise UsageError(f"{path}: cannot read ({exc.strerror})", "check the path and its permissions") from None
    return parse_lock(data, path, name)


# --------------------------------------------------------------------------- what a lock is made from


def read_pyproject(pyproject: Path) -> dict:
    try:
        return toml_loads(Path(pyproject).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, TomlError) as exc:
        raise UsageError(f"{pyproject}: cannot read ({exc})", "run from a checkout of capture") from None


def requirements_for(spec: LockSpec, project: dict) -> list[Requirement]:
    """The runtime dependencies and the spec's extras (markers evaluated for the image)."""
    proj = project.get("project") or {}
    extras = proj.get("optional-dependencies") or {}
    absent = [e for e in spec.extras if e not in extras]
    if absent:
        raise UsageError(f"pyproject.toml has no extra {absent[0]!r}, which the {spec.name} lock installs",
                         "restore it, or change the lock's extras in capture/image/locks.py")
    env = spec.marker_env()
    out = []
    for text in [*(proj.get("dependencies") or []), *(r for e in spec.extras for r in extras[e])]:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({**env, "extra": ""}):
            out.append(req)
    return out


def source_digest(spec: LockSpec, project: dict) -> str:
    """sha256 of what a lock is resolved from: the requirements it takes from pyproject, its
    torch pin and its platform. A lock whose header differs is stale."""
    lines = sorted(str(r) for r in requirements_for(spec, project))
    lines += [f"torch: {spec.torch or 'from the base'}", f"python: {spec.python_version}", f"platform: {spec.platform}"]
    return hashlib.sha256("\n".join(lines).encode("utf-8")).hexdigest()


# --------------------------------------------------------------------------- generating (uv)


def uv_binary() -> str:
    try:
        from uv import find_uv_bin  # the dev extra pins uv

        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        found = shutil.which("uv")
        if found:
            return found
    raise UsageError("uv is not installed (it resolves the image locks)", "pip install 'capture-stack[dev]' (it pins uv; in a checkout: pip install -e '.[dev]')")


def _wheel_file_hash(url: str) -> str | None:
    parts = urlsplit(url)
    if parts.scheme != "file":
        return None
    h = hashlib.sha256()
    with open(unquote(parts.path), "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def wheels_from_pylock(spec: LockSpec, pylock: dict) -> list[LockedWheel]:
    """The image's wheels out of uv's PEP 751 ``pylock.toml``: the hashes of the wheels its tags accept."""
    accepted = spec.tags()
    env = spec.marker_env()
    out = []
    for pkg in pylock.get("packages") or []:
        name, version = canonicalize_name(pkg["name"]), str(pkg["version"])
        if pkg.get("marker") and not Marker(pkg["marker"]).evaluate({**env, "extra": ""}):
            continue
        hashes = []
        for wheel in pkg.get("wheels") or []:
            url = wheel.get("url") or wheel.get("path") or ""
            filename = wheel.get("name") or unquote(url.rsplit("/", 1)[-1])
            try:
                tags = parse_wheel_filename(filename)[3]
            except InvalidWheelFilename:
                continue
            if not tags & accepted:
                continue
            digest = (wheel.get("hashes") or {}).get("sha256") or _wheel_file_hash(url)
            if digest:
                hashes.append(digest)
        if not hashes:
            raise UsageError(f"no wheel of {name}=={version} fits {spec.name} (cp{spec.abi[2:]}, {spec.platform})",
                             "the images install wheels only: pin a version that publishes one")
        out.append(LockedWheel(name, version, tuple(sorted(set(hashes)))))
    return sorted(out, key=lambda w: w.name)


def resolve(spec: LockSpec, pyproject: Path, index_args: Sequence[str] = (), skip_torch: bool = False) -> list[LockedWheel]:
    """Resolve pyproject's requirements for the image with ``uv pip compile``; nothing is installed.

    ``index_args`` pass through (``--index-url``, ``--extra-index-url``, ``--find-links``,
    ``--no-index``). Where the base provides torch, or ``skip_torch``, torch is excluded from the
    resolution, so nothing that only torch needs is locked.
    """
    with tempfile.TemporaryDirectory(prefix="capture-lock-") as tmp:
        out = Path(tmp, "pylock.toml")
        cmd = [uv_binary(), "pip", "compile", str(pyproject), "--quiet", "--no-header",
               "--python-version", spec.python_version, "--python-platform", spec.uv_platform,
               "--only-binary", ":all:", "--format", "pylock.toml", "-o", str(out),
               *[arg for e in spec.extras for arg in ("--extra", e)], *index_args]
        if spec.base_provides_torch or skip_torch:
            Path(tmp, "excludes.txt").write_text("torch\n", encoding="utf-8")
            cmd += ["--excludes", str(Path(tmp, "excludes.txt"))]
        else:
            Path(tmp, "overrides.txt").write_text(f"{spec.torch}\n", encoding="utf-8")
            cmd += ["--overrides", str(Path(tmp, "overrides.txt"))]
        sys.stderr.write(f"resolving pyproject.toml [{', '.join(spec.extras)}] for the {spec.name} lock "
                         f"(cp{spec.abi[2:]}, {spec.platform}) with uv...\n")
        env = {k: v for k, v in os.environ.items() if not k.startswith("UV_")}
        env["UV_CACHE_DIR"] = os.environ.get("UV_CACHE_DIR") or str(Path(tempfile.gettempdir(), "capture-uv-cache"))
        proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        if proc.returncode != 0:
            lines = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()]
            reason = next((ln for ln in lines if "no version" in ln.lower() or "not found" in ln.lower()),
                          lines[-1] if lines else "uv failed")
            raise UsageError(f"uv could not resolve the {spec.name} lock: {reason.lstrip('╰─▶ ')}",
                             "a wheel may live on another index: pass --extra-index-url URL or --find-links DIR, "
                             "or --skip torch to leave torch out as missing")
        try:
            data = toml_loads(out.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, TomlError) as exc:
            raise UsageError(f"uv wrote a lock capture cannot read ({exc})", "check the uv version (`uv --version`)") from None
    return wheels_from_pylock(spec, data)


def render(spec: LockSpec, wheels: Sequence[LockedWheel], project: dict, missing: Sequence[str] = ()) -> bytes:
    torch = spec.torch or "from the base image (excluded)"
    lines = [
        f"# capture image lock: {spec.name}",
        f"# for {spec.base_python}: python {spec.python_version} ({spec.abi}), glibc {spec.glibc[0]}.{spec.glibc[1]} "
        f"({spec.platform} and older)",
        f"# pyproject: dependencies + [{', '.join(spec.extras)}], torch {torch} sha256:{source_digest(spec, project)}",
        f"# regenerate: capture image lock {spec.name} (uv pip compile; see docs/images.md)",
    ]
    lines += [f"{_MISSING}{req}" for req in missing]
    lines += [w.line() for w in wheels]
    return ("\n".join(lines) + "\n").encode("utf-8")


def generate(name: str, pyproject: Path, index_args: Sequence[str] = (), skip_torch: bool = False,
             skip_reason: str = "its wheel index was not reachable where this lock was made",
             out: Path | None = None) -> Lock:
    """Regenerate a lock from ``pyproject.toml`` and write it atomically."""
    spec = flavour(name)
    if skip_torch and spec.base_provides_torch:
        raise UsageError(f"--skip torch: the {name} lock takes torch from the base image already",
                         "skip torch only for a lock that pins a torch build")
    project = read_pyproject(pyproject)
    wheels = resolve(spec, pyproject, index_args, skip_torch=skip_torch)
    missing = [f"{spec.torch} ({skip_reason})"] if skip_torch else []
    data = render(spec, wheels, project, missing)
    path = Path(out) if out else lock_path(name)
    atomic_write(path, data)
    return parse_lock(data, path, name)


def environ_without_pip_target() -> dict[str, str]:
    """The environment minus variables that would redirect pip's installs (e.g. PIP_TARGET)."""
    # PIP_REQUIRE_VIRTUALENV and friends stay: they are the user's pip configuration.
    return {k: v for k, v in os.environ.items() if k not in ("PIP_TARGET", "PIP_PREFIX", "PIP_USER")}

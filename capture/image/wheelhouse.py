"""The wheelhouse: exactly the locked wheels, downloaded on the host before any image build.

Builds run with no index at all (``pip install --no-index --require-hashes``), so everything an
image installs is fetched here, by ``pip download`` with the image's Python and platform, and
checked against the lock's hashes (pip checks while downloading; :func:`locate` checks again
before a build so a file changed on disk since is caught).
"""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence, cast

from packaging.utils import (
    InvalidWheelFilename,
    canonicalize_name,
    parse_wheel_filename,
)
from packaging.version import Version

from capture.errors import UsageError
from capture.image import locks

DEFAULT_ROOT = Path(".cache") / "wheelhouse"


@dataclass(frozen=True)
class Wheelhouse:
    lock: locks.Lock
    path: Path
    files: tuple[Path, ...]
    """One wheel per lock entry, in lock order."""
    downloaded: bool
    """False when every wheel was already there with the right hash."""

    @property
    def size_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)


def default_dest(lock_name: str) -> Path:
    """``$CAPTURE_WHEELHOUSE/<lock>``, else ``.cache/wheelhouse/<lock>`` in the current folder."""
    root = os.environ.get("CAPTURE_WHEELHOUSE")
    return (Path(root) if root else DEFAULT_ROOT) / lock_name


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def locate(lock: locks.Lock, dest: Path) -> tuple[list[Path], list[str]]:
    """The wheel in ``dest`` for each lock entry, and ``name==version`` of those absent or wrong."""
    by_key: dict[tuple[str, Version], list[Path]] = {}
    if dest.is_dir():
        for f in dest.iterdir():
            if not f.name.endswith(".whl"):
                continue
            try:
                name, version, _, _ = parse_wheel_filename(f.name)
            except InvalidWheelFilename:
                continue
            by_key.setdefault((canonicalize_name(name), version), []).append(f)
    found, missing = [], []
    for wheel in lock.wheels:
        match = next((f for f in by_key.get((wheel.name, Version(wheel.version)), [])
                      if _sha256(f) in wheel.hashes), None)
        if match is None:
            missing.append(f"{wheel.name}=={wheel.version}")
        else:
            found.append(match)
    return found, missing


@dataclass(frozen=True)
class _Output:
    returncode: int
    text: str


def _relay(cmd: list[str], env: dict[str, str]) -> _Output:
    """Run pip with its output (progress bars included) passed through to our stderr as it comes."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    assert proc.stdout is not None
    stdout = cast(io.BufferedReader, proc.stdout)  # binary with the default bufsize: it has read1
    chunks: list[bytes] = []
    while True:
        chunk = stdout.read1(65536)
        if not chunk:
            break
        chunks.append(chunk)
        sys.stderr.write(chunk.decode("utf-8", "replace"))
        sys.stderr.flush()
    return _Output(proc.wait(), b"".join(chunks).decode("utf-8", "replace"))


def prepare(lock_name: str, dest: Path | None = None, lock_file: Path | None = None,
            pip_args: Sequence[str] = (), python: str = sys.executable) -> Wheelhouse:
    """Download every locked wheel into ``dest`` (pip's progress on stderr); reuse what is there."""
    lock = locks.read_lock(lock_name, lock_file)
    lock.require_complete()
    fl = locks.flavour(lock_name)
    dest = Path(dest) if dest else default_dest(lock_name)
    found, missing = locate(lock, dest)
    if not missing:
        sys.stderr.write(f"wheelhouse {dest}: all {len(found)} locked wheels present, hashes match\n")
        return Wheelhouse(lock, dest, tuple(found), downloaded=False)
    dest.mkdir(parents=True, exist_ok=True)
    sys.stderr.write(f"wheelhouse {dest}: downloading {len(missing)} of {len(lock.wheels)} locked wheels "
                     f"for python {fl.python_version} / {fl.platform}\n")
    cmd = [python, "-m", "pip", "download", "--no-deps", "--require-hashes", "--progress-bar", "on",
           "--dest", str(dest), *fl.pip_target_args(), *pip_args, "-r", str(lock.path)]
    output = _relay([*cmd], env=locks.environ_without_pip_target())
    if output.returncode != 0:
        errors = [ln for ln in output.text.splitlines() if ln.startswith("ERROR")]
        reason = errors[0] if errors else "pip download failed"
        raise UsageError(f"cannot prepare the {lock_name} wheelhouse: {reason}",
                         "a wheel may live on another index (pass --extra-index-url URL / --find-links DIR); "
                         "a hash mismatch means the index serves other bytes than the lock recorded")
    found, still = locate(lock, dest)
    if still:
        raise UsageError(f"wheelhouse {dest}: pip finished but {', '.join(still)} is missing or has another hash",
                         f"delete {dest} and run `capture image wheelhouse {lock_name}` again")
    return Wheelhouse(lock, dest, tuple(found), downloaded=True)

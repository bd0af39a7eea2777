"""Build a flavour's image through the Docker SDK, then check that it carries every label.

The build context is staged in a fresh folder: the flavour's Dockerfile, the selected lock
(``locks/<lock>.txt``), its wheelhouse (``wheels/<lock>/``, hard links where the disk allows)
and a wheel of capture itself built here (``dist/``, installed by hash). The build runs with
``network_mode="host"`` (no bridge network is ever needed) and no index inside: pip in the
Dockerfile only sees the wheelhouse.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping

from packaging.utils import canonicalize_name

from capture import __version__
from capture.errors import DockerUnavailable, UsageError
from capture.image import (
    DISTRIBUTION,
    FLAVOURS,
    LABEL_BASE_DIGEST,
    LABEL_BASE_NAME,
    LABEL_CREATED,
    LABEL_FLAVOUR,
    LABEL_LOCK,
    LABEL_LOCK_SHA256,
    LABEL_REVISION,
    LABEL_SOURCE,
    LABEL_TITLE,
    LABEL_VERSION,
    REQUIRED_LABELS,
    _short,
    docker_client,
    locks,
    wheelhouse,
)

_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
LOCAL_BASE = "capture-local/bookworm-python:base"
"""The Debian stand-in base that ``make base-local`` (``.ci/docker.sh``) builds with debootstrap."""
STANDIN_TAG = "capture-local/rocm-pytorch-standin:base"
"""The local stand-in for rocm/pytorch (torch in /opt/venv) that CI builds the ROCm Dockerfile on."""
NO_REGISTRY_HINT = ("where no registry is reachable, build on the local base: `make base-local`, then "
                    f"`make trial-cpu LOCAL_BASE=1` (or --base-image {LOCAL_BASE})")


@dataclass(frozen=True)
class BuildResult:
    image_id: str
    """``sha256:...`` as ``docker inspect`` reports it."""
    tag: str
    flavour: str
    lock: str
    base_name: str
    base_digest: str
    labels: Mapping[str, str] = field(default_factory=dict)


def project_root() -> Path:
    """The checkout capture runs from (Dockerfiles live in ``images/`` beside the package)."""
    root = Path(os.environ.get("CAPTURE_SOURCE_DIR") or Path(__file__).resolve().parents[2])
    if not (root / "pyproject.toml").is_file() or not (root / "images").is_dir():
        raise UsageError(f"{root}: not a capture checkout (no pyproject.toml and images/)",
                         "run from a git checkout of capture, or set CAPTURE_SOURCE_DIR to one")
    return root


def dockerfile(flavour: str, root: Path | None = None) -> Path:
    if flavour not in FLAVOURS:
        raise UsageError(f"unknown image flavour {flavour!r}", f"use one of: {', '.join(FLAVOURS)}")
    path = (root or project_root()) / "images" / flavour / "Dockerfile"
    if not path.is_file():
        raise UsageError(f"{path}: no such Dockerfile", "restore images/ from the repository")
    return path


def default_base(flavour: str, root: Path | None = None) -> str:
    """The ``ARG BASE_IMAGE=...`` default of a flavour's Dockerfile, which must be pinned by
    digest (``NAME:TAG@sha256:<64 hex>``, settled decision 4): a tag alone names whatever the
    registry serves that day."""
    text = dockerfile(flavour, root).read_text(encoding="utf-8")
    m = re.search(r"^ARG BASE_IMAGE=(\S+)$", text, re.MULTILINE)
    if not m:
        raise UsageError(f"images/{flavour}/Dockerfile has no `ARG BASE_IMAGE=` default", "restore it from the repository")
    name, sep, digest = m.group(1).partition("@")
    if not (sep and _DIGEST.fullmatch(digest)):
        raise UsageError(f"images/{flavour}/Dockerfile: the `ARG BASE_IMAGE=` default {m.group(1)!r} is not pinned by digest",
                         "write it as NAME:TAG@sha256:<64 hex> (`docker inspect --format '{{index .RepoDigests 0}}' NAME:TAG`)")
    return m.group(1)


def split_ref(ref: str) -> tuple[str, str | None]:
    """``name:tag@sha256:...`` -> (``name:tag``, ``sha256:...``); no digest -> (ref, None)."""
    name, sep, digest = ref.partition("@")
    if sep and not _DIGEST.fullmatch(digest):
        raise UsageError(f"--base-image {ref!r}: the digest must be sha256:<64 hex>", "copy it from `docker inspect`")
    return name, (digest if sep else None)


def resolve_base(client: Any, ref: str) -> tuple[str, str]:
    """(base.name, base.digest) for a base reference.

    A digest in the reference is taken as is (docker verifies it when pulling). Otherwise the
    local image answers: its registry digest when it came from one, else its image ID (an image
    made here with ``docker import`` has no other identity).
    """
    name, digest = split_ref(ref)
    if digest:
        return name, digest
    from docker.errors import ImageNotFound

    try:
        image = client.images.get(ref)
    except ImageNotFound:
        raise UsageError(f"base image {ref!r} is not on this machine and has no digest to pin",
                         f"pull it first (`docker pull {ref}`) or pass NAME:TAG@sha256:... to --base-image") from None
    repo = name.rsplit(":", 1)[0] if ":" in name.rsplit("/", 1)[-1] else name
    for rd in image.attrs.get("RepoDigests") or []:
        if rd.split("@", 1)[0] == repo:
            return name, rd.split("@", 1)[1]
    return name, image.id


def git_identity(root: Path) -> tuple[str, str]:
    """(source URL with credentials removed, revision) of the checkout; ``unknown`` outside git."""
    from capture.redact import redact_url

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    revision = git("rev-parse", "HEAD") or "unknown"
    if revision != "unknown" and git("status", "--porcelain", "--untracked-files=no"):
        revision += "-dirty"
    source = git("remote", "get-url", "origin")
    return (redact_url(source) if source else "unknown"), revision


def source_date_epoch(root: Path) -> int:
    """``$SOURCE_DATE_EPOCH``, else the commit time of HEAD, else 1980-01-01 (outside git)."""
    env = os.environ.get("SOURCE_DATE_EPOCH", "").strip()
    if env:
        if not env.isdigit():
            raise UsageError(f"SOURCE_DATE_EPOCH={env!r} is not a number of seconds", "unset it, or set it to `git log -1 --format=%ct`")
        return int(env)
    try:
        out = subprocess.run(["git", "-C", str(root), "log", "-1", "--format=%ct"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 315532800
    return int(out.stdout.strip()) if out.returncode == 0 and out.stdout.strip().isdigit() else 315532800


def rfc3339(epoch: int) -> str:
    return datetime.fromtimestamp(epoch, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def wheel_glob() -> str:
    return DISTRIBUTION.replace("-", "_") + "-*.whl"


_NOT_SOURCE = {".git", ".venv", "build", "dist", "__pycache__", ".pytest_cache", ".mypy_cache"}


def _source_files(root: Path) -> list[str]:
    """The checkout's files as its user sees them: tracked and untracked-but-not-ignored (git), or
    every file outside build outputs, caches and virtual environments where ``root`` is no checkout."""
    proc = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                          capture_output=True)
    if proc.returncode == 0:
        return [f for f in proc.stdout.decode("utf-8", "surrogateescape").split("\0") if f and (root / f).is_file()]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _NOT_SOURCE and not d.endswith(".egg-info")]
        out += [os.path.relpath(os.path.join(dirpath, f), root) for f in filenames]
    return out


def build_capture_wheel(root: Path, dest: Path, python: str = sys.executable) -> tuple[Path, str]:
    """A wheel of this checkout (no dependencies: those are locked) and its sha256. Built from a
    copy of the source files alone: setuptools builds in the tree it is given, and a ``build/``
    or ``*.egg-info`` left in the checkout would carry stale files into the wheel."""
    dest.mkdir(parents=True, exist_ok=True)
    # A fixed timestamp makes the wheel's bytes depend on the source alone, so an unchanged
    # checkout hits Docker's layer cache.
    env = {**locks.environ_without_pip_target(), "SOURCE_DATE_EPOCH": "315532800"}
    with tempfile.TemporaryDirectory(prefix="capture-wheel-") as tmp:
        src = Path(tmp) / "src"
        for rel in _source_files(root):
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / rel, src / rel)
        proc = subprocess.run([python, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                               "--wheel-dir", str(dest), str(src)], capture_output=True, text=True, env=env)
    wheels = sorted(dest.glob(wheel_glob()))
    if proc.returncode != 0 or not wheels:
        tail = (proc.stderr.strip().splitlines() or ["no wheel produced"])[-1]
        raise UsageError(f"cannot build a wheel of capture from {root}: {_short(tail)}",
                         "the build needs setuptools in this Python (pip install setuptools)")
    data = wheels[-1].read_bytes()
    return wheels[-1], hashlib.sha256(data).hexdigest()


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _set_times(folder: Path, epoch: int) -> None:
    """Every staged file and folder dated ``epoch``, so COPY layers do not depend on the clock."""
    for path in [*folder.rglob("*"), folder]:
        os.utime(path, (epoch, epoch), follow_symlinks=False)


def stage_context(flavour: str, lock: locks.Lock, wheels: list[Path], root: Path, into: Path,
                  epoch: int = 315532800) -> str:
    """Fill ``into`` with everything the Dockerfile copies; returns capture's wheel sha256."""
    shutil.copy2(dockerfile(flavour, root), into / "Dockerfile")
    (into / "locks").mkdir()
    shutil.copy2(lock.path, into / "locks" / f"{lock.flavour}.txt")
    wdir = into / "wheels" / lock.flavour
    wdir.mkdir(parents=True)
    for w in wheels:
        _link_or_copy(w, wdir / w.name)
    dist = into / "dist"
    wheel, sha = build_capture_wheel(root, dist)
    (dist / "capture.txt").write_text(
        f"{DISTRIBUTION} @ file:///build/dist/{wheel.name} --hash=sha256:{sha}\n", encoding="utf-8")
    _set_times(into, epoch)
    return sha


def expected_labels(flavour: str, lock: locks.Lock, base_name: str, base_digest: str, created: str,
                    source: str, revision: str) -> dict[str, str]:
    return {
        LABEL_TITLE: f"capture ({flavour})",
        LABEL_CREATED: created,
        LABEL_SOURCE: source,
        LABEL_REVISION: revision,
        LABEL_VERSION: __version__,
        LABEL_BASE_NAME: base_name,
        LABEL_BASE_DIGEST: base_digest,
        LABEL_FLAVOUR: flavour,
        LABEL_LOCK: lock.flavour,
        LABEL_LOCK_SHA256: lock.sha256,
    }


def check_labels(labels: Mapping[str, str] | None, expected: Mapping[str, str], image: str) -> None:
    """Every required label present and equal to what the build passed in."""
    labels = labels or {}
    absent = [k for k in REQUIRED_LABELS if not labels.get(k)]
    if absent:
        raise UsageError(f"image {image}: label {absent[0]} is missing"
                         + (f" (and {len(absent) - 1} more)" if len(absent) > 1 else ""),
                         "the Dockerfile must set every org.opencontainers.image.* and io.capture.* label")
    for key, want in expected.items():
        if labels.get(key) != want:
            raise UsageError(f"image {image}: label {key} is {labels.get(key)!r}, expected {want!r}",
                             "a stale build cache or an edited Dockerfile; rebuild with `capture image build --no-cache`")


def default_tag(flavour: str, lock_name: str) -> str:
    suffix = "" if lock_name == locks.DEFAULT_LOCK[flavour] else f"-{lock_name}"
    return f"capture-{flavour}:{__version__}{suffix}"


def build(flavour: str, *, base_image: str | None = None, tag: str | None = None,
          lock_name: str | None = None, wheel_dir: Path | None = None, no_cache: bool = False,
          pip_args: tuple[str, ...] = (), client: Any = None) -> BuildResult:
    """Build ``images/<flavour>/Dockerfile``; progress streams to stderr."""
    root = project_root()
    dockerfile(flavour, root)
    lock_name = lock_name or locks.DEFAULT_LOCK[flavour]
    lock = locks.read_lock(lock_name)
    lock.require_complete()
    base_ref = base_image or default_base(flavour, root)
    client = client or docker_client()
    if not split_ref(base_ref)[1]:
        # --base-image without a digest (a local base such as the debootstrap one): the local
        # image answers, and the build runs on exactly that image.
        base_name, base_digest = resolve_base(client, base_ref)
    else:
        base_name, base_digest = split_ref(base_ref)  # type: ignore[assignment]
    wh = wheelhouse.prepare(lock_name, wheel_dir, pip_args=pip_args)
    source, revision = git_identity(root)
    epoch = source_date_epoch(root)
    created = rfc3339(epoch)
    tag = tag or default_tag(flavour, lock_name)
    expected = expected_labels(flavour, lock, base_name, str(base_digest), created, source, revision)
    buildargs = {
        "BASE_IMAGE": base_ref, "BASE_NAME": base_name, "BASE_DIGEST": str(base_digest),
        "LOCK": lock_name, "LOCK_SHA256": lock.sha256, "CREATED": created, "SOURCE": source,
        "REVISION": revision, "VERSION": __version__, "SOURCE_DATE_EPOCH": str(epoch),
    }
    cache = root / ".cache"
    cache.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"build-{flavour}-", dir=cache) as tmp:
        ctx = Path(tmp)
        stage_context(flavour, lock, list(wh.files), root, ctx, epoch)
        sys.stderr.write(f"building {tag} from images/{flavour}/Dockerfile on {base_ref} "
                         f"with the {lock_name} lock ({len(wh.files)} wheels, created {created})\n")
        image_id, stages = _stream_build(client, ctx, tag, buildargs, no_cache)
    keep_stages(client, tag, stages)
    inspect = client.api.inspect_image(image_id)
    labels = (inspect.get("Config") or {}).get("Labels") or {}
    check_labels(labels, expected, tag)
    return BuildResult(inspect["Id"], tag, flavour, lock_name, base_name, str(base_digest), dict(labels))


_STEP_FROM = re.compile(r"^Step \d+/\d+ : FROM (\S+)(?: (?:AS|as) (\S+))?")
_STEP_ID = re.compile(r"^ ---> ([0-9a-f]{12,64})$")


def _build_error(tag: str, reason: str) -> UsageError:
    text = reason.lower()
    if ("pull access denied" in text or "manifest unknown" in text or "no such host" in text
            or "dial tcp" in text or "failed to resolve" in text or "not found: manifest" in text
            or "name resolution" in text or "i/o timeout" in text or "tls handshake timeout" in text
            or "connection refused" in text or ("error response from daemon" in text and "pull" in text)):
        return UsageError(f"docker build of {tag} failed: the base image cannot be pulled ({_short(reason)})",
                          NO_REGISTRY_HINT)
    return UsageError(f"docker build of {tag} failed: {_short(reason)}", "the build log above shows the failing step")


def _stream_build(client: Any, ctx: Path, tag: str, buildargs: dict[str, str], no_cache: bool,
                  dockerfile_name: str = "Dockerfile") -> tuple[str, dict[str, str]]:
    """Build; returns (image ID, {stage name: the ID it ended with}) for the stages before the last."""
    from docker.errors import APIError, DockerException

    image_id = None
    error = None
    stages: dict[str, str] = {}
    stage: str | None = None
    last: str | None = None
    count = 0
    try:
        for chunk in client.api.build(path=str(ctx), dockerfile=dockerfile_name, tag=tag, buildargs=buildargs,
                                      network_mode="host", rm=True, forcerm=True, pull=False,
                                      nocache=no_cache, decode=True):
            if "stream" in chunk:
                sys.stderr.write(chunk["stream"])
                for line in chunk["stream"].splitlines():
                    if m := _STEP_FROM.match(line):
                        if stage is not None and last:
                            stages[stage] = last
                        stage, last, count = m.group(2) or f"stage{count}", None, count + 1
                    elif m := _STEP_ID.match(line):
                        last = m.group(1)
            elif "status" in chunk:
                sys.stderr.write(chunk["status"] + (" " + chunk["progress"] if chunk.get("progress") else "") + "\n")
            if "error" in chunk:
                error = chunk["error"].strip()
                sys.stderr.write(error + "\n")
            aux = chunk.get("aux") or {}
            if "ID" in aux:
                image_id = aux["ID"]
    except APIError as exc:
        raise _build_error(tag, exc.explanation or str(exc)) from None
    except DockerException as exc:
        raise DockerUnavailable(f"docker build of {tag} stopped: {_short(str(exc))}",
                                "check that the daemon is still running") from None
    if error:
        raise _build_error(tag, error)
    if not image_id:
        image_id = client.images.get(tag).id
    return image_id, stages


def keep_stages(client: Any, tag: str, stages: Mapping[str, str]) -> dict[str, str]:
    """Tag each stage that would be left dangling as ``TAG-stage-NAME``; remove the one it replaces.

    The classic builder keeps a multi-stage build's intermediate stages as untagged images; they
    are the layer cache of the next build (the install stage holds the wheelhouse, ~1.6 GB for the
    CPU flavour). Named, they can be listed and removed; the stage image a new build replaced is
    removed here, so nothing is left dangling.
    """
    from docker.errors import APIError, ImageNotFound

    repo, _, version = tag.rpartition(":") if ":" in tag.rsplit("/", 1)[-1] else (tag, "", "latest")
    dangling = {i.id for i in client.images.list(filters={"dangling": True})}
    tagged = {}
    for name, short_id in stages.items():
        try:
            image = client.images.get(short_id)
        except ImageNotFound:
            continue
        if image.id not in dangling:
            continue  # a parent of the final image (or tagged already): not left behind
        name_tag = f"{version}-stage-{name}"
        try:
            old = client.images.get(f"{repo}:{name_tag}").id
        except ImageNotFound:
            old = None
        image.tag(repo, name_tag)
        tagged[name] = f"{repo}:{name_tag}"
        if old and old != image.id:
            try:
                client.images.remove(old, noprune=False)
            except APIError:
                pass  # still used by another image: not dangling
    return tagged


def build_standin_base(wheel_dir: Path, *, client: Any = None, base: str = LOCAL_BASE,
                       tag: str = STANDIN_TAG) -> str:
    """The rocm/pytorch stand-in: ``base`` with the CPU torch (and what it needs) in /opt/venv."""
    client = client or docker_client()
    root = project_root()
    cpu = locks.read_lock("cpu")
    found, missing = wheelhouse.locate(cpu, Path(wheel_dir))
    if missing:
        raise UsageError(f"wheelhouse {wheel_dir}: {missing[0]} is missing", "run `capture image wheelhouse cpu` first")
    keep = {"torch", "filelock", "typing-extensions", "sympy", "mpmath", "networkx", "jinja2", "markupsafe",
            "fsspec", "setuptools"}
    lines = [w.line() for w in cpu.wheels if w.name in keep]
    cache = root / ".cache"
    cache.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="build-standin-", dir=cache) as tmp:
        ctx = Path(tmp)
        shutil.copy2(root / "images" / "rocm" / "standin.Dockerfile", ctx / "Dockerfile")
        (ctx / "lock.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
        (ctx / "wheels").mkdir()
        for f in found:
            if canonicalize_name(f.name.split("-", 1)[0]) in keep:
                _link_or_copy(f, ctx / "wheels" / f.name)
        _set_times(ctx, 315532800)
        image_id, _ = _stream_build(client, ctx, tag, {"BASE_IMAGE": base}, False)
    return image_id

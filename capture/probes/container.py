"""Whether we run in a container, which runtime, and the image identity the runner passed in.

Detection reads marker files and /proc only. The image cannot be identified from inside, so
``capture run`` passes it through the environment: ``CAPTURE_IMAGE_ID`` (``sha256:...``),
``CAPTURE_IMAGE_REF`` and ``CAPTURE_IMAGE_LABELS`` (a JSON object).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from capture import _json
from capture.probes import ProbeOptions
from capture.redact import redact_text, redact_url

ENV_IMAGE_ID = "CAPTURE_IMAGE_ID"
ENV_IMAGE_REF = "CAPTURE_IMAGE_REF"
ENV_IMAGE_LABELS = "CAPTURE_IMAGE_LABELS"

_IMAGE_ID = re.compile(r"sha256:[0-9a-f]{64}")

# (runtime, pattern) searched in /proc/1/cgroup and /proc/self/mountinfo; first match wins.
_PROC_HINTS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("kubernetes", re.compile(r"kubepods|/var/lib/kubelet/pods/")),
    ("podman", re.compile(r"libpod|/containers/storage/overlay")),
    ("docker", re.compile(r"/docker[/-]|/var/lib/docker/")),
    ("containerd", re.compile(r"containerd|cri-containerd")),
)


@dataclass(frozen=True)
class ContainerInfo:
    in_container: bool
    runtime: str | None = None
    """docker, podman, containerd, kubernetes, or unknown (a container whose runtime no hint names)."""
    image_id: str | None = None
    image_ref: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    hints: tuple[str, ...] = ()
    """What the decision rests on, e.g. ``/.dockerenv``, ``env container=podman``."""
    errors: tuple[str, ...] = ()
    """Bad values passed in by the runner (kept out of the fields above)."""

    def to_manifest(self) -> dict[str, Any]:
        return {
            "in_container": self.in_container,
            "runtime": self.runtime,
            "image_id": self.image_id,
            "image_ref": self.image_ref,
            "labels": dict(self.labels) or None,
            "hints": list(self.hints) or None,
            "errors": list(self.errors) or None,
        }


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def _container_mounts(mountinfo: str) -> str:
    """Only the mounts a runtime makes for its container: the root and the /etc files it injects.

    A host that runs containers has their overlay mounts in its own table too; those say
    nothing about where *we* run.
    """
    keep = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if len(fields) > 4 and fields[4] in ("/", "/etc/hostname", "/etc/hosts", "/etc/resolv.conf"):
            keep.append(line)
    return "\n".join(keep)


def detect(root: Path, env: Mapping[str, str]) -> tuple[bool, str | None, list[str]]:
    hints: list[str] = []
    votes: list[str] = []
    if (root / ".dockerenv").exists():
        hints.append("/.dockerenv")
        votes.append("docker")
    containerenv = root / "run/.containerenv"
    if containerenv.exists():
        hints.append("/run/.containerenv")
        engine = re.search(r'^engine="?([a-z]+)', _read(containerenv), re.M)
        votes.append(engine.group(1) if engine and engine.group(1) in ("podman", "buildah") else "podman")
        if votes[-1] == "buildah":
            votes[-1] = "podman"
    if env.get("container"):
        hints.append(f"env container={env['container']}")
        votes.append({"docker": "docker", "podman": "podman", "oci": "unknown"}.get(env["container"], "unknown"))
    if env.get("KUBERNETES_SERVICE_HOST"):
        hints.append("env KUBERNETES_SERVICE_HOST")
        votes.append("kubernetes")
    for name in ("proc/1/cgroup", "proc/self/mountinfo"):
        text = _read(root / name)
        if name.endswith("mountinfo"):
            text = _container_mounts(text)
        for runtime, pattern in _PROC_HINTS:
            if pattern.search(text):
                hints.append(f"/{name} mentions {runtime}")
                votes.append(runtime)
                break
    if not votes:
        return False, None, hints
    # An orchestrator names the setting better than the engine under it.
    for runtime in ("kubernetes", "podman", "docker", "containerd"):
        if runtime in votes:
            return True, runtime, hints
    return True, "unknown", hints


def image_identity(env: Mapping[str, str]) -> tuple[str | None, str | None, dict[str, str], list[str]]:
    errors: list[str] = []
    image_id = env.get(ENV_IMAGE_ID) or None
    if image_id is not None and not _IMAGE_ID.fullmatch(image_id):
        errors.append(f"{ENV_IMAGE_ID} is not sha256:<64 hex> (ignored)")
        image_id = None
    image_ref = env.get(ENV_IMAGE_REF) or None
    if image_ref is not None:
        image_ref = redact_url(image_ref)
    labels: dict[str, str] = {}
    raw = env.get(ENV_IMAGE_LABELS)
    if raw:
        try:
            data = _json.loads(raw)
        except _json.JsonError as exc:  # also an integer over 4300 digits, or nesting too deep
            errors.append(f"{ENV_IMAGE_LABELS} is not valid JSON ({exc.reason}); labels not recorded")
        else:
            if not isinstance(data, dict):
                errors.append(f"{ENV_IMAGE_LABELS} must be a JSON object, found {type(data).__name__}; labels not recorded")
            else:
                labels = {redact_text(str(k)): redact_text(v if isinstance(v, str) else json.dumps(v))
                          for k, v in data.items()}
    return image_id, image_ref, labels, errors


def probe(options: ProbeOptions, *, root: Path = Path("/"), env: Mapping[str, str] | None = None) -> ContainerInfo:
    env = os.environ if env is None else env
    in_container, runtime, hints = detect(root, env)
    image_id, image_ref, labels, errors = image_identity(env)
    return ContainerInfo(in_container=in_container, runtime=runtime, image_id=image_id, image_ref=image_ref,
                         labels=labels, hints=tuple(hints), errors=tuple(errors))

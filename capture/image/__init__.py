"""Matching CUDA, ROCm and CPU images (shared/DESIGN.md, decision 4).

- :mod:`capture.image.locks`: one hash-locked requirements file per flavour, regenerated from a
  pinned input with ``capture image lock FLAVOUR``.
- :mod:`capture.image.wheelhouse`: ``pip download`` of exactly the locked wheels on the host.
- :mod:`capture.image.build`: ``docker build`` through the SDK, labels checked afterwards.
- :mod:`capture.image.save`: export an image and its base into one archive.
- :mod:`capture.image.run`: run a trial inside an image, by ID, networking off.

Everything that talks to Docker goes through :func:`capture.image.docker_client`, so "no
daemon" is one error with one hint.
"""

from __future__ import annotations

from typing import Any

from capture.errors import DockerUnavailable

FLAVOURS = ("cuda", "rocm", "cpu")
DISTRIBUTION = "capture-stack"
"""The name on the package index (``capture`` there is an unrelated project); the import package
and the command stay ``capture``."""

# Labels every image carries; `capture image build` fails when one is missing or wrong.
LABEL_CREATED = "org.opencontainers.image.created"
LABEL_SOURCE = "org.opencontainers.image.source"
LABEL_REVISION = "org.opencontainers.image.revision"
LABEL_VERSION = "org.opencontainers.image.version"
LABEL_TITLE = "org.opencontainers.image.title"
LABEL_BASE_NAME = "org.opencontainers.image.base.name"
LABEL_BASE_DIGEST = "org.opencontainers.image.base.digest"
LABEL_LOCK_SHA256 = "io.capture.lock.sha256"
LABEL_LOCK = "io.capture.lock"
LABEL_FLAVOUR = "io.capture.flavour"
REQUIRED_LABELS = (
    LABEL_CREATED, LABEL_SOURCE, LABEL_REVISION, LABEL_VERSION, LABEL_TITLE,
    LABEL_BASE_NAME, LABEL_BASE_DIGEST, LABEL_LOCK_SHA256, LABEL_LOCK, LABEL_FLAVOUR,
)


def docker_client(timeout_s: int = 600) -> Any:
    """A connected ``docker.DockerClient``, or :class:`DockerUnavailable` with the fix."""
    try:
        import docker
        from docker.errors import DockerException
    except ImportError:  # pragma: no cover - docker is a hard dependency
        raise DockerUnavailable("the docker Python package is not installed",
                                "pip install docker") from None
    try:
        client = docker.from_env(timeout=timeout_s)
        client.ping()
    except DockerException as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DockerUnavailable(
            f"no Docker daemon answers ({_short(reason)})",
            "start it (`sudo systemctl start docker`, or `.ci/docker.sh` here) or point DOCKER_HOST at one",
        ) from None
    return client


def _short(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"

"""Export an image together with its base into one ``docker load``-able archive.

Upstream tags get deleted (NVIDIA removes CUDA tags six months after end of support), and a
digest pin is worth little once the registry no longer serves it; the archive keeps both the
image and the base it was built on. The base is found through the image's
``org.opencontainers.image.base.*`` labels.
"""

from __future__ import annotations

import io
import json
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from capture._atomic import atomic_open
from capture.errors import DockerUnavailable, UsageError
from capture.image import LABEL_BASE_DIGEST, LABEL_BASE_NAME, _short, docker_client
from capture.image.run import resolve_image


@dataclass(frozen=True)
class SavedArchive:
    path: Path
    size_bytes: int
    image_id: str
    base_id: str
    names: tuple[str, ...]
    """What the archive was asked to carry (tags where the images have them, else IDs)."""


def find_base(client: Any, labels: dict[str, str], image: str) -> tuple[str, str]:
    """(name to save the base under, its image ID) from the image's base.* labels."""
    from docker.errors import ImageNotFound

    name, digest = labels.get(LABEL_BASE_NAME), labels.get(LABEL_BASE_DIGEST)
    if not name or not digest:
        raise UsageError(f"image {image} has no {LABEL_BASE_NAME}/{LABEL_BASE_DIGEST} labels",
                         "save images built by `capture image build`, which records their base")
    repo = name.rsplit(":", 1)[0] if ":" in name.rsplit("/", 1)[-1] else name
    for candidate in (f"{repo}@{digest}", digest, name):
        try:
            base = client.images.get(candidate)
        except (ImageNotFound, ValueError):
            continue
        # A digest label that is an image ID (a base made with docker import) must match exactly;
        # a registry digest must be one of the image's RepoDigests.
        if base.id == digest or any(rd.endswith("@" + digest) for rd in base.attrs.get("RepoDigests") or []):
            tags = base.attrs.get("RepoTags") or []
            return (name if name in tags else (tags[0] if tags else base.id)), base.id
    raise UsageError(f"the base of {image} ({name}@{digest}) is no longer on this machine",
                     f"pull it (`docker pull {repo}@{digest}`) before saving")


def save(image: str, output: Path, client: Any = None) -> SavedArchive:
    """Write ``output`` (a tar that ``docker load -i`` restores both images from), atomically."""
    from docker.errors import APIError, DockerException

    client = client or docker_client()
    image_id, labels = resolve_image(client, image)
    base_name, base_id = find_base(client, labels, image)
    tags = client.api.inspect_image(image_id).get("RepoTags") or []
    image_name = image if image in tags else (tags[0] if tags else image_id)
    names = (image_name, base_name)
    output = Path(output)
    folder = output.parent if str(output.parent) else Path(".")
    if not folder.is_dir():
        raise UsageError(f"-o {output}: folder {folder} does not exist", "create it first")
    try:
        with atomic_open(output) as f:
            # GET /images/get?names=A&names=B: one archive holding both, as `docker save A B` does.
            resp = client.api._get(client.api._url("/images/get"), params={"names": list(names)}, stream=True)
            client.api._raise_for_status(resp)
            written = 0
            for chunk in resp.iter_content(chunk_size=1 << 20):
                f.write(chunk)
                written += len(chunk)
            f.flush()
            check_archive(Path(f.name), (image_id, base_id))  # before the rename: a bad archive never lands
    except APIError as exc:
        raise UsageError(f"docker could not export {image}: {_short(exc.explanation or str(exc))}",
                         "check `docker image ls`") from None
    except DockerException as exc:
        raise DockerUnavailable(f"export of {image} stopped: {_short(str(exc))}", "check that dockerd still runs") from None
    sys.stderr.write(f"saved {image_name} and its base {base_name} to {output}\n")
    return SavedArchive(output, written, image_id, base_id, names)


def archive_image_ids(path: Path) -> set[str]:
    """The image IDs (config digests) an archive from ``docker save`` holds."""
    with tarfile.open(path) as tar:
        member = tar.extractfile("manifest.json")
        if member is None:
            raise UsageError(f"{path}: not a docker image archive (no manifest.json)", "make it with `capture image save`")
        manifest = json.load(io.TextIOWrapper(member, encoding="utf-8"))
    ids = set()
    for entry in manifest:
        config = entry["Config"]  # "<hex>.json" (docker 20-24) or "blobs/sha256/<hex>" (OCI layout)
        hexpart = config.rsplit("/", 1)[-1].removesuffix(".json")
        ids.add(f"sha256:{hexpart}")
    return ids


def check_archive(path: Path, want: tuple[str, ...]) -> None:
    have = archive_image_ids(path)
    absent = [w for w in want if w not in have]
    if absent:
        raise UsageError(f"the exported archive lacks {absent[0]}", "docker returned a partial export; try again")

"""Run capture inside an image: by image ID, networking off, the image's identity passed in.

- The reference is resolved to an image ID first and the container is created from that ID, so
  a tag that moved, or one that would be pulled, can never stand in silently.
- ``network_mode="none"``: the trial reads models and datasets from the mounted HF cache only.
- The HF cache is mounted read-only, the output folder read-write; the container runs as the
  calling user so what it writes there belongs to them.
- GPUs are requested the way each vendor's runtime expects: NVIDIA through a device request
  (the NVIDIA Container Toolkit), AMD by passing /dev/kfd and /dev/dri with the groups that own
  them and ``seccomp=unconfined`` (ROCm's documented container settings).
- ``CAPTURE_IMAGE_ID``, ``CAPTURE_IMAGE_REF`` and ``CAPTURE_IMAGE_LABELS`` (JSON) let the container
  probe record the image from inside (:mod:`capture.probes.container`).
- Output streams through while it runs; the full log is saved to ``OUT/container.log`` before the
  container is removed; the container's exit status becomes ours.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from capture._atomic import atomic_write
from capture.errors import DockerUnavailable, UsageError
from capture.image import LABEL_FLAVOUR, _short, docker_client

ENV_IMAGE_ID = "CAPTURE_IMAGE_ID"
ENV_IMAGE_REF = "CAPTURE_IMAGE_REF"
ENV_IMAGE_LABELS = "CAPTURE_IMAGE_LABELS"

OUT_MOUNT = "/out"
CACHE_MOUNT = "/hf-cache"
KEY_MOUNT = "/run/capture/key"
SIGNERS_MOUNT = "/run/capture/allowed_signers"
AMD_DEVICES = ("/dev/kfd", "/dev/dri")
VENDORS = {"cuda": "nvidia", "rocm": "amd"}

NVIDIA_HINT = ("install the NVIDIA Container Toolkit (nvidia-container-toolkit), run "
               "`sudo nvidia-ctk runtime configure --runtime=docker` and restart dockerd")


@dataclass(frozen=True)
class RunSpec:
    """Everything a run needs, decided before any container exists (shown by ``--dry-run``)."""

    image_id: str
    image_ref: str
    labels: Mapping[str, str]
    command: tuple[str, ...]
    out_dir: Path
    cache_dir: Path | None = None
    gpus: str | None = None
    """``all`` or a comma-separated list of device indices; None: no GPU."""
    vendor: str | None = None
    """``nvidia`` or ``amd`` when GPUs are requested."""
    user: str | None = None
    key_file: Path | None = None
    allowed_signers: Path | None = None
    extra_env: Mapping[str, str] = field(default_factory=dict)

    def environment(self) -> dict[str, str]:
        env = {
            ENV_IMAGE_ID: self.image_id,
            ENV_IMAGE_REF: self.image_ref,
            ENV_IMAGE_LABELS: json.dumps(dict(self.labels), sort_keys=True),
            "HOME": "/tmp",
            "HF_HUB_OFFLINE": "1",
        }
        if self.cache_dir is not None:
            env["HF_HUB_CACHE"] = CACHE_MOUNT
        if self.key_file is not None:
            env["CAPTURE_KEY"] = KEY_MOUNT
        if self.allowed_signers is not None:
            env["CAPTURE_ALLOWED_SIGNERS"] = SIGNERS_MOUNT
        env.update(self.extra_env)
        return env

    def volumes(self) -> dict[str, dict[str, str]]:
        vols = {str(self.out_dir): {"bind": OUT_MOUNT, "mode": "rw"}}
        if self.cache_dir is not None:
            vols[str(self.cache_dir)] = {"bind": CACHE_MOUNT, "mode": "ro"}
        if self.key_file is not None:
            vols[str(self.key_file)] = {"bind": KEY_MOUNT, "mode": "ro"}
            pub = Path(f"{self.key_file}.pub")
            if pub.is_file():  # the principal defaults to the public key's comment
                vols[str(pub)] = {"bind": KEY_MOUNT + ".pub", "mode": "ro"}
        if self.allowed_signers is not None:
            vols[str(self.allowed_signers)] = {"bind": SIGNERS_MOUNT, "mode": "ro"}
        return vols

    def gpu_options(self) -> dict[str, Any]:
        """The create() keyword arguments that give the container its GPUs."""
        if not self.gpus:
            return {}
        if self.vendor == "nvidia":
            from docker.types import DeviceRequest

            if self.gpus == "all":
                req = DeviceRequest(count=-1, capabilities=[["gpu"]])
            else:
                req = DeviceRequest(device_ids=self.gpus.split(","), capabilities=[["gpu"]])
            return {"device_requests": [req]}
        if self.vendor == "amd":
            return {
                "devices": [f"{d}:{d}:rwm" for d in AMD_DEVICES],
                "group_add": amd_groups(),
                "security_opt": ["seccomp=unconfined"],
            }
        raise UsageError(f"unknown GPU vendor {self.vendor!r}", "use --vendor nvidia or --vendor amd")

    def create_kwargs(self) -> dict[str, Any]:
        return {
            "image": self.image_id,
            "command": list(self.command),
            "environment": self.environment(),
            "volumes": self.volumes(),
            "network_mode": "none",
            "user": self.user,
            "detach": True,
            **self.gpu_options(),
        }


def amd_groups() -> list[str]:
    """``video``, ``render`` and the numeric groups that own the AMD device nodes on this host.

    The nodes keep the host's group IDs inside the container, and the image's own ``render``
    group need not have the same number, so the host's numbers are what grant access.
    """
    groups = ["video"]
    for path in ("/dev/kfd", *sorted(str(p) for p in Path("/dev/dri").glob("renderD*"))):
        try:
            gid = str(os.stat(path).st_gid)
        except OSError:
            continue
        if gid not in groups and gid != "0":
            groups.append(gid)
    return groups


def resolve_image(client: Any, ref: str) -> tuple[str, dict[str, str]]:
    """(image ID, labels) of a local image; never pulls."""
    from docker.errors import ImageNotFound, NullResource

    try:
        attrs = client.api.inspect_image(ref)
    except (ImageNotFound, NullResource):
        raise UsageError(f"image {ref!r} is not on this machine",
                         "build it with `capture image build FLAVOUR` or load it with `docker load -i ARCHIVE`; "
                         "capture run never pulls") from None
    return attrs["Id"], dict((attrs.get("Config") or {}).get("Labels") or {})


def plan(client: Any, image: str, command: Sequence[str], out_dir: Path, *, cache_dir: Path | None = None,
         gpus: str | None = None, vendor: str | None = None, key_file: Path | None = None,
         allowed_signers: Path | None = None) -> RunSpec:
    """Check the inputs and decide the run; creates ``out_dir`` (nothing else happens yet)."""
    if not command:
        raise UsageError("nothing to run in the container",
                         "put the capture command after `--`, e.g. `capture run --image REF -- trial --example tiny`")
    image_id, labels = resolve_image(client, image)
    if gpus:
        flavour = labels.get(LABEL_FLAVOUR)
        vendor = vendor or VENDORS.get(flavour or "")
        if vendor is None:
            raise UsageError(f"--gpus {gpus}: image {image} is the {flavour or 'unlabelled'} flavour, which has no GPU stack",
                             "run a cuda or rocm image, or pass --vendor nvidia|amd for an image of your own")
        if vendor == "amd":
            absent = [d for d in AMD_DEVICES if not os.path.exists(d)]
            if absent:
                raise DockerUnavailable(f"--gpus {gpus}: {absent[0]} does not exist, so no AMD GPU can be passed in",
                                        "load the amdgpu kernel driver (ROCm's amdgpu-dkms) on this host")
    for flag, path in (("--cache", cache_dir), ("--key", key_file), ("--allowed-signers", allowed_signers)):
        if path is not None and not Path(path).exists():
            raise UsageError(f"{flag} {path}: no such file or folder", "check the path")
    out_dir = Path(out_dir).resolve()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--out {out_dir}: cannot create ({exc.strerror})", "choose a folder you can write") from None
    return RunSpec(
        image_id=image_id, image_ref=image, labels=labels, command=tuple(command), out_dir=out_dir,
        cache_dir=Path(cache_dir).resolve() if cache_dir else None, gpus=gpus, vendor=vendor if gpus else None,
        user=f"{os.getuid()}:{os.getgid()}",
        key_file=Path(key_file).resolve() if key_file else None,
        allowed_signers=Path(allowed_signers).resolve() if allowed_signers else None,
    )


def _gpu_error(spec: RunSpec, explanation: str) -> DockerUnavailable | None:
    text = explanation.lower()
    if "could not select device driver" in text or "nvidia-container-cli" in text or "unknown runtime" in text:
        return DockerUnavailable(f"--gpus {spec.gpus}: Docker has no NVIDIA GPU runtime ({_short(explanation)})", NVIDIA_HINT)
    if spec.vendor == "amd" and ("error gathering device information" in text or "no such file" in text):
        return DockerUnavailable(f"--gpus {spec.gpus}: the AMD devices cannot be passed in ({_short(explanation)})",
                                 "load the amdgpu kernel driver (ROCm's amdgpu-dkms) on this host")
    return None


def execute(client: Any, spec: RunSpec, stdout: Any = None, stderr: Any = None) -> int:
    """Run the container to completion; returns its exit status."""
    from docker.errors import APIError, DockerException

    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    try:
        container = client.containers.create(**spec.create_kwargs())
    except APIError as exc:
        raise _gpu_error(spec, exc.explanation or str(exc)) or UsageError(
            f"cannot create the container: {_short(exc.explanation or str(exc))}", "check the image and the flags") from None
    try:
        try:
            container.start()
        except APIError as exc:
            raise _gpu_error(spec, exc.explanation or str(exc)) or UsageError(
                f"cannot start the container: {_short(exc.explanation or str(exc))}", "check the image and the flags") from None
        stderr.write(f"running {spec.image_ref} ({spec.image_id[:19]}) as {' '.join(spec.command)}\n")
        try:
            for out, err in container.attach(stdout=True, stderr=True, stream=True, logs=True, demux=True):
                if out:
                    stdout.write(out.decode("utf-8", "replace"))
                    stdout.flush()
                if err:
                    stderr.write(err.decode("utf-8", "replace"))
                    stderr.flush()
        except DockerException:
            pass  # the log is complete in container.log either way
        status = int(container.wait().get("StatusCode", 1))
        log = container.logs(stdout=True, stderr=True, timestamps=True)
        atomic_write(spec.out_dir / "container.log", log)
        return status
    except DockerException as exc:
        raise DockerUnavailable(f"lost the Docker daemon while the container ran: {_short(str(exc))}",
                                "check `docker info`; the container may still exist (`docker ps -a`)") from None
    finally:
        try:
            container.remove(force=True)
        except DockerException:
            pass


def run(image: str, command: Sequence[str], out_dir: Path, *, cache_dir: Path | None = None, gpus: str | None = None,
        vendor: str | None = None, key_file: Path | None = None, allowed_signers: Path | None = None,
        client: Any = None) -> int:
    client = client or docker_client()
    spec = plan(client, image, command, out_dir, cache_dir=cache_dir, gpus=gpus, vendor=vendor,
                key_file=key_file, allowed_signers=allowed_signers)
    return execute(client, spec)

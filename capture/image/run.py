"""Run capture inside an image: by image ID, networking off, the image's identity passed in.

- The reference is resolved to an image ID first and the container is created from that ID, so
  a tag that moved, or one that would be pulled, can never stand in silently.
- ``network_mode="none"``: the trial reads models and datasets from the mounted HF cache only.
- The HF cache is mounted read-only, the output folder read-write; the container runs as the
  calling user so what it writes there belongs to them. Every mount source is checked first
  (:mod:`capture.image.mounts`: no root, home or system folder, no socket or device, ``--out``
  and ``--cache`` disjoint, key files regular files).
- The code (``--code DIR``, default the git work tree of the current folder) is mounted
  read-only at the same path as on the host, with its git folders (a linked worktree's common
  folder too), and is the container's working folder: the code probe inside sees what it sees
  outside, so ``code.*`` agrees.
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
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from capture._atomic import atomic_write
from capture.errors import DockerUnavailable, UsageError
from capture.image import LABEL_FLAVOUR, _short, docker_client, mounts

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
    code_dir: Path | None = None
    """Mounted read-only at the same path, and the working folder."""
    git_dirs: tuple[Path, ...] = ()
    """Git folders outside ``code_dir`` that its git state lives in (a linked worktree's), read-only."""
    key_pub: Path | None = None
    creates: tuple[str, ...] = ()
    """What a real run creates before starting (shown by ``--dry-run``, which creates nothing)."""

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
        if self.code_dir is not None:
            vols[str(self.code_dir)] = {"bind": str(self.code_dir), "mode": "ro"}
            for g in self.git_dirs:
                vols[str(g)] = {"bind": str(g), "mode": "ro"}
        if self.key_file is not None:
            vols[str(self.key_file)] = {"bind": KEY_MOUNT, "mode": "ro"}
            if self.key_pub is not None:  # the principal defaults to the public key's comment
                vols[str(self.key_pub)] = {"bind": KEY_MOUNT + ".pub", "mode": "ro"}
        if self.allowed_signers is not None:
            vols[str(self.allowed_signers)] = {"bind": SIGNERS_MOUNT, "mode": "ro"}
        return vols

    def mounts(self) -> list[dict[str, str]]:
        """Every mount, as ``--dry-run`` shows it."""
        return [{"source": src, "target": v["bind"], "mode": v["mode"]} for src, v in self.volumes().items()]

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
            **({"working_dir": str(self.code_dir)} if self.code_dir is not None else {}),
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


def code_mounts(code: Path | str) -> tuple[Path, tuple[Path, ...]]:
    """(the code folder, the git folders outside it that hold its git state), resolved and checked."""
    real = mounts.folder("--code", code, must_exist=True, inside_system=True)
    extra: list[Path] = []
    try:
        out = subprocess.run(["git", "-C", str(real), "rev-parse", "--path-format=absolute", "--git-dir", "--git-common-dir"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return real, ()
    if out.returncode == 0:
        for line in out.stdout.splitlines():
            g = mounts.resolved(line.strip())
            if line.strip() and not (g == real or real in g.parents) and g not in extra:
                extra.append(mounts.folder("--code (its git folder)", g, must_exist=True, inside_system=True))
    # Keep only the outermost folders (a worktree's git dir lies inside the common dir).
    outer = tuple(g for g in extra if not any(o != g and o in g.parents for o in extra))
    return real, outer


def default_code() -> Path | None:
    """The git work tree of the current folder; None outside git."""
    try:
        out = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return Path(out.stdout.strip()) if out.returncode == 0 and out.stdout.strip() else None


def plan(client: Any | None, image: str, command: Sequence[str], out_dir: Path, *, cache_dir: Path | None = None,
         gpus: str | None = None, vendor: str | None = None, key_file: Path | None = None,
         allowed_signers: Path | None = None, code_dir: Path | None = None,
         creates: Sequence[str] = ()) -> RunSpec:
    """Check the inputs and decide the run; creates nothing (:func:`execute` creates ``out_dir``)."""
    if not command:
        raise UsageError("nothing to run in the container",
                         "put the capture command after `--`, e.g. `capture run --image REF -- trial --example tiny`")
    out = mounts.folder("--out", out_dir, must_exist=False)
    cache = mounts.folder("--cache", cache_dir, must_exist=True) if cache_dir is not None else None
    mounts.disjoint(out, cache)
    key = mounts.regular_file("--key", key_file) if key_file is not None else None
    pub = None
    if key is not None and os.path.lexists(f"{key_file}.pub"):
        pub = mounts.regular_file("--key (its .pub)", f"{key_file}.pub")
    signers = mounts.regular_file("--allowed-signers", allowed_signers) if allowed_signers is not None else None
    code, git_dirs = code_mounts(code_dir) if code_dir is not None else (None, ())
    mounts.writable_apart(out, {"--code": code, "--key": key, "--key (its .pub)": pub, "--allowed-signers": signers,
                                **{f"--code's git folder {i + 1}": g for i, g in enumerate(git_dirs)}})
    image_id, labels = resolve_image(client or docker_client(), image)
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
    made = [*creates] + ([] if out.is_dir() else [f"folder {out}"])
    return RunSpec(
        image_id=image_id, image_ref=image, labels=labels, command=tuple(command), out_dir=out,
        cache_dir=cache, gpus=gpus, vendor=vendor if gpus else None,
        user=f"{os.getuid()}:{os.getgid()}", key_file=key, key_pub=pub, allowed_signers=signers,
        code_dir=code, git_dirs=git_dirs, creates=tuple(made),
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
        spec.out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--out {spec.out_dir}: cannot create ({exc.strerror})", "choose a folder you can write") from None
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
        code_dir: Path | None = None, client: Any = None) -> int:
    client = client or docker_client()
    spec = plan(client, image, command, out_dir, cache_dir=cache_dir, gpus=gpus, vendor=vendor,
                key_file=key_file, allowed_signers=allowed_signers, code_dir=code_dir)
    return execute(client, spec)

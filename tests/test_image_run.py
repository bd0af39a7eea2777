"""What `capture run` asks Docker for, decided without a daemon (the docker tests run it for real)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from docker.types import DeviceRequest

from capture._cli import main
from capture.errors import DockerUnavailable
from capture.image import run

IMAGE_ID = "sha256:" + "c" * 64
LABELS = {"io.capture.flavour": "cuda", "org.opencontainers.image.title": "capture (cuda)"}


def _spec(tmp_path: Path, **kw) -> run.RunSpec:
    return run.RunSpec(image_id=IMAGE_ID, image_ref="capture-cuda:0.1.0", labels=LABELS,
                       command=("trial", "--example", "tiny"), out_dir=tmp_path / "out", **kw)


def test_runs_by_id_with_networking_off_and_identity_passed_in(tmp_path):
    kw = _spec(tmp_path, cache_dir=tmp_path / "hub", user="1000:1000").create_kwargs()
    assert kw["image"] == IMAGE_ID and kw["network_mode"] == "none" and kw["user"] == "1000:1000"
    env = kw["environment"]
    assert env["CAPTURE_IMAGE_ID"] == IMAGE_ID and env["CAPTURE_IMAGE_REF"] == "capture-cuda:0.1.0"
    assert json.loads(env["CAPTURE_IMAGE_LABELS"]) == LABELS
    assert env["HF_HUB_OFFLINE"] == "1" and env["HF_HUB_CACHE"] == "/hf-cache"
    assert kw["volumes"] == {str(tmp_path / "out"): {"bind": "/out", "mode": "rw"},
                             str(tmp_path / "hub"): {"bind": "/hf-cache", "mode": "ro"}}
    assert "working_dir" not in kw and kw["command"] == ["trial", "--example", "tiny"]
    assert "device_requests" not in kw and "devices" not in kw


def test_nvidia_gpus_are_a_device_request(tmp_path):
    kw = _spec(tmp_path, gpus="all", vendor="nvidia").create_kwargs()
    (req,) = kw["device_requests"]
    assert isinstance(req, DeviceRequest) and req["Count"] == -1 and req["Capabilities"] == [["gpu"]]
    (req,) = _spec(tmp_path, gpus="0,2", vendor="nvidia").create_kwargs()["device_requests"]
    assert req["DeviceIDs"] == ["0", "2"] and req["Capabilities"] == [["gpu"]]


def test_amd_gpus_are_devices_groups_and_unconfined_seccomp(tmp_path):
    kw = _spec(tmp_path, gpus="all", vendor="amd").create_kwargs()
    assert kw["devices"] == ["/dev/kfd:/dev/kfd:rwm", "/dev/dri:/dev/dri:rwm"]
    assert kw["security_opt"] == ["seccomp=unconfined"]
    assert kw["group_add"][0] == "video"
    assert "device_requests" not in kw


def test_key_and_signers_are_mounted_read_only(tmp_path):
    kw = _spec(tmp_path, key_file=tmp_path / "k", allowed_signers=tmp_path / "a").create_kwargs()
    assert kw["volumes"][str(tmp_path / "k")] == {"bind": "/run/capture/key", "mode": "ro"}
    assert kw["environment"]["CAPTURE_KEY"] == "/run/capture/key"
    assert kw["environment"]["CAPTURE_ALLOWED_SIGNERS"] == "/run/capture/allowed_signers"


@pytest.mark.parametrize("explanation", [
    'could not select device driver "" with capabilities: [[gpu]]',
    "OCI runtime create failed: nvidia-container-cli: initialization error: nvml error: driver not loaded",
])
def test_missing_nvidia_runtime_becomes_one_error_with_the_toolkit_hint(tmp_path, explanation):
    err = run._gpu_error(_spec(tmp_path, gpus="all", vendor="nvidia"), explanation)
    assert isinstance(err, DockerUnavailable) and err.exit_code == 2
    assert err.message.startswith("--gpus all: Docker has no NVIDIA GPU runtime")
    assert "NVIDIA Container Toolkit" in err.hint
    assert run._gpu_error(_spec(tmp_path), "No such image") is None


def test_run_without_daemon_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/absent.sock")
    assert main(["run", "--image", "capture-cpu:0.1.0", "--out", str(tmp_path / "o"), "--", "fingerprint"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no Docker daemon answers") and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_run_needs_a_command(tmp_path, capsys):
    assert main(["run", "--image", "x", "--"]) == 2
    assert "nothing to run in the container" in capsys.readouterr().err

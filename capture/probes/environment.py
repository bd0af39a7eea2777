"""Environment variables that change results, from an allowlist; secrets are never recorded.

A variable is recorded only if its name is allowlisted (a prefix such as ``NCCL_`` or an exact
name such as ``PYTHONHASHSEED``). Even then it is withheld, and only its name listed under
``redacted``, when its name or its value looks like a credential. Variables outside the
allowlist (``HF_TOKEN``, ``AWS_SECRET_ACCESS_KEY``, ...) are neither recorded nor named.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from capture.probes import ProbeOptions

ALLOWED_PREFIXES = (
    "CUDA_", "NCCL_", "TORCH", "PYTORCH_", "HIP_", "ROCR_", "HSA_", "ROCM_", "MIOPEN_", "RCCL_",
    "CUBLAS_", "CUBLASLT_", "CUDNN_", "NVIDIA_", "NVTE_", "TRITON_", "OMP_", "GOMP_", "MKL_",
    "OPENBLAS_", "KMP_", "ACCELERATE_", "XLA_", "FSDP_", "DS_", "HF_HUB_", "HF_DATASETS_",
    "TRANSFORMERS_", "GPU_", "AMD_", "HCC_", "NVTX_",
)
ALLOWED_NAMES = frozenset({
    "TOKENIZERS_PARALLELISM", "HF_HOME", "HF_ENDPOINT", "LD_LIBRARY_PATH", "LD_PRELOAD",
    "PYTHONHASHSEED", "PYTHONOPTIMIZE", "PYTHONPATH", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE",
    "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "CROSS_RANK",
    "CROSS_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "CC", "CXX",
})
# Allowlisted names whose wording trips the secret-name check but that hold no secret.
NOT_SECRET_NAMES = frozenset({"TOKENIZERS_PARALLELISM"})
SKIPPED_PREFIXES = ("CAPTURE_IMAGE_",)  # recorded by the container probe

_SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH|PRIVATE|COOKIE|SESSION", re.I)
# Names where a long opaque value is presumably a credential even without a telltale word.
_SUSPICIOUS_NAME = re.compile(r"PASS|PWD|CRED|CERT|SIGN|API|ACCESS|SALT|HMAC|LICEN[CS]E|ACCOUNT|USER", re.I)
_SECRET_VALUE = re.compile(
    r"[a-z][a-z0-9+.-]*://[^/\s@:]*:[^/\s@]*@"  # URL with user:password@
    r"|https?://[^/\s@]+@"  # http(s) URL with userinfo: the user name is often the token
    r"|\bhf_[A-Za-z0-9]{10,}"  # Hugging Face token
    r"|\b(?:ghp|gho|ghu|ghs|ghr)_[A-Za-z0-9]{20,}|\bgithub_pat_\w{20,}|\bglpat-[\w-]{20,}"
    r"|\bxox[abprs]-[\w-]{10,}|\bsk-[A-Za-z0-9_-]{20,}|\bAKIA[0-9A-Z]{16}\b|\bAIza[\w-]{30,}"
    r"|\beyJ[\w-]{10,}\.[\w-]{10,}\."  # JWT
    r"|\b(?:bearer|basic|token)\s+[\w.~+/=-]{8,}"  # Authorization header values
    r"|-----BEGIN [A-Z ]*PRIVATE KEY-----"
    r"|(?:password|passwd|pwd|secret|token|api[_-]?key)\s*[=:]",
    re.I,
)
_OPAQUE_BLOB = re.compile(r"[0-9a-fA-F]{32,}|[A-Za-z0-9+/_-]{24,}={0,2}")


def is_secret(name: str, value: str) -> bool:
    """True when a variable must not be recorded."""
    if name not in NOT_SECRET_NAMES and _SECRET_NAME.search(name):
        return True
    if _SECRET_VALUE.search(value):
        return True
    return bool(_SUSPICIOUS_NAME.search(name) and _OPAQUE_BLOB.search(value))


def is_allowed(name: str) -> bool:
    if name.startswith(SKIPPED_PREFIXES):
        return False
    return name in ALLOWED_NAMES or name.startswith(ALLOWED_PREFIXES)


@dataclass(frozen=True)
class EnvironmentInfo:
    variables: Mapping[str, str] = field(default_factory=dict)
    redacted: tuple[str, ...] = ()
    """Allowlisted names whose values looked like credentials and were left out."""

    def to_manifest(self) -> dict[str, Any]:
        return {"variables": dict(self.variables), "redacted": sorted(self.redacted)}


def probe(options: ProbeOptions, *, env: Mapping[str, str] | None = None) -> EnvironmentInfo:
    env = os.environ if env is None else env
    variables: dict[str, str] = {}
    redacted: list[str] = []
    for name in sorted(env):
        if not is_allowed(name):
            continue
        value = env[name]
        if is_secret(name, value):
            redacted.append(name)
        else:
            variables[name] = value
    return EnvironmentInfo(variables=variables, redacted=tuple(redacted))

"""Environment variables that change results, from an allowlist; secrets are never recorded.

A variable is recorded only if its name is allowlisted (a prefix such as ``NCCL_`` or an exact
name such as ``PYTHONHASHSEED``). Even then it is withheld, and only its name listed under
``redacted``, when its name or its value looks like a credential. Variables outside the
allowlist (``HF_TOKEN``, ``AWS_SECRET_ACCESS_KEY``, ...) are neither recorded nor named. What
looks like a credential is decided by :mod:`capture.redact` (structure and value).

The variables are read from :func:`capture.startenv.environ_at_start`: the environment as the
process found it, before torch or any other library set variables of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from capture import redact, startenv
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


def is_secret(name: str, value: str) -> bool:
    """True when a variable must not be recorded (its name or its value holds a credential)."""
    if name in NOT_SECRET_NAMES:
        name = ""
    return redact.looks_secret(name, value)


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
    env = startenv.environ_at_start() if env is None else env
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

"""Which extra of the distribution provides an optional import, for the one-line hint a command
gives when it is missing (``pip install 'capture-stack[trial]'``).

The base install (``pip install capture-stack``) runs fingerprint, keygen, sign, verify, diff,
pin, compare, show, export, decide, init, image and run; what needs more names its extra.
tests/test_base_install.py checks this table against pyproject.toml's extras.
"""

from __future__ import annotations

from capture.errors import UsageError

DISTRIBUTION = "capture-stack"

EXTRA_OF: dict[str, tuple[str, str]] = {
    # top-level module: (extra, the distribution in that extra that provides it)
    "torch": ("trial", "torch"),
    "numpy": ("trial", "numpy"),
    "transformers": ("trial", "transformers"),
    "peft": ("trial", "peft"),
    "safetensors": ("trial", "safetensors"),
    "accelerate": ("hf", "accelerate"),
    "lightning": ("lightning", "lightning"),
    "mlflow": ("trackers", "mlflow-skinny"),
    "wandb": ("trackers", "wandb"),
    "tensorboard": ("trackers", "tensorboard"),
    "uv": ("dev", "uv"),
    "bitsandbytes": ("qlora", "bitsandbytes"),
    "liger_kernel": ("kernels", "liger-kernel"),
}


def missing_extra(exc: ModuleNotFoundError, command: str | None) -> UsageError | None:
    """The usage error (exit 2) for an import that an extra provides; None for any other."""
    top = (exc.name or "").split(".")[0]
    if top not in EXTRA_OF:
        return None
    extra = EXTRA_OF[top][0]
    what = f"capture {command}" if command else "capture"
    return UsageError(f"{what} needs the {extra} extra ({top} is not installed)",
                      f"pip install '{DISTRIBUTION}[{extra}]'")

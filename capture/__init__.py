"""capture: tie every GPU fine-tuning result to the exact stack that produced it."""

from __future__ import annotations

from capture import startenv as _startenv  # noqa: F401 - first: the environment before any library touches it

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Recorder", "__version__"]

if TYPE_CHECKING:
    from capture.recorder import Recorder


def __getattr__(name: str) -> Any:
    # Lazy: `capture verify` must not pay for importing torch.
    if name == "Recorder":
        from capture.recorder import Recorder

        return Recorder
    raise AttributeError(f"module 'capture' has no attribute {name!r}")

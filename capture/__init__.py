"""capture: tie every GPU fine-tuning result to the exact stack that produced it."""

from capture import startenv as _startenv  # noqa: F401 - first: the environment before any library touches it

__version__ = "0.1.0"

"""capture: tie every GPU fine-tuning result to the exact stack that produced it."""

__version__ = "0.1.0"

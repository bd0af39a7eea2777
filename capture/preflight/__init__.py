"""Preflight: is this the card, and the machine, that was paid for?

Health from the driver (NVML; amdsmi on AMD) and measured figures (bf16 GEMM, device copy,
pinned host<->device, peer copies, all-reduce bus bandwidth) judged against what the catalog
(capture/data/preflight.toml) says that SKU should do. The result is the ``[preflight]`` table of a
manifest (capture.preflight.checks). ``capture preflight`` runs it alone; ``capture trial`` runs it
as its first stage.
"""

from capture.preflight.checks import Check, PreflightResult
from capture.preflight.report import preflight_rows, render
from capture.preflight.stage import run_preflight, trial_preflight

__all__ = ["Check", "PreflightResult", "preflight_rows", "render", "run_preflight", "trial_preflight"]

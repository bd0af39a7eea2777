"""Moved to :mod:`capture.recorder` (``from capture import Recorder``); kept for old imports."""

from capture.recorder import Recorder, RecorderResult, device_name, throughput_fields

__all__ = ["Recorder", "RecorderResult", "device_name", "throughput_fields"]

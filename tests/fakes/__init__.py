"""Fake GPU bindings built from real captured tool output (tests/fixtures), faked at the binding.

There is no GPU here, so the vendor libraries (libnvidia-ml, libamd_smi) cannot answer. These
fakes stand in for the Python bindings (``pynvml``, ``amdsmi``) and serve values parsed from real
``nvidia-smi -q`` / ``-q -x`` / ``topo -m`` and ``amd-smi static`` / ``rocm-smi`` output, so the
probe code runs exactly as it would against the real binding:

- the fake ``pynvml`` reuses the real package's error classes (``NVMLError_NotSupported``, ...),
  constants and ctypes structures; only the functions that would call into the C library are
  replaced;
- a value the tool printed as ``N/A`` / ``[N/A]`` (or did not print at all) makes the matching
  call raise ``NVMLError_NotSupported`` / ``AmdSmiLibraryException(NOT_SUPPORTED)``, as the real
  libraries do on boards without that field.

Use::

    fake = fake_pynvml_from_smi_q(text)        # or fake_pynvml_h200(), fake_pynvml_from_smi_xml(xml)
    monkeypatch.setitem(sys.modules, "pynvml", fake)

``write_tool(tmp_path, "nvidia-smi", {"-q -x": xml})`` puts a real executable on a folder you add
to PATH, for the subprocess fallbacks.

Split by binding: ``fakes/nvml.py`` (pynvml), ``fakes/amdsmi.py`` (amdsmi), ``fakes/_common.py``
(fixture folders, the N/A marker, ``write_tool``). Everything is re-exported here, so tests keep
importing ``from fakes import ...``.
"""

from fakes._common import *  # noqa: F401,F403
from fakes.amdsmi import *  # noqa: F401,F403
from fakes.nvml import *  # noqa: F401,F403

"""The toolchain probe against the real tools on this machine, and version parsing of real output."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from capture.probes import ProbeOptions
from capture.probes.toolchain import parse_version, probe

REAL_OUTPUTS = {
    # first lines as the tools print them (gcc from tests/fixtures/h200/collect_env.txt's machine)
    "gcc": ("gcc (Ubuntu 13.3.0-6ubuntu2~24.04.1) 13.3.0\nCopyright (C) 2023", "13.3.0"),
    "cmake": ("cmake version 4.4.3\n\nCMake suite maintained", "4.4.3"),
    "nvcc": ("nvcc: NVIDIA (R) Cuda compiler driver\nCuda compilation tools, release 13.0, V13.0.88\nBuild cuda_13.0.r13.0", "13.0.88"),
    "clang": ("Debian clang version 14.0.6\nTarget: x86_64-pc-linux-gnu", "14.0.6"),
    "hipcc": ("HIP version: 6.2.41133-dd7f95766\nAMD clang version 18.0.0git", "6.2.41133-dd7f95766"),
}


@pytest.mark.parametrize("tool", sorted(REAL_OUTPUTS))
def test_parse_version(tool: str):
    text, want = REAL_OUTPUTS[tool]
    assert parse_version(tool, text) == want


def test_probe_matches_the_real_gcc():
    gcc = shutil.which("gcc")
    if not gcc:
        pytest.skip("no gcc on PATH")
    out = subprocess.run([gcc, "-dumpfullversion"], capture_output=True, text=True).stdout.strip()
    table = probe(ProbeOptions()).to_manifest()
    assert table["gcc"] == {"version": out, "path": gcc}


def test_probe_with_empty_path(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PATH", "")
    assert probe(ProbeOptions()).to_manifest() == {}


def test_nvcc_version_json_is_read_without_starting_nvcc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # the layout of a CUDA toolkit: bin/nvcc and version.json beside bin/ (as in /usr/local/cuda)
    (tmp_path / "bin").mkdir()
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 99.9, V99.9.99'\n")
    nvcc.chmod(0o755)
    (tmp_path / "version.json").write_text('{"cuda": {"name": "CUDA SDK", "version": "13.0.2"},'
                                           ' "cuda_nvcc": {"name": "CUDA NVCC", "version": "13.0.88"}}')
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert probe(ProbeOptions()).to_manifest()["nvcc"]["version"] == "13.0.88"
    (tmp_path / "version.json").unlink()  # no file: falls back to running nvcc
    assert probe(ProbeOptions()).to_manifest()["nvcc"]["version"] == "99.9.99"


PIP_WRAPPER = """#!{python}
# -*- coding: utf-8 -*-
import re
import sys
from {tool} import {tool}
if __name__ == '__main__':
    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])
    sys.exit({tool}())
"""


@pytest.mark.parametrize("tool", ["cmake", "ninja"])
def test_a_pip_console_script_wrapper_is_bypassed(tool: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """pip's `cmake`/`ninja` wrappers start Python (~100 ms); the probe runs the binary they exec.
    The wrapper's interpreter does not exist here: had the probe run the wrapper, no version."""
    real = shutil.which(tool)
    if real is None:
        pytest.skip(f"no {tool} on this machine")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    wrapper = venv / "bin" / tool
    wrapper.write_text(PIP_WRAPPER.format(python=venv / "bin" / "no-such-python", tool=tool))
    wrapper.chmod(0o755)
    data_bin = venv / "lib" / "python3.11" / "site-packages" / tool / "data" / "bin"
    data_bin.mkdir(parents=True)
    (data_bin / tool).symlink_to(real)
    monkeypatch.setenv("PATH", str(venv / "bin"))
    found = probe(ProbeOptions())
    expected = parse_version(tool, subprocess.run([real, "--version"], capture_output=True, text=True).stdout)
    assert found.versions[tool] == expected and found.paths[tool] == str(wrapper)

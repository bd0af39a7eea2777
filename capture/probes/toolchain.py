"""Compilers and build tools on PATH (they build CUDA/HIP extensions such as flash-attn at install
or first use, so they are part of the stack). One short subprocess per tool that exists."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from capture.probes import ProbeOptions

# tool -> (command, regex that pulls the version out of its output)
TOOLS: dict[str, tuple[list[str], str]] = {
    "gcc": (["gcc", "--version"], r"(\d+\.\d+(?:\.\d+)?)"),
    "clang": (["clang", "--version"], r"clang version (\d+\.\d+(?:\.\d+)?)"),
    "cmake": (["cmake", "--version"], r"cmake version (\S+)"),
    "nvcc": (["nvcc", "--version"], r"release (\d+\.\d+), V(\S+)"),
    "hipcc": (["hipcc", "--version"], r"HIP version: (\S+)"),
    "ninja": (["ninja", "--version"], r"(\S+)"),
}
TIMEOUT_S = 5.0


def parse_version(tool: str, output: str) -> str | None:
    m = re.search(TOOLS[tool][1], output)
    if not m:
        return None
    return m.group(2) if tool == "nvcc" else m.group(1)


@dataclass(frozen=True)
class Toolchain:
    versions: dict[str, str] = field(default_factory=dict)
    paths: dict[str, str] = field(default_factory=dict)

    def to_manifest(self) -> dict:
        return {name: {"version": v, "path": self.paths[name]} for name, v in self.versions.items()}


def _nvcc_from_version_json(exe: str) -> str | None:
    """CUDA toolkits ship version.json beside bin/: reading it beats starting nvcc (~100 ms)."""
    try:
        data = json.loads((Path(exe).resolve().parent.parent / "version.json").read_text())
        return str(data["cuda_nvcc"]["version"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def wrapped_binary(exe: str, tool: str) -> str | None:
    """The real binary behind a pip console-script wrapper, or None when ``exe`` is not one.

    ``pip install cmake`` / ``ninja`` put a Python script in ``<prefix>/bin`` that starts an
    interpreter, imports the package and execs ``<site-packages>/<tool>/data/bin/<tool>``: ~100 ms
    of Python before the tool says its version. The binary itself answers in milliseconds, with
    the same output; the manifest still records the path on PATH."""
    try:
        with open(exe, "rb") as f:
            head = f.read(2048)
    except OSError:
        return None
    first = head.split(b"\n", 1)[0]
    if not (head.startswith(b"#!") and b"python" in first and re.search(rb"(?:from|import) %s\b" % tool.encode(), head)):
        return None
    import glob

    prefix = Path(exe).parent.parent
    for candidate in sorted(glob.glob(str(prefix / "lib" / "python*" / "site-packages" / tool / "data" / "bin" / tool))):
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def _start(tool: str) -> tuple[str, str, str | subprocess.Popen[bytes]] | None:
    """``(tool, path on PATH, version or the started process)``, or None when the tool is absent."""
    cmd = TOOLS[tool][0]
    exe = shutil.which(cmd[0])
    if not exe:
        return None
    if tool == "nvcc" and (version := _nvcc_from_version_json(exe)):
        return tool, exe, version
    run = wrapped_binary(exe, tool) or exe
    try:
        proc = subprocess.Popen([run, *cmd[1:]], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)
    except (OSError, subprocess.SubprocessError):
        return None
    return tool, exe, proc


def _finish(proc: subprocess.Popen[bytes], deadline: float) -> str | None:
    try:
        out, _ = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return None
    return out.decode("utf-8", "replace")


def probe(options: ProbeOptions) -> Toolchain:
    # Every tool starts at once: their start-up (not ours) is what costs time, so it overlaps;
    # each is then read in turn, all within one TIMEOUT_S.
    started: list[tuple[str, str, str | subprocess.Popen[bytes]]] = []
    versions: dict[str, str] = {}
    paths: dict[str, str] = {}
    try:
        for tool in TOOLS:
            if (one := _start(tool)) is not None:
                started.append(one)
        deadline = time.monotonic() + TIMEOUT_S
        for tool, exe, how in started:
            version = how if isinstance(how, str) else None
            if isinstance(how, subprocess.Popen):
                out = _finish(how, deadline)
                version = parse_version(tool, out) if out is not None else None
            if version:
                versions[tool], paths[tool] = version, exe
    finally:
        for _, _, how in started:
            if isinstance(how, subprocess.Popen) and how.poll() is None:
                how.kill()
                how.communicate()
    return Toolchain(versions, paths)

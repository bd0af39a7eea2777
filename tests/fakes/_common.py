"""Shared by the fakes: fixture folders, the N/A marker, executables on PATH."""

from __future__ import annotations

import ctypes
import json
import re
import stat
import sys
import types
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pynvml as _real_pynvml

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
H200 = FIXTURES / "h200"
REAL = FIXTURES / "real-world"

NA = None  # a value the tool printed as N/A: the binding raises NotSupported for it

_MISSING_TEXT = {"", "N/A", "[N/A]", "Not Supported", "[Not Supported]", "Unknown Error", "[Unknown Error]"}

# =========================================================================== tools on PATH


def write_tool(folder: Path, name: str, outputs: dict[str, str], rc: int = 0) -> Path:
    """A real executable ``folder/name`` that prints ``outputs[" ".join(argv)]`` and exits ``rc``.

    Unknown arguments exit 2 with a message on stderr, like the real tools do.
    """
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f".{name}.json"
    data.write_text(json.dumps(outputs))
    exe = folder / name
    exe.write_text(
        f"#!{sys.executable}\n"
        "import json, sys\n"
        f"outputs = json.load(open({str(data)!r}))\n"
        "key = ' '.join(sys.argv[1:])\n"
        "if key not in outputs:\n"
        "    sys.stderr.write('unknown arguments: ' + key + '\\n'); sys.exit(2)\n"
        "sys.stdout.write(outputs[key])\n"
        f"sys.exit({rc})\n"
    )
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return exe

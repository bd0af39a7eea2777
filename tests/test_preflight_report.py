"""`capture preflight`'s terminal table, read from the real H200 full run (tests/fixtures) and a
hand-made one at its edges: within the width, nothing cut, numbers kept with their units."""

from __future__ import annotations

import json
from pathlib import Path

from capture.preflight.report import render

FIX = Path(__file__).parent / "fixtures" / "preflight" / "h200"


def _rows(text: str) -> dict[str, str]:
    """check name -> its last column, continuation lines joined back."""
    out: dict[str, str] = {}
    name = ""
    for line in text.splitlines()[1:]:
        if not line.strip() or line.startswith("preflight "):
            break
        if line.startswith(" "):
            out[name] += " " + line.strip()
        else:
            name = line.split()[0]
            out[name] = line[len(text.splitlines()[0].split("expected / reason")[0]):].strip()
    return out


def test_the_h200_full_run_fits_100_columns_and_every_reason_is_whole():
    data = json.loads((FIX / "preflight-full-first-run.json").read_text())
    text = render(data, verbose=True)
    assert all(len(x) <= 100 for x in text.splitlines()), max(text.splitlines(), key=len)
    rows = _rows(text)
    for c in data["preflight"]["checks"] if "preflight" in data else data["checks"]:
        note = c.get("reason", "") if c.get("verdict") != "pass" or not c.get("expected") else c["expected"]
        assert rows[c["name"]] == note  # whole, in order, only re-spaced at line ends
    assert "8192x8192x8192" in text and "1980 MHz" in text  # a number stays with its unit
    wide = render(data, verbose=True, width=400)
    assert len(wide.splitlines()) == len([c for c in (data.get("preflight") or data)["checks"]]) + 3


def test_a_narrow_terminal_puts_the_reason_below_the_row_and_a_long_word_is_not_cut():
    path = "/" + "very-long-folder-name/" * 6 + "nvidia-smi"
    data = {"verdict": "fail", "mode": "quick", "device_kind": "cuda", "duration_s": 1.0, "checks": [
        {"name": "a_check_with_a_rather_long_name", "device": 0, "verdict": "fail", "value": 1.5, "unit": "GB/s",
         "reason": f"below the healthy range: {path} reported 1.5 GB/s"}]}
    text = render(data, width=60)
    lines = text.splitlines()
    assert lines[0].split() == ["check", "dev", "result", "value"] and lines[1] == "    expected / reason"
    assert lines[2].split() == ["a_check_with_a_rather_long_name", "0", "FAIL", "1.5", "GB/s"]
    assert lines[3] == "    below the healthy range:" and lines[4] == f"    {path}"  # overruns, never cut
    assert lines[5] == "    reported 1.5 GB/s"
    assert all(len(x) <= 60 for x in lines if path not in x)

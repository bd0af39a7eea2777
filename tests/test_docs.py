"""Every field a real manifest holds is documented in docs/manifest.md, and README documents every
command and flag the CLI accepts."""

from __future__ import annotations

import argparse
import re
import tomllib
from pathlib import Path

import pytest

from capture._cli import _parser
from capture.fingerprint import collect
from capture.probes import ProbeOptions

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "manifest.md").read_text()
README = (ROOT / "README.md").read_text()

# Keys chosen by the data, as the doc writes them.
DYNAMIC = [
    (re.compile(r"^python\.packages\.[^.]+"), "python.packages.<name>"),
    (re.compile(r"^environment\.variables\.[^.]+$"), "environment.variables.<NAME>"),
    (re.compile(r"^toolchain\.[^.]+"), "toolchain.<tool>"),
    (re.compile(r"^trial\.memory\.estimate\.(weights|lora_adapters|gradients|optimizer_state|optimizer_state_paged|"
                r"autocast_weight_copies|activations|attention|logits|transient|library_workspaces|allocator_reserve|"
                r"cuda_context|libraries|framework_overhead)\b"), "trial.memory.estimate.<term>"),
    (re.compile(r"^trial\.cost\.phases\.[^.]+_s$"), "trial.cost.phases.<phase>_s"),
    (re.compile(r"^datasets\[\]"), "models[]"),
    (re.compile(r"^.*\.skipped$"), "<table>.skipped"),
]


def _expand(token: str) -> list[str]:
    m = re.search(r"\{([^}]*)\}", token)
    if not m:
        return [token]
    return [x for part in m.group(1).split(",") for x in _expand(token[:m.start()] + part.strip() + token[m.end():])]


def documented() -> tuple[set[str], set[str]]:
    """(exact paths, prefixes whose children are all documented)."""
    exact: set[str] = set()
    prefixes: set[str] = set()
    for line in DOC.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        tokens = re.findall(r"`([^`]+)`", cells[0])
        first = tokens[0]
        paths = []
        for tok in tokens:
            if "." in tok or tok == first:
                paths.extend(_expand(tok))
            else:
                base = first.rsplit(".", 1)[0] if "." in first else first
                paths.extend(_expand(f"{base}.{tok}"))
        for p in paths:
            if p.endswith(".*"):
                prefixes.add(p[:-2])
            else:
                exact.add(p)
                if "table" in cells[1] or "array of tables" in cells[1]:
                    prefixes.add(p)
    return exact, prefixes


def schema_paths(data, prefix: str = "") -> set[str]:
    out: set[str] = set()
    if isinstance(data, dict):
        for k, v in data.items():
            out |= schema_paths(v, f"{prefix}.{k}" if prefix else k)
    elif isinstance(data, list) and data and all(isinstance(x, dict) for x in data):
        for item in data:
            out |= schema_paths(item, prefix + "[]")
    else:
        out.add(prefix)
    return out


def normalise(key: str) -> str:
    for pattern, repl in DYNAMIC:
        key = pattern.sub(repl, key)
    return key


def undocumented(manifest: dict) -> list[str]:
    exact, prefixes = documented()
    missing = []
    for key in sorted(schema_paths({k: v for k, v in manifest.items() if k != "signature"})):
        k = normalise(key)
        if k + "[]" in exact or k + "[]" in prefixes:  # an empty array of tables (one GPU: no links)
            continue
        if k in exact or any(k == p or k.startswith(p + ".") or k.startswith(p + "[]") for p in prefixes):
            continue
        missing.append(key)
    return missing


def test_doc_parser_is_not_vacuous():
    exact, prefixes = documented()
    assert "nvidia.devices[].uuid" in exact and "trial.stats.step_time_p90_s" in exact
    assert "python.packages.<name>.version" in exact
    assert undocumented({"accelerator": {"vendor": "x", "no_such_field": 1}}) == ["accelerator.no_such_field"]


def test_every_field_of_a_live_fingerprint_is_documented(tmp_path: Path):
    manifest = collect(ProbeOptions(code=ROOT, progress=False))
    assert undocumented(manifest) == []


@pytest.mark.parametrize("path", sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "manifests").rglob("*.toml")
                                        if not p.name.startswith(".") and ".capture" not in p.parts))
def test_every_field_of_the_real_manifests_is_documented(path: str):
    data = tomllib.loads((ROOT / path).read_text())
    assert undocumented(data) == []


def _flags(parser: argparse.ArgumentParser, prefix: str = "") -> list[tuple[str, str]]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out.append((f"{prefix}{name}".strip(), ""))
                out.extend(_flags(sub, f"{prefix}{name} "))
        else:
            opts = [o for o in action.option_strings if o not in ("-h", "--help", "--version", "-v", "--verbose")]
            if opts:
                out.append((prefix.strip(), tuple(opts)))
    return out


def test_readme_documents_every_command_and_flag():
    missing = []
    for command, flag in _flags(_parser()):
        if not flag:
            if f"capture {command}" not in README:
                missing.append(f"capture {command}")
        elif not any(re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", README) for o in flag):
            missing.append(f"capture {command} {'/'.join(flag)}")
    assert missing == []

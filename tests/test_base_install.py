"""The base install (`pip install capture-stack`, no extras): the commands that read manifests work,
and those that need an extra name it in one line, exit 2.

The interpreter is this venv's with every module of every extra's distributions hidden by a
meta-path finder installed before capture is imported (a fresh base-only venv would need the
network); torch, numpy, transformers and the rest are then absent as they are on a base install.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from capture._extras import DISTRIBUTION, EXTRA_OF

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
H200_RUN = ROOT / "manifests" / "nvidia-h200-x1" / "2026-12-02" / "ff69c22bd470.toml"

_DRIVER = r"""
import contextlib, importlib.abc, io, json, sys
HIDDEN = set(json.loads(sys.argv[1]))

class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, Hide())
from capture._cli import main
results = []
for argv in json.loads(sys.argv[2]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as exc:
            rc = exc.code
        except BaseException as exc:  # a traceback is the failure this test looks for
            import traceback
            rc, err = "raised", io.StringIO(traceback.format_exc())
    results.append({"argv": argv, "rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue()})
hidden_loaded = sorted(m for m in sys.modules if m.split(".")[0] in HIDDEN)
print(json.dumps({"results": results, "hidden_loaded": hidden_loaded}))
"""


def _base_names() -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in PROJECT["dependencies"]}


def hidden_modules() -> set[str]:
    """Top-level modules of every distribution an extra adds (those the base also needs stay)."""
    extra_dists = {canonicalize_name(Requirement(r).name) for reqs in PROJECT["optional-dependencies"].values()
                   for r in reqs} - _base_names()
    modules = {m for m, dists in packages_distributions().items()
               if any(canonicalize_name(d) in extra_dists for d in dists) and not m.startswith("_")}
    assert {"torch", "numpy", "transformers", "peft", "safetensors"} <= modules  # the venv has the trial extra
    return modules


def run_without_extras(commands: list[list[str]], cwd: Path, home: Path) -> dict:
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "CAPTURE_LOG_LEVEL": "ERROR"}
    proc = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps(sorted(hidden_modules())), json.dumps(commands)],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_rich_is_a_base_dependency_and_the_extra_table_matches_pyproject():
    assert "rich" in _base_names()  # decide, show, compare and the reports render with it
    extras = PROJECT["optional-dependencies"]
    for module, (extra, dist) in EXTRA_OF.items():
        assert canonicalize_name(dist) in {canonicalize_name(Requirement(r).name) for r in extras[extra]}, (module, extra)
    import importlib.util

    installed = {m for m in EXTRA_OF if importlib.util.find_spec(m) is not None}
    assert installed <= hidden_modules() | {"uv"}  # each one an extra really adds (liger-kernel: CUDA only, not in dev)
    assert PROJECT["name"] == DISTRIBUTION


def test_reading_commands_work_and_trial_commands_name_their_extra(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    runs = tmp_path / "runs"
    shutil.copytree(ROOT / "manifests", runs)
    other = runs / "nvidia-h200-x1" / "2026-12-02" / "2405025881d1.toml"
    allowed = str(runs / ".capture" / "allowed_signers")
    h200 = str(runs / H200_RUN.relative_to(ROOT / "manifests"))
    commands = {
        "fingerprint": ["fingerprint", "-o", str(tmp_path / "fp.toml"), "--key", str(tmp_path / "key")],
        "verify": ["verify", str(tmp_path / "fp.toml"), "--allowed-signers", str(tmp_path / "key.allowed")],
        "verify tree": ["verify", "--signature-only", str(runs), "--allowed-signers", allowed],
        "show": ["show", h200, "--allowed-signers", allowed],
        "compare": ["compare", h200, str(other), "--allowed-signers", allowed],
        "decide": ["decide", str(runs), "--allowed-signers", allowed, "-o", str(tmp_path / "site")],
        "trial": ["trial", "--example", "tiny", "-o", str(tmp_path / "trial.toml")],
        "preflight": ["preflight"],
        "estimate": ["estimate", "--example", "tiny"],
    }
    # The key's allowed-signers line, as `capture keygen` prints it, for the live verify.
    out = run_without_extras([["keygen", "-o", str(tmp_path / "key")]], tmp_path, home)["results"][0]
    line = next(ln.strip() for ln in out["stderr"].splitlines() if "ssh-ed25519" in ln)
    (tmp_path / "key.allowed").write_text(line + "\n")
    got = run_without_extras(list(commands.values()), tmp_path, home)
    assert got["hidden_loaded"] == []
    res = dict(zip(commands, got["results"]))
    for name, r in res.items():
        assert "Traceback" not in r["stderr"] and r["rc"] != "raised", (name, r["stderr"][-2000:])
    assert res["fingerprint"]["rc"] == 0
    assert res["verify"]["rc"] == 0, res["verify"]["stderr"]  # signature, trust and the live stack: unchanged
    assert res["verify tree"]["rc"] == 0, res["verify tree"]["stdout"][-2000:] + res["verify tree"]["stderr"][-2000:]
    assert res["show"]["rc"] == 0 and "H200" in res["show"]["stdout"]
    assert res["compare"]["rc"] in (0, 1) and "tokens/s" in res["compare"]["stdout"]
    assert res["decide"]["rc"] == 0 and (tmp_path / "site" / "index.html").is_file()
    for name in ("trial", "preflight", "estimate"):
        assert res[name]["rc"] == 2
        assert res[name]["stderr"] == (f"error: capture {name} needs the trial extra (torch is not installed)\n"
                                       f"hint: pip install '{DISTRIBUTION}[trial]'\n")
    assert not (tmp_path / "trial.toml").exists()


@pytest.mark.parametrize("module", sorted(EXTRA_OF))
def test_every_extra_module_gives_the_one_line_hint(module):
    from capture._extras import missing_extra

    err = missing_extra(ModuleNotFoundError(f"No module named '{module}.sub'", name=f"{module}.sub"), "exec")
    extra = EXTRA_OF[module][0]
    assert err is not None and err.exit_code == 2
    assert err.diagnostics() == (f"error: capture exec needs the {extra} extra ({module} is not installed)\n"
                                 f"hint: pip install 'capture-stack[{extra}]'")
    assert missing_extra(ModuleNotFoundError("No module named 'nothing_here'", name="nothing_here"), "exec") is None

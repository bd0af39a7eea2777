"""The workflow `capture init --ci` writes, run as a script: its steps, extracted from the YAML, are
executed with bash against a real repository made by `capture init`, with capture installed the way
the workflow installs it (pip, the spec from CAPTURE_INSTALL, here from a wheel built from this
tree and no index). Green on the init commit; a pull request that adds a signer together with
results signed by it fails, naming both; a pull request with a trusted run is green, site included."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from capture import __version__
from capture._cli import main
from capture.decide.init import check_install_spec, install_spec
from capture.errors import UsageError
from capture.results.pin import pin
from test_results_helpers import Signer, git, h200_manifest

ROOT = Path(__file__).resolve().parent.parent
SPEC = f"capture-stack=={__version__}"
GIT_ENV = {"GIT_AUTHOR_NAME": "Results Bot", "GIT_AUTHOR_EMAIL": "bot@example.invalid",
           "GIT_COMMITTER_NAME": "Results Bot", "GIT_COMMITTER_EMAIL": "bot@example.invalid",
           "GIT_CONFIG_NOSYSTEM": "1"}


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """capture installed from a wheel of this tree by pip, into a folder of its own (no index, no deps:
    the dependencies are this interpreter's)."""
    base = tmp_path_factory.mktemp("ci-install")
    src = base / "src"
    src.mkdir()
    shutil.copytree(ROOT / "capture", src / "capture", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    wheels = base / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(wheels), str(src)], check=True, capture_output=True, timeout=600)
    return wheels


@pytest.fixture
def people(tmp_path) -> dict[str, Signer]:
    return {"alice": Signer(tmp_path, "alice@lab"), "bob": Signer(tmp_path, "bob@elsewhere")}


def _workflow(repo: Path) -> dict:
    return yaml.safe_load((repo / ".github" / "workflows" / "capture.yml").read_text())


def _init(tmp_path: Path, people, monkeypatch) -> Path:
    for k, v in GIT_ENV.items():
        monkeypatch.setenv(k, v)
    repo = tmp_path / "results"
    assert main(["init", str(repo), "--key", f"{people['alice'].key}.pub", "--ci", "--install", SPEC]) == 0
    git(repo, "branch", "-M", "main")
    return repo


def test_the_workflow_is_pinned_read_only_and_installs_capture_stack(tmp_path, people, monkeypatch, home):
    repo = _init(tmp_path, people, monkeypatch)
    text = (repo / ".github" / "workflows" / "capture.yml").read_text()
    flow = _workflow(repo)
    assert flow["permissions"] == {"contents": "read"}
    job = flow["jobs"]["verify"]
    uses = [s["uses"] for s in job["steps"] if "uses" in s]
    assert uses and all(re.fullmatch(r"actions/[\w-]+@[0-9a-f]{40}", u) for u in uses), uses
    assert job["env"]["CAPTURE_INSTALL"] == f"${{{{ vars.CAPTURE_INSTALL || '{SPEC}' }}}}"
    code = "\n".join(line.split("#")[0] for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert not re.search(r"(?<![\w-])capture==", code.replace("capture-stack==", ""))
    checkout = next(s for s in job["steps"] if s.get("uses", "").startswith("actions/checkout@"))
    assert checkout["with"]["fetch-depth"] == 0 and checkout["with"]["persist-credentials"] is False
    assert "--trust-from" in text


@pytest.mark.parametrize("spec", [SPEC, "capture-stack @ git+https://github.com/org/capture@" + "a" * 40])
def test_install_specs_that_are_accepted(spec):
    assert check_install_spec(spec) == spec


@pytest.mark.parametrize("spec", ["capture==0.1.0", "capture-stack", "capture-stack>=0.1", "capture-stack==0.1.0; python_version>'3'",
                                  "capture-stack @ git+https://github.com/org/capture@main", "capture-stack[trial]==0.1.0",
                                  "capture-stack @ https://example.com/x.whl", "capture-stack==0.1.0'; rm -rf /'"])
def test_install_specs_that_are_refused(spec):
    with pytest.raises(UsageError, match="--install"):
        check_install_spec(spec)


def test_the_default_install_spec_names_capture_stack():
    spec, _note = install_spec()
    assert check_install_spec(spec) == spec and spec.startswith("capture-stack")


def _expand(value: str, context: dict[str, str]) -> str:
    def one(m: re.Match[str]) -> str:
        expr = m.group(1).strip()
        if expr in context:
            return context[expr]
        alternatives = [a.strip() for a in expr.split("||")]
        for a in alternatives:
            if a.startswith("'") and a.endswith("'"):
                return a[1:-1]
            if context.get(a):
                return context[a]
        return ""
    out = re.sub(r"\$\{\{(.*?)\}\}", one, value)
    assert "${{" not in out
    return out


def run_workflow(repo: Path, wheels: Path, tmp_path: Path, event: str, base: str = "") -> list[subprocess.CompletedProcess[str]]:
    """Every `run` step of the job, in order, with bash as GitHub runs it (`bash -e`, pipefail),
    until one fails; the `uses` steps are what the runner provides (a checkout, Python)."""
    job = _workflow(repo)["jobs"]["verify"]
    context = {"github.event_name": event, "github.event.pull_request.base.sha": base if event == "pull_request" else "",
               "github.event.before": base if event == "push" else "", "vars.CAPTURE_INSTALL": ""}
    target = tmp_path / f"site-packages-{event}-{base[:7]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CAPTURE_", "PIP_"))}
    env.update({"PYTHONPATH": str(target), "PATH": f"{target / 'bin'}:{Path(sys.executable).parent}:{env['PATH']}",
                "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheels), "PIP_NO_DEPS": "1", "PIP_TARGET": str(target),
                "PIP_DISABLE_PIP_VERSION_CHECK": "1", **GIT_ENV})
    env.update({k: _expand(str(v), context) for k, v in job["env"].items()})
    done = []
    for step in job["steps"]:
        if "run" not in step:
            continue
        step_env = dict(env, **{k: _expand(str(v), context) for k, v in step.get("env", {}).items()})
        proc = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", _expand(step["run"], context)],
                              cwd=repo, env=step_env, capture_output=True, text=True, timeout=600)
        done.append(proc)
        if proc.returncode != 0:
            break
    return done


def test_the_workflow_steps_run_green_on_the_init_commit_and_judge_pull_requests(installed, tmp_path, people, monkeypatch, home):
    repo = _init(tmp_path, people, monkeypatch)
    steps = run_workflow(repo, installed, tmp_path, "push")  # the first push: no commit before it
    assert [p.returncode for p in steps] == [0, 0, 0], [p.stderr for p in steps]
    assert "0 manifest(s)" in steps[1].stdout and "no run pinned yet" in steps[2].stdout
    installed_capture = subprocess.run([str(next((tmp_path).glob("site-packages-push-*")) / "bin" / "capture"), "--version"],
                                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(next(tmp_path.glob("site-packages-push-*")))))
    assert installed_capture.stdout.strip() == f"capture {__version__}"

    main_sha = git(repo, "rev-parse", "HEAD").strip()
    git(repo, "checkout", "-q", "-b", "bob-joins")
    with open(repo / ".capture" / "allowed_signers", "a") as f:
        f.write(people["bob"].allowed_line)
    git(repo, "commit", "-q", "--no-verify", "-am", "trust bob")  # the hook has its own test
    fast = h200_manifest(created_utc="2026-12-02T09:00:00Z")
    fast["trial"]["stats"]["tokens_per_s"] = 999_999.0
    src = tmp_path / "bob.toml"
    people["bob"].write(src, fast)
    bobs = pin([str(src)], repo).runs[0].path
    steps = run_workflow(repo, installed, tmp_path, "pull_request", main_sha)
    assert [p.returncode for p in steps] == [0, 4]
    text = steps[1].stdout + steps[1].stderr
    assert "bob@elsewhere" in text and ".capture/allowed_signers" in text and Path(bobs).name in text

    git(repo, "checkout", "-q", "main")
    git(repo, "checkout", "-q", "-b", "alice-run")
    src = tmp_path / "alice.toml"
    people["alice"].write(src, h200_manifest(created_utc="2026-12-03T09:00:00Z"))
    pin([str(src)], repo)
    steps = run_workflow(repo, installed, tmp_path, "pull_request", main_sha)
    assert [p.returncode for p in steps] == [0, 0, 0], [p.stderr[-2000:] for p in steps]
    assert (repo / "site" / "index.html").is_file()
    assert git(repo, "status", "--porcelain") == ""  # site/ is ignored by the .gitignore init wrote


def test_a_bad_install_variable_fails_the_install_step(installed, tmp_path, people, monkeypatch, home):
    repo = _init(tmp_path, people, monkeypatch)
    job = _workflow(repo)["jobs"]["verify"]
    install = next(s for s in job["steps"] if s.get("name") == "install capture")
    proc = subprocess.run(["bash", "-eo", "pipefail", "-c", install["run"]], env=dict(os.environ, CAPTURE_INSTALL="capture==0.1.0"),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "must be capture-stack" in proc.stdout

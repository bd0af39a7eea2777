"""`capture init`: a results repository with real git, a real key, and the shipped CI template."""

from __future__ import annotations

import os
import subprocess

import pytest

from capture._cli import main
from capture.results.pin import pin
from test_results_helpers import Signer, h200_manifest


@pytest.fixture
def identity(monkeypatch, tmp_path):
    for k, v in {"GIT_AUTHOR_NAME": "Results Bot", "GIT_AUTHOR_EMAIL": "bot@example.invalid",
                 "GIT_COMMITTER_NAME": "Results Bot", "GIT_COMMITTER_EMAIL": "bot@example.invalid",
                 "HOME": str(tmp_path / "home"), "XDG_CONFIG_HOME": str(tmp_path / "home" / ".config"),
                 "GIT_CONFIG_NOSYSTEM": "1"}.items():
        monkeypatch.setenv(k, v)
    return Signer(tmp_path, "alice@lab")


def _git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def test_init_then_pin_then_the_hook(identity, tmp_path, capsys):
    repo = tmp_path / "results"
    assert main(["init", str(repo), "--key", f"{identity.key}.pub", "--ci"]) == 0
    out = capsys.readouterr().out
    assert "commit " in out
    assert _git(repo, "status", "--porcelain") == ""  # everything written is committed
    files = sorted(_git(repo, "ls-files").split())
    assert files == [".capture/allowed_signers", ".capture/results.toml", ".githooks/pre-commit",
                     ".github/workflows/capture.yml", ".gitignore", "README.md"]
    assert (repo / ".capture" / "allowed_signers").read_text().split() == [
        "alice@lab", 'namespaces="capture-manifest"', *identity.allowed_line.split()[1:]]
    assert "site/" in (repo / ".gitignore").read_text().splitlines()
    flow = (repo / ".github" / "workflows" / "capture.yml").read_text()
    assert "capture verify . --signature-only" in flow and "capture decide . -o site" in flow
    assert os.access(repo / ".githooks" / "pre-commit", os.X_OK)
    assert _git(repo, "config", "core.hooksPath").strip() == ".githooks"

    run = tmp_path / "run.toml"
    identity.write(run, h200_manifest())
    result = pin([str(run)], repo)  # the new repository's own trust is what pin checks
    assert result.commit and not result.runs[0].already_pinned

    # the hook runs `capture verify . --signature-only`: an unsigned manifest stops the commit
    env = dict(os.environ, PATH=f"{os.path.dirname(os.sys.executable)}:{os.environ['PATH']}")
    (repo / "stray.toml").write_text('schema_version = 1\nkind = "fingerprint"\ncreated_utc = "2026-12-02T00:00:00Z"\n')
    _git(repo, "add", "stray.toml")
    refused = subprocess.run(["git", "-C", str(repo), "commit", "-q", "-m", "stray"], capture_output=True, text=True, env=env)
    assert refused.returncode != 0 and "UNSIGNED" in refused.stdout + refused.stderr


def test_init_refuses_twice_and_bad_keys(identity, tmp_path, capsys):
    repo = tmp_path / "r"
    assert main(["init", str(repo), "--key", str(identity.key)]) == 0  # the private key's .pub is found
    capsys.readouterr()
    before = _git(repo, "rev-parse", "HEAD")
    assert main(["init", str(repo), "--key", f"{identity.key}.pub"]) == 2
    assert "already a results repository" in capsys.readouterr().err
    assert _git(repo, "rev-parse", "HEAD") == before
    bad = tmp_path / "bad.pub"
    bad.write_text("ssh-rsa AAAA x\n")
    assert main(["init", str(tmp_path / "other"), "--key", str(bad)]) == 2
    assert "not an ssh-ed25519 public key" in capsys.readouterr().err
    assert not (tmp_path / "other").exists()  # nothing written before the key was checked


def test_init_inside_an_existing_repository(identity, tmp_path, capsys):
    top = tmp_path / "project"
    top.mkdir()
    _git(top, "init", "-q")
    (top / "code.py").write_text("x = 1\n")
    assert main(["init", str(top / "manifests"), "--key", f"{identity.key}.pub", "--ci"]) == 0
    flow = (top / ".github" / "workflows" / "capture.yml").read_text()
    assert "capture verify manifests --signature-only" in flow
    assert "code.py" in _git(top, "status", "--porcelain")  # other work is left alone


def test_index_md_tells_full_from_lora_and_names_the_scaling():
    from capture.results.index import render_markdown

    rows = [{"path": "a.toml", "content_id": "aaaaaaaaaaaa", "kind": "trial", "method": "full",
             "scaling": "ddp x2 eff 0.94 · fsdp x2 eff 0.78", "tokens_per_s": 64113.2, "step_time_median_s": 0.2555,
             "step_time_cv": 0.0073, "peak_memory_bytes": 51795329024, "mfu": 0.3316},
            {"path": "b.toml", "content_id": "bbbbbbbbbbbb", "kind": "trial", "method": "lora"}]
    md = render_markdown(rows).decode()
    header = next(line for line in md.splitlines() if line.startswith("| created"))
    assert "| method | scaling |" in header and "| step CV |" in header and "| MFU |" in header
    a = next(line for line in md.splitlines() if "aaaaaaaaaaaa" in line)
    assert "| full | ddp x2 eff 0.94 · fsdp x2 eff 0.78 | 64,113 | 255.5 ms | 0.73 % | 48.24 GiB | 33.2 % |" in a
    assert "| lora | - |" in next(line for line in md.splitlines() if "bbbbbbbbbbbb" in line)

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


def _git(repo, *args, check=True):
    return subprocess.run(["git", "-C", str(repo), *args], check=check, capture_output=True, text=True).stdout


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


# --------------------------------------------------------------------------- issue 25: init never half-made, never overwrites


def _tree(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")) if path.exists() else None


def test_init_on_an_existing_file_is_one_line_exit_2(identity, tmp_path, capsys):
    target = tmp_path / "results"
    target.write_text("a file\n")
    assert main(["init", str(target), "--key", f"{identity.key}.pub"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {target}: exists and is not a folder") and "Traceback" not in err
    assert target.read_text() == "a file\n"


def test_init_without_a_git_identity_writes_nothing_and_a_second_init_works(identity, tmp_path, monkeypatch, capsys):
    for k in ("GIT_AUTHOR_NAME", "GIT_AUTHOR_EMAIL", "GIT_COMMITTER_NAME", "GIT_COMMITTER_EMAIL"):
        monkeypatch.delenv(k)
    monkeypatch.setenv("EMAIL", "")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", os.devnull)
    repo = tmp_path / "results"
    code = main(["init", str(repo), "--key", f"{identity.key}.pub", "--ci"])
    err = capsys.readouterr().err
    if code == 0:  # git found an identity on this machine anyway (e.g. a hostname with a domain)
        pytest.skip("git guessed an identity here")
    assert code == 2 and "identity" in err and "nothing was written" in err and "Traceback" not in err
    assert not repo.exists()
    monkeypatch.setenv("GIT_AUTHOR_NAME", "A")
    monkeypatch.setenv("GIT_AUTHOR_EMAIL", "a@example.invalid")
    monkeypatch.setenv("GIT_COMMITTER_NAME", "A")
    monkeypatch.setenv("GIT_COMMITTER_EMAIL", "a@example.invalid")
    assert main(["init", str(repo), "--key", f"{identity.key}.pub", "--ci"]) == 0
    assert _git(repo, "status", "--porcelain") == ""


def test_a_commit_that_fails_after_writing_takes_everything_back(identity, tmp_path, capsys):
    """The commit fails (a pre-existing index.lock): no file, no staged entry, no .git is left, in a
    new repository and in an existing one, and the next init works."""
    top = tmp_path / "project"
    top.mkdir()
    _git(top, "init", "-q")
    (top / "code.py").write_text("x = 1\n")
    _git(top, "add", "code.py")
    _git(top, "commit", "-q", "-m", "code")
    before = _tree(top)
    (top / ".git" / "index.lock").write_text("")
    assert main(["init", str(top / "manifests"), "--key", f"{identity.key}.pub", "--ci"]) == 2
    err = capsys.readouterr().err
    assert "nothing was kept" in err and "Traceback" not in err
    (top / ".git" / "index.lock").unlink()
    assert _tree(top) == before and _git(top, "status", "--porcelain") == ""
    assert _git(top, "config", "--get", "core.hooksPath", check=False).strip() == ""
    assert main(["init", str(top / "manifests"), "--key", f"{identity.key}.pub", "--ci"]) == 0


@pytest.mark.parametrize("existing", ["allowed_signers", "workflow", "hook", "hooksPath"])
def test_init_never_replaces_trust_workflow_or_hook_without_force(identity, tmp_path, capsys, existing):
    top = tmp_path / "project"
    top.mkdir()
    _git(top, "init", "-q")
    theirs = {"allowed_signers": top / "manifests" / ".capture" / "allowed_signers",
              "workflow": top / ".github" / "workflows" / "capture.yml",
              "hook": top / ".githooks" / "pre-commit"}.get(existing)
    if theirs is not None:
        theirs.parent.mkdir(parents=True)
        theirs.write_text("theirs\n")
    else:
        _git(top, "config", "core.hooksPath", "my-hooks")
    before = _tree(top)
    args = ["init", str(top / "manifests"), "--key", f"{identity.key}.pub", "--ci"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert ("already exists" in err or "core.hooksPath is already" in err) and "--force" in err, err
    assert _tree(top) == before
    if theirs is not None:
        assert theirs.read_text() == "theirs\n"
    else:
        assert _git(top, "config", "core.hooksPath").strip() == "my-hooks"
    assert main([*args, "--force"]) == 0
    if theirs is not None:
        assert theirs.read_text() != "theirs\n"
    assert _git(top, "config", "core.hooksPath").strip() == ".githooks"


def test_init_accepts_the_default_key_and_its_principal(identity, tmp_path, monkeypatch, capsys):
    """No --key, no --principal: the default key (made by `capture keygen`), and the principal every
    command signs with (the key's comment)."""
    key = tmp_path / "home" / ".config" / "capture" / "id_ed25519"
    assert main(["keygen", "-C", "carol@lab"]) == 0
    capsys.readouterr()
    assert key.is_file()
    repo = tmp_path / "results"
    assert main(["init", str(repo)]) == 0
    line = (repo / ".capture" / "allowed_signers").read_text()
    assert line.startswith("carol@lab ") and (key.with_suffix(".pub")).read_text().split()[1] in line
    from capture import signing

    assert signing.default_principal(key) == "carol@lab"


def test_keygen_writes_user_at_host_as_the_comment_by_default(identity, tmp_path, capsys):
    from capture import signing

    key = tmp_path / "k"
    assert main(["keygen", "-o", str(key)]) == 0
    capsys.readouterr()
    comment = key.with_suffix(".pub").read_text().split()[2]
    assert comment == signing.keys._user_at_host() == signing.default_principal(key)

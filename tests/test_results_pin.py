"""`capture pin` against real git repositories, real keys and real signed manifests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from capture._cli import main
from capture.errors import TrustError, UsageError
from capture.results import _publish
from capture.results.pin import pin, pin_path
from test_results_helpers import git, h200_manifest, keys, make_results_repo  # noqa: F401

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _state(repo: Path) -> tuple[str, str, list[str]]:
    """HEAD, `git status --porcelain --ignored`, and every file in the work tree (besides .git)."""
    files = sorted(str(p.relative_to(repo)) for p in repo.rglob("*") if ".git" not in p.relative_to(repo).parts)
    return git(repo, "rev-parse", "HEAD").strip(), git(repo, "status", "--porcelain", "--ignored"), files


@pytest.fixture
def repo(tmp_path, keys):
    return make_results_repo(tmp_path / "results", keys["alice"])


def test_pin_commits_manifest_and_index_row(repo, keys, tmp_path, capsys):
    src = tmp_path / "run.toml"
    raw = keys["alice"].write(src, h200_manifest())
    before = git(repo, "rev-parse", "HEAD").strip()

    assert main(["pin", str(src), "--repo", str(repo), "--tag"]) == 0

    out = capsys.readouterr().out
    rel = pin_path(h200_manifest(), raw)
    assert rel.startswith("nvidia-h200-x1/2026-12-02/") and rel.endswith(".toml")
    assert f"pinned          {rel}" in out
    assert (repo / rel).read_bytes() == raw
    assert git(repo, "rev-parse", "HEAD~1").strip() == before
    assert git(repo, "status", "--porcelain") == ""
    assert sorted(git(repo, "show", "--name-only", "--format=", "HEAD").split()) == sorted([rel, "index.json", "index.md"])
    subject = git(repo, "log", "-1", "--format=%s")
    assert "NVIDIA H200 x1" in subject and rel.split("/")[-1][:-5] in subject
    body = git(repo, "log", "-1", "--format=%b")
    assert "64,113 tokens/s" in body and "driver 580.159.04" in body and "signed by alice@lab" in body
    cid = Path(rel).stem
    assert git(repo, "cat-file", "-t", f"run/{cid}").strip() == "tag"
    assert git(repo, "rev-parse", f"run/{cid}^{{commit}}").strip() == git(repo, "rev-parse", "HEAD").strip()

    rows = json.loads((repo / "index.json").read_text())["runs"]
    assert len(rows) == 1
    row = rows[0]
    assert row["path"] == rel and row["content_id"] == cid and row["kind"] == "trial"
    assert row["model"] == "NVIDIA H200" and row["count"] == 1 and row["driver_version"] == "580.159.04"
    assert row["runtime"] == "cuda" and row["runtime_version"] == "13.0" and row["torch_version"] == "2.11.0+cu130"
    assert row["models"] == ["meta-llama/Llama-3.2-1B@4e20de362430"]
    assert row["tokens_per_s"] == pytest.approx(64113.23398891535)
    assert row["step_time_median_s"] == pytest.approx(0.2555478640000075)
    assert row["peak_memory_bytes"] == 51795329024 and row["peak_memory_source"] == "device_used"
    assert row["recovery_verdict"] == "diverged at step 5" and row["costs"]["trial_cost"] == 0.595
    assert row["costs"]["trial_cost_per_million_trained_tokens"] == pytest.approx(0.17)
    assert row["signer"] == "alice@lab" and row["signer_fingerprint"] == keys["alice"].fingerprint
    md = (repo / "index.md").read_text()
    assert f"[{cid}]({rel})" in md and "| 64,113 |" in md and "| alice@lab |" in md


def test_pin_same_bytes_twice_is_a_noop(repo, keys, tmp_path, capsys):
    src = tmp_path / "run.toml"
    keys["alice"].write(src, h200_manifest())
    pin([str(src)], repo)
    before = _state(repo)
    assert main(["pin", str(src), str(src), "--repo", str(repo)]) == 0
    captured = capsys.readouterr()
    assert captured.out.count("already pinned") == 2
    assert "nothing new to commit" in captured.err
    assert _state(repo) == before
    assert len(json.loads((repo / "index.json").read_text())["runs"]) == 1


def test_second_run_adds_a_row_and_keeps_the_first(repo, keys, tmp_path):
    a, b = tmp_path / "a.toml", tmp_path / "b.toml"
    keys["alice"].write(a, h200_manifest())
    cpu = h200_manifest(kind="fingerprint", created_utc="2026-12-03T08:00:00Z")
    cpu["accelerator"] = {"vendor": "none", "model": "cpu", "count": 0, "runtime": "cpu"}
    keys["alice"].write(b, cpu)
    r1 = pin([str(a)], repo)
    r2 = pin([str(b)], repo, message="CPU baseline")
    assert r2.runs[0].path.startswith("cpu/2026-12-03/")
    assert git(repo, "log", "-1", "--format=%s").strip() == "CPU baseline"
    rows = json.loads((repo / "index.json").read_text())["runs"]
    assert [r["path"] for r in rows] == [r1.runs[0].path, r2.runs[0].path]
    assert git(repo, "rev-list", "--count", "HEAD").strip() == "3"


def _tamper(raw: bytes) -> bytes:
    return raw.replace(b'driver_version = "580.159.04"', b'driver_version = "580.159.05"', 1)


@pytest.mark.parametrize("case", ["tampered", "unsigned", "untrusted", "appended"])
def test_refused_manifest_leaves_repo_unchanged(repo, keys, tmp_path, capsys, case):
    good = tmp_path / "good.toml"
    keys["alice"].write(good, h200_manifest(created_utc="2026-12-01T00:00:00Z"))
    bad = tmp_path / "bad.toml"
    if case == "tampered":
        raw = keys["alice"].write(bad, h200_manifest())
        bad.write_bytes(_tamper(raw))
    elif case == "unsigned":
        from capture import manifest as mf
        bad.write_bytes(mf.dumps(h200_manifest()))
    elif case == "untrusted":
        keys["mallory"].write(bad, h200_manifest())
    else:
        raw = keys["alice"].write(bad, h200_manifest())
        bad.write_bytes(raw + b"\n[trial.stats]\ntokens_per_s = 1e9\n")
    before = _state(repo)
    # The good manifest comes first: nothing of it may be committed either.
    assert main(["pin", str(good), str(bad), "--repo", str(repo)]) == 4
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err and len(err.strip().splitlines()) <= 2
    assert _state(repo) == before


def test_untrusted_signer_names_the_key(repo, keys, tmp_path):
    bad = tmp_path / "bad.toml"
    keys["mallory"].write(bad, h200_manifest())
    with pytest.raises(TrustError, match=r"mallory@elsewhere"):
        pin([str(bad)], repo)


def test_personal_allowed_signers_is_never_used(tmp_path, keys, monkeypatch):
    """Trust comes only from the repository: $CAPTURE_ALLOWED_SIGNERS naming mallory changes nothing."""
    repo = make_results_repo(tmp_path / "results", keys["alice"])
    personal = tmp_path / "personal_allowed_signers"
    personal.write_text(keys["mallory"].allowed_line)
    monkeypatch.setenv("CAPTURE_ALLOWED_SIGNERS", str(personal))
    bad = tmp_path / "bad.toml"
    keys["mallory"].write(bad, h200_manifest())
    with pytest.raises(TrustError):
        pin([str(bad)], repo)


def test_malformed_manifest_is_exit_3(repo, keys, tmp_path, capsys):
    from capture import signing
    bad = tmp_path / "bad.toml"
    # A valid signature by a trusted signer over a body that is not a manifest.
    body = b'schema_version = 1\nkind = "trial"\ncreated_utc = 5\n'
    bad.write_bytes(body + signing.make_trailer(body, signing.load_private_key(keys["alice"].key), "alice@lab"))
    before = _state(repo)
    assert main(["pin", str(bad), "--repo", str(repo)]) == 3
    assert "created_utc" in capsys.readouterr().err
    assert _state(repo) == before


def test_not_a_git_repo_and_dirty_repo_are_refused(tmp_path, keys, capsys):
    src = tmp_path / "run.toml"
    keys["alice"].write(src, h200_manifest())
    plain = tmp_path / "plain"
    plain.mkdir()
    assert main(["pin", str(src), "--repo", str(plain)]) == 2
    err = capsys.readouterr().err
    assert "not a git repository" in err and "git init" in err

    repo = make_results_repo(tmp_path / "results", keys["alice"])
    (repo / "notes.txt").write_text("work in progress\n")
    before = _state(repo)
    assert main(["pin", str(src), "--repo", str(repo)]) == 2
    err = capsys.readouterr().err
    assert "uncommitted changes (notes.txt)" in err
    assert _state(repo) == before


def test_missing_or_uncommitted_allowed_signers(tmp_path, keys):
    src = tmp_path / "run.toml"
    keys["alice"].write(src, h200_manifest())
    repo = tmp_path / "r"
    repo.mkdir()
    git(repo, "init", "-q")
    git(repo, "-c", "user.name=a", "-c", "user.email=a@b", "commit", "-q", "--allow-empty", "-m", "empty")
    with pytest.raises(TrustError, match="no allowed-signers file"):
        pin([str(src)], repo)


def test_different_file_at_same_path_is_never_overwritten(repo, keys, tmp_path):
    src = tmp_path / "run.toml"
    raw = keys["alice"].write(src, h200_manifest())
    rel = pin_path(h200_manifest(), raw)
    (repo / rel).parent.mkdir(parents=True)
    (repo / rel).write_bytes(b"someone else's bytes\n")
    git(repo, "add", rel)
    git(repo, "commit", "-q", "-m", "squat")
    with pytest.raises(UsageError, match="refusing to overwrite"):
        pin([str(src)], repo)
    assert (repo / rel).read_bytes() == b"someone else's bytes\n"


def _pin_in_subprocess(src: Path, repo: Path, hook: str, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, _CAPTURE_TEST_PIN_HOOK=hook)
    return subprocess.run([sys.executable, "-m", "capture", "pin", str(src), "--repo", str(repo), *extra],
                          env=env, capture_output=True, text=True, timeout=120)


def test_killed_pin_leaves_repo_as_it_was(repo, keys, tmp_path):
    src = tmp_path / "run.toml"
    keys["alice"].write(src, h200_manifest())
    before = _state(repo)
    proc = _pin_in_subprocess(src, repo, "kill:before-commit")
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert _state(repo) == before
    git_dir = repo / ".git"
    assert list(git_dir.glob("capture-pin-*")), "the killed pin should have left its temporary index"
    # The commit it had built exists only as an unreachable object; the next pin just works
    # and removes the dead process's temporary index.
    assert pin([str(src)], repo).commit is not None
    assert not list(git_dir.glob("capture-pin-*"))
    assert git(repo, "status", "--porcelain") == ""


@pytest.mark.parametrize("stage", ["after-files", "after-update-ref"])
def test_failure_while_publishing_is_undone(repo, keys, tmp_path, stage):
    first = tmp_path / "first.toml"
    keys["alice"].write(first, h200_manifest(created_utc="2026-11-30T00:00:00Z"))
    pin([str(first)], repo)  # so that index.json/index.md exist and must be restored, not removed
    src = tmp_path / "run.toml"
    keys["alice"].write(src, h200_manifest())
    before = _state(repo)
    index_before = (repo / "index.json").read_bytes()
    proc = _pin_in_subprocess(src, repo, f"fail:{stage}")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "left as it was" in proc.stderr
    assert _state(repo) == before
    assert (repo / "index.json").read_bytes() == index_before
    assert not (repo / ".git" / "index.lock").exists()


def test_pin_into_a_folder_of_a_larger_repository_keeps_other_staged_work(tmp_path, keys):
    """manifests/ in the project repository is a results repository: pin commits only there."""
    top = tmp_path / "project"
    top.mkdir()
    git(top, "init", "-q", "-b", "main")
    git(top, "config", "user.name", "Lead")
    git(top, "config", "user.email", "lead@example.invalid")
    (top / "manifests").mkdir()
    (top / "manifests" / "allowed_signers").write_text(keys["alice"].allowed_line)
    (top / "code.py").write_text("print(1)\n")
    git(top, "add", ".")
    git(top, "commit", "-q", "-m", "project")
    (top / "code.py").write_text("print(2)\n")
    git(top, "add", "code.py")  # someone's staged work outside manifests/
    (top / "scratch.txt").write_text("untracked, outside manifests/\n")
    src = tmp_path / "run.toml"
    keys["alice"].write(src, h200_manifest())

    result = pin([str(src)], top / "manifests")

    changed = git(top, "show", "--name-only", "--format=", "HEAD").split()
    assert sorted(changed) == sorted(f"manifests/{p}" for p in (result.runs[0].path, "index.json", "index.md"))
    status = git(top, "status", "--porcelain").splitlines()
    assert sorted(status) == ["?? scratch.txt", "M  code.py"]


# --------------------------------------------------------------------------- kills, concurrency, symlinks (issue 17)


def _leftovers(repo: Path) -> list[str]:
    git_dir = repo / ".git"
    return sorted(p.name for p in git_dir.iterdir()
                  if p.name == "index.lock" or (p.name.startswith(("capture-pin", ".capture-pin")) and p.name != "capture-pin.lock"))


@pytest.mark.parametrize("step", _publish.STEPS)
def test_kill_at_each_step_leaves_the_repo_as_it_was_or_repaired_by_the_next_pin(repo, keys, tmp_path, step):
    first = tmp_path / "first.toml"
    keys["alice"].write(first, h200_manifest(created_utc="2026-11-30T00:00:00Z"))
    pin([str(first)], repo)  # index.json/index.md exist, so an undo must restore them, not remove them
    src = tmp_path / "run.toml"
    raw = keys["alice"].write(src, h200_manifest())
    rel = pin_path(h200_manifest(), raw)
    before = _state(repo)
    head_before = before[0]

    proc = _pin_in_subprocess(src, repo, f"kill:{step}", "--tag")
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    if step in ("locked", "before-commit", "after-journal"):
        assert _state(repo) == before  # nothing visible happened yet

    result = pin([str(src)], repo, tag=True)  # repairs first (finishing or undoing), then pins

    assert git(repo, "rev-list", "--count", f"{head_before}..HEAD").strip() == "1"
    assert git(repo, "show", "--name-only", "--format=", "HEAD").split() == sorted([rel, "index.json", "index.md"])
    assert git(repo, "status", "--porcelain", "--ignored", "--untracked-files=all") == ""
    assert (repo / rel).read_bytes() == raw
    assert [r["path"] for r in json.loads((repo / "index.json").read_text())["runs"]].count(rel) == 1
    cid = Path(rel).stem
    assert git(repo, "rev-parse", f"run/{cid}^{{commit}}").strip() == git(repo, "rev-parse", "HEAD").strip()
    assert _leftovers(repo) == []
    assert result.runs[0].already_pinned == (result.commit is None)


def test_concurrent_pins_wait_for_each_other(repo, keys, tmp_path):
    sources = []
    for k in range(4):
        src = tmp_path / f"run{k}.toml"
        keys["alice"].write(src, h200_manifest(created_utc=f"2026-12-0{k + 1}T00:00:00Z"))
        sources.append(src)
    head_before = git(repo, "rev-parse", "HEAD").strip()
    procs = [subprocess.Popen([sys.executable, "-m", "capture", "pin", str(s), "--repo", str(repo)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for s in sources]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], [o[1] for o in outs]
    assert all("Traceback" not in err and "index.lock" not in err for _, err in outs)
    assert git(repo, "rev-list", "--count", f"{head_before}..HEAD").strip() == "4"
    assert len(json.loads((repo / "index.json").read_text())["runs"]) == 4
    assert git(repo, "status", "--porcelain", "--untracked-files=all") == ""
    assert _leftovers(repo) == []


def test_a_foreign_index_lock_is_left_alone(repo, keys, tmp_path):
    src = tmp_path / "run.toml"
    keys["alice"].write(src, h200_manifest())
    lock = repo / ".git" / "index.lock"
    lock.write_bytes(b"another git process\n")
    before = _state(repo)
    with pytest.raises(UsageError, match="another git process is working"):
        pin([str(src)], repo)
    assert lock.read_bytes() == b"another git process\n"
    assert _state(repo) == before
    lock.unlink()
    assert pin([str(src)], repo).commit is not None


def test_allowed_signers_symlink_outside_the_repo_is_refused(tmp_path, keys):
    outside = tmp_path / "outside_signers"
    outside.write_text(keys["alice"].allowed_line)
    repo = tmp_path / "results"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    git(repo, "config", "user.name", "Results Bot")
    git(repo, "config", "user.email", "results@example.invalid")
    (repo / ".capture").mkdir()
    (repo / ".capture" / "allowed_signers").symlink_to(outside)
    git(repo, "add", ".capture/allowed_signers")
    git(repo, "commit", "-q", "-m", "trust signers (a link)")
    src = tmp_path / "run.toml"
    keys["alice"].write(src, h200_manifest())
    before = _state(repo)
    with pytest.raises(TrustError, match="is a symlink to .* outside") as info:
        pin([str(src)], repo)
    assert info.value.exit_code == 4
    assert _state(repo) == before


def test_ignored_symlinked_accelerator_folder_is_refused(repo, keys, tmp_path, capsys):
    src = tmp_path / "run.toml"
    raw = keys["alice"].write(src, h200_manifest())
    slug = pin_path(h200_manifest(), raw).split("/")[0]
    (repo / ".gitignore").write_text(f"{slug}\n")
    git(repo, "add", ".gitignore")
    git(repo, "commit", "-q", "-m", "ignore")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (repo / slug).symlink_to(outside, target_is_directory=True)
    head = git(repo, "rev-parse", "HEAD").strip()
    assert main(["pin", str(src), "--repo", str(repo)]) == 2
    err = capsys.readouterr().err
    assert "is a symlink" in err and err.count("error:") == 1 and "Traceback" not in err
    assert list(outside.rglob("*")) == []
    assert git(repo, "rev-parse", "HEAD").strip() == head


@pytest.mark.parametrize("step", ["after-files", "after-update-ref"])
def test_the_next_pin_of_another_manifest_repairs_first(repo, keys, tmp_path, step, capsys):
    killed = tmp_path / "killed.toml"
    raw_killed = keys["alice"].write(killed, h200_manifest(created_utc="2026-11-30T00:00:00Z"))
    head_before = git(repo, "rev-parse", "HEAD").strip()
    assert _pin_in_subprocess(killed, repo, f"kill:{step}").returncode == -signal.SIGKILL
    other = tmp_path / "other.toml"
    keys["alice"].write(other, h200_manifest())
    assert main(["pin", str(other), "--repo", str(repo)]) == 0
    done = "finished" if step == "after-update-ref" else "undone"
    assert f"capture pin: {done} an interrupted pin" in capsys.readouterr().err
    runs = [r["path"] for r in json.loads((repo / "index.json").read_text())["runs"]]
    killed_rel = pin_path(h200_manifest(created_utc="2026-11-30T00:00:00Z"), raw_killed)
    assert (killed_rel in runs) == (step == "after-update-ref")
    assert git(repo, "rev-list", "--count", f"{head_before}..HEAD").strip() == ("2" if step == "after-update-ref" else "1")
    assert git(repo, "status", "--porcelain", "--untracked-files=all", "--ignored") == ""
    assert _leftovers(repo) == []

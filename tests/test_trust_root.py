"""Who decides trust (issue 25, DESIGN decision 6): the verifier, never a file beside the data.

Every attack of the review, against real git repositories, real keys and the real commands:
a subfolder ``allowed_signers`` in a results repository, a downloaded ``run.toml`` shipped with an
``allowed_signers`` beside it, another user's file in an ancestor folder (``/tmp``), a change that
adds a signer together with manifests signed by it (``--trust-from``), files whose name is not their
content id or that ``index.json`` does not list, and a staged unsigned manifest with a signed copy
in the work tree (``--staged``, the pre-commit hook).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from capture import manifest as mf
from capture._cli import main
from capture.decide.runs import expand, open_all
from capture.results.pin import pin
from capture.verify import trust_root
from capture.verify.tree import verify_tree
from test_results_helpers import Signer, git, h200_manifest, make_results_repo

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def people(tmp_path_factory) -> dict[str, Signer]:
    folder = tmp_path_factory.mktemp("people")
    return {"alice": Signer(folder, "alice@lab"), "bob": Signer(folder, "bob@elsewhere")}


@pytest.fixture(autouse=True)
def _fresh_warnings(home):
    """An isolated HOME (no personal file of this machine), and each ignored file warned about anew."""
    trust_root._WARNED.clear()
    yield


def _as(signer: Signer, principal: str) -> str:
    """An allowed-signers line listing ``signer``'s key under another principal."""
    return f"{principal} {signer.public_key}\n"


def _statuses(report) -> dict[str, str]:
    return {Path(e.path).name: e.status for e in report.entries}


# --------------------------------------------------------------------------- the three attacks


def test_a_subfolder_allowed_signers_in_a_results_repo_decides_nothing(tmp_path, people, caplog, capsys):
    alice, bob = people["alice"], people["bob"]
    repo = make_results_repo(tmp_path / "results", alice)
    genuine = tmp_path / "genuine.toml"
    alice.write(genuine, h200_manifest(created_utc="2026-12-01T09:00:00Z"))
    pin([str(genuine)], repo)
    # bob plants a subfolder with his own manifest and an allowed_signers naming his key "alice@lab"
    sub = repo / "nvidia-h200-x1" / "2026-12-01"
    (sub / "allowed_signers").write_text(_as(bob, "alice@lab"))
    (sub / ".capture").mkdir()
    (sub / ".capture" / "allowed_signers").write_text(_as(bob, "alice@lab"))
    forged = h200_manifest(created_utc="2026-12-01T10:00:00Z")
    forged["trial"]["stats"]["tokens_per_s"] = 999_999.0
    raw = bob.write(sub / "forged.toml", forged)
    os.rename(sub / "forged.toml", sub / f"{mf_content_id(raw)}.toml")

    with caplog.at_level(logging.WARNING):
        code = main(["verify", str(repo), "--signature-only"])
    out = capsys.readouterr().out
    assert code == 4
    rows = {line.split()[1].rsplit("/", 1)[-1]: line.split()[0] for line in out.splitlines()[:-1]}
    assert rows[f"{mf_content_id(raw)}.toml"] == "UNTRUSTED"
    assert list(rows.values()).count("OK") == 1  # alice's genuine run stays trusted
    warned = caplog.text
    assert f"ignored {sub / 'allowed_signers'}" in warned and f"ignored {sub / '.capture' / 'allowed_signers'}" in warned
    assert str(repo / ".capture" / "allowed_signers") in warned  # the file used is named

    runs, files = open_all(expand([str(repo)]))
    by_name = {Path(f.path).name: f for f in files}
    assert by_name[f"{mf_content_id(raw)}.toml"].state == "untrusted"
    assert [r.trusted for r in runs].count(True) == 1


def mf_content_id(raw: bytes) -> str:
    from capture.results.summary import content_id

    return content_id(raw)


def test_a_downloaded_manifest_with_allowed_signers_beside_it_is_not_trusted(tmp_path, people, caplog, capsys):
    bob = people["bob"]
    download = tmp_path / "Downloads" / "bundle"
    download.mkdir(parents=True)
    run = download / "run.toml"
    bob.write(run, h200_manifest())
    (download / "allowed_signers").write_text(bob.allowed_line)
    (download / ".capture").mkdir()
    (download / ".capture" / "allowed_signers").write_text(bob.allowed_line)
    (download / ".capture" / "results.toml").write_text("layout = 1\n")  # not a repository: still nothing

    with caplog.at_level(logging.WARNING):
        assert main(["verify", str(run), "--signature-only"]) == 4
        err = capsys.readouterr().err
        assert "no allowed-signers file was found" in err
        assert main(["show", str(run)]) == 0
        shown = capsys.readouterr().out
        assert "signer trusted" not in shown and "NOT trusted" in shown
        assert main(["compare", str(run), str(run)]) == 0
        assert "signer trusted" not in capsys.readouterr().out
    assert f"ignored {download / 'allowed_signers'}" in caplog.text
    assert f"ignored {download / '.capture' / 'allowed_signers'}" in caplog.text
    # the verifier's own choice still works
    assert main(["verify", str(run), "--signature-only", "--allowed-signers", str(download / "allowed_signers")]) == 0


def _as_another_user(path: Path, monkeypatch) -> None:
    """Make ``path`` another user's: chown where we may (root), else pretend to be someone else."""
    if os.geteuid() == 0:
        os.chown(path, 4242, 4242, follow_symlinks=False)
    else:
        me = os.geteuid()
        monkeypatch.setattr(trust_root.os, "geteuid", lambda: me + 1)


def test_another_users_file_in_an_ancestor_folder_decides_nothing(tmp_path, people, monkeypatch, capsys, caplog):
    """/tmp/allowed_signers (anyone can write /tmp): outside a repository it is ignored; a planted
    /tmp/.git with /tmp/.capture/allowed_signers owned by another user is ignored too (git's rule)."""
    bob = people["bob"]
    shared_tmp = tmp_path / "tmp"
    (shared_tmp / "work").mkdir(parents=True)
    run = shared_tmp / "work" / "run.toml"
    bob.write(run, h200_manifest())
    (shared_tmp / "allowed_signers").write_text(bob.allowed_line)
    assert main(["verify", str(run), "--signature-only"]) == 4
    assert "no allowed-signers file was found" in capsys.readouterr().err

    (shared_tmp / ".git").mkdir()
    (shared_tmp / ".capture").mkdir()
    planted = shared_tmp / ".capture" / "allowed_signers"
    planted.write_text(bob.allowed_line)
    assert trust_root.choose(run).path == planted  # ours: the repository's root file counts
    trust_root._WARNED.clear()
    _as_another_user(planted, monkeypatch)
    with caplog.at_level(logging.WARNING):
        assert trust_root.choose(run).path is None
        assert main(["verify", str(run), "--signature-only"]) == 4
    assert "owned by another user" in caplog.text and str(planted) in caplog.text


# --------------------------------------------------------------------------- the order


def test_lookup_order_flag_env_repository_root_personal(tmp_path, people, monkeypatch, home):
    repo = make_results_repo(tmp_path / "results", people["alice"])
    deep = repo / "runs" / "h200"
    deep.mkdir(parents=True)
    manifest_path = deep / "m.toml"
    root_file = repo / ".capture" / "allowed_signers"
    assert trust_root.results_root(manifest_path) == repo
    assert trust_root.choose(manifest_path).path == root_file
    (deep / ".capture").mkdir()
    (deep / ".capture" / "allowed_signers").write_text("")  # a subfolder never becomes the root
    assert trust_root.results_root(manifest_path) == repo and trust_root.choose(manifest_path).path == root_file
    (repo / "allowed_signers").write_text("")  # nor does a file beside the root's .capture
    assert trust_root.choose(manifest_path).path == root_file
    personal = home / ".config" / "capture" / "allowed_signers"
    personal.parent.mkdir(parents=True)
    personal.write_text("")
    outside = tmp_path / "elsewhere" / "m.toml"
    outside.parent.mkdir()
    (outside.parent / "allowed_signers").write_text("")
    assert trust_root.choose(outside).path == personal
    root_file.unlink()  # a repository without a trust file: the verifier's own file
    (deep / ".capture" / "allowed_signers").unlink()
    (deep / ".capture").rmdir()
    (repo / ".capture" / "results.toml").write_text("layout = 1\n")
    assert trust_root.choose(manifest_path).path == personal
    monkeypatch.setenv("CAPTURE_ALLOWED_SIGNERS", str(tmp_path / "env_file"))
    assert trust_root.choose(manifest_path).path == tmp_path / "env_file"
    assert trust_root.choose(manifest_path, tmp_path / "flag").path == tmp_path / "flag"
    assert trust_root.choose(manifest_path, tmp_path / "flag").source == "--allowed-signers"


def test_relative_paths_and_xdg_config(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    (tmp_path / "xdg" / "capture").mkdir(parents=True)
    (tmp_path / "xdg" / "capture" / "allowed_signers").write_text("")
    (tmp_path / "allowed_signers").write_text("")
    monkeypatch.chdir(tmp_path)
    assert trust_root.choose("m.toml").path == tmp_path / "xdg" / "capture" / "allowed_signers"
    assert trust_root.choose("m.toml").ignored == (tmp_path / "allowed_signers",)


def test_a_root_trust_file_linking_outside_the_repository_is_refused(tmp_path, people):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "allowed_signers").write_text(people["alice"].allowed_line)
    repo = tmp_path / "repo"
    (repo / ".capture").mkdir(parents=True)
    git(repo, "init", "-q")
    (repo / ".capture" / "allowed_signers").symlink_to(outside / "allowed_signers")
    from capture.errors import TrustError

    with pytest.raises(TrustError, match="is a symlink to .* outside") as info:
        trust_root.choose(repo / "m.toml")
    assert info.value.exit_code == 4 and "\n" not in info.value.message
    (repo / ".capture" / "allowed_signers").unlink()
    (repo / ".capture").rmdir()
    (repo / ".capture").symlink_to(outside)
    (outside / "allowed_signers").rename(outside / "allowed_signers.tmp")
    (outside / "allowed_signers.tmp").rename(outside / "allowed_signers")
    with pytest.raises(TrustError, match="outside"):
        trust_root.choose(repo / "m.toml")
    (repo / ".capture").unlink()
    (repo / ".capture").mkdir()
    (repo / "real_signers").write_text("")
    (repo / ".capture" / "allowed_signers").symlink_to(repo / "real_signers")  # inside: fine
    assert trust_root.choose(repo / "m.toml").path == repo / ".capture" / "allowed_signers"


def test_pin_refuses_a_root_allowed_signers_outside_capture(tmp_path, people):
    from capture.errors import TrustError

    repo = tmp_path / "results"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    git(repo, "config", "user.name", "T")
    git(repo, "config", "user.email", "t@example.invalid")
    (repo / "allowed_signers").write_text(people["alice"].allowed_line)
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "trust (the old place)")
    src = tmp_path / "run.toml"
    people["alice"].write(src, h200_manifest())
    with pytest.raises(TrustError, match=r"\.capture/allowed_signers, at its root") as info:
        pin([str(src)], repo)
    assert "git -C" in info.value.hint and "mv allowed_signers .capture/allowed_signers" in info.value.hint


# --------------------------------------------------------------------------- trust changes apart from results


def _pr_repo(tmp_path: Path, people: dict[str, Signer]) -> tuple[Path, Path]:
    """main: alice trusted, one run of hers pinned; branch `pr`: bob added to the trust file and
    a run of his pinned in the same commit (999,999 tokens/s)."""
    alice, bob = people["alice"], people["bob"]
    repo = make_results_repo(tmp_path / "results", alice)
    src = tmp_path / "alice.toml"
    alice.write(src, h200_manifest(created_utc="2026-12-01T09:00:00Z"))
    pin([str(src)], repo)
    git(repo, "checkout", "-q", "-b", "pr")
    with open(repo / ".capture" / "allowed_signers", "a") as f:
        f.write(bob.allowed_line)
    git(repo, "commit", "-q", "-am", "trust bob")
    fast = h200_manifest(created_utc="2026-12-02T09:00:00Z")
    fast["trial"]["stats"]["tokens_per_s"] = 999_999.0
    bob_src = tmp_path / "bob.toml"
    bob.write(bob_src, fast)
    pinned = pin([str(bob_src)], repo).runs[0].path
    return repo, repo / pinned


def test_trust_from_the_base_revision_names_the_added_signer_and_its_manifests(tmp_path, people, capsys):
    repo, bobs = _pr_repo(tmp_path, people)
    assert main(["verify", str(repo), "--signature-only"]) == 0  # the branch trusts itself
    capsys.readouterr()
    assert main(["verify", str(repo), "--signature-only", "--trust-from", "main"]) == 4
    out, err = capsys.readouterr()
    row = next(line for line in out.splitlines() if bobs.name in line)
    assert row.startswith("UNTRUSTED") and "bob@elsewhere" in row and "a signer this change adds to .capture/allowed_signers" in row
    assert "main" in row
    assert "this change adds signer bob@elsewhere" in err and bobs.name in err
    ok = [line for line in out.splitlines() if line.startswith("OK")]
    assert len(ok) == 1 and "alice@lab" in ok[0]
    # the JSON names them too, and a single file works the same way
    assert main(["verify", str(repo), "--signature-only", "--trust-from", "main", "--json"]) == 4
    doc = json.loads(capsys.readouterr().out)
    assert any("bob@elsewhere" in n and bobs.name in n for n in doc["summary"]["notes"])
    assert main(["verify", str(bobs), "--signature-only", "--trust-from", "main"]) == 4
    assert main(["verify", str(bobs), "--signature-only", "--trust-from", "pr"]) == 0


def test_trust_from_after_the_signer_landed_on_its_own(tmp_path, people, capsys):
    repo, _ = _pr_repo(tmp_path, people)
    assert main(["verify", str(repo), "--signature-only", "--trust-from", "pr~1"]) == 0  # the trust commit


def test_trust_from_bad_revisions_and_places(tmp_path, people, capsys):
    repo, _ = _pr_repo(tmp_path, people)
    assert main(["verify", str(repo), "--signature-only", "--trust-from", "no-such-branch"]) == 2
    assert "not a commit" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["verify", str(repo), "--trust-from", "main", "--allowed-signers", str(tmp_path)])
    assert exc.value.code == 2 and "not allowed with" in capsys.readouterr().err
    loose = tmp_path / "loose"
    loose.mkdir()
    people["alice"].write(loose / "run.toml", h200_manifest())
    assert main(["verify", str(loose), "--signature-only", "--trust-from", "HEAD"]) == 2
    assert "in no results repository" in capsys.readouterr().err
    git(repo, "checkout", "-q", "main")
    first = git(repo, "rev-list", "--max-parents=0", "HEAD").strip()
    assert main(["verify", str(repo), "--signature-only", "--trust-from", first]) == 0  # alice was trusted then


def test_trust_from_a_revision_without_the_trust_file_trusts_nobody(tmp_path, people):
    repo = tmp_path / "project"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    git(repo, "config", "user.name", "T")
    git(repo, "config", "user.email", "t@example.invalid")
    (repo / "README.md").write_text("project\n")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "first")
    results = repo / "results"
    (results / ".capture").mkdir(parents=True)
    (results / ".capture" / "allowed_signers").write_text(people["alice"].allowed_line)
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "results folder")
    src = tmp_path / "run.toml"
    people["alice"].write(src, h200_manifest())
    pin([str(src)], results)
    report = verify_tree([str(results)], trust_from="main~2")
    (row,) = report.entries
    assert row.status == "UNTRUSTED" and "a signer this change adds to results/.capture/allowed_signers" in row.reason
    at_first = trust_root.from_revision([str(results)], "main~2")
    assert not at_first.present and at_first.allowed.signers == ()
    assert at_first.allowed.path == "main~2:results/.capture/allowed_signers (absent: nobody is trusted)"
    assert verify_tree([str(results)], trust_from="main").exit_code == 0


# --------------------------------------------------------------------------- the pinned files themselves


def test_pinned_files_are_named_by_content_and_listed_in_the_index(tmp_path, people, capsys):
    alice = people["alice"]
    repo = make_results_repo(tmp_path / "results", alice)
    srcs = []
    for day in ("01", "02"):
        src = tmp_path / f"{day}.toml"
        alice.write(src, h200_manifest(created_utc=f"2026-12-{day}T09:00:00Z"))
        srcs.append(str(src))
    paths = [repo / r.path for r in pin(srcs, repo).runs]
    assert _statuses(verify_tree([str(repo)])) == {p.name: "OK" for p in paths}

    renamed = paths[0].with_name("0123456789ab.toml")
    paths[0].rename(renamed)  # a pinned file under another name
    copied = repo / "nvidia-h200-x1" / "2026-12-09" / paths[1].name
    copied.parent.mkdir()
    shutil.copy(paths[1], copied)  # a copy its index does not list (counted twice by decide)
    report = verify_tree([str(repo)])
    by_path = {e.path: e for e in report.entries}
    assert by_path[str(renamed)].status == "INVALID" and "named by their content id" in by_path[str(renamed)].reason
    assert by_path[str(copied)].status == "INVALID" and "not listed in index.json" in by_path[str(copied)].reason
    assert by_path[str(paths[0])].status == "MALFORMED" and "listed in index.json but absent" in by_path[str(paths[0])].reason
    assert by_path[str(paths[1])].status == "OK"
    assert report.exit_code == 4
    assert main(["verify", str(repo), "--signature-only"]) == 4
    out = capsys.readouterr().out
    assert "named by their content id" in out and "not listed in index.json" in out


def test_a_broken_index_is_one_malformed_row(tmp_path, people, capsys):
    repo = make_results_repo(tmp_path / "results", people["alice"])
    src = tmp_path / "run.toml"
    people["alice"].write(src, h200_manifest())
    pin([str(src)], repo)
    (repo / "index.json").write_text('{"runs": [')
    report = verify_tree([str(repo)])
    index_rows = [e for e in report.entries if e.path.endswith("index.json")]
    assert len(index_rows) == 1 and index_rows[0].status == "MALFORMED" and "not JSON" in index_rows[0].reason
    (repo / "index.json").write_text('{"runs": [' + "9" * 5000 + "]}")  # past int()'s 4,300-digit limit
    report = verify_tree([str(repo)])
    assert any(e.path.endswith("index.json") and e.status == "MALFORMED" for e in report.entries)
    people["alice"].write(tmp_path / "run2.toml", h200_manifest(created_utc="2026-12-03T10:15:00Z"))
    git(repo, "commit", "-qam", "an index with a 5,000-digit number")
    capsys.readouterr()
    assert main(["pin", str(tmp_path / "run2.toml"), "--repo", str(repo)]) == 3  # one line, not a traceback
    err = capsys.readouterr().err
    assert err.startswith(f"error: {repo / 'index.json'}: cannot read the index") and "Traceback" not in err, err
    (repo / "index.json").unlink()
    os.mkfifo(repo / "index.json")  # never read as a stream that does not end
    report = verify_tree([str(repo)])
    assert any(e.path.endswith("index.json") and "FIFO" in (e.reason or "") for e in report.entries)


def test_files_without_a_manifest_header_are_skipped_not_malformed(tmp_path, people, capsys):
    folder = tmp_path / "runs"
    folder.mkdir()
    people["alice"].write(folder / "run.toml", h200_manifest())
    (folder / "llama.toml").write_text('[trial]\nname = "llama"\n[trial.model]\nsource = "hub"\n')
    (folder / "half.toml").write_text('schema_version = 1\nkind = "trial"\ncreated_utc = "2026')
    (folder / "allowed_signers").write_text(people["alice"].allowed_line)
    code = main(["verify", str(folder), "--signature-only", "--allowed-signers", str(folder / "allowed_signers")])
    out = capsys.readouterr().out
    rows = {line.split()[1].rsplit("/", 1)[-1]: line.split()[0] for line in out.splitlines()[:-1]}
    assert rows == {"half.toml": "MALFORMED", "llama.toml": "SKIPPED", "run.toml": "OK"}
    assert code == 3 and "1 SKIPPED" in out.splitlines()[-1]
    (folder / "half.toml").unlink()
    assert main(["verify", str(folder), "--signature-only", "--allowed-signers", str(folder / "allowed_signers")]) == 0
    # named on its own, a file that is no manifest is still refused (exit 3)
    capsys.readouterr()
    assert main(["verify", str(folder / "llama.toml"), "--signature-only"]) == 3


# --------------------------------------------------------------------------- what a commit holds


def test_staged_content_is_verified_not_the_work_tree(tmp_path, people, capsys):
    alice = people["alice"]
    repo = make_results_repo(tmp_path / "results", alice)
    src = tmp_path / "run.toml"
    raw = alice.write(src, h200_manifest())
    rel = pin([str(src)], repo).runs[0].path
    # stage an unsigned copy, then put the signed bytes back in the work tree
    (repo / rel).write_bytes(mf.split_signed(raw)[0])
    git(repo, "add", rel)
    (repo / rel).write_bytes(raw)
    assert main(["verify", str(repo), "--signature-only"]) == 0  # the work tree looks fine
    capsys.readouterr()
    assert main(["verify", str(repo), "--signature-only", "--staged", "--trust-from", "HEAD"]) == 4
    out = capsys.readouterr().out
    assert f"UNSIGNED {repo / rel}  not signed" in out and "capture-staged" not in out
    git(repo, "add", rel)  # stage the signed bytes again: the commit would hold them
    assert main(["verify", str(repo), "--signature-only", "--staged", "--trust-from", "HEAD"]) == 0


def test_the_hook_refuses_a_staged_unsigned_manifest_and_a_self_trusting_commit(tmp_path, people, monkeypatch, capsys):
    alice, bob = people["alice"], people["bob"]
    for k, v in {"GIT_AUTHOR_NAME": "A", "GIT_AUTHOR_EMAIL": "a@example.invalid", "GIT_COMMITTER_NAME": "A",
                 "GIT_COMMITTER_EMAIL": "a@example.invalid", "GIT_CONFIG_NOSYSTEM": "1"}.items():
        monkeypatch.setenv(k, v)
    repo = tmp_path / "results"
    assert main(["init", str(repo), "--key", f"{alice.key}.pub", "--ci", "--install", "capture-stack==0.1.0"]) == 0
    capsys.readouterr()
    src = tmp_path / "run.toml"
    raw = alice.write(src, h200_manifest())
    rel = pin([str(src)], repo).runs[0].path
    env = dict(os.environ, PATH=f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")]))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "capture").write_text(f"#!/bin/sh\nexec {sys.executable} -m capture \"$@\"\n")
    (bin_dir / "capture").chmod(0o755)
    env["PATH"] = f"{bin_dir}:{env['PATH']}"

    def commit(message: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", "-C", str(repo), "commit", "-q", "-m", message], capture_output=True, text=True, env=env)

    (repo / rel).write_bytes(mf.split_signed(raw)[0] + b"# edited\n")
    git(repo, "add", rel)
    (repo / rel).write_bytes(raw)
    done = commit("unsigned, with a signed copy in the work tree")
    assert done.returncode != 0 and "UNSIGNED" in done.stdout + done.stderr
    git(repo, "reset", "-q", "--", rel)
    # one commit that adds bob and a manifest of his: refused, naming both
    with open(repo / ".capture" / "allowed_signers", "a") as f:
        f.write(bob.allowed_line)
    bob_src = tmp_path / "bob.toml"
    bob_raw = bob.write(bob_src, h200_manifest(created_utc="2026-12-03T00:00:00Z"))
    target = repo / "nvidia-h200-x1" / "2026-12-03" / f"{mf_content_id(bob_raw)}.toml"
    target.parent.mkdir(parents=True)
    target.write_bytes(bob_raw)
    git(repo, "add", "-A")
    done = commit("trust bob and his run")
    text = done.stdout + done.stderr
    assert done.returncode != 0 and "bob@elsewhere" in text and ".capture/allowed_signers" in text and target.name in text

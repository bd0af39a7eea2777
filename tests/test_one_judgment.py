"""One judgment (issue 10): verify FILE and verify DIR agree; diff and compare agree; one JSON shape
and one status vocabulary; code drift names files; in-process variables are not drift; nothing a
file holds can forge a report line."""

from __future__ import annotations

import copy
import io
import json
import os
import tomllib
from pathlib import Path

import pytest
import tomli_w

from capture import manifest as mf
from capture import signing
from capture._cli import main
from capture.verify import Policy, compare_manifests, flatten
from capture.verify.compare import code_changes
from capture.verify.policy import DEFAULT_COMPARE, IN_PROCESS_VARIABLES
from capture.verify.tree import verify_paths
from test_results_helpers import git, make_results_repo


def _results_repo(tmp_path: Path, test_signer) -> Path:
    repo = make_results_repo(tmp_path / "results")
    (repo / ".capture" / "allowed_signers").write_text(test_signer.allowed.read_text())
    git(repo, "commit", "-qam", "trust the test signer")
    return repo


def test_verify_file_and_verify_dir_agree_on_a_manifest_made_outside_git(tmp_path, test_signer, home,
                                                                        monkeypatch, capsys):
    plain = tmp_path / "plain"
    plain.mkdir()
    monkeypatch.chdir(plain)  # not a git work tree: the code probe records "skipped"
    m = tmp_path / "m.toml"
    assert main(["fingerprint", "-o", str(m), "--key", str(test_signer.key), "--principal", test_signer.principal]) == 0
    repo = _results_repo(tmp_path, test_signer)
    assert main(["pin", str(m), "--repo", str(repo)]) == 0
    pinned = next(p for p in repo.rglob("*.toml") if ".capture" not in p.parts)
    # Run both from inside the results repository (a git work tree with other content).
    monkeypatch.chdir(repo)
    capsys.readouterr()
    file_code = main(["verify", str(pinned), "--json"])
    single = json.loads(capsys.readouterr().out)
    dir_code = main(["verify", str(repo), "--json"])
    tree = json.loads(capsys.readouterr().out)
    assert file_code == dir_code == 0, (single, tree)
    (row,) = tree["manifests"]
    assert row["status"] == single["status"] == "ok"
    assert set(row) == set(single)  # one JSON shape
    assert [d["field"] for d in row["differences"]] == [d["field"] for d in single["differences"]] == []
    assert any("code: not recorded" in n for n in single["notes"]) and single["notes"] == row["notes"]


def test_single_file_json_names_each_refusal_like_the_tree(tmp_path, test_signer, h200_body, capsys):
    signed = test_signer.sign(h200_body)
    files = {
        "unsigned": h200_body,
        "invalid": signed.replace(b"580.159.04", b"580.159.05", 1),
        "untrusted": signed,
        "malformed": b"schema_version = 1\nkind = ",
    }
    other = tmp_path / "nobody"
    other.write_text("")
    for status, data in files.items():
        f = tmp_path / f"{status}.toml"
        f.write_bytes(data)
        assert main(["verify", str(f), "--json", "--allowed-signers", str(other)]) in (3, 4)
        single = json.loads(capsys.readouterr().out)
        main(["verify", str(f), str(f), "--json", "--allowed-signers", str(other)])
        row = json.loads(capsys.readouterr().out)["manifests"][0]
        assert single["status"] == row["status"] == status
        assert single["exit_code"] == row["exit_code"] == (3 if status == "malformed" else 4)


def _mutated(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, str):
        return value + "-changed"
    return "changed"


def _set_flat(data: dict, key: str, value) -> None:
    """Set the value that flatten() calls ``key`` (arrays of tables keyed by index/repo_id)."""
    parts = key.split(".")
    node = data
    i = 0
    while i < len(parts) - 1:
        part = parts[i]
        child = node[part]
        if isinstance(child, list):
            ident = parts[i + 1]
            node = next(x for x in child if str(x.get("index", x.get("repo_id", x.get("spec")))) == ident
                        or str(child.index(x)) == ident)
            i += 2
            continue
        node = child
        i += 1
    node[parts[-1]] = value


def test_diff_and_compare_agree_on_every_field_the_default_policy_compares(tmp_path, test_signer, h200_body, capsys):
    base = tomllib.loads(h200_body.decode())
    # Fields the real manifest lacks (an AMD stack, a container, a dataset): present on B only.
    base["container"] = {"in_container": True, "runtime": "docker", "image_id": "sha256:" + "a" * 64}
    base["framework"].update(hip_version="6.2.41133", miopen_version="3.2", rccl_version="2.20",
                             loaded={"cudnn_version": "91900", "nccl_version": "2.28.9"})
    base["models"] = [{"repo_id": "org/m", "commit": "c" * 40, "content_hash": "sha256:1"}]
    base["datasets"] = [{"repo_id": "org/d", "commit": "d" * 40, "content_hash": "sha256:2"}]
    base["code"]["commit"] = "e" * 40
    base["python"]["packages"]["mypkg"] = {"version": "0.1", "source": "vcs", "commit": "f" * 40}
    base["amd"] = {"driver_version": "6.8.5", "devices": [{"index": 0, "market_name": "MI300X", "gfx_target": "gfx942"}]}
    a = tmp_path / "a.toml"
    a.write_bytes(test_signer.sign(tomli_w.dumps(base).encode()))
    policy = Policy.default()
    keys = [k for k in flatten(base) if policy.rule_for(k) is not None]
    packages = [k for k in keys if k.startswith("python.packages.")]
    keys = [k for k in keys if k not in packages] + packages[:4] + [k for k in packages if ".mypkg." in k]
    covered = {next(p for p in DEFAULT_COMPARE if __import__("fnmatch").fnmatchcase(k, p)) for k in keys}
    assert covered == set(DEFAULT_COMPARE), set(DEFAULT_COMPARE) - covered
    allowed = ["--allowed-signers", str(test_signer.allowed)]
    disagreements = []
    for key in keys:
        b_data = copy.deepcopy(base)
        _set_flat(b_data, key, _mutated(flatten(base)[key]))
        b = tmp_path / "b.toml"
        b.write_bytes(test_signer.sign(tomli_w.dumps(b_data).encode()))
        diff_code = main(["diff", str(a), str(b), "--json"])
        diff_fields = {d["field"] for d in json.loads(capsys.readouterr().out)["differences"]}
        compare_code = main(["compare", str(a), str(b), "--json", *allowed])
        doc = json.loads(capsys.readouterr().out)
        compare_fields = {c["field"] for c in doc["stack"]} | {
            f"python.packages.{p['name']}.version" for p in doc["packages"]["changed"]}
        if not (diff_code == compare_code == 1 and key in diff_fields and key in compare_fields | {
                k for k in diff_fields if k.startswith("python.packages.")}):
            disagreements.append((key, diff_code, compare_code, sorted(diff_fields), sorted(compare_fields)))
    assert disagreements == []
    # ... and the same bytes are "same" in both.
    assert main(["diff", str(a), str(a)]) == 0 and main(["compare", str(a), str(a), *allowed]) == 0


def test_in_process_variables_are_never_drift(h200_body):
    a = tomllib.loads(h200_body.decode())
    b = copy.deepcopy(a)
    for name in IN_PROCESS_VARIABLES:
        b["environment"]["variables"][name.rsplit(".", 1)[1]] = "/tmp/torchinductor_root"
    for policy in (Policy.default(), Policy.review(), Policy.everything()):
        assert compare_manifests(a, b, policy)[0] == [], policy.source
    b["environment"]["variables"]["NCCL_DEBUG"] = "INFO"  # one a person set: the review policy shows it
    assert [d.field for d in compare_manifests(a, b, Policy.review())[0]] == ["environment.variables.NCCL_DEBUG"]
    assert compare_manifests(a, b, Policy.default())[0] == []  # the default "same stack" ignores the environment


def test_code_drift_names_files_and_says_the_tree_is_now_dirty():
    a = {"code": {"commit": "c1", "tree_hash": "t1", "dirty": False,
                  "files": {"train.py": "b1", "data.py": "b2", "old.py": "b3"}, "file_count": 3}}
    b = {"code": {"commit": "c1", "tree_hash": "t2", "dirty": True,
                  "files": {"train.py": "b9", "data.py": "b2", "new.py": "b4"}, "file_count": 3}}
    (d,) = compare_manifests(a, b)[0]
    assert d.field == "code.tree_hash"
    assert d.detail == ("1 file(s) changed: train.py; 1 file(s) added: new.py; 1 file(s) removed: old.py; "
                        "the work tree is now dirty (uncommitted changes)")
    assert "train.py" in d.line() and d.to_json()["detail"] == d.detail
    b["code"]["files_truncated"] = True
    assert "past its bound" in (code_changes(a, b).describe() or "")
    many = {"code": {"tree_hash": "t3", "files": {f"f{i:02}.py": "x" for i in range(25)}}}
    (d,) = compare_manifests({"code": {"tree_hash": "t0", "files": {}}}, many)[0]
    assert "25 file(s) added" in d.detail and "and 15 more" in d.detail


def test_a_file_cannot_forge_a_report_line(tmp_path, test_signer, h200_body, capsys):
    """Finding 11: control characters in a principal (refused when signing) are escaped when verifying."""
    key = signing.load_private_key(test_signer.key)
    principal = "evil\r\x1b[2KOK         forged.toml  (alice@lab, SHA256:x)\n"
    body = h200_body if h200_body.endswith(b"\n\n") else h200_body + b"\n"
    trailer = signing._render_trailer(principal, signing.public_key_line(key),
                                      signing.sshsig_sign(body, key, signing.NAMESPACE))
    folder = tmp_path / "tree"
    folder.mkdir()
    (folder / "evil.toml").write_bytes(body + trailer)
    name = folder / "x\x1b[2KOK.toml"
    name.write_bytes(b"schema_version = 1\ngarbage")
    out = io.StringIO()
    code = verify_paths([str(folder)], allowed_signers=str(test_signer.allowed), out=out)
    text = out.getvalue()
    assert code == 4
    assert "\x1b" not in text and "\r" not in text
    assert sorted(ln.split()[0] for ln in text.splitlines()) == ["2", "MALFORMED", "UNTRUSTED"]
    assert "\\x1b[2KOK" in text
    assert main(["verify", str(folder / "evil.toml"), "--allowed-signers", str(test_signer.allowed)]) == 4
    err = capsys.readouterr().err
    assert "\x1b" not in err and err.count("\n") == 2 and err.startswith("error:")
    assert main(["show", str(folder / "evil.toml"), "--allowed-signers", str(test_signer.allowed)]) == 0
    assert "\x1b" not in capsys.readouterr().out


def test_tree_honours_code_and_verify_artifacts_like_single(tmp_path, test_signer, home, monkeypatch, capsys):
    import subprocess

    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text("print(1)\n")
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@e", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@e"}
    for cmd in (["git", "init", "-q", "-b", "main"], ["git", "add", "."], ["git", "commit", "-qm", "init"]):
        subprocess.run(cmd, cwd=code, check=True, env=env)
    m = tmp_path / "m" / "m.toml"
    m.parent.mkdir()
    assert main(["fingerprint", "--code", str(code), "-o", str(m), "--key", str(test_signer.key)]) == 0
    moved = tmp_path / "moved"
    code.rename(moved)  # the recorded path is gone: without --code both would compare the cwd
    monkeypatch.chdir(tmp_path)
    allowed = ["--allowed-signers", str(test_signer.allowed)]
    capsys.readouterr()
    single = main(["verify", str(m), "--code", str(moved), "--json", *allowed])
    s = json.loads(capsys.readouterr().out)
    tree = main(["verify", str(m.parent), "--code", str(moved), "--json", *allowed])
    t = json.loads(capsys.readouterr().out)["manifests"][0]
    assert single == tree == 0 and s["status"] == t["status"] == "ok"
    assert s["code_dir"] == t["code_dir"] == str(moved)
    (moved / "train.py").write_text("print(2)\n")
    assert main(["verify", str(m), "--code", str(moved), *allowed]) == 1
    assert main(["verify", str(m.parent), "--code", str(moved), *allowed]) == 1
    assert "code." in capsys.readouterr().out


@pytest.mark.parametrize("command", ["show", "compare"])
def test_show_and_compare_exit_4_on_unsigned_or_invalid_unless_allowed(tmp_path, test_signer, h200_body, command, capsys):
    signed = test_signer.sign(h200_body)
    for data in (h200_body, signed.replace(b"580.159.04", b"580.159.05", 1)):
        f = tmp_path / "f.toml"
        f.write_bytes(data)
        args = [command, str(f)] + ([str(f)] if command == "compare" else []) + [
            "--allowed-signers", str(test_signer.allowed)]
        assert main(args) == 4
        out, err = capsys.readouterr()
        assert out and err.startswith("error:") and err.count("error:") == 1  # printed, then refused
        assert main([*args, "--allow-unsigned"]) == 0
        capsys.readouterr()
    f.write_bytes(signed)
    assert main([command, str(f)] + ([str(f)] if command == "compare" else [])) == 0  # untrusted: labelled only
    assert "NOT trusted" in capsys.readouterr().out

"""`capture verify DIR | GLOB | FILE...` over a real results repository."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from capture import manifest as mf
from capture._cli import main
from capture.results.pin import pin
from capture.verify.tree import verify_paths, verify_tree, worst_exit_code
from test_results_helpers import h200_manifest, keys, make_results_repo  # noqa: F401


@pytest.fixture
def tree(tmp_path, keys):
    """A results repository with two pinned runs, then one file of each failure kind added."""
    repo = make_results_repo(tmp_path / "results", keys["alice"])
    srcs = []
    for day in ("2026-12-01", "2026-12-02"):
        src = tmp_path / f"{day}.toml"
        keys["alice"].write(src, h200_manifest(created_utc=f"{day}T09:00:00Z"))
        srcs.append(str(src))
    result = pin(srcs, repo)
    return repo, [r.path for r in result.runs]


def _add_bad_files(repo: Path, keys) -> dict[str, str]:
    bad = repo / "incoming"
    bad.mkdir()
    raw = keys["alice"].write(bad / "tampered.toml", h200_manifest())
    (bad / "tampered.toml").write_bytes(raw.replace(b"580.159.04", b"580.159.05", 1))
    keys["mallory"].write(bad / "untrusted.toml", h200_manifest())
    (bad / "unsigned.toml").write_bytes(mf.dumps(h200_manifest()))
    (bad / "truncated.toml").write_bytes(b'schema_version = 1\nkind = "trial"\ncreated_utc = "2026')
    return {"tampered": "INVALID", "untrusted": "UNTRUSTED", "unsigned": "UNSIGNED", "truncated": "MALFORMED"}


def test_clean_tree_is_ok(tree):
    repo, paths = tree
    out = io.StringIO()
    assert verify_paths([str(repo)], out=out) == 0
    lines = out.getvalue().splitlines()
    assert len(lines) == 3
    for p in paths:
        assert any(line.startswith("OK") and line.endswith(")") and p in line and "alice@lab" in line for line in lines)
    assert lines[-1].startswith("2 manifest(s): 2 OK") and "signature and trust only" in lines[-1]


def test_each_failure_is_named_and_the_worst_code_wins(tree, keys):
    repo, paths = tree
    expected = _add_bad_files(repo, keys)
    report = verify_tree([str(repo)])
    by_name = {Path(e.path).stem: e for e in report.entries}
    for name, status in expected.items():
        assert by_name[name].status == status, by_name[name]
        assert by_name[name].reason
    assert "not valid TOML" in by_name["truncated"].reason
    assert "mallory@elsewhere" in by_name["untrusted"].reason
    assert report.exit_code == 4
    assert report.counts["OK"] == 2 and report.counts["MALFORMED"] == 1
    # Without the signature failures, malformed (3) is the worst.
    for name in ("tampered", "untrusted", "unsigned"):
        (repo / "incoming" / f"{name}.toml").unlink()
    assert verify_paths([str(repo)], out=io.StringIO()) == 3


def test_cli_json_has_one_object_per_file_and_a_summary(tree, keys, capsys):
    repo, paths = tree
    _add_bad_files(repo, keys)
    code = main(["verify", str(repo), "--signature-only", "--json"])
    assert code == 4
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["manifests"]) == 6
    assert doc["summary"]["total"] == 6 and doc["summary"]["ok"] == 2 and doc["summary"]["exit_code"] == 4
    ok = [m for m in doc["manifests"] if m["status"] == "ok"]
    assert {m["signer"]["principal"] for m in ok} == {"alice@lab"}


def test_glob_and_several_files(tree, capsys):
    repo, paths = tree
    assert main(["verify", str(repo / "nvidia-h200-x1" / "*" / "*.toml"), "--signature-only"]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()] == ["OK", "OK", "2"]
    files = [str(repo / p) for p in paths]
    assert main(["verify", *files, "--signature-only"]) == 0
    out = capsys.readouterr().out
    assert "2 manifest(s): 2 OK" in out


def test_explicit_allowed_signers_replaces_the_repository_one(tree, keys, tmp_path):
    repo, _ = tree
    other = tmp_path / "only_mallory"
    other.write_text(keys["mallory"].allowed_line)
    report = verify_tree([str(repo)], allowed_signers=str(other))
    assert {e.status for e in report.entries} == {"UNTRUSTED"}


def test_stack_check_reports_drift_against_this_machine(tree):
    """An H200 manifest verified on this CPU machine drifts: the report names the fields."""
    repo, _ = tree
    report = verify_tree([str(repo)], stack=True)
    assert {e.status for e in report.entries} == {"DRIFT"}
    fields = {d.field for d in report.entries[0].differences}
    assert "accelerator.model" in fields and "nvidia.driver_version" in fields
    assert report.exit_code == 1
    assert "DRIFT" in report.entries[0].line() and "accelerator" in report.entries[0].line()


def test_missing_file_is_malformed_and_empty_folder_is_usage(tmp_path, capsys):
    assert main(["verify", str(tmp_path / "a.toml"), str(tmp_path / "b.toml"), "--signature-only"]) == 3
    assert "no such file" in capsys.readouterr().out
    (tmp_path / "empty").mkdir()
    assert main(["verify", str(tmp_path / "empty"), "--signature-only"]) == 2


def test_worst_exit_code_precedence():
    assert worst_exit_code([0, 1, 3, 4, 0]) == 4
    assert worst_exit_code([1, 3, 0]) == 3
    assert worst_exit_code([0, 1]) == 1
    assert worst_exit_code([]) == 0
    assert worst_exit_code([1, 2]) == 2


def test_process_pool_gives_the_same_report(tree, keys, monkeypatch):
    repo, _ = tree
    _add_bad_files(repo, keys)
    from capture.verify import tree as tree_mod
    sequential = verify_tree([str(repo)], jobs=1)
    monkeypatch.setattr(tree_mod, "PARALLEL_MIN_FILES", 1)
    parallel = verify_tree([str(repo)], jobs=2)
    assert [(e.path, e.status, e.reason, e.principal) for e in parallel.entries] == \
        [(e.path, e.status, e.reason, e.principal) for e in sequential.entries]
    stacked = verify_tree([str(repo)], jobs=2, stack=True)
    assert [e.status for e in stacked.entries].count("DRIFT") == 2


def test_bad_explicit_allowed_signers_is_one_usage_error(tree, tmp_path, capsys):
    repo, _ = tree
    assert main(["verify", str(repo), "--signature-only", "--allowed-signers", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_empty_results_repository_verifies_as_zero_manifests(tmp_path, capsys):
    repo = tmp_path / "results"
    (repo / ".capture").mkdir(parents=True)
    (repo / ".capture" / "results.toml").write_text("layout = 1\n")
    assert main(["verify", str(repo), "--signature-only"]) == 0
    assert capsys.readouterr().out.startswith("0 manifest(s)")


def test_project_manifests_folder_verifies():
    """manifests/ of this project is a results repository; every manifest in it must verify."""
    folder = Path(__file__).resolve().parent.parent / "manifests"
    report = verify_tree([str(folder)])
    assert report.exit_code == 0, "\n".join(e.line() for e in report.entries)

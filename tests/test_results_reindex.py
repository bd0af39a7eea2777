"""`capture pin --reindex`: rows an older capture wrote are recomputed from the signed manifests.

A results repository keeps one row per pinned manifest in ``index.json`` / ``index.md``, computed
when the manifest was pinned. After an upgrade, older rows read differently from new ones (this
project's own ``manifests/index.md`` had 7 of 25 rows with an old cost label). The reindex reads
every listed manifest again through the door, with the repository's own trust file, and commits
the index only if this capture computes it differently. Real keys, real git repositories.
"""

from __future__ import annotations

import json
import os

import pytest

from capture._cli import main
from capture.results.pin import pin, reindex
from test_results_helpers import Signer, git, h200_manifest, make_results_repo

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def people(tmp_path_factory) -> dict[str, Signer]:
    folder = tmp_path_factory.mktemp("people")
    return {"alice": Signer(folder, "alice@lab"), "bob": Signer(folder, "bob@elsewhere")}


@pytest.fixture
def pinned(tmp_path, people, home):
    """A results repository with two runs pinned by alice; its index as pin wrote it."""
    repo = make_results_repo(tmp_path / "results", people["alice"])
    files = []
    for i, created in enumerate(("2026-12-02T10:15:00Z", "2026-12-03T10:15:00Z")):
        files.append(tmp_path / f"run{i}.toml")
        people["alice"].write(files[-1], h200_manifest(created_utc=created))
    result = pin([str(f) for f in files], repo)
    return repo, [r.path for r in result.runs]


def _head(repo) -> str:
    return git(repo, "rev-parse", "HEAD")


def _age(repo, path: str) -> dict:
    """Rewrite ``path``'s row as an older capture wrote it (a label since renamed, a figure it did
    not compute), and commit that, as a repository pinned before an upgrade holds it."""
    doc = json.loads((repo / "index.json").read_text())
    row = next(r for r in doc["runs"] if r["path"] == path)
    fresh = dict(row)
    row.pop("tokens_per_s", None)
    row["cost_per_million_tokens"] = "0.1206 per million trained tokens"
    (repo / "index.json").write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    (repo / "index.md").write_text((repo / "index.md").read_text().replace("| trial |", "| trial (old) |", 1))
    git(repo, "commit", "-qam", "an index an older capture wrote")
    return fresh


def test_rows_an_older_capture_wrote_are_recomputed_and_committed(pinned, capsys):
    repo, paths = pinned
    want_json, want_md = (repo / "index.json").read_bytes(), (repo / "index.md").read_bytes()
    fresh = _age(repo, paths[0])
    before = _head(repo)
    capsys.readouterr()
    assert main(["pin", "--reindex", "--repo", str(repo)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"recomputed  {paths[0]}" and out[1].endswith(": 1 of 2 rows recomputed"), out
    assert git(repo, "rev-parse", "HEAD~1") == before and git(repo, "status", "--porcelain") == ""
    assert (repo / "index.json").read_bytes() == want_json and (repo / "index.md").read_bytes() == want_md
    row = next(r for r in json.loads((repo / "index.json").read_text())["runs"] if r["path"] == paths[0])
    assert row == fresh and "cost_per_million_tokens" not in row
    assert git(repo, "log", "-1", "--format=%B").startswith("reindex: 1 of 2 rows recomputed by capture ")
    assert f"- {paths[0]}" in git(repo, "log", "-1", "--format=%B")
    assert main(["verify", str(repo), "--signature-only"]) == 0
    capsys.readouterr()
    # Again: nothing differs, nothing is committed.
    assert main(["pin", "--reindex", "--repo", str(repo), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc == {"commit": None, "rows": 2, "changed": []} and _head(repo) == git(repo, "rev-parse", "HEAD")


@pytest.mark.parametrize("attack", ["outside", "absent", "untrusted", "renamed"])
def test_a_listed_file_that_is_not_a_trusted_pinned_manifest_stops_the_reindex(pinned, people, tmp_path, attack, capsys):
    """The index is hostile input too: a row pointing outside the repository, a row whose file is
    gone, a manifest by a signer the repository does not trust or under a name that is not its
    content id. Each is one line with the documented exit code; the repository is left as it was
    (HEAD, work tree)."""
    repo, paths = pinned
    doc = json.loads((repo / "index.json").read_text())
    expected = {"outside": 3, "absent": 3, "untrusted": 4, "renamed": 4}[attack]
    if attack == "outside":
        people["alice"].write(tmp_path / "elsewhere.toml", h200_manifest())
        doc["runs"][0]["path"] = "../elsewhere.toml"
    elif attack == "absent":
        git(repo, "rm", "-q", paths[0])
    elif attack == "untrusted":
        people["bob"].write(repo / paths[0], h200_manifest(created_utc="2026-12-02T10:15:00Z"))
    elif attack == "renamed":
        other = repo / paths[0]
        other.write_bytes((repo / paths[1]).read_bytes())
    (repo / "index.json").write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    git(repo, "commit", "-qam", f"a repository with a hostile row ({attack})")
    before, tree = _head(repo), git(repo, "status", "--porcelain", "--untracked-files=all")
    capsys.readouterr()
    code = main(["pin", "--reindex", "--repo", str(repo)])
    err = capsys.readouterr().err
    assert code == expected, (attack, code, err)
    assert err.startswith("error: ") and "Traceback" not in err and len(err.strip().splitlines()) == 2, err
    assert _head(repo) == before and git(repo, "status", "--porcelain", "--untracked-files=all") == tree


def test_the_index_reader_never_blocks_on_a_fifo_or_reads_past_its_limit(tmp_path):
    """One reader for `pin`, `pin --reindex` and `verify DIR`: a FIFO returns at once, a link to
    /dev/zero is refused, a 5,000-digit number or a wrong schema_version is one error."""
    from capture.errors import ManifestError
    from capture.results.index import load_rows

    assert load_rows(tmp_path) is None
    index = tmp_path / "index.json"
    os.mkfifo(index)
    with pytest.raises(ManifestError, match="FIFO"):
        load_rows(tmp_path)
    index.unlink()
    index.symlink_to("/dev/zero")
    with pytest.raises(ManifestError, match="character device"):
        load_rows(tmp_path)
    index.unlink()
    for text, message in (('{"runs": [' + "9" * 5000 + "]}", "not JSON: "),
                          ('{"runs": [{"path": "a.toml"}], "schema_version": "1"}', "is not an integer"),
                          ('{"runs": [{"path": "a.toml"}], "schema_version": 2}', "newer than this capture"),
                          ('{"runs": [{"name": "a.toml"}]}', "not a capture index")):
        index.write_text(text)
        with pytest.raises(ManifestError, match=message):
            load_rows(tmp_path)
    index.write_text('{"runs": [{"path": "a/b.toml", "kind": "trial"}], "schema_version": 1}')
    assert load_rows(tmp_path) == [{"path": "a/b.toml", "kind": "trial"}]


def test_reindex_and_pin_arguments(pinned, tmp_path, capsys):
    repo, _ = pinned
    assert main(["pin", "--repo", str(repo)]) == 2
    assert "no manifest to pin" in capsys.readouterr().err
    assert main(["pin", "--reindex", str(tmp_path / "run0.toml"), "--repo", str(repo)]) == 2
    assert "--reindex takes no FILE" in capsys.readouterr().err
    assert main(["pin", "--reindex", "--repo", str(tmp_path / "nowhere")]) == 2
    assert reindex(repo).commit is None


def test_an_ignored_fifo_where_the_index_or_a_manifest_goes_is_one_error_not_a_hang(pinned, people, tmp_path):
    """Paths git ignores pass the clean-repository check, so they are read as hostile too: a FIFO
    where index.md or a manifest is to be compared would block a plain read forever."""
    import subprocess
    import sys

    repo, paths = pinned
    git(repo, "rm", "-q", "--cached", "index.md")
    (repo / ".gitignore").write_text("index.md\nnvidia-h200-x1/2026-12-04/\n")
    git(repo, "add", ".gitignore")
    git(repo, "commit", "-qm", "index.md ignored")
    (repo / "index.md").unlink()
    os.mkfifo(repo / "index.md")
    cli = [sys.executable, "-m", "capture", "pin"]
    proc = subprocess.run([*cli, "--reindex", "--repo", str(repo)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3 and "a FIFO" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    run = tmp_path / "run-04.toml"
    people["alice"].write(run, h200_manifest(created_utc="2026-12-04T10:15:00Z"))
    from capture.results.pin import pin_path
    from capture.verify.open import open_manifest

    opened = open_manifest(str(run), require_trusted=False)
    rel = pin_path(opened.data, opened.raw)
    (repo / rel).parent.mkdir(parents=True)
    os.mkfifo(repo / rel)
    proc = subprocess.run([*cli, str(run), "--repo", str(repo)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3 and "a FIFO" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr

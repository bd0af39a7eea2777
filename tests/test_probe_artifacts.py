"""Artifacts probe: real hub cache trees on disk (blobs named by their real hashes, symlinked
snapshots, refs), checked against huggingface_hub's own scanner; local folders; corrupted blobs."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

import pytest
from huggingface_hub import scan_cache_dir

from capture import fingerprint, manifest
from capture.errors import EXIT_USAGE, UsageError
from capture.probes import ProbeOptions
from capture.probes import artifacts

FIXTURE = Path(__file__).parent / "fixtures" / "real-world" / "hf-hub-cache-tree-gpt-j-6B.txt"
GPTJ_COMMIT = "918ad376364058dee23512629bc385380c98e57d"


def gptj_file_names() -> list[str]:
    """The snapshot file names of the real gpt-j-6B cache listing."""
    text = FIXTURE.read_text()
    assert GPTJ_COMMIT in text
    return re.findall(r"── (\S+) -> \.\./\.\./blobs/[0-9a-f]{40}", text)


def git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def make_repo(cache: Path, repo_id: str, commit: str, files: dict[str, bytes], kind: str = "model",
              lfs: tuple[str, ...] = (), refs: tuple[str, ...] = ("main",)) -> Path:
    """A hub cache repo as huggingface_hub writes it: blobs named by content hash, relative symlinks."""
    folder = cache / f"{kind}s--{repo_id.replace('/', '--')}"
    (folder / "blobs").mkdir(parents=True, exist_ok=True)
    for path, data in files.items():
        blob_id = hashlib.sha256(data).hexdigest() if path in lfs else git_sha1(data)
        (folder / "blobs" / blob_id).write_bytes(data)
        link = folder / "snapshots" / commit / path
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(folder / "blobs" / blob_id, link.parent), link)
    (folder / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (folder / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (folder / "refs" / ref).write_text(commit)
    return folder


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    cache = tmp_path / "hub"
    gptj = {name: f"{name} of gpt-j-6B\n".encode() for name in gptj_file_names()}
    gptj["pytorch_model.bin"] = os.urandom(3 * 1024 * 1024 + 17)
    gptj["nested/dir/config.json"] = b'{"a": 1}\n'
    make_repo(cache, "EleutherAI/gpt-j-6B", GPTJ_COMMIT, gptj, lfs=("pytorch_model.bin",), refs=("main", "v1.0"))
    make_repo(cache, "EleutherAI/gpt-j-6B", "a" * 40, {"config.json": b"old\n"}, refs=())
    make_repo(cache, "tatsu-lab/alpaca", "c" * 40, {"data/train.parquet": b"PAR1" * 100, "README.md": b"# alpaca\n"},
              kind="dataset", lfs=("data/train.parquet",))
    return cache


def test_resolves_branch_against_the_cache(cache: Path) -> None:
    (info,) = artifacts.probe_models(ProbeOptions(models=("EleutherAI/gpt-j-6B",), hf_cache=cache, progress=False))
    assert (info.repo_id, info.revision, info.commit, info.source) == ("EleutherAI/gpt-j-6B", "main", GPTJ_COMMIT, "hf-cache")
    paths = [f.path for f in info.files]
    assert paths == sorted(gptj_file_names() + ["pytorch_model.bin", "nested/dir/config.json"])
    model = next(f for f in info.files if f.path == "pytorch_model.bin")
    assert model.lfs is True and len(model.blob_id or "") == 64 and model.size_bytes == 3 * 1024 * 1024 + 17
    vocab = next(f for f in info.files if f.path == "vocab.json")
    assert vocab.lfs is False and vocab.blob_id == git_sha1(b"vocab.json of gpt-j-6B\n")
    entries = b"".join(f"{f.blob_id} {f.path}".encode() + b"\0" for f in info.files)
    assert info.content_hash == "sha256:" + hashlib.sha256(b"capture-hf-snapshot-v1\0" + entries).hexdigest()
    assert info.verified is None


def test_huggingface_hub_scanner_agrees(cache: Path) -> None:
    (info,) = artifacts.probe_models(ProbeOptions(models=("EleutherAI/gpt-j-6B@v1.0",), hf_cache=cache, progress=False))
    (dataset,) = artifacts.probe_datasets(ProbeOptions(datasets=("tatsu-lab/alpaca",), hf_cache=cache, progress=False))
    scanned = scan_cache_dir(cache)
    assert not scanned.warnings
    for ours, repo_type in ((info, "model"), (dataset, "dataset")):
        repo = next(r for r in scanned.repos if r.repo_id == ours.repo_id and r.repo_type == repo_type)
        revision = next(r for r in repo.revisions if r.commit_hash == ours.commit)
        theirs = {(f.file_path.relative_to(revision.snapshot_path).as_posix(), f.blob_path.name, f.size_on_disk)
                  for f in revision.files}
        assert theirs == {(f.path, f.blob_id, f.size_bytes) for f in ours.files}
    gptj = next(r for r in scanned.repos if r.repo_id == "EleutherAI/gpt-j-6B")
    assert {ref for r in gptj.revisions for ref in r.refs} == {"main", "v1.0"}


@pytest.mark.parametrize("rev", ["main", "v1.0", GPTJ_COMMIT, GPTJ_COMMIT[:7]])
def test_revision_forms(cache: Path, rev: str) -> None:
    (info,) = artifacts.probe_models(ProbeOptions(models=(f"EleutherAI/gpt-j-6B@{rev}",), hf_cache=cache, progress=False))
    assert info.commit == GPTJ_COMMIT and info.revision == rev


def test_other_cached_commit_by_hash(cache: Path) -> None:
    (info,) = artifacts.probe_models(ProbeOptions(models=("EleutherAI/gpt-j-6B@aaaa",), hf_cache=cache, progress=False))
    assert info.commit == "a" * 40 and [f.path for f in info.files] == ["config.json"]


@pytest.mark.parametrize(("spec", "kind", "message", "hint"), [
    ("EleutherAI/gpt-neo-125m", "model", "model EleutherAI/gpt-neo-125m is not in the hub cache",
     "hf download EleutherAI/gpt-neo-125m --revision main"),
    ("EleutherAI/gpt-j-6B@float16", "model", "(no ref float16)",
     "hf download EleutherAI/gpt-j-6B --revision float16"),
    ("EleutherAI/gpt-j-6B@0123abcd", "model", "(no ref or snapshot 0123abcd)",
     "hf download EleutherAI/gpt-j-6B --revision 0123abcd"),
    ("tatsu-lab/alpaca@v2", "dataset", "dataset tatsu-lab/alpaca@v2 is not in the hub cache",
     "hf download tatsu-lab/alpaca --repo-type dataset --revision v2"),
    ("tatsu-lab/alpaca", "model", "model tatsu-lab/alpaca is not in the hub cache",
     "hf download tatsu-lab/alpaca --revision main"),
    ("not a repo!", "model", "is neither a hub repo id", "local folder or file that exists"),
    ("org/name@../../etc", "model", "is neither a hub repo id", "local folder or file that exists"),
])
def test_not_cached_is_a_usage_error(cache: Path, spec: str, kind: str, message: str, hint: str) -> None:
    options = ProbeOptions(models=(spec,) if kind == "model" else (), datasets=(spec,) if kind == "dataset" else (),
                           hf_cache=cache, progress=False)
    fn = artifacts.probe_models if kind == "model" else artifacts.probe_datasets
    with pytest.raises(UsageError) as err:
        fn(options)
    assert message in err.value.message and "\n" not in err.value.message
    assert hint in (err.value.hint or "")
    assert err.value.exit_code == EXIT_USAGE


def test_ambiguous_prefix(cache: Path) -> None:
    make_repo(cache, "EleutherAI/gpt-j-6B", "a" * 39 + "b", {"x": b"x"}, refs=())
    with pytest.raises(UsageError, match="matches 2 cached commits"):
        artifacts.probe_models(ProbeOptions(models=("EleutherAI/gpt-j-6B@aaaaaaaa",), hf_cache=cache))


def test_ref_to_a_snapshot_that_is_not_downloaded(cache: Path) -> None:
    (cache / "models--EleutherAI--gpt-j-6B" / "refs" / "dev").write_text("d" * 40)
    with pytest.raises(UsageError, match="points to dddddddddddd, which is not downloaded"):
        artifacts.probe_models(ProbeOptions(models=("EleutherAI/gpt-j-6B@dev",), hf_cache=cache))


@pytest.mark.parametrize("content", ["../../../..", "../../../../../" + "x" * 20, "main", "", "d" * 39 + "\n", "D" * 40])
def test_a_ref_that_does_not_hold_a_commit_hash_names_no_folder(cache: Path, content: str) -> None:
    """refs/<name> names the snapshot folder to hash: one that holds a path ("../../../.." would make
    the probe walk and hash a folder outside the cache) or anything but a commit hash is refused."""
    (cache / "models--EleutherAI--gpt-j-6B" / "refs" / "dev").write_text(content)
    with pytest.raises(UsageError, match="ref dev holds .*, not a commit hash"):
        artifacts.probe_models(ProbeOptions(models=("EleutherAI/gpt-j-6B@dev",), hf_cache=cache))
    (cache / "models--EleutherAI--gpt-j-6B" / "refs" / "dev").write_text("a" * 40 + "\n")  # hub writes none; git does
    assert artifacts.probe_models(ProbeOptions(models=("EleutherAI/gpt-j-6B@dev",), hf_cache=cache))[0].commit == "a" * 40


def test_verify_catches_a_corrupted_blob(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = ("EleutherAI/gpt-j-6B",)
    (good,) = artifacts.probe_models(ProbeOptions(models=spec, hf_cache=cache, verify_artifacts=True, progress=False))
    assert good.verified is True and good.mismatches == ()
    assert capsys.readouterr().err == ""  # progress=False: no bar

    folder = cache / "models--EleutherAI--gpt-j-6B" / "blobs"
    model = next(f for f in good.files if f.path == "pytorch_model.bin")
    vocab = next(f for f in good.files if f.path == "vocab.json")
    with open(folder / str(model.blob_id), "r+b") as f:  # one flipped byte in the middle
        f.seek(2 * 1024 * 1024)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    (folder / str(vocab.blob_id)).write_bytes(b"tampered\n")
    (bad,) = artifacts.probe_models(ProbeOptions(models=spec, hf_cache=cache, verify_artifacts=True, progress=True))
    assert bad.verified is False
    assert bad.mismatches == ("pytorch_model.bin", "vocab.json")
    assert bad.content_hash == good.content_hash  # the cache still claims the same content
    assert "verify EleutherAI/gpt-j-6B" in capsys.readouterr().err
    table = manifest.to_toml_value(bad.to_manifest())
    assert table["verified"] is False and table["mismatches"] == ["pytorch_model.bin", "vocab.json"]


def test_missing_blob_is_reported(cache: Path) -> None:
    folder = cache / "models--EleutherAI--gpt-j-6B"
    (info,) = artifacts.probe_models(ProbeOptions(models=("EleutherAI/gpt-j-6B",), hf_cache=cache, progress=False))
    merges = next(f for f in info.files if f.path == "merges.txt")
    (folder / "blobs" / str(merges.blob_id)).unlink()
    (info,) = artifacts.probe_models(ProbeOptions(models=("EleutherAI/gpt-j-6B",), hf_cache=cache,
                                                  verify_artifacts=True, progress=False))
    assert info.missing_files == ("merges.txt",)
    assert info.verified is False and info.mismatches == ()


def test_cache_location_from_environment(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    options = ProbeOptions(models=("EleutherAI/gpt-j-6B",), progress=False)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    home = tmp_path / "hfhome"
    home.mkdir()
    (home / "hub").symlink_to(cache)
    monkeypatch.setenv("HF_HOME", str(home))
    assert artifacts.hub_cache_dir(options) == home / "hub"
    assert artifacts.probe_models(options)[0].commit == GPTJ_COMMIT
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert artifacts.hub_cache_dir(options) == cache
    assert artifacts.hub_cache_dir(ProbeOptions(hf_cache=tmp_path / "explicit")) == tmp_path / "explicit"


def test_cache_without_symlinks_hashes_copies(tmp_path: Path) -> None:
    folder = tmp_path / "hub" / "models--org--plain"
    (folder / "snapshots" / ("e" * 40)).mkdir(parents=True)
    (folder / "snapshots" / ("e" * 40) / "config.json").write_bytes(b"{}\n")
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text("e" * 40)
    (info,) = artifacts.probe_models(ProbeOptions(models=("org/plain",), hf_cache=tmp_path / "hub", progress=False))
    (f,) = info.files
    assert f.blob_id == hashlib.sha256(b"{}\n").hexdigest() and f.lfs is True


def test_local_folder(tmp_path: Path) -> None:
    folder = tmp_path / "my-model"
    (folder / "sub").mkdir(parents=True)
    (folder / "config.json").write_bytes(b"{}\n")
    (folder / "sub" / "weights.bin").write_bytes(b"\x01" * 1000)
    (folder / "loop").symlink_to(folder)  # must not recurse forever
    (info,) = artifacts.probe_models(ProbeOptions(models=(str(folder),), progress=False))
    assert (info.source, info.path, info.repo_id, info.commit) == ("local-dir", str(folder), None, None)
    digests = {"config.json": hashlib.sha256(b"{}\n").hexdigest(),
               "sub/weights.bin": hashlib.sha256(b"\x01" * 1000).hexdigest()}
    entries = b"".join(f"{digests[p]} {p}".encode() + b"\0" for p in sorted(digests))
    assert info.content_hash == "sha256:" + hashlib.sha256(b"capture-dir-v1\0" + entries).hexdigest()
    assert [(f.path, f.sha256) for f in info.files] == sorted(digests.items())
    assert info.size_bytes == 1003
    (folder / "config.json").write_bytes(b"{ }\n")
    assert artifacts.probe_models(ProbeOptions(models=(str(folder),), progress=False))[0].content_hash != info.content_hash


def test_fingerprint_writes_models_and_datasets(cache: Path, tmp_path: Path) -> None:
    data = fingerprint.collect(ProbeOptions(models=("EleutherAI/gpt-j-6B@v1.0",), datasets=("tatsu-lab/alpaca",),
                                            hf_cache=cache, code=tmp_path, progress=False))
    body = manifest.dumps(data)
    parsed = manifest.parse_body(body)
    (model,) = parsed["models"]
    assert model["commit"] == GPTJ_COMMIT and model["source"] == "hf-cache"
    assert {f["path"] for f in model["files"]} >= set(gptj_file_names())
    assert parsed["datasets"][0]["repo_id"] == "tatsu-lab/alpaca"
    assert b"[[models.files]]" in body and b"[[datasets.files]]" in body


def test_cli_not_cached_is_one_line_and_exit_2(cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from capture._cli import main

    out = tmp_path / "m.toml"
    code = main(["fingerprint", "-o", str(out), "--hf-cache", str(cache), "--code", str(tmp_path),
                 "--model", "EleutherAI/gpt-j-6B@float16"])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE
    assert err.splitlines()[0].startswith("error: model EleutherAI/gpt-j-6B@float16 is not in the hub cache")
    assert "hint: hf download EleutherAI/gpt-j-6B --revision float16" in err
    assert "Traceback" not in err and not out.exists()


def test_cli_fingerprint_with_a_cached_model(cache: Path, tmp_path: Path) -> None:
    from capture._cli import main

    out = tmp_path / "m.toml"
    assert main(["fingerprint", "-o", str(out), "--hf-cache", str(cache), "--code", str(tmp_path),
                 "--model", "EleutherAI/gpt-j-6B@v1.0", "--verify-artifacts"]) == 0
    (model,) = manifest.load_unverified(out).data["models"]
    assert (model["commit"], model["verified"], model["mismatches"]) == (GPTJ_COMMIT, True, [])


def test_cli_verify_artifacts_with_a_corrupted_blob_is_exit_6(cache: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """One corrupted blob: an error naming its path on stderr, exit 6, and no manifest written."""
    from capture._cli import main
    from capture.errors import EXIT_ARTIFACT

    (good,) = artifacts.probe_models(ProbeOptions(models=("EleutherAI/gpt-j-6B",), hf_cache=cache, progress=False))
    vocab = next(f for f in good.files if f.path == "vocab.json")
    blob = cache / "models--EleutherAI--gpt-j-6B" / "blobs" / str(vocab.blob_id)
    blob.write_bytes(b"tampered\n")
    out = tmp_path / "m.toml"
    code = main(["fingerprint", "-o", str(out), "--hf-cache", str(cache), "--code", str(tmp_path),
                 "--model", "EleutherAI/gpt-j-6B", "--verify-artifacts"])
    err = capsys.readouterr().err
    assert code == EXIT_ARTIFACT == 6
    first, hint = err.strip().splitlines()[-2:]
    assert first == f"error: model EleutherAI/gpt-j-6B: vocab.json does not match its blob id: {blob.resolve()}"
    assert hint == f"hint: the cached file is corrupt: delete {blob.resolve()} and run `hf download EleutherAI/gpt-j-6B --revision main`"
    assert "Traceback" not in err and not out.exists()
    # without --verify-artifacts the same cache fingerprints fine (nothing re-read)
    assert main(["fingerprint", "-o", str(out), "--hf-cache", str(cache), "--code", str(tmp_path),
                 "--model", "EleutherAI/gpt-j-6B"]) == 0


def test_cli_verify_artifacts_with_a_missing_blob_is_exit_6(cache: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    from capture._cli import main

    folder = cache / "models--EleutherAI--gpt-j-6B"
    (folder / "snapshots" / GPTJ_COMMIT / "merges.txt").resolve().unlink()
    code = main(["fingerprint", "-o", str(tmp_path / "m.toml"), "--hf-cache", str(cache), "--code", str(tmp_path),
                 "--model", "EleutherAI/gpt-j-6B", "--verify-artifacts"])
    err = capsys.readouterr().err
    assert code == 6 and "error: model EleutherAI/gpt-j-6B: merges.txt is missing from the hub cache" in err
    assert "hf download EleutherAI/gpt-j-6B --revision main" in err


@pytest.mark.parametrize(("env", "expected"), [
    ({"HF_HUB_CACHE": "/c/hub", "HUGGINGFACE_HUB_CACHE": "/old", "HF_HOME": "/h"}, "/c/hub"),
    ({"HUGGINGFACE_HUB_CACHE": "/old", "HF_HOME": "/h"}, "/old"),
    ({"HF_HOME": "/h", "XDG_CACHE_HOME": "/x"}, "/h/hub"),
    ({"XDG_CACHE_HOME": "/x"}, "/x/huggingface/hub"),
    ({"HOME": "/home/u"}, "/home/u/.cache/huggingface/hub"),
])
def test_paths_hub_cache_dir_agrees_with_huggingface_hub(env: dict[str, str], expected: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess
    import sys

    from capture import paths

    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert paths.hub_cache_dir() == Path(expected)
    theirs = subprocess.run([sys.executable, "-c", "from huggingface_hub import constants; print(constants.HF_HUB_CACHE)"],
                            capture_output=True, text=True, check=True).stdout.strip()
    assert Path(theirs) == Path(expected)


def test_local_file(tmp_path: Path) -> None:
    """A data set kept as one file: hashed by content and name, never mistaken for a hub id."""
    data = tmp_path / "chat.jsonl"
    data.write_bytes(b'{"messages": []}\n')
    (info,) = artifacts.probe_datasets(ProbeOptions(datasets=(str(data),), progress=False))
    digest = hashlib.sha256(b'{"messages": []}\n').hexdigest()
    assert (info.source, info.path, info.size_bytes) == ("local-file", str(data), 17)
    assert info.content_hash == "sha256:" + hashlib.sha256(b"capture-file-v1\0" + f"{digest} chat.jsonl".encode() + b"\0").hexdigest()
    assert [(f.path, f.sha256) for f in info.files] == [("chat.jsonl", digest)]
    data.write_bytes(b'{"messages": [1]}\n')
    assert artifacts.probe_datasets(ProbeOptions(datasets=(str(data),), progress=False))[0].content_hash != info.content_hash

"""Code probe: real git repositories in tmp folders; the .git folder must not change at all."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from capture import manifest
from capture.probes import ProbeOptions, Skipped
from capture.probes import code

GIT_ENV = {**os.environ, "GIT_AUTHOR_NAME": "T", "GIT_AUTHOR_EMAIL": "t@example.invalid",
           "GIT_COMMITTER_NAME": "T", "GIT_COMMITTER_EMAIL": "t@example.invalid",
           "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], env=GIT_ENV, check=True,
                          capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    git(root, "init", "-q", "-b", "main")
    (root / "train.py").write_text("print('train')\n")
    (root / "run.sh").write_text("#!/bin/sh\n")
    (root / "run.sh").chmod(0o755)
    (root / "pkg").mkdir()
    (root / "pkg" / "model.py").write_text("x = 1\n")
    (root / ".gitignore").write_text("*.log\nout/\n")
    os.symlink("train.py", root / "link.py")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "first")
    return root


def snapshot(folder: Path) -> dict[str, tuple]:
    """Every entry under ``folder``: type, mode, mtime (ns) and content hash."""
    out: dict[str, tuple] = {}
    for dirpath, dirs, files in os.walk(folder):
        for name in dirs + files:
            full = os.path.join(dirpath, name)
            st = os.lstat(full)
            digest = None
            if os.path.isfile(full) and not os.path.islink(full):
                digest = hashlib.sha256(Path(full).read_bytes()).hexdigest()
            out[os.path.relpath(full, folder)] = (st.st_mode, st.st_mtime_ns, st.st_size, digest)
    out["."] = (os.lstat(folder).st_mode, os.lstat(folder).st_mtime_ns)
    return out


def probe(folder: Path) -> code.CodeInfo:
    info = code.probe(ProbeOptions(code=folder))
    assert isinstance(info, code.CodeInfo), info
    return info


def test_clean_repo(repo: Path) -> None:
    info = probe(repo)
    assert info.source == "git"
    assert info.path == str(repo)
    assert info.commit == git(repo, "rev-parse", "HEAD")
    assert (info.branch, info.detached, info.dirty) == ("main", False, False)
    assert (info.modified_count, info.untracked_count) == (0, 0)
    assert info.file_count == 5  # .gitignore, link.py, pkg/model.py, run.sh, train.py
    assert info.remote_url is None
    assert info.tree_hash.startswith("sha256:") and len(info.tree_hash) == 71


def test_tree_hash_follows_the_documented_algorithm(repo: Path) -> None:
    entries = b""
    for rel in sorted([b".gitignore", b"link.py", b"pkg/model.py", b"run.sh", b"train.py"]):
        full = repo / os.fsdecode(rel)
        # the blob id from git itself, not from our code
        if full.is_symlink():
            kind = "L"
            digest = subprocess.run(["git", "hash-object", "--stdin"], input=b"train.py", cwd=repo,
                                    capture_output=True, check=True).stdout.decode().strip()
        else:
            kind = "X" if os.access(full, os.X_OK) else "F"
            digest = git(repo, "hash-object", os.fsdecode(rel))
        entries += f"{kind} {digest} ".encode() + rel + b"\0"
    expected = "sha256:" + hashlib.sha256(b"capture-tree-v2\0" + entries).hexdigest()
    info = probe(repo)
    assert info.tree_hash == expected
    assert info.file_count == 5


def test_git_folder_is_untouched_even_with_a_stale_index(repo: Path) -> None:
    # A changed mtime makes the index stat data stale: a plain `git status` would refresh and
    # rewrite .git/index. The probe must not.
    (repo / "train.py").write_text("print('train')\n")
    os.utime(repo / "train.py", ns=(1_000_000_000, 1_000_000_000))
    (repo / "pkg" / "model.py").write_text("x = 2\n")
    (repo / "new.py").write_text("new\n")
    before = snapshot(repo / ".git")
    info = probe(repo)
    assert info.dirty
    assert snapshot(repo / ".git") == before


def test_stale_index_would_be_rewritten_by_plain_git_status(repo: Path) -> None:
    # The control for the test above: shows the situation is one where git does write.
    os.utime(repo / "train.py", ns=(1_000_000_000, 1_000_000_000))
    before = snapshot(repo / ".git")
    git(repo, "status", "--porcelain")
    assert snapshot(repo / ".git") != before


def test_dirty_untracked_and_ignored(repo: Path) -> None:
    clean = probe(repo).tree_hash
    (repo / "debug.log").write_text("ignored\n")
    (repo / "out").mkdir()
    (repo / "out" / "ckpt.bin").write_bytes(b"\0" * 10)
    ignored = probe(repo)
    assert ignored.tree_hash == clean and not ignored.dirty

    (repo / "notes.txt").write_text("untracked\n")
    untracked = probe(repo)
    assert untracked.tree_hash != clean
    assert untracked.dirty and (untracked.modified_count, untracked.untracked_count) == (0, 1)
    (repo / "notes.txt").unlink()

    (repo / "train.py").write_text("print('changed')\n")
    modified = probe(repo)
    assert modified.tree_hash not in (clean, untracked.tree_hash)
    assert modified.dirty and (modified.modified_count, modified.untracked_count) == (1, 0)

    (repo / "train.py").write_text("print('train')\n")  # same content again: same hash
    assert probe(repo).tree_hash == clean

    (repo / "run.sh").chmod(0o644)
    assert probe(repo).tree_hash != clean
    (repo / "run.sh").chmod(0o755)

    (repo / "pkg" / "model.py").unlink()
    deleted = probe(repo)
    assert deleted.tree_hash != clean and deleted.dirty and deleted.modified_count == 1


def test_staged_change_is_dirty(repo: Path) -> None:
    (repo / "train.py").write_text("staged\n")
    git(repo, "add", "train.py")
    info = probe(repo)
    assert info.dirty and info.modified_count == 1


def test_detached_head(repo: Path) -> None:
    first = git(repo, "rev-parse", "HEAD")
    (repo / "train.py").write_text("v2\n")
    git(repo, "commit", "-q", "-am", "second")
    git(repo, "checkout", "-q", "--detach", first)
    info = probe(repo)
    assert (info.commit, info.branch, info.detached, info.dirty) == (first, None, True, False)


@pytest.mark.parametrize(("url", "clean"), [
    ("https://alice:ghp_SECRETTOKEN0123456789@github.com/org/repo.git", "https://github.com/org/repo.git"),
    ("https://x-access-token:gho_SECRET@github.com/org/repo.git", "https://github.com/org/repo.git"),
    ("ssh://git@github.com/org/repo.git", "ssh://git@github.com/org/repo.git"),
    ("git@github.com:org/repo.git", "git@github.com:org/repo.git"),
])
def test_remote_credentials_are_stripped(repo: Path, url: str, clean: str) -> None:
    git(repo, "remote", "add", "origin", url)
    git(repo, "remote", "add", "aaa-other", "https://example.invalid/other.git")
    info = probe(repo)
    assert (info.remote_name, info.remote_url) == ("origin", clean)
    body = manifest.dumps({**manifest.new_manifest(), "code": info.to_manifest()})
    assert b"SECRET" not in body and b"alice" not in body


def test_no_commits_yet(tmp_path: Path) -> None:
    root = tmp_path / "empty"
    root.mkdir()
    git(root, "init", "-q", "-b", "trunk")
    (root / "a.py").write_text("a\n")
    before = snapshot(root / ".git")
    info = probe(root)
    assert (info.commit, info.branch, info.detached, info.dirty, info.untracked_count) == (None, "trunk", False, True, 1)
    assert info.file_count == 1
    assert snapshot(root / ".git") == before


def test_subfolder_hashes_the_whole_work_tree(repo: Path) -> None:
    assert probe(repo / "pkg").tree_hash == probe(repo).tree_hash


def test_submodule(repo: Path, tmp_path: Path) -> None:
    lib = tmp_path / "lib"
    lib.mkdir()
    git(lib, "init", "-q", "-b", "main")
    (lib / "lib.py").write_text("lib\n")
    git(lib, "add", "-A")
    git(lib, "commit", "-q", "-m", "lib")
    git(repo, "-c", "protocol.file.allow=always", "submodule", "add", "-q", str(lib), "vendor/lib")
    git(repo, "commit", "-q", "-m", "add submodule")
    pinned = probe(repo)
    assert not pinned.dirty
    (lib / "lib.py").write_text("lib v2\n")
    git(lib, "commit", "-q", "-am", "v2")
    git(repo / "vendor" / "lib", "-c", "protocol.file.allow=always", "pull", "-q", "origin", "main")
    moved = probe(repo)
    assert moved.tree_hash != pinned.tree_hash and moved.dirty


def test_plain_folder(tmp_path: Path) -> None:
    folder = tmp_path / "plain"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("a\n")
    (folder / "sub" / "b.bin").write_bytes(b"\x00\x01")
    info = probe(folder)
    assert info.source == "directory" and info.commit is None and info.file_count == 2
    assert info.size_bytes == 4
    entries = b"".join(
        f"F {hashlib.sha1(b'blob %d' % len(data) + bytes([0]) + data).hexdigest()} ".encode() + rel + b"\0"
        for rel, data in sorted([(b"a.txt", b"a\n"), (b"sub/b.bin", b"\x00\x01")]))
    assert info.tree_hash == "sha256:" + hashlib.sha256(b"capture-tree-v2\0" + entries).hexdigest()
    table = manifest.to_toml_value(info.to_manifest())
    assert set(table) == {"path", "source", "tree_hash", "file_count", "size_bytes", "files", "files_total",
                          "files_truncated"}
    assert table["files"] == {"a.txt": hashlib.sha1(b"blob 2\0a\n").hexdigest(),
                              "sub/b.bin": hashlib.sha1(b"blob 2\0\x00\x01").hexdigest()}
    assert (table["files_total"], table["files_truncated"]) == (2, False)


def test_missing_folder_is_skipped(tmp_path: Path) -> None:
    result = code.probe(ProbeOptions(code=tmp_path / "nope"))
    assert result == Skipped(f"no such folder: {tmp_path / 'nope'}")


def test_cwd_that_is_not_a_work_tree_is_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = code.probe(ProbeOptions())
    assert isinstance(result, Skipped) and "--code DIR" in result.reason


def test_cwd_work_tree_is_used_by_default(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(repo / "pkg")
    info = code.probe(ProbeOptions())
    assert isinstance(info, code.CodeInfo) and info.path == str(repo)


def test_clean_files_take_their_id_from_the_index_and_agree_with_a_full_rehash(repo: Path, tmp_path: Path) -> None:
    """The fast path (index ids for files git confirms clean) equals hashing every byte: a copy of
    the same files as a plain folder, hashed from disk, gives the same tree hash."""
    info = probe(repo)
    copy = tmp_path / "copy"
    listing = git(repo, "ls-files", "-z", "--cached", "--others", "--exclude-standard").split("\0")
    for rel in filter(None, listing):
        src, dst = repo / rel, copy / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), dst)
        else:
            shutil.copy2(src, dst)
    assert probe(copy).tree_hash == info.tree_hash
    # a modified tracked file and an untracked one are hashed from disk, and still agree
    (repo / "train.py").write_text("print('edited')\n")
    (repo / "notes.txt").write_text("new\n")
    (copy / "train.py").write_text("print('edited')\n")
    (copy / "notes.txt").write_text("new\n")
    assert probe(repo).tree_hash == probe(copy).tree_hash != info.tree_hash


def test_files_map_names_each_file_by_its_blob_id(repo: Path) -> None:
    info = probe(repo)
    staged = dict(line.split(" ", 1)[1].split("\t")[::-1] for line in git(repo, "ls-files", "-s").splitlines())
    assert dict(info.files) == {p: s.split(" ")[0] for p, s in staged.items()}
    assert list(info.files) == sorted(info.files, key=str.encode)
    (repo / "train.py").write_text("print('edited')\n")
    (repo / "new.py").write_text("new\n")
    (repo / "run.sh").unlink()
    after = probe(repo)
    changed = {p for p in info.files.keys() & after.files.keys() if info.files[p] != after.files[p]}
    assert changed == {"train.py"}
    assert after.files.keys() - info.files.keys() == {"new.py"}
    assert info.files.keys() - after.files.keys() == {"run.sh"}
    assert (after.files_total, after.files_truncated) == (5, False)


def test_files_map_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "many"
    folder.mkdir()
    for i in range(12):
        (folder / f"f{i:02d}.txt").write_text(str(i))
    monkeypatch.setattr(code, "FILES_LIMIT", 5)
    info = probe(folder)
    assert list(info.files) == [f"f{i:02d}.txt" for i in range(5)]
    assert (info.files_total, info.files_truncated, info.file_count) == (12, True, 12)
    body = manifest.dumps({**manifest.new_manifest(), "code": info.to_manifest()})
    assert b"[code.files]" in body and b"files_truncated = true" in body


def _full_rehash(repo: Path, copy: Path) -> str:
    """The tree hash of the same listed files copied into a plain folder (every byte hashed)."""
    listing = git(repo, "ls-files", "-z", "--cached", "--others", "--exclude-standard").split("\0")
    for rel in filter(None, listing):
        src, dst = repo / rel, copy / rel
        if not os.path.lexists(src):
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), dst)
        else:
            shutil.copy2(src, dst)
    return probe(copy).tree_hash


def test_renames_spaces_and_conflicts_in_the_status_are_read_exactly(repo: Path, tmp_path: Path) -> None:
    """git status --porcelain=v2: a staged rename (its source path follows as its own field), a path
    with spaces, and an unmerged file each count as modified; the ones whose work tree differs
    are hashed from disk, so the tree hash equals a full rehash; commit and branch are git's."""
    (repo / "with space.txt").write_text("a b\n")
    git(repo, "add", "with space.txt")
    git(repo, "commit", "-q", "-m", "spaces")
    git(repo, "checkout", "-q", "-b", "other")
    (repo / "train.py").write_text("print('other')\n")
    git(repo, "commit", "-q", "-am", "other side")
    git(repo, "checkout", "-q", "main")
    (repo / "train.py").write_text("print('main')\n")
    git(repo, "commit", "-q", "-am", "main side")
    merge = subprocess.run(["git", "-C", str(repo), "merge", "-q", "other"], env=GIT_ENV, capture_output=True)
    assert merge.returncode != 0  # a conflict in train.py
    git(repo, "mv", "with space.txt", "renamed with space.txt")
    (repo / "renamed with space.txt").write_text("changed after the rename\n")
    info = probe(repo)
    assert info.commit == git(repo, "rev-parse", "HEAD")
    assert (info.branch, info.detached, info.dirty) == ("main", False, True)
    assert info.modified_count == 2  # the conflicted file and the rename
    assert "renamed with space.txt" in info.files and "with space.txt" not in info.files
    assert info.tree_hash == _full_rehash(repo, tmp_path / "copy")


def test_a_dot_git_that_is_no_repository_is_hashed_as_a_plain_folder(tmp_path: Path) -> None:
    """The reads started early beside a .git folder are dropped when rev-parse finds no work tree."""
    folder = tmp_path / "fake"
    (folder / ".git").mkdir(parents=True)
    (folder / "a.txt").write_text("a\n")
    info = probe(folder)
    assert info.source == "directory" and info.commit is None
    assert set(info.files) == {"a.txt"}


def test_a_work_tree_given_by_a_link_to_its_top_keeps_the_early_reads(repo: Path, tmp_path: Path) -> None:
    link = tmp_path / "link"
    os.symlink(repo, link)
    via_link, direct = probe(link), probe(repo)
    assert via_link.tree_hash == direct.tree_hash and via_link.commit == direct.commit
    assert via_link.path == direct.path == str(repo.resolve())

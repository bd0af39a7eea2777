"""Packages probe: the real venv, and fabricated site folders for each PEP 610 origin."""

from __future__ import annotations

import functools
import importlib.metadata
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from capture import manifest
from capture.probes import ProbeOptions
from capture.probes import packages
from capture.probes.packages import normalize_name, strip_url_credentials


def make_dist(site: Path, name: str, version: str, direct_url: dict | str | None = None,
              folder: str | None = None, egg_info_file: bool = False) -> Path:
    if egg_info_file:
        path = site / f"{name}-{version}-py3.11.egg-info"
        path.write_text(f"Metadata-Version: 1.1\nName: {name}\nVersion: {version}\n")
        return path
    dist = site / (folder or f"{name.replace('-', '_')}-{version}.dist-info")
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nSummary: x\n\n"
        "Long description\nName: not-a-header\n")
    if direct_url is not None:
        text = direct_url if isinstance(direct_url, str) else json.dumps(direct_url)
        (dist / "direct_url.json").write_text(text)
    return dist


@functools.cache
def _fresh_sys_path() -> list[str]:
    """sys.path of a fresh interpreter of this environment (this process may have grown its own:
    the suite adds tests/, and importing setuptools appends setuptools/_vendor)."""
    out = subprocess.run([sys.executable, "-c", "import sys, json; print(json.dumps(sys.path))"],
                         capture_output=True, text=True, check=True, cwd=Path(__file__).parent)
    return json.loads(out.stdout)


def test_real_venv_matches_importlib_metadata() -> None:
    t0 = time.perf_counter()
    info = packages.probe(ProbeOptions())
    elapsed = time.perf_counter() - t0
    assert info.version == ".".join(map(str, sys.version_info[:3]))
    assert info.implementation == "CPython"
    expected: dict[str, str] = {}
    for dist in importlib.metadata.distributions(path=_fresh_sys_path()):  # same order as import: first wins
        expected.setdefault(normalize_name(dist.metadata["Name"]), dist.version)
    assert {p.name: p.version for p in info.packages} == expected
    for name in ("torch", "gitpython", "huggingface-hub", "tomli-w", "capture-stack"):  # this project's distribution
        assert info.get(name) is not None, name
    assert elapsed < 2.0  # tens of ms for ~60 dists even on a slow 2-core VM


def test_real_venv_sources_follow_direct_url() -> None:
    info = packages.probe(ProbeOptions())
    for dist in importlib.metadata.distributions(path=_fresh_sys_path()):
        pkg = info.get(dist.metadata["Name"])
        assert pkg is not None
        if pkg.location != str(dist.locate_file("")):
            continue  # a shadowed copy
        text = dist.read_text("direct_url.json")
        if text is None:
            assert pkg.source == "index"
        else:
            data = json.loads(text)
            kind = next(k for k in ("vcs_info", "archive_info", "dir_info") if k in data)
            assert pkg.source == {"vcs_info": "vcs", "archive_info": "archive", "dir_info": "local"}[kind]


def test_each_origin_in_a_fabricated_site(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    make_dist(site, "Plain_Pkg", "1.0")
    make_dist(site, "from-git", "0.3.dev1", {
        "url": "https://oauth2:glpat-SECRETSECRET@gitlab.example/org/from-git.git",
        "vcs_info": {"vcs": "git", "commit_id": "4f3e1c8d2b9a7f6e5d4c3b2a1908f7e6d5c4b3a2", "requested_revision": "v0.3"}})
    make_dist(site, "mylib", "2.0", {"url": "file:///home/me/src/mylib", "dir_info": {"editable": True}})
    make_dist(site, "frozen", "2.1", {"url": "file:///home/me/src/frozen", "dir_info": {}})
    make_dist(site, "wheelpkg", "3.0", {
        "url": "https://user:hunter2@files.example/wheelpkg-3.0-py3-none-any.whl?X-Amz-Signature=abcdef&v=1",
        "archive_info": {"hashes": {"sha256": "ab" * 32}}})
    make_dist(site, "legacyhash", "0.1", {"url": "https://files.example/l.tar.gz", "archive_info": {"hash": "sha256=" + "cd" * 32}})
    make_dist(site, "broken-direct", "1.0", "{not json")
    make_dist(site, "oldegg", "0.9", egg_info_file=True)
    nometa = site / "no_meta-4.5.dist-info"
    nometa.mkdir()

    info = packages.probe(ProbeOptions(), path=[str(site)])
    got = {p.name: p for p in info.packages}
    assert got["plain-pkg"].source == "index" and got["plain-pkg"].version == "1.0"
    git = got["from-git"]
    assert (git.source, git.vcs, git.commit, git.requested_revision) == (
        "vcs", "git", "4f3e1c8d2b9a7f6e5d4c3b2a1908f7e6d5c4b3a2", "v0.3")
    assert git.url == "https://gitlab.example/org/from-git.git"
    assert (got["mylib"].source, got["mylib"].editable, got["mylib"].url) == ("local", True, "file:///home/me/src/mylib")
    assert (got["frozen"].source, got["frozen"].editable) == ("local", False)
    assert got["wheelpkg"].source == "archive"
    assert got["wheelpkg"].archive_hash == "sha256:" + "ab" * 32
    assert got["wheelpkg"].url == "https://files.example/wheelpkg-3.0-py3-none-any.whl?v=1"
    assert got["legacyhash"].archive_hash == "sha256:" + "cd" * 32
    assert got["broken-direct"].source == "unknown"
    assert got["oldegg"].version == "0.9"
    assert got["no-meta"].version == "4.5"

    body = manifest.dumps({**manifest.new_manifest(), "python": info.to_manifest()})
    for secret in (b"glpat-SECRETSECRET", b"hunter2", b"oauth2", b"abcdef"):
        assert secret not in body
    assert b'[python.packages.from-git]' in body


def test_first_on_path_wins_and_shadowed_copies_are_noted(tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir(), second.mkdir()
    make_dist(first, "Dup.Pkg", "2.0")
    make_dist(second, "dup_pkg", "1.0")
    info = packages.probe(ProbeOptions(), path=[str(first), str(tmp_path / "missing"), str(second)])
    (pkg,) = info.packages
    assert (pkg.name, pkg.version, pkg.location) == ("dup-pkg", "2.0", str(first))
    assert pkg.shadowed == (f"1.0 in {second}",)
    assert pkg.to_manifest()["shadowed"] == [f"1.0 in {second}"]


def test_a_packages_private_copies_on_sys_path_are_not_installed(tmp_path: Path) -> None:
    site = tmp_path / "site-packages"
    make_dist(site, "tool", "1.0")
    (site / "tool").mkdir()
    (site / "tool" / "__init__.py").write_text("")
    make_dist(site / "tool" / "_vendor", "vendored-only", "2.2.2")
    info = packages.probe(ProbeOptions(), path=[str(site), str(site / "tool" / "_vendor")])
    assert [p.name for p in info.packages] == ["tool"]


def test_importing_setuptools_changes_nothing_a_fresh_interpreter_would_not_see(tmp_path: Path) -> None:
    """The bug: a process that imported setuptools (torch.utils.cpp_extension and inductor do)
    recorded setuptools' vendored packages, and `capture verify` in a fresh process reported each as
    drift (exit 1). Measured here with the real setuptools of this environment."""
    pytest.importorskip("setuptools")
    code = ("import sys, json; n = len(sys.path); import setuptools; from capture.probes import packages;"
            "print(json.dumps([sys.path[n:], [(p.name, p.version) for p in packages.scan()]]))")
    after = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                      cwd=tmp_path).stdout)
    fresh = json.loads(subprocess.run(
        [sys.executable, "-c", "import json; from capture.probes import packages;"
         "print(json.dumps([(p.name, p.version) for p in packages.scan()]))"],
        capture_output=True, text=True, check=True, cwd=tmp_path).stdout)
    added = [p for p in after[0] if not p.startswith("__editable__")]
    if not any(Path(p).is_dir() and any(Path(p).glob("*.dist-info")) for p in added):
        pytest.skip("this setuptools adds no folder of distributions to sys.path")
    assert after[1] == fresh


def test_zip_path_entry(tmp_path: Path) -> None:
    import zipfile

    archive = tmp_path / "deps.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("zipped-1.2.dist-info/METADATA", "Metadata-Version: 2.1\nName: zipped\nVersion: 1.2\n")
    (pkg,) = packages.probe(ProbeOptions(), path=[str(archive)]).packages
    assert (pkg.name, pkg.version, pkg.source) == ("zipped", "1.2", "index")


@pytest.mark.parametrize(("url", "clean"), [
    ("https://user:token@github.com/org/r.git", "https://github.com/org/r.git"),
    ("https://ghp_abcdef0123456789@github.com/org/r.git", "https://github.com/org/r.git"),
    ("git+https://u:p@host.example:8443/x", "git+https://host.example:8443/x"),
    ("ssh://git@github.com/org/r.git", "ssh://git@github.com/org/r.git"),
    ("ssh://git:pw@github.com/org/r.git", "ssh://git@github.com/org/r.git"),
    ("git+ssh://git@host/x.git", "git+ssh://git@host/x.git"),
    ("git@github.com:org/r.git", "git@github.com:org/r.git"),
    ("https://host/x?token=abc&ref=main", "https://host/x?ref=main"),
    ("file:///home/me/src", "file:///home/me/src"),
    ("/plain/path", "/plain/path"),
])
def test_strip_url_credentials(url: str, clean: str) -> None:
    assert strip_url_credentials(url) == clean


def test_normalize_name() -> None:
    assert normalize_name("Foo.Bar__baz--Qux") == "foo-bar-baz-qux"

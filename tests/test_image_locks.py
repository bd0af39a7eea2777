"""Lock files and the wheelhouse: the committed locks, the parser, and generation + download
through the real pip against a local folder of real wheel files (no network)."""

from __future__ import annotations

import base64
import hashlib
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from capture._cli import main
from capture.errors import UsageError
from capture.image import locks, wheelhouse

GOOD = "a==1.0 --hash=sha256:" + "0" * 64


# --------------------------------------------------------------------------- committed locks

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.mark.parametrize("name", sorted(locks.LOCKS))
def test_every_runtime_dependency_of_the_package_is_in_each_lock(name):
    """pyproject.toml is the one source: each runtime dependency, and each requirement of the
    lock's extras (torch excepted where the base provides it), is locked at a version it allows."""
    spec = locks.flavour(name)
    lock = locks.read_lock(name)
    versions = lock.versions()
    required = locks.requirements_for(spec, PROJECT)
    runtime = {canonicalize_name(Requirement(r).name) for r in PROJECT["project"]["dependencies"]}
    assert runtime <= {canonicalize_name(r.name) for r in required}
    for req in required:
        key = canonicalize_name(req.name)
        if key == "torch" and (spec.base_provides_torch or any(m.startswith(spec.torch or "-") for m in lock.missing)):
            assert key not in versions, f"{name}.txt locks torch, which comes from elsewhere"
            continue
        assert key in versions, f"{name}.txt lacks {key}, which pyproject.toml requires: run `capture image lock {name}`"
        assert req.specifier.contains(versions[key], prereleases=True), f"{name}.txt: {key}=={versions[key]} violates {req}"


@pytest.mark.parametrize("name", sorted(locks.LOCKS))
def test_each_lock_is_generated_from_the_current_pyproject(name):
    spec = locks.flavour(name)
    lock = locks.read_lock(name)
    assert lock.source_sha256 == locks.source_digest(spec, PROJECT), (
        f"{name}.txt is stale against pyproject.toml: run `capture image lock {name}`")
    header = lock.path.read_text().splitlines()
    assert f"python {spec.python_version} ({spec.abi})" in header[1]


def test_a_dependency_missing_from_a_lock_fails_the_check(tmp_path):
    """The check above is real: the CPU lock with tomli removed (the bug it was made for)."""
    text = locks.lock_path("cpu").read_text()
    cut = "\n".join(ln for ln in text.splitlines() if not ln.startswith("tomli=="))
    lock = locks.parse_lock(cut.encode(), tmp_path / "cpu.txt", "cpu")
    required = {canonicalize_name(r.name) for r in locks.requirements_for(locks.flavour("cpu"), PROJECT)}
    assert "tomli" in required and "tomli" not in lock.versions()


def test_torch_builds_per_lock():
    assert locks.read_lock("cpu").versions()["torch"] == "2.13.0+cpu"
    cuda = locks.read_lock("cuda").versions()
    assert cuda["torch"] == "2.13.0"
    # PyPI's Linux torch 2.13.0 is the CUDA 13.0 build: its CUDA 13 libraries are locked with it.
    assert cuda["cuda-toolkit"].startswith("13.0.3")
    assert "nvidia-cudnn-cu13" in cuda and "nvidia-nccl-cu13" in cuda and not any(n.endswith("-cu12") for n in cuda)
    for name in ("rocm", "standin"):
        lock = locks.read_lock(name)
        names = set(lock.versions())
        # torch comes with the base: neither torch nor anything only torch needs is locked.
        assert lock.complete and "torch" not in names and "sympy" not in names and "networkx" not in names
        assert not any(n.startswith(("nvidia-", "cuda-", "triton")) for n in names)
        assert "amdsmi" in names


def test_the_wheel_route_says_what_is_missing_and_refuses_to_build():
    lock = locks.read_lock("rocm-wheels")
    assert not lock.complete and lock.missing[0].startswith("torch==2.13.0+rocm7.2 ")
    with pytest.raises(UsageError, match="rocm-wheels.txt is incomplete: torch==2.13.0\\+rocm7.2") as exc:
        lock.require_complete()
    assert "--extra-index-url" in exc.value.hint and "rocm/pytorch" in exc.value.hint


def test_cli_wheelhouse_of_incomplete_lock_is_one_line_exit_2(capsys, tmp_path):
    assert main(["image", "wheelhouse", "rocm-wheels", "--dest", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: rocm-wheels.txt is incomplete") and "Traceback" not in err
    assert not (tmp_path / "w").exists()


def test_platform_tags_cover_older_manylinux():
    fl = locks.flavour("cpu")
    args = fl.pip_target_args()
    plats = [args[i + 1] for i, a in enumerate(args) if a == "--platform"]
    assert plats[0] == "manylinux_2_36_x86_64" and "manylinux_2_17_x86_64" in plats and "manylinux2014_x86_64" in plats
    assert ["--abi", "cp311"] == args[args.index("--abi"):args.index("--abi") + 2] and "abi3" in args
    tags = {str(t) for t in fl.tags()}
    assert "cp311-cp311-manylinux_2_28_x86_64" in tags and "py3-none-any" in tags and "cp312-cp312-manylinux_2_28_x86_64" not in tags
    with pytest.raises(UsageError, match="unknown image lock 'tpu'"):
        locks.flavour("tpu")


# --------------------------------------------------------------------------- parser


@pytest.mark.parametrize("text, match", [
    ("a==1.0\n", "expected `name==version --hash"),
    ("a==1.0 --hash=sha256:" + "0" * 64 + " junk\n", "expected `name==version --hash"),
    ("a==1.0 --hash=sha256:abc\n", "expected `name==version --hash"),
    ("a>=1.0 --hash=sha256:" + "0" * 64 + "\n", "not pinned with == alone"),
    ("a[x]==1.0 --hash=sha256:" + "0" * 64 + "\n", "not pinned with == alone"),
    (f"{GOOD}\nA==1.0 --hash=sha256:" + "1" * 64 + "\n", "a is listed twice"),
    ("# only a comment\n", "no locked wheels"),
    ("a=!1 --hash=sha256:" + "0" * 64 + "\n", "lock.txt:1"),
])
def test_bad_lock_lines_are_one_line_errors(tmp_path, text, match):
    path = tmp_path / "lock.txt"
    path.write_text(text)
    with pytest.raises(UsageError, match=match):
        locks.read_lock("cpu", path)


def test_non_utf8_and_absent_lock(tmp_path):
    path = tmp_path / "lock.txt"
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(UsageError, match="not UTF-8"):
        locks.read_lock("cpu", path)
    with pytest.raises(UsageError, match="no such lock file"):
        locks.read_lock("cpu", tmp_path / "absent.txt")


def test_lock_sha256_is_of_the_file_bytes(tmp_path):
    path = tmp_path / "lock.txt"
    path.write_text(f"# missing: b==2 (index down)\n{GOOD}\n")
    lock = locks.read_lock("cpu", path)
    assert lock.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert lock.missing == ("b==2 (index down)",) and lock.wheels[0].line() == GOOD


# --------------------------------------------------------------------------- generation and download


def _wheel(folder: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> Path:
    """A real (minimal, valid) pure-Python wheel."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": f"__version__ = {version!r}\n".encode(),
        f"{dist}/METADATA": ("Metadata-Version: 2.1\nName: " + name + "\nVersion: " + version + "\n"
                             + "".join(f"Requires-Dist: {r}\n" for r in requires)).encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = ("\n".join(record) + "\n").encode()
    out = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(out, "w") as z:
        for path, data in files.items():
            z.writestr(path, data)
    return out


@pytest.fixture
def index(tmp_path):
    """A folder of wheels, and index flags that make it the only source."""
    folder = tmp_path / "index"
    folder.mkdir()
    _wheel(folder, "capalpha", "1.0", ("capbeta==2.0", "capgamma==3.0; sys_platform == 'win32'"))
    _wheel(folder, "capbeta", "2.0")
    _wheel(folder, "capbeta", "2.1")
    _wheel(folder, "capgamma", "3.0")
    _wheel(folder, "torch", "2.13.0+cpu", ("capbeta==2.0", "capgamma==3.0"))
    return folder, ("--no-index", "--find-links", str(folder))


def _project(tmp_path: Path, deps: list[str], extras: dict[str, list[str]] | None = None) -> Path:
    extras = extras or {"trial": [], "amd": []}
    body = "".join(f"{k} = {v!r}\n" for k, v in extras.items())
    path = tmp_path / "pyproject.toml"
    path.write_text(f'[project]\nname = "x"\nversion = "1"\ndependencies = {deps!r}\n'
                    f"[project.optional-dependencies]\n{body}".replace("'", '"'))
    return path


def test_generate_resolves_pyproject_for_the_image_with_uv_and_records_real_hashes(tmp_path, index):
    folder, args = index
    project = _project(tmp_path, ["capalpha>=1"], {"trial": ["torch>=2"]})
    lock = locks.generate("cpu", project, args, out=tmp_path / "cpu.txt")
    assert [(w.name, w.version) for w in lock.wheels] == [("capalpha", "1.0"), ("capbeta", "2.0"), ("capgamma", "3.0"), ("torch", "2.13.0+cpu")]
    for w in lock.wheels:
        file = next(folder.glob(f"{w.name}-{w.version}-*.whl"))
        assert w.hashes == (hashlib.sha256(file.read_bytes()).hexdigest(),)
    text = lock.path.read_text()
    assert text.startswith("# capture image lock: cpu\n") and lock.complete
    assert lock.source_sha256 == locks.source_digest(locks.flavour("cpu"), tomllib.loads(project.read_text()))


def test_generate_for_a_base_with_torch_locks_only_what_is_added(tmp_path, index):
    _, args = index
    project = _project(tmp_path, ["capalpha>=1"], {"trial": ["torch>=2"], "amd": []})
    lock = locks.generate("standin", project, args, out=tmp_path / "standin.txt")
    # torch, and capgamma (which only torch needs), come from the base.
    assert [w.name for w in lock.wheels] == ["capalpha", "capbeta"]


def test_generate_with_skip_torch_writes_it_down_as_missing(tmp_path, index):
    _, args = index
    project = _project(tmp_path, ["capalpha>=1"], {"trial": ["torch>=2"], "amd": []})
    lock = locks.generate("rocm-wheels", project, args, skip_torch=True, skip_reason="index unreachable",
                          out=tmp_path / "rw.txt")
    assert [w.name for w in lock.wheels] == ["capalpha", "capbeta"]
    assert lock.missing == ("torch==2.13.0+rocm7.2 (index unreachable)",)
    with pytest.raises(UsageError, match="takes torch from the base image already"):
        locks.generate("rocm", project, args, skip_torch=True, out=tmp_path / "x.txt")


def test_generate_failure_is_one_line(tmp_path, index):
    _, args = index
    project = _project(tmp_path, ["capalpha==9.9"])
    with pytest.raises(UsageError, match="uv could not resolve the cpu lock: .*capalpha"):
        locks.generate("cpu", project, args, out=tmp_path / "cpu.txt")
    assert not (tmp_path / "cpu.txt").exists()


def test_wheelhouse_downloads_checks_and_reuses(tmp_path, index, capsys):
    folder, args = index
    lock = locks.generate("standin", _project(tmp_path, ["capalpha>=1"]), args, out=tmp_path / "standin.txt")
    dest = tmp_path / "wh"
    first = wheelhouse.prepare("standin", dest, lock_file=lock.path, pip_args=args)
    assert first.downloaded and sorted(f.name for f in first.files) == [
        "capalpha-1.0-py3-none-any.whl", "capbeta-2.0-py3-none-any.whl"]
    assert capsys.readouterr().out == ""  # pip's progress goes to stderr; stdout stays for results
    second = wheelhouse.prepare("standin", dest, lock_file=lock.path, pip_args=args)
    assert not second.downloaded

    # A wheel whose bytes changed on disk no longer counts.
    (dest / "capbeta-2.0-py3-none-any.whl").write_bytes(b"not the wheel")
    found, missing = wheelhouse.locate(lock, dest)
    assert missing == ["capbeta==2.0"] and len(found) == 1


def test_wheelhouse_refuses_bytes_that_differ_from_the_lock(tmp_path, index):
    folder, args = index
    lock = locks.generate("standin", _project(tmp_path, ["capbeta==2.0"]), args, out=tmp_path / "standin.txt")
    _wheel(folder, "capbeta", "2.0", ("capgamma==3.0",))  # same name and version, other bytes
    with pytest.raises(UsageError, match="cannot prepare the standin wheelhouse: ERROR: .*(hash|HASH)"):
        wheelhouse.prepare("standin", tmp_path / "wh", lock_file=lock.path, pip_args=args)

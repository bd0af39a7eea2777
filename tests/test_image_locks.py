"""Lock files and the wheelhouse: the committed locks, the parser, and generation + download
through the real pip against a local folder of real wheel files (no network)."""

from __future__ import annotations

import base64
import hashlib
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


@pytest.mark.parametrize("name", ["cpu", "cuda", "rocm"])
def test_committed_lock_pins_every_input_requirement(name):
    lock = locks.read_lock(name)
    versions = {w.name: w.version for w in lock.wheels}
    missing = {canonicalize_name(Requirement(m.split(" ", 1)[0]).name) for m in lock.missing}
    for req, version in locks.input_pins(name).items():
        if req in missing:
            continue
        assert versions.get(req) == version, f"{name}.txt: {req} is {versions.get(req)}, {name}.in pins {version}"
    header = lock.path.read_text().splitlines()
    fl = locks.flavour(name)
    assert f"python {fl.python_version} ({fl.abi})" in header[1]
    input_sha = hashlib.sha256(locks.input_path(name).read_bytes()).hexdigest()
    assert header[2] == f"# input: {name}.in sha256:{input_sha}", "the lock is stale: run `capture image lock`"


def test_cpu_and_cuda_locks_are_complete_and_match_their_torch_builds():
    cpu, cuda = locks.read_lock("cpu"), locks.read_lock("cuda")
    assert cpu.complete and cuda.complete
    assert {w.name: w.version for w in cpu.wheels}["torch"] == "2.13.0+cpu"
    by_name = {w.name: w.version for w in cuda.wheels}
    assert by_name["torch"] == "2.13.0"
    # PyPI's Linux torch 2.13.0 is the CUDA 13.0 build: its CUDA 13 libraries are locked with it.
    assert by_name["cuda-toolkit"].startswith("13.0.3")
    assert "nvidia-cudnn-cu13" in by_name and "nvidia-nccl-cu13" in by_name
    assert not any(n.endswith("-cu12") for n in by_name)


def test_rocm_lock_says_what_is_missing_and_refuses_to_build():
    lock = locks.read_lock("rocm")
    assert not lock.complete
    assert lock.missing[0].startswith("torch==2.13.0+rocm7.2 ")
    names = {w.name for w in lock.wheels}
    # PyPI's torch (the CUDA build) must not sneak in through peft's dependency on torch.
    assert "torch" not in names and not any(n.startswith(("nvidia-", "cuda-", "triton")) for n in names)
    with pytest.raises(UsageError, match="rocm.txt is incomplete: torch==2.13.0\\+rocm7.2") as exc:
        lock.require_complete()
    assert "--extra-index-url" in exc.value.hint and "--lock cpu" in exc.value.hint


def test_cli_wheelhouse_of_incomplete_lock_is_one_line_exit_2(capsys, tmp_path):
    assert main(["image", "wheelhouse", "rocm", "--dest", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: rocm.txt is incomplete") and "Traceback" not in err
    assert not (tmp_path / "w").exists()


def test_platform_tags_cover_older_manylinux():
    fl = locks.flavour("cpu")
    args = fl.pip_target_args()
    plats = [args[i + 1] for i, a in enumerate(args) if a == "--platform"]
    assert plats[0] == "manylinux_2_36_x86_64" and "manylinux_2_17_x86_64" in plats and "manylinux2014_x86_64" in plats
    assert ["--abi", "cp311"] == args[args.index("--abi"):args.index("--abi") + 2] and "abi3" in args
    with pytest.raises(UsageError, match="unknown image flavour 'tpu'"):
        locks.flavour("tpu")


# --------------------------------------------------------------------------- parser


@pytest.mark.parametrize("text, match", [
    ("a==1.0\n", "expected `name==version --hash"),
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
    """A folder of wheels, and pip flags that make it the only source."""
    folder = tmp_path / "index"
    folder.mkdir()
    _wheel(folder, "capalpha", "1.0", ("capbeta==2.0", "capgamma==3.0; sys_platform == 'win32'"))
    _wheel(folder, "capbeta", "2.0")
    _wheel(folder, "capbeta", "2.1")
    _wheel(folder, "capgamma", "3.0")
    return folder, ("--no-index", "--find-links", str(folder))


def test_generate_resolves_for_the_image_and_records_real_hashes(tmp_path, index):
    folder, pip_args = index
    src = tmp_path / "cpu.in"
    src.write_text("capalpha==1.0\n")
    lock = locks.generate("cpu", pip_args=pip_args, out=tmp_path / "cpu.txt", input_file=src)
    assert [(w.name, w.version) for w in lock.wheels] == [("capalpha", "1.0"), ("capbeta", "2.0")]
    for w in lock.wheels:
        file = next(folder.glob(f"{w.name}-{w.version}-*.whl"))
        assert w.sha256 == hashlib.sha256(file.read_bytes()).hexdigest()
    assert lock.complete and lock.path.read_text().startswith("# capture image lock: cpu\n")


def test_generate_with_skip_drops_what_only_the_skipped_package_needs(tmp_path, index):
    folder, pip_args = index
    _wheel(folder, "capdelta", "1.0", ("capalpha==1.0",))
    src = tmp_path / "cpu.in"
    src.write_text("capdelta==1.0\ncapalpha==1.0\n")
    lock = locks.generate("cpu", pip_args=pip_args, out=tmp_path / "cpu.txt", input_file=src, skip=["capalpha"],
                          skip_reason="index unreachable")
    # capdelta pulls capalpha (and so capbeta) in; both go, and the skip is written down.
    assert [w.name for w in lock.wheels] == ["capdelta"]
    assert lock.missing == ("capalpha==1.0 (index unreachable)",)
    with pytest.raises(UsageError, match="--skip capzeta: not in cpu.in"):
        locks.generate("cpu", pip_args=pip_args, out=tmp_path / "x.txt", input_file=src, skip=["capzeta"])


def test_generate_failure_is_one_line(tmp_path, index):
    _, pip_args = index
    src = tmp_path / "cpu.in"
    src.write_text("capalpha==9.9\n")
    with pytest.raises(UsageError, match="pip could not resolve the cpu lock: ERROR: .*capalpha==9.9"):
        locks.generate("cpu", pip_args=pip_args, out=tmp_path / "cpu.txt", input_file=src)
    assert not (tmp_path / "cpu.txt").exists()


def test_wheelhouse_downloads_checks_and_reuses(tmp_path, index, capsys):
    folder, pip_args = index
    src = tmp_path / "cpu.in"
    src.write_text("capalpha==1.0\n")
    lock = locks.generate("cpu", pip_args=pip_args, out=tmp_path / "cpu.txt", input_file=src)
    dest = tmp_path / "wh"
    first = wheelhouse.prepare("cpu", dest, lock_file=lock.path, pip_args=pip_args)
    assert first.downloaded and sorted(f.name for f in first.files) == [
        "capalpha-1.0-py3-none-any.whl", "capbeta-2.0-py3-none-any.whl"]
    assert capsys.readouterr().out == ""  # pip's progress goes to stderr; stdout stays for results
    second = wheelhouse.prepare("cpu", dest, lock_file=lock.path, pip_args=pip_args)
    assert not second.downloaded

    # A wheel whose bytes changed on disk no longer counts.
    (dest / "capbeta-2.0-py3-none-any.whl").write_bytes(b"not the wheel")
    found, missing = wheelhouse.locate(lock, dest)
    assert missing == ["capbeta==2.0"] and len(found) == 1


def test_wheelhouse_refuses_bytes_that_differ_from_the_lock(tmp_path, index):
    folder, pip_args = index
    src = tmp_path / "cpu.in"
    src.write_text("capbeta==2.0\n")
    lock = locks.generate("cpu", pip_args=pip_args, out=tmp_path / "cpu.txt", input_file=src)
    _wheel(folder, "capbeta", "2.0", ("capgamma==3.0",))  # same name and version, other bytes
    with pytest.raises(UsageError, match="cannot prepare the cpu wheelhouse: ERROR: .*(hash|HASH)"):
        wheelhouse.prepare("cpu", tmp_path / "wh", lock_file=lock.path, pip_args=pip_args)

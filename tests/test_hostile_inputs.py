"""Hostile input never gets further than its documented exit code (issue 17, findings 3-6 and 11).

Each case in tests/fixtures/hostile/ (and the ones that cannot be committed: huge files, FIFOs,
symlinks to devices, made here) goes through every command that reads a manifest, in-process
through ``capture._cli.main``: the exit code is the documented one (3 for every case here: see
README "One door, one judgment"), stderr has exactly one ``error:`` line (and at most one
``hint:``), no traceback. A few go through a real subprocess with an address-space limit, so a
case that read /dev/zero into memory would die instead of passing.
"""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import tomli_w

from capture import manifest as mf
from capture._cli import main
from test_results_helpers import make_results_repo  # noqa: F401  (a real results repository)

HOSTILE = Path(__file__).parent / "fixtures" / "hostile"
ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(120)


def _head() -> bytes:
    return b'schema_version = 1\nkind = "fingerprint"\ncreated_utc = "2026-12-02T00:00:00Z"\n'


def _body_with(h200_body: bytes, edit: Callable[[dict], None]) -> bytes:
    import tomllib

    data = tomllib.loads(h200_body.decode())
    edit(data)
    return tomli_w.dumps(data).encode()


def _set(path: str, value) -> Callable[[dict], None]:
    def edit(d: dict) -> None:
        *parents, last = path.split(".")
        for p in parents:
            d = d[int(p)] if isinstance(d, list) else d[p]
        if isinstance(d, list):
            d[int(last)] = value
        else:
            d[last] = value
    return edit


def _cases(tmp: Path, sign: Callable[[bytes], bytes], h200_body: bytes) -> dict[str, Path]:
    """name -> file. Every case is exit 3 in every reading command."""
    import datetime as dt

    out: dict[str, Path] = {}

    def put(name: str, data: bytes) -> None:
        p = tmp / f"{name}.toml"
        p.write_bytes(data)
        out[name] = p

    # (3) deep nesting: committed small files, their signed versions, and one too big to commit
    for f in sorted(HOSTILE.glob("deep-*.toml")):
        put(f.stem, f.read_bytes())
        put(f"signed-{f.stem}", sign(f.read_bytes()))
    put("deep-array-100000", _head() + b"x = " + b"[" * 100_000 + b"\n")
    # (4) non-regular and huge
    zero = tmp / "dev-zero.toml"
    zero.symlink_to("/dev/zero")
    out["symlink-to-dev-zero"] = zero
    fifo = tmp / "fifo.toml"
    os.mkfifo(fifo)
    out["fifo"] = fifo
    huge = tmp / "huge.toml"
    with huge.open("wb") as fh:
        fh.write(_head())
        fh.truncate(17 * 1024 * 1024)  # sparse: 17 MiB that cost no disk
    out["huge-17-mib"] = huge
    # (6) wrong types inside validly signed manifests
    for name, edit in {
        "count-is-a-string": _set("accelerator.count", "1"),
        "count-is-nan": _set("accelerator.count", float("nan")),
        "tokens-per-s-is-inf": _set("trial.stats.tokens_per_s", float("inf")),
        "created-is-a-date": _set("created_utc", dt.datetime(2026, 12, 2, tzinfo=dt.timezone.utc)),
        "driver-is-a-date": _set("nvidia.driver_version", dt.date(2026, 12, 2)),
        "models-is-a-number": _set("probe.models", 3),
        "devices-is-a-table": _set("nvidia.devices", {"index": 0}),
        "device-index-is-a-list": _set("nvidia.devices.0.index", [0]),
        "framework-version-is-a-table": _set("framework.version", {"a": 1}),
        "code-path-is-a-number": _set("code.path", 7),
        "packages-is-a-list": _set("python.packages", [1, 2]),
        "step-median-is-a-string": _set("trial.stats.step_time_median_s", "fast"),
    }.items():
        put(f"signed-{name}", sign(_body_with(h200_body, edit)))
    # (5) disguised trailers: a body that holds a signature table in another spelling
    signed = sign(h200_body)
    body, trailer = mf.split_signed(signed)
    assert trailer is not None
    forged = body.replace(b'driver_version = "580.159.04"', b'driver_version = "999.99"')
    for name, spelling in {"trailing-space": b"[signature] ", "inner-spaces": b"[ signature ]",
                           "quoted": b'["signature"]', "trailing-tab": b"[signature]\t",
                           "quoted-space": b'["signature" ]'}.items():
        put(f"trailer-spelled-{name}", forged + trailer.replace(b"[signature]", spelling, 1))
    put("signed-body-with-signature-subtable", sign(h200_body + b"\n[signature.x]\nprincipal = \"alice@lab\"\n"))
    put("signed-body-with-dotted-signature-key", sign(b'signature.principal = "alice@lab"\n' + h200_body))
    put("signed-body-with-inline-signature", sign(b'signature = { principal = "alice@lab" }\n' + h200_body))
    put("unsigned-body-with-signature-table", _head() + b'[signature.format]\nx = "sshsig"\n')
    # (11) control characters in keys
    put("signed-key-with-escape", sign(_head() + b'[host]\n"os\\u001b[2K" = "x"\n'))
    # an integer past Python's 4,300-digit limit: int() raises a plain ValueError, not TOMLDecodeError
    digits = b"9" * 5000
    put("integer-of-5000-digits", _head() + b"x = " + digits + b"\n")
    put("signed-integer-of-5000-digits", sign(_head() + b"x = " + digits + b"\n"))
    return out


def _commands(f: Path, folder: Path, repo: Path, signer) -> dict[str, list[str]]:
    a = ["--allowed-signers", str(signer.allowed)]
    return {
        "verify": ["verify", str(f), *a],
        "verify-signature-only": ["verify", str(f), "--signature-only", *a],
        "verify-json": ["verify", str(f), "--json", *a],
        "verify-dir": ["verify", str(folder), "--signature-only", *a],
        "diff": ["diff", str(f), str(f)],
        "show": ["show", str(f), *a],
        "compare": ["compare", str(f), str(f), *a],
        "pin": ["pin", str(f), "--repo", str(repo)],
        "export": ["export", str(f), "--format", "in-toto", "--key", str(signer.key)],
        "sign": ["sign", str(f), "--key", str(signer.key)],
    }


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, test_signer, h200_body):
    tmp = tmp_path_factory.mktemp("hostile")
    cases = _cases(tmp, test_signer.sign, h200_body)
    repo = tmp_path_factory.mktemp("results") / "r"
    from test_results_helpers import git

    make_results_repo(repo)
    (repo / ".capture" / "allowed_signers").write_text(test_signer.allowed.read_text())
    git(repo, "commit", "-qam", "trust the test signer")
    folders = {}
    for name, f in cases.items():  # verify DIR: each case alone in a folder
        d = tmp / "dirs" / name
        d.mkdir(parents=True)
        if f.is_fifo():
            os.mkfifo(d / f.name)
        elif f.is_symlink():
            (d / f.name).symlink_to(os.readlink(f))
        else:
            (d / f.name).write_bytes(f.read_bytes()) if f.stat().st_size < 1 << 20 else (d / f.name).symlink_to(f)
        folders[name] = d
    return cases, folders, repo


def _one_error(err: str) -> None:
    assert "Traceback" not in err, err
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, err
    assert len([ln for ln in err.splitlines() if ln.startswith("hint:")]) <= 1, err


CASE_NAMES = sorted(["deep-array-500", "deep-inline-table-500", "deep-table-headers-60", "deep-within-tomllib-limit-200",
                     "signed-deep-array-500", "signed-deep-inline-table-500", "signed-deep-table-headers-60",
                     "signed-deep-within-tomllib-limit-200", "deep-array-100000", "symlink-to-dev-zero", "fifo",
                     "huge-17-mib", "signed-count-is-a-string", "signed-count-is-nan", "signed-tokens-per-s-is-inf",
                     "signed-created-is-a-date", "signed-driver-is-a-date", "signed-models-is-a-number",
                     "signed-devices-is-a-table", "signed-device-index-is-a-list",
                     "signed-framework-version-is-a-table", "signed-code-path-is-a-number",
                     "signed-packages-is-a-list", "signed-step-median-is-a-string",
                     "signed-body-with-signature-subtable", "signed-body-with-dotted-signature-key",
                     "signed-body-with-inline-signature", "unsigned-body-with-signature-table",
                     "signed-key-with-escape", "integer-of-5000-digits", "signed-integer-of-5000-digits"])


def test_the_corpus_is_what_the_test_runs(corpus):
    cases, _, _ = corpus
    trailer_cases = [n for n in cases if n.startswith("trailer-spelled-")]
    assert len(trailer_cases) == 5
    assert set(cases) == set(CASE_NAMES) | set(trailer_cases)


@pytest.mark.parametrize("command", ["verify", "verify-signature-only", "verify-json", "verify-dir", "diff", "show",
                                     "compare", "pin", "export", "sign"])
def test_every_hostile_case_is_exit_3_in_every_reading_command(corpus, test_signer, command, capsys):
    cases, folders, repo = corpus
    failures = []
    for name, f in sorted(cases.items()):
        before = f.read_bytes() if f.is_file() and not f.is_symlink() and f.stat().st_size < 1 << 20 else None
        args = _commands(f, folders[name], repo, test_signer)[command]
        rc = main(args)
        out, err = capsys.readouterr()
        if rc != 3:
            failures.append(f"{name}: exit {rc}: {err.strip() or out[-300:]}")
            continue
        if command == "verify-dir":
            assert "Traceback" not in err and not err.count("error:")
            rows = out.splitlines()
            assert rows[0].startswith("MALFORMED ") and rows[-1].startswith("1 manifest(s): 0 OK, 1 MALFORMED"), out
            assert len(rows) == 2, out  # one row, one summary: nothing a file can add
        elif command == "verify-json":
            import json
            assert json.loads(out)["status"] == "malformed"
        else:
            _one_error(err)
            assert out == "" or command in ("show", "compare", "diff"), out
        if before is not None:
            assert f.read_bytes() == before, f"{command} changed {name}"
    assert failures == []
    assert not [p for p in repo.rglob("*.toml") if ".capture" not in p.parts], "pin wrote a hostile file"


def test_the_forged_trailer_attack_is_refused_by_export(corpus, test_signer, capsys):
    """Finding 5: `[signature] ` (trailing space) made export attest a tampered body with the signer's identity."""
    cases, _, _ = corpus
    f = cases["trailer-spelled-trailing-space"]
    assert main(["export", str(f), "--format", "in-toto", "--key", str(test_signer.key)]) == 3
    err = capsys.readouterr().err
    assert "signature" in err and "not a signed manifest" in err


@pytest.mark.parametrize("reader", ["allowed-signers", "policy", "key", "export-key"])
@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "huge"])
def test_other_files_read_safely(tmp_path, test_signer, h200_body, reader, kind, capsys):
    """Allowed signers, policy and key files: refused (exit 2, one line) when not regular or too big."""
    bad = tmp_path / "bad"
    if kind == "fifo":
        os.mkfifo(bad)
    elif kind == "dev-zero":
        bad.symlink_to("/dev/zero")
    else:
        with bad.open("wb") as fh:
            fh.truncate(17 * 1024 * 1024)
        bad.chmod(0o600)
    m = tmp_path / "m.toml"
    m.write_bytes(test_signer.sign(h200_body))
    args = {
        "allowed-signers": ["verify", str(m), "--signature-only", "--allowed-signers", str(bad)],
        "policy": ["verify", str(m), "--signature-only", "--allowed-signers", str(test_signer.allowed), "--policy", str(bad)],
        "key": ["sign", str(m), "--key", str(bad)],
        "export-key": ["export", "--format", "pubkey-pem", "--key", str(bad)],
    }[reader]
    assert main(args) == 2
    err = capsys.readouterr().err
    _one_error(err)
    assert re.search(r"not a regular file|over the .* limit|FIFO|character device", err), err


def _limited() -> None:
    lim = 1 << 30  # 1 GiB of address space: reading /dev/zero whole would die here
    resource.setrlimit(resource.RLIMIT_AS, (lim, lim))


@pytest.mark.parametrize("name", ["symlink-to-dev-zero", "fifo", "huge-17-mib", "deep-array-100000",
                                  "signed-count-is-nan", "signed-body-with-signature-subtable"])
@pytest.mark.parametrize("command", ["verify", "show"])
def test_subprocess_bounded_time_and_memory(corpus, test_signer, name, command):
    cases, _, _ = corpus
    args = [sys.executable, "-m", "capture", command, str(cases[name]), "--allowed-signers", str(test_signer.allowed)]
    r = subprocess.run(args, capture_output=True, text=True, timeout=30, preexec_fn=_limited,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 3, r.stderr
    _one_error(r.stderr)


@pytest.mark.parametrize("text", ["[fields]\n\"a\" = " + "[" * 100_000 + "\n", "x = " + "{a = " * 600 + "1" + "}" * 600 + "\n",
                                  "fields = 3\n", "[ignore]\nfields = [[[1]]]\n", "x = " + "9" * 5000 + "\n"])
def test_hostile_policy_file_is_one_config_error(tmp_path, test_signer, h200_body, text, capsys):
    """Finding 3 for --policy: a config error (exit 2, one line), never a RecursionError."""
    policy = tmp_path / "policy.toml"
    policy.write_text(text)
    m = tmp_path / "m.toml"
    m.write_bytes(test_signer.sign(h200_body))
    for args in (["verify", str(m), "--policy", str(policy), "--allowed-signers", str(test_signer.allowed)],
                 ["diff", str(m), str(m), "--policy", str(policy)]):
        assert main(args) == 2
        _one_error(capsys.readouterr().err)


# --------------------------------------------------------------------------- issue 25: loops, globs, -o targets


def test_a_symlink_loop_named_toml_is_one_row_in_verify_and_decide(tmp_path, test_signer, h200_body, capsys):
    folder = tmp_path / "runs"
    folder.mkdir()
    (folder / "good.toml").write_bytes(test_signer.sign(h200_body))
    (folder / "loop.toml").symlink_to("loop.toml")
    (folder / "a.toml").symlink_to("b.toml")
    (folder / "b.toml").symlink_to("a.toml")
    a = ["--allowed-signers", str(test_signer.allowed)]
    assert main(["verify", str(folder), "--signature-only", *a]) == 3
    out, err = capsys.readouterr()
    assert "Traceback" not in err and [ln.split()[0] for ln in out.splitlines()[:-1]].count("MALFORMED") == 3
    for args in ([str(folder)], [str(folder / "*.toml")], [str(folder / "**" / "*.toml")], [str(folder / "loop.toml")]):
        assert main(["decide", *args, *a]) == 0  # a glob matches files only: the loops are left out
        out, err = capsys.readouterr()
        assert "Traceback" not in err and err.count("error:") == 0, err
        if args[0].endswith(("runs", "loop.toml")):
            assert "loop.toml" in out and "MALFORMED" in out


def _folder_linking_to_itself(tmp_path: Path, sign) -> tuple[Path, bytes]:
    root = tmp_path / "runs"
    (root / "sub").mkdir(parents=True)
    raw = sign(b"")
    (root / "sub" / "run.toml").write_bytes(raw)
    for name in ("self", "twin", "again"):  # three links back: 3**depth paths for a walker that follows them all
        (root / name).symlink_to(root, target_is_directory=True)
        (root / "sub" / name).symlink_to(root, target_is_directory=True)
    return root, raw


@pytest.mark.parametrize("command", ["verify", "decide"])
def test_a_glob_over_a_folder_that_links_to_itself_ends_in_bounded_memory(tmp_path, test_signer, h200_body, command):
    """Issue 25: `'**'` over such a folder grew to 22.5 GiB. Now each folder is entered once; the run
    ends in seconds under a 1 GiB address-space limit and lists the one manifest once."""
    root, _ = _folder_linking_to_itself(tmp_path, lambda _: test_signer.sign(h200_body))
    args = [sys.executable, "-m", "capture", command, str(root / "**" / "*.toml"), "--allowed-signers", str(test_signer.allowed)]
    if command == "verify":
        args.append("--signature-only")
    r = subprocess.run(args, capture_output=True, text=True, timeout=60, preexec_fn=_limited,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    if command == "verify":
        assert r.stdout.splitlines()[-1].startswith("1 manifest(s): 1 OK"), r.stdout


def test_glob_expansion_stops_at_its_documented_count(tmp_path, monkeypatch, capsys):
    from capture.verify import walk

    for i in range(12):
        (tmp_path / f"m{i}.toml").write_text("")
    monkeypatch.setattr(walk, "MAX_FILES", 10)
    assert main(["verify", str(tmp_path / "*.toml"), "--signature-only"]) == 2
    _one_error(capsys.readouterr().err)
    assert main(["verify", str(tmp_path), "--signature-only"]) == 2
    err = capsys.readouterr().err
    _one_error(err)
    assert "more than 10 files" in err
    monkeypatch.setattr(walk, "MAX_ENTRIES", 5)
    assert main(["decide", str(tmp_path / "**" / "*.toml")]) == 2
    assert "more than 5 entries" in capsys.readouterr().err


def test_the_glob_walker_matches_what_glob_matches(tmp_path):
    import glob

    from capture.verify import walk

    for rel in ("a.toml", "b.txt", ".hidden.toml", "d/x.toml", "d/e/y.toml", "d/.h/z.toml", "f[1].toml", "g/h/i/j.toml"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    for pattern in ("*.toml", "**/*.toml", "d/**/*.toml", "*/*.toml", "d/*/*.toml", "?.toml", "[ab].*", "**/j.toml", "g/**"):
        full = str(tmp_path / pattern)
        want = sorted(m for m in glob.glob(full, recursive=True) if os.path.isfile(m))
        assert sorted(walk.glob_files(full)) == want, pattern


def _targets(tmp_path: Path) -> dict[str, Path]:
    out = {}
    (tmp_path / "folder").mkdir()
    out["folder"] = tmp_path / "folder"
    os.mkfifo(tmp_path / "fifo")
    out["fifo"] = tmp_path / "fifo"
    (tmp_path / "real").write_text("keep\n")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    out["symlink"] = tmp_path / "link"
    out["device"] = Path(os.devnull)
    return out


@pytest.mark.parametrize("command", ["fingerprint", "fingerprint-signed", "export", "keygen", "trial", "sign"])
def test_o_refuses_anything_but_a_regular_file_or_a_new_path(tmp_path, test_signer, h200_body, command, capsys, home):
    """Issue 25: `-o` swapped a FIFO, a device node (as root: /dev/null) or a symlink for a regular file."""
    m = tmp_path / "m.toml"
    m.write_bytes(test_signer.sign(h200_body))
    for kind, target in _targets(tmp_path).items():
        if command == "sign" and kind in ("folder", "fifo", "device"):
            continue  # sign reads FILE first: those are refused as manifests (exit 3)
        before = os.lstat(target)
        args = {
            "fingerprint": ["fingerprint", "-o", str(target)],
            "fingerprint-signed": ["fingerprint", "-o", str(target), "--key", str(test_signer.key)],
            "export": ["export", str(m), "--format", "in-toto", "--key", str(test_signer.key), "-o", str(target)],
            "keygen": ["keygen", "-o", str(target), "--force"],
            "trial": ["trial", "--example", "tiny", "-o", str(target)],
            "sign": ["sign", str(target), "--key", str(test_signer.key)],
        }[command]
        if command == "sign":
            (tmp_path / "real").write_bytes(mf.split_signed(test_signer.sign(h200_body))[0])
        assert main(args) == 2, (kind, capsys.readouterr())
        err = capsys.readouterr().err
        _one_error(err)
        assert "is a" in err and "regular file or a new path" in err, err
        after = os.lstat(target)
        assert (after.st_mode, after.st_ino) == (before.st_mode, before.st_ino), kind


def test_sizes_count_regular_files_once_and_never_follow_links_below_the_named_path(tmp_path):
    """One walk behind every size capture records (checkpoints, the recorder's, a dead trial's
    scratch): a link inside a folder is not followed (it may lead to /, or back into the folder),
    a FIFO and an unreadable subfolder add nothing and block nothing, and the named path itself may
    be a link."""
    from capture._safe_read import tree_bytes

    top = tmp_path / "ckpt"
    (top / "shard").mkdir(parents=True)
    (top / "a.bin").write_bytes(b"x" * 1000)
    (top / "shard" / "b.bin").write_bytes(b"y" * 234)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"z" * 50_000)
    (top / "to-outside").symlink_to(outside)
    (top / "loop").symlink_to(top, target_is_directory=True)
    (top / "root").symlink_to("/", target_is_directory=True)
    os.mkfifo(top / "pipe")
    locked = top / "locked"
    locked.mkdir()
    (locked / "c.bin").write_bytes(b"w" * 7)
    assert tree_bytes(top) == 1000 + 234 + 7
    (tmp_path / "named-link").symlink_to(top, target_is_directory=True)
    assert tree_bytes(tmp_path / "named-link") == 1241
    assert tree_bytes(top / "a.bin") == 1000 and tree_bytes(top / "to-outside") == 50_000
    assert tree_bytes(tmp_path / "missing") is None and tree_bytes(top / "pipe") is None
    locked.chmod(0)
    try:
        expected = 1234 if os.geteuid() != 0 else 1241  # root reads a mode-0 folder
        assert tree_bytes(top) == expected
    finally:
        locked.chmod(0o755)

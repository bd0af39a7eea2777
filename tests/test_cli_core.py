"""The core commands end to end, in-process through capture._cli.main, with real keys, real git
repositories and a real pip install changing the live stack after signing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from capture._cli import main

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture()
def code_repo(tmp_path: Path) -> Path:
    repo = tmp_path / "code"
    repo.mkdir()
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@e", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@e"}
    (repo / "train.py").write_text("print('train')\n")
    for cmd in (["git", "init", "-q", "-b", "main"], ["git", "add", "."], ["git", "commit", "-qm", "init"]):
        subprocess.run(cmd, cwd=repo, check=True, env=env)
    return repo


@pytest.fixture()
def signer(tmp_path: Path, home: Path) -> tuple[Path, Path]:
    """A key made by `capture keygen` and an allowed-signers file that trusts it."""
    key = tmp_path / "keys" / "id_ed25519"
    key.parent.mkdir()
    assert main(["keygen", "-o", str(key), "-C", "ci@capture"]) == 0
    pub = (key.parent / "id_ed25519.pub").read_text().split()
    allowed = tmp_path / "trust" / "signers"  # not beside the manifests: they must not find it by themselves
    allowed.parent.mkdir()
    allowed.write_text(f'ci@capture namespaces="capture-manifest" {pub[0]} {pub[1]}\n')
    return key, allowed


def _fingerprint(tmp_path: Path, code: Path, key: Path, name: str = "m.toml") -> Path:
    out = tmp_path / name
    assert main(["fingerprint", "--code", str(code), "-o", str(out), "--key", str(key)]) == 0
    return out


def test_fingerprint_to_stdout_is_a_manifest(capsysbinary, code_repo: Path):
    import tomllib

    assert main(["fingerprint", "--code", str(code_repo)]) == 0
    data = tomllib.loads(capsysbinary.readouterr().out.decode())
    assert data["kind"] == "fingerprint" and data["schema_version"] == 1
    assert {"accelerator", "python", "host", "toolchain"} <= set(data)


def test_keygen_sign_verify_same_stack(tmp_path: Path, signer, code_repo: Path, capsys):
    key, allowed = signer
    assert oct(key.stat().st_mode & 0o777) == "0o600"
    m = _fingerprint(tmp_path, code_repo, key)
    capsys.readouterr()
    assert main(["verify", str(m), "--allowed-signers", str(allowed)]) == 0
    out = capsys.readouterr().out
    assert "signature: valid" in out and "same stack" in out
    assert main(["verify", str(m), "--allowed-signers", str(allowed), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["status"] == "ok" and report["signer"]["principal"] == "ci@capture"


def test_sign_command_and_resign_replaces_trailer(tmp_path: Path, signer, code_repo: Path):
    key, allowed = signer
    m = tmp_path / "u.toml"
    assert main(["fingerprint", "--code", str(code_repo), "-o", str(m)]) == 0
    assert main(["verify", str(m), "--allowed-signers", str(allowed)]) == 4  # unsigned
    assert main(["sign", str(m), "--key", str(key)]) == 0
    once = m.read_bytes()
    assert main(["sign", str(m), "--key", str(key)]) == 0
    assert m.read_bytes().count(b"[signature]") == 1 and m.read_bytes().split(b"[signature]")[0] == once.split(b"[signature]")[0]
    assert main(["verify", str(m), "--allowed-signers", str(allowed), "--signature-only"]) == 0


def test_any_changed_body_byte_is_rejected(tmp_path: Path, signer, code_repo: Path, capsys):
    key, allowed = signer
    m = _fingerprint(tmp_path, code_repo, key)
    raw = m.read_bytes()
    body_len = raw.index(b"[signature]")
    for pos in (0, body_len // 3, body_len // 2, body_len - 2):
        bad = bytearray(raw)
        bad[pos] ^= 0x01
        m.write_bytes(bytes(bad))
        assert main(["verify", str(m), "--allowed-signers", str(allowed)]) == 4, pos
    assert "error:" in capsys.readouterr().err


def test_untrusted_and_missing_signers(tmp_path: Path, signer, code_repo: Path, capsys):
    key, _ = signer
    m = _fingerprint(tmp_path, code_repo, key)
    other = tmp_path / "other"
    assert main(["keygen", "-o", str(other), "-C", "someone@else"]) == 0
    pub = Path(f"{other}.pub").read_text().split()
    stranger = tmp_path / "stranger_signers"
    stranger.write_text(f"ci@capture {pub[0]} {pub[1]}\n")
    capsys.readouterr()
    assert main(["verify", str(m), "--allowed-signers", str(stranger)]) == 4
    assert "not" in capsys.readouterr().err.lower()
    # no allowed-signers anywhere (isolated HOME, tmp folder)
    assert main(["verify", str(m)]) == 4
    err = capsys.readouterr().err
    assert err.startswith("error:") and "hint:" in err and "Traceback" not in err


def _wheel(tmp_path: Path, name: str, version: str) -> Path:
    """A real, minimal wheel (PEP 427) for a one-module distribution."""
    whl = tmp_path / f"{name}-{version}-py3-none-any.whl"
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}.py": f"VERSION = {version!r}\n",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    with zipfile.ZipFile(whl, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
        z.writestr(f"{dist}/RECORD", "".join(f"{p},,\n" for p in files) + f"{dist}/RECORD,,\n")
    return whl


def _pip_install(site: Path, wheel: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--upgrade",
                    "--target", str(site), str(wheel)], check=True, capture_output=True)


def test_drift_after_installing_a_package_names_it(tmp_path: Path, signer, code_repo: Path,
                                                   monkeypatch: pytest.MonkeyPatch, capsys):
    key, allowed = signer
    site = tmp_path / "site"
    _pip_install(site, _wheel(tmp_path, "capture_drift_demo", "1.0"))
    monkeypatch.syspath_prepend(str(site))
    m = _fingerprint(tmp_path, code_repo, key)
    capsys.readouterr()
    assert main(["verify", str(m), "--allowed-signers", str(allowed)]) == 0
    capsys.readouterr()
    # the live stack changes (pip --target --upgrade keeps the old dist-info beside the new one,
    # so start the target afresh, as a venv upgrade would leave it)
    shutil.rmtree(site)
    _pip_install(site, _wheel(tmp_path, "capture_drift_demo", "1.1"))
    assert main(["verify", str(m), "--allowed-signers", str(allowed)]) == 1
    out = capsys.readouterr().out
    assert "DRIFT" in out
    assert 'python.packages.capture-drift-demo.version: recorded "1.0", live "1.1"' in out


def test_code_change_after_signing_is_drift(tmp_path: Path, signer, code_repo: Path, capsys):
    key, allowed = signer
    m = _fingerprint(tmp_path, code_repo, key)
    (code_repo / "train.py").write_text("print('changed')\n")
    capsys.readouterr()
    assert main(["verify", str(m), "--allowed-signers", str(allowed)]) == 1
    out = capsys.readouterr().out
    import tomllib

    lines = out.splitlines()  # a short value on one line, two sha256 values each on its own, within 100 columns
    at = lines.index("    code.tree_hash:")
    assert lines[at + 1] == f'      recorded "{tomllib.loads(m.read_text())["code"]["tree_hash"]}"'
    assert lines[at + 2].startswith('      live "sha256:') and "train.py" in lines[at + 3]
    assert all(len(x) <= 100 for x in lines[1:] if str(allowed) not in x), out


def test_policy_file_loosens(tmp_path: Path, signer, code_repo: Path, capsys):
    key, allowed = signer
    m = _fingerprint(tmp_path, code_repo, key)
    (code_repo / "train.py").write_text("print('changed')\n")
    policy = tmp_path / "policy.toml"
    policy.write_text('[ignore]\nfields = ["code.*"]\n')
    assert main(["verify", str(m), "--allowed-signers", str(allowed), "--policy", str(policy)]) == 0


def test_planted_secrets_never_reach_the_manifest(tmp_path: Path, signer, code_repo: Path,
                                                  monkeypatch: pytest.MonkeyPatch):
    key, _ = signer
    secrets = {
        "HF_TOKEN": "hf_abcdefghijklmnopqrstuvwxyzABCDEF",
        "CUDA_API_TOKEN": "s3cr3t-cuda-token-value",
        "NCCL_SOCKET_PASSWORD": "hunter2-nccl-password",
        "TORCH_HOME": "https://alice:pa55w0rd-in-url@models.example/torch",
        "PYTORCH_SECRET_KEY": "pytorch-secret-key-value",
    }
    for k, v in secrets.items():
        monkeypatch.setenv(k, v)
    subprocess.run(["git", "remote", "add", "origin", "https://bob:ghp_tokenInRemote123@git.example/x.git"],
                   cwd=code_repo, check=True)
    m = _fingerprint(tmp_path, code_repo, key)
    raw = m.read_text()
    for value in [*secrets.values(), "pa55w0rd-in-url", "ghp_tokenInRemote123"]:
        assert value not in raw


def test_diff_names_differences(tmp_path: Path, signer, code_repo: Path, capsys):
    key, _ = signer
    a = _fingerprint(tmp_path, code_repo, key, "a.toml")
    (code_repo / "train.py").write_text("print('changed')\n")
    b = _fingerprint(tmp_path, code_repo, key, "b.toml")
    capsys.readouterr()
    assert main(["diff", str(a), str(a)]) == 0
    assert main(["diff", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    # no allowed-signers file: shown, not refused; past 100 columns the verdict goes below the path
    assert f"A: {a} — signature valid, signer NOT trusted" in out or f"A: {a}\n   signature valid, signer NOT trusted" in out
    import tomllib

    hashes = [tomllib.loads(f.read_text())["code"]["tree_hash"] for f in (a, b)]
    lines = out.splitlines()
    at = lines.index("  code.tree_hash:")  # two sha256 values do not fit one line: each side on its own
    assert lines[at + 1:at + 3] == [f'    A "{hashes[0]}"', f'    B "{hashes[1]}"']
    assert all(len(x) <= 100 for x in lines if str(a) not in x and str(b) not in x), out
    assert main(["diff", str(a), str(b), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["differences"][0]["field"] == "code.tree_hash"


BAD_FILES = {
    "empty": (b"", 3),
    "not-utf8": (b"\xff\xfe\x00garbage", 3),
    "not-toml": (b"{{ definitely not toml", 3),
    "truncated-unsigned": (b'schema_version = 1\nkind = "finger', 3),
    "wrong-types": (b'schema_version = 1\nkind = "fingerprint"\ncreated_utc = "x"\nhost = "h"\n', 3),
    "future-schema": (b'schema_version = 7\nkind = "fingerprint"\ncreated_utc = "x"\n', 3),
    "unsigned-valid": (b'schema_version = 1\nkind = "fingerprint"\ncreated_utc = "x"\n', 4),
    "broken-trailer": (b'schema_version = 1\nkind = "fingerprint"\ncreated_utc = "x"\n[signature]\nformat = "sshsig\n', 4),
    "trailer-integer-of-5000-digits": (b'schema_version = 1\nkind = "fingerprint"\ncreated_utc = "x"\n[signature]\nx = '
                                       + b"9" * 5000 + b"\n", 4),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
@pytest.mark.parametrize("command", ["verify", "diff"])
def test_bad_input_one_line_error_and_exit_code(tmp_path: Path, home: Path, case: str, command: str, capsys):
    data, code = BAD_FILES[case]
    f = tmp_path / f"{case}.toml"
    f.write_bytes(data)
    args = ["verify", str(f)] if command == "verify" else ["diff", str(f), str(f)]
    rc = main(args)
    err = capsys.readouterr().err
    if command == "diff" and code == 4:
        assert rc == 0  # diff compares content; it does not require a signature
        return
    assert rc == code
    assert err.startswith("error: ") and "Traceback" not in err
    assert len([ln for ln in err.splitlines() if ln.startswith("error:")]) == 1


def test_missing_file(tmp_path: Path, home: Path, capsys):
    assert main(["verify", str(tmp_path / "nope.toml")]) == 3
    assert "no such file" in capsys.readouterr().err


def test_truncated_signed_file_is_rejected(tmp_path: Path, signer, code_repo: Path):
    key, allowed = signer
    m = _fingerprint(tmp_path, code_repo, key)
    raw = m.read_bytes()
    for cut in (len(raw) - 40, raw.index(b"[signature]") + 20, len(raw) // 2):
        m.write_bytes(raw[:cut])
        assert main(["verify", str(m), "--allowed-signers", str(allowed)]) in (3, 4)


@pytest.mark.parametrize("case", ["missing", "group-readable", "directory", "public-half", "garbage"])
def test_bad_key_exit_2_and_no_output_file(tmp_path: Path, signer, code_repo: Path, case: str, capsys):
    key, _ = signer
    bad = tmp_path / "badkey"
    if case == "group-readable":
        bad.write_bytes(key.read_bytes())
        bad.chmod(0o644)
    elif case == "directory":
        bad.mkdir()
    elif case == "public-half":
        bad = Path(f"{key}.pub")
    elif case == "garbage":
        bad.write_text("not a key\n")
        bad.chmod(0o600)
    out = tmp_path / "never.toml"
    assert main(["fingerprint", "--code", str(code_repo), "-o", str(out), "--key", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "hint:" in err and "Traceback" not in err
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".never")]


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["verify"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["fingerprint", "--no-such-flag"])
    assert e.value.code == 2
    assert "hint:" in capsys.readouterr().err


def test_console_script_entry_point_runs(tmp_path: Path, home: Path):
    r = subprocess.run([sys.executable, "-m", "capture", "--version"], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0 and r.stdout.startswith("capture ")


def test_manifest_made_outside_git_does_not_drift_on_code(tmp_path: Path, signer, monkeypatch: pytest.MonkeyPatch, capsys):
    key, allowed = signer
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "train.py").write_text("x = 1\n")
    monkeypatch.chdir(plain)  # no --code and not a git work tree: the code probe skips
    m = tmp_path / "m.toml"
    assert main(["fingerprint", "-o", str(m), "--key", str(key)]) == 0
    assert "skipped" in m.read_text().split("[code]")[1].split("\n[")[0]
    capsys.readouterr()
    assert main(["verify", str(m), "--allowed-signers", str(allowed)]) == 0
    assert "code: not recorded" in capsys.readouterr().out

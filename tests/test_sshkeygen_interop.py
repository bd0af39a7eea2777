"""Interop with the real OpenSSH ssh-keygen, both ways (shared/DESIGN.md decision 1).

Signatures capture makes verify with ``ssh-keygen -Y verify``; signatures ssh-keygen makes verify
in capture; keys move both ways; and capture's allowed-signers decisions agree with ssh-keygen's.
"""

from __future__ import annotations

import datetime as dt
import shutil
import subprocess
from pathlib import Path

import pytest

from capture import manifest, signing
from capture.errors import KeyError_, SignatureError

SSH_KEYGEN = shutil.which("ssh-keygen") or "/usr/bin/ssh-keygen"
pytestmark = pytest.mark.skipif(not Path(SSH_KEYGEN).exists(), reason="ssh-keygen (OpenSSH) is not installed")
NS = "capture-manifest"


@pytest.fixture(autouse=True)
def _isolated_home(home):
    """Every test here runs with the isolated HOME of tests/conftest.py."""
    return home


def keygen(*args: str, stdin: bytes | None = None, check: bool = True) -> subprocess.CompletedProcess[bytes]:
    proc = subprocess.run([SSH_KEYGEN, *args], input=stdin, capture_output=True, timeout=60)
    if check and proc.returncode != 0:
        raise AssertionError(f"ssh-keygen {' '.join(args)} failed ({proc.returncode}): {proc.stderr.decode()}")
    return proc


def ssh_key(tmp_path: Path, name: str, *extra: str, comment: str = "alice@example.com") -> Path:
    path = tmp_path / name
    keygen("-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path), *extra)
    return path


def pub(path: Path) -> str:
    return " ".join(Path(f"{path}.pub").read_text().split()[:2])


@pytest.fixture
def body() -> bytes:
    m = manifest.new_manifest("fingerprint")
    m["created_utc"] = "2025-06-01T12:00:00Z"
    m["host"] = {"hostname": "gpu-node-07", "os": "Ubuntu 24.04", "cpu_count": 16, "memory_total_bytes": 134_000_000_000}
    m["nvidia"] = {"driver_version": "580.159.04", "cuda_driver_version": "13.0"}
    return manifest.dumps(m)


def ssh_verify(tmp_path: Path, body: bytes, armored: str, allowed_line: str, principal: str,
               namespace: str = NS, verify_time: str | None = None) -> subprocess.CompletedProcess[bytes]:
    sig = tmp_path / "sig"
    sig.write_text(armored)
    allowed = tmp_path / "ssh_allowed"
    allowed.write_text(allowed_line + "\n")
    args = ["-Y", "verify", "-f", str(allowed), "-I", principal, "-n", namespace, "-s", str(sig)]
    if verify_time:
        args += ["-O", f"verify-time={verify_time}"]
    return keygen(*args, stdin=body, check=False)


# --------------------------------------------------------------------------- capture signs, ssh-keygen verifies


def test_capture_signature_verifies_with_ssh_keygen(tmp_path, body):
    key = tmp_path / "k"
    signing.generate_key(key, comment="alice@example.com")
    path = tmp_path / "m.toml"
    signing.write_signed(path, body, key)
    signed_body, trailer = manifest.split_signed(path.read_bytes())
    fields = manifest.parse_trailer(trailer)
    proc = ssh_verify(tmp_path, signed_body, fields["signature"],
                      f'{fields["principal"]} namespaces="{NS}" {fields["public_key"]}', fields["principal"])
    assert proc.returncode == 0, proc.stderr.decode()
    fp = signing.fingerprint(fields["public_key"])
    assert f'Good "{NS}" signature for alice@example.com with ED25519 key {fp}' in proc.stdout.decode()
    # The same check fails on one changed byte, so the assertion above can fail too.
    tampered = signed_body.replace(b"gpu-node-07", b"gpu-node-08")
    proc = ssh_verify(tmp_path, tampered, fields["signature"], f'alice@example.com {fields["public_key"]}', "alice@example.com")
    assert proc.returncode != 0 and b"Signature verification failed" in proc.stderr


def test_check_novalidate_accepts_capture_signature(tmp_path):
    key = tmp_path / "k"
    signing.generate_key(key)
    (tmp_path / "sig").write_text(signing.sshsig_sign(b"payload\n", signing.load_private_key(key)))
    proc = keygen("-Y", "check-novalidate", "-n", NS, "-s", str(tmp_path / "sig"), stdin=b"payload\n")
    assert b"Good" in proc.stdout
    wrong_ns = keygen("-Y", "check-novalidate", "-n", "file", "-s", str(tmp_path / "sig"), stdin=b"payload\n", check=False)
    assert wrong_ns.returncode != 0


def test_capture_key_works_in_ssh_keygen(tmp_path, body):
    key = tmp_path / "k"
    line = signing.generate_key(key, comment="ci@lab")
    assert keygen("-y", "-f", str(key)).stdout.decode().split()[:2] == line.split()[:2]
    listed = keygen("-l", "-f", f"{key}.pub").stdout.decode().split()
    assert listed[1] == signing.fingerprint(line) and listed[-1] == "(ED25519)"
    # ssh-keygen signs with capture's key; capture verifies the whole signed manifest
    msg = tmp_path / "body"
    msg.write_bytes(body + b"\n")
    keygen("-Y", "sign", "-n", NS, "-f", str(key), str(msg))
    armored = Path(f"{msg}.sig").read_text()
    signed = msg.read_bytes() + signing._render_trailer("ci@lab", pub(key), armored)
    allowed = tmp_path / "allowed"
    allowed.write_text(f"ci@lab {pub(key)}\n")
    info, got = signing.verify_signed_bytes(signed, signing.AllowedSigners.load(allowed), "m")
    assert got == msg.read_bytes() and info.principal == "ci@lab"


# --------------------------------------------------------------------------- ssh-keygen signs, capture verifies


def test_ssh_keygen_key_and_signature_work_in_capture(tmp_path):
    key = ssh_key(tmp_path, "id_ed25519")
    loaded = signing.load_private_key(key)
    assert signing.public_key_line(loaded) == pub(key)
    assert signing.default_principal(key) == "alice@example.com"
    msg = tmp_path / "msg"
    msg.write_bytes(b"schema_version = 1\n")
    keygen("-Y", "sign", "-n", NS, "-f", str(key), str(msg))
    theirs = Path(f"{msg}.sig").read_text()
    assert signing.sshsig_verify(msg.read_bytes(), theirs) == pub(key)
    # Ed25519 is deterministic: capture writes the very same armored bytes
    assert signing.sshsig_sign(msg.read_bytes(), loaded) == theirs
    with pytest.raises(SignatureError, match="changed after signing"):
        signing.sshsig_verify(msg.read_bytes() + b" ", theirs)


def test_ssh_keygen_key_signs_manifest_in_capture(tmp_path, body):
    key = ssh_key(tmp_path, "id_ed25519", comment="bob@example.com")
    path = tmp_path / "m.toml"
    path.write_bytes(body)
    signing.sign_file(path, key)
    allowed = tmp_path / "allowed_signers"
    allowed.write_text(f"bob@example.com {pub(key)} from ssh-keygen\n")
    info, _ = signing.verify_signed_bytes(path.read_bytes(), signing.AllowedSigners.load(allowed), str(path))
    assert info.principal == "bob@example.com" and info.public_key == pub(key)


def test_ssh_keygen_other_namespace_rejected(tmp_path):
    key = ssh_key(tmp_path, "k")
    msg = tmp_path / "msg"
    msg.write_bytes(b"data\n")
    keygen("-Y", "sign", "-n", "file", "-f", str(key), str(msg))
    with pytest.raises(SignatureError, match="namespace 'file', not 'capture-manifest'"):
        signing.sshsig_verify(b"data\n", Path(f"{msg}.sig").read_text())


def test_ssh_keygen_sha256_signature_rejected(tmp_path):
    key = ssh_key(tmp_path, "k")
    msg = tmp_path / "msg"
    msg.write_bytes(b"data\n")
    keygen("-Y", "sign", "-n", NS, "-O", "hashalg=sha256", "-f", str(key), str(msg))
    sig = Path(f"{msg}.sig")
    keygen("-Y", "check-novalidate", "-n", NS, "-s", str(sig), stdin=b"data\n")  # a real, valid signature
    with pytest.raises(SignatureError, match="uses hash 'sha256'; capture accepts only 'sha512'"):
        signing.sshsig_verify(b"data\n", sig.read_text())


def test_ssh_keygen_rsa_signature_rejected(tmp_path):
    key = tmp_path / "rsa"
    keygen("-q", "-t", "rsa", "-b", "2048", "-N", "", "-f", str(key))
    msg = tmp_path / "msg"
    msg.write_bytes(b"data\n")
    keygen("-Y", "sign", "-n", NS, "-f", str(key), str(msg))
    with pytest.raises(SignatureError, match="made with a ssh-rsa key; capture accepts only Ed25519"):
        signing.sshsig_verify(b"data\n", Path(f"{msg}.sig").read_text())


# --------------------------------------------------------------------------- bad keys from ssh-keygen


@pytest.mark.parametrize("args,match", [
    (("-t", "ed25519", "-N", "correct horse"), "protected by a passphrase"),
    (("-t", "rsa", "-b", "2048", "-N", ""), "holds an RSA key; capture signs with Ed25519 keys only"),
    (("-t", "rsa", "-b", "2048", "-N", "", "-m", "PEM"), "holds an RSA key"),
    (("-t", "ecdsa", "-N", ""), "holds an ECDSA key"),
])
def test_ssh_keygen_keys_capture_refuses(tmp_path, args, match):
    key = tmp_path / "key"
    keygen("-q", *args, "-f", str(key))
    with pytest.raises(KeyError_, match=match) as info:
        signing.load_private_key(key)
    assert "capture keygen" in info.value.hint


def test_ssh_keygen_pub_file_given(tmp_path):
    key = ssh_key(tmp_path, "id_ed25519")
    with pytest.raises(KeyError_, match="is a public key") as info:
        signing.load_private_key(Path(f"{key}.pub"))
    assert info.value.hint == f"pass {key} instead"


# --------------------------------------------------------------------------- allowed signers agree with ssh-keygen


DIFFERENTIAL = [
    # (allowed-signers line with {k} for the key, principal, verify time UTC)
    ("alice@example.com {k}", "alice@example.com", None),
    ("alice@example.com {k}", "ALICE@example.com", None),
    ("*@example.com {k}", "alice@example.com", None),
    ("*@example.com {k}", "alice@example.org", None),
    ("alice@example.??? {k}", "alice@example.com", None),
    ('"!mallory@*,*@example.com" {k}', "mallory@example.com", None),
    ("!mallory@*,*@example.com {k}", "alice@example.com", None),
    ("!bob {k}", "alice", None),
    ("[ab]lice {k}", "alice", None),
    ('alice namespaces="capture-*" {k}', "alice", None),
    ('alice namespaces="git,file" {k}', "alice", None),
    ('alice namespaces="!capture-manifest,*" {k}', "alice", None),
    ("alice cert-authority {k}", "alice", None),
    ('alice valid-after="20250101Z" {k}', "alice", "20241231235959Z"),
    ('alice valid-after="20250101Z" {k}', "alice", "20250101Z"),
    ('alice valid-before="202512311200Z" {k}', "alice", "202512311200Z"),
    ('alice valid-before="202512311200Z" {k}', "alice", "20251231120001Z"),
    ('alice valid-after="20250101",valid-before="20250201" {k}', "alice", "20250115Z"),
    ('alice VALID-AFTER="20990101Z" {k}', "alice", None),
    ("alice,bob {k} trailing comment", "bob", None),
]


@pytest.mark.parametrize("line,principal,when", DIFFERENTIAL)
def test_allowed_signers_decisions_match_ssh_keygen(tmp_path, line, principal, when):
    key = ssh_key(tmp_path, "k")
    msg = b"data\n"
    armored = signing.sshsig_sign(msg, signing.load_private_key(key))
    text = line.format(k=pub(key))
    theirs = ssh_verify(tmp_path, msg, armored, text, principal, verify_time=when).returncode == 0
    (tmp_path / "ours").write_text(text + "\n")
    now = None
    if when:
        fmt = {9: "%Y%m%dZ", 13: "%Y%m%d%H%MZ", 15: "%Y%m%d%H%M%SZ"}[len(when)]
        now = dt.datetime.strptime(when, fmt).replace(tzinfo=dt.timezone.utc)
    ours = signing.AllowedSigners.load(tmp_path / "ours").is_trusted(principal, pub(key), NS, now=now)
    assert ours == theirs, f"capture says {ours}, ssh-keygen says {theirs} for {text!r} / {principal!r}"


def test_capture_made_allowed_signers_line_works_in_ssh_keygen(tmp_path, body):
    # the line ensure_default_key writes (and the trust hint prints) is valid for ssh-keygen
    key = signing.ensure_default_key()
    allowed = Path(tmp_path / "home" / ".config" / "capture" / "allowed_signers")
    principal = signing.default_principal(key)
    armored = signing.sshsig_sign(body, signing.load_private_key(key))
    (tmp_path / "sig").write_text(armored)
    proc = keygen("-Y", "verify", "-f", str(allowed), "-I", principal, "-n", NS, "-s", str(tmp_path / "sig"),
                  stdin=body, check=False)
    assert proc.returncode == 0, proc.stderr.decode()
    found = keygen("-Y", "find-principals", "-f", str(allowed), "-s", str(tmp_path / "sig"), stdin=body)
    assert found.stdout.decode().strip() == principal


# Every character that str.splitlines() treats as a line break; OpenSSH and git break at "\n" only.
HIDDEN_BREAKS = ["\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"]


@pytest.mark.parametrize("brk", HIDDEN_BREAKS, ids=[f"U+{ord(c):04X}" for c in HIDDEN_BREAKS])
def test_hidden_line_break_cannot_add_a_signer(tmp_path, brk):
    # A reviewer sees one line trusting bob; the key comment hides "alice <bob's key>" after a
    # character that is not a line break for OpenSSH. Neither tool may trust bob's key for alice.
    key = ssh_key(tmp_path, "bob", comment="bob")
    msg = b"data\n"
    armored = signing.sshsig_sign(msg, signing.load_private_key(key))
    text = f"bob {pub(key)} bob's laptop{brk}alice {pub(key)}"
    (tmp_path / "ours").write_bytes((text + "\n").encode("utf-8"))
    ours = signing.AllowedSigners.load(tmp_path / "ours")
    for principal, expected in (("alice", False), ("bob", True)):
        theirs = ssh_verify(tmp_path, msg, armored, text, principal).returncode == 0
        assert theirs == expected, f"ssh-keygen changed its mind on {principal}"
        assert ours.is_trusted(principal, pub(key), NS) == theirs, f"{principal} with break {brk!r}"

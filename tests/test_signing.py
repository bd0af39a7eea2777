"""Signing: keys, SSHSIG, the [signature] trailer, allowed signers. Real keys, real files, no mocks.

Interop with the real ssh-keygen is in test_sshkeygen_interop.py.
"""

from __future__ import annotations

import base64
import datetime as dt
import os
import re
import stat
import struct
import warnings
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from capture import manifest, signing
from capture.signing import sshsig
from capture.errors import KeyError_, ManifestError, SignatureError, TrustError, UsageError
from signing_helpers import allowed_file, body, h200_manifest, key, pub_of  # noqa: F401 (fixtures)

UTC = dt.timezone.utc


@pytest.fixture(autouse=True)
def _isolated_home(home):
    """Every test here runs with the isolated HOME of tests/conftest.py."""
    return home


# --------------------------------------------------------------------------- keys


def test_generate_key_writes_private_0600_and_pub(tmp_path):
    path = tmp_path / "k"
    line = signing.generate_key(path, comment="ci@runner")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(Path(f"{path}.pub").stat().st_mode) == 0o644
    assert path.read_bytes().startswith(b"-----BEGIN OPENSSH PRIVATE KEY-----\n")
    assert Path(f"{path}.pub").read_text() == line + "\n"
    key = signing.load_private_key(path)
    assert line == signing.public_key_line(key) + " ci@runner"
    assert line.startswith("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAI")
    assert not list(tmp_path.glob(".*.tmp"))  # no temporary files left behind


def test_generate_key_without_comment(tmp_path):
    line = signing.generate_key(tmp_path / "k")
    assert len(line.split()) == 2


@pytest.mark.parametrize("existing", ["k", "k.pub"])
def test_generate_key_refuses_to_overwrite(tmp_path, existing):
    (tmp_path / existing).write_text("precious\n")
    with pytest.raises(UsageError, match="already exists; refusing to overwrite") as info:
        signing.generate_key(tmp_path / "k")
    assert "capture keygen -o" in info.value.hint
    assert (tmp_path / existing).read_text() == "precious\n"


def test_generate_key_overwrite_replaces_both_halves(tmp_path):
    first = signing.generate_key(tmp_path / "k")
    second = signing.generate_key(tmp_path / "k", overwrite=True)
    assert first != second
    assert signing.public_key_line(signing.load_private_key(tmp_path / "k")) == second


def test_generate_key_bad_places(tmp_path):
    with pytest.raises(UsageError, match="no such folder"):
        signing.generate_key(tmp_path / "missing" / "k")
    with pytest.raises(UsageError, match="is a folder"):
        signing.generate_key(tmp_path)
    with pytest.raises(UsageError, match="control characters"):
        signing.generate_key(tmp_path / "k", comment="a\nb")


def _write(path: Path, data: bytes, mode: int = 0o600) -> Path:
    path.write_bytes(data)
    path.chmod(mode)
    return path


def _bad_key_cases(tmp_path: Path, good: Path) -> dict[str, tuple[Path, str, str]]:
    """name -> (path, message regex, hint regex): one broken key file per error."""
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    ec_key = ec.generate_private_key(ec.SECP256R1())
    ed = Ed25519PrivateKey.generate()
    with warnings.catch_warnings():  # cryptography warns that DSA is deprecated: what users still hold
        warnings.simplefilter("ignore")
        from cryptography.hazmat.primitives.asymmetric import dsa
        dsa_key = dsa.generate_private_key(key_size=1024)
    openssh, pem, pkcs8 = serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.PrivateFormat.PKCS8
    none = serialization.NoEncryption()
    return {
        "missing": (tmp_path / "nope", "no such key file", "capture keygen"),
        "folder": (tmp_path, "is a folder", "--key"),
        "group readable": (_write(tmp_path / "g", good.read_bytes(), 0o640), "permissions 0640 are too open", r"chmod 600 .*/g$"),
        "other readable": (_write(tmp_path / "o", good.read_bytes(), 0o604), "permissions 0604 are too open", "chmod 600"),
        "pub given": (Path(f"{good}.pub"), "is a public key; signing needs the private key", f"pass {good} instead"),
        "empty": (_write(tmp_path / "e", b""), "not an OpenSSH or PEM private key", "capture keygen"),
        "text": (_write(tmp_path / "t", b"hello world\n"), "not an OpenSSH or PEM private key", "capture keygen"),
        "truncated": (_write(tmp_path / "tr", good.read_bytes()[:120]), "cannot load the private key", "capture keygen"),
        "rsa openssh": (_write(tmp_path / "rsa", rsa_key.private_bytes(openssh, pem, none)), "holds an RSA key; capture signs with Ed25519 keys only", "capture keygen"),
        "rsa pem": (_write(tmp_path / "rsa.pem", rsa_key.private_bytes(openssh, pkcs8, none)), "holds an RSA key", "capture keygen"),
        "ecdsa": (_write(tmp_path / "ec", ec_key.private_bytes(openssh, pem, none)), "holds an ECDSA key", "capture keygen"),
        "dsa pem": (_write(tmp_path / "dsa.pem", dsa_key.private_bytes(openssh, pkcs8, none)), "holds a DSA key", "capture keygen"),
        "encrypted pkcs8": (_write(tmp_path / "enc", ed.private_bytes(openssh, pkcs8, serialization.BestAvailableEncryption(b"pw"))),
                            "protected by a passphrase", "without one: `capture keygen"),
    }


CASES = ["missing", "folder", "group readable", "other readable", "pub given", "empty", "text", "truncated",
         "rsa openssh", "rsa pem", "ecdsa", "dsa pem", "encrypted pkcs8"]


@pytest.mark.filterwarnings("error")  # the error is one line: no library warning printed beside it
@pytest.mark.parametrize("case", CASES)
def test_load_private_key_errors(tmp_path, key, case):
    path, message, hint = _bad_key_cases(tmp_path, key)[case]
    with pytest.raises(KeyError_, match=message) as info:
        signing.load_private_key(path)
    assert info.value.exit_code == 2
    assert "\n" not in info.value.message
    assert info.value.hint and re.search(hint, info.value.hint)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file; an unreadable key cannot be made here")
def test_load_private_key_unreadable(tmp_path, key):
    key.chmod(0o000)
    with pytest.raises(KeyError_, match="permission denied"):
        signing.load_private_key(key)


def test_load_pkcs8_pem_ed25519(tmp_path):
    ed = Ed25519PrivateKey.generate()
    path = _write(tmp_path / "k.pem", ed.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                        serialization.NoEncryption()))
    assert signing.public_key_line(signing.load_private_key(path)) == signing.public_key_line(ed)


def test_default_key_path_honours_env(tmp_path, monkeypatch, _isolated_home):
    assert signing.default_key_path() == _isolated_home / ".config" / "capture" / "id_ed25519"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert signing.default_key_path() == tmp_path / "xdg" / "capture" / "id_ed25519"
    monkeypatch.setenv("CAPTURE_KEY", str(tmp_path / "mine"))
    assert signing.default_key_path() == tmp_path / "mine"


def test_ensure_default_key_creates_and_trusts_once(tmp_path, capsys, _isolated_home, body):
    path = signing.ensure_default_key()
    assert path == _isolated_home / ".config" / "capture" / "id_ed25519"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err
    allowed = path.parent / "allowed_signers"
    lines = allowed.read_text().splitlines()
    assert len(lines) == 1 and lines[0].endswith(pub_of(path)) and 'namespaces="capture-manifest"' in lines[0]
    assert signing.ensure_default_key() == path  # second use: nothing new
    assert allowed.read_text().splitlines() == lines
    assert capsys.readouterr().err == ""
    # the default key signs, and the default trust finds it for a manifest anywhere
    target = tmp_path / "somewhere" / "m.toml"
    target.parent.mkdir()
    signing.write_signed(target, body, path)
    found = signing.find_allowed_signers(target)
    if found != allowed:
        pytest.skip(f"an allowed_signers file above the test folder takes precedence: {found}")
    info, _ = signing.verify_signed_bytes(target.read_bytes(), signing.AllowedSigners.load(found), str(target))
    assert info.principal == signing.default_principal(path)


def test_ensure_default_key_appends_to_existing_allowed_signers(_isolated_home, key):
    folder = _isolated_home / ".config" / "capture"
    folder.mkdir(parents=True)
    (folder / "allowed_signers").write_text(f"bob@example.com {pub_of(key)}")  # no final newline
    path = signing.ensure_default_key()
    lines = (folder / "allowed_signers").read_text().splitlines()
    assert lines[0] == f"bob@example.com {pub_of(key)}" and lines[1].endswith(pub_of(path))
    assert len(signing.AllowedSigners.load(folder / "allowed_signers").signers) == 2


def test_ensure_default_key_missing_capture_key(tmp_path, monkeypatch):
    monkeypatch.setenv("CAPTURE_KEY", str(tmp_path / "absent"))
    with pytest.raises(KeyError_, match=r"\$CAPTURE_KEY names .*absent, which does not exist"):
        signing.ensure_default_key()
    assert not (tmp_path / "absent").exists()


def test_default_principal(tmp_path, key):
    assert signing.default_principal(key) == "alice@example.com"
    bare = tmp_path / "bare"
    signing.generate_key(bare)
    principal = signing.default_principal(bare)
    assert "@" in principal and principal == signing.default_principal(tmp_path / "no-such-key")


# --------------------------------------------------------------------------- SSHSIG


def test_sshsig_round_trip_and_format(key):
    k = signing.load_private_key(key)
    armored = signing.sshsig_sign(b"hello\n", k)
    lines = armored.splitlines()
    assert lines[0] == "-----BEGIN SSH SIGNATURE-----" and lines[-1] == "-----END SSH SIGNATURE-----"
    assert all(len(line) <= 70 for line in lines[1:-1]) and len(lines[1]) == 70
    blob = base64.b64decode("".join(lines[1:-1]))
    assert blob.startswith(b"SSHSIG\x00\x00\x00\x01")
    assert b"\x00\x00\x00\x10capture-manifest\x00\x00\x00\x00\x00\x00\x00\x06sha512" in blob
    assert signing.sshsig_verify(b"hello\n", armored) == signing.public_key_line(k)
    assert signing.sshsig_sign(b"hello\n", k) == armored  # Ed25519 is deterministic


def test_sshsig_rejections(key):
    k = signing.load_private_key(key)
    armored = signing.sshsig_sign(b"data", k)
    with pytest.raises(SignatureError, match="changed after signing"):
        signing.sshsig_verify(b"datA", armored)
    with pytest.raises(SignatureError, match="namespace 'capture-manifest', not 'file'"):
        signing.sshsig_verify(b"data", armored, namespace="file")
    with pytest.raises(SignatureError, match="namespace 'git'"):
        signing.sshsig_verify(b"data", signing.sshsig_sign(b"data", k, namespace="git"))
    with pytest.raises(SignatureError, match="not an armored SSH signature"):
        signing.sshsig_verify(b"data", armored.replace("SSH SIGNATURE", "PGP SIGNATURE"))
    with pytest.raises(SignatureError, match="not an armored SSH signature"):
        signing.sshsig_verify(b"data", "")
    with pytest.raises(SignatureError, match="not valid base64"):
        signing.sshsig_verify(b"data", armored.replace("U1NIU0lH", "U1NI*0lH"))


def _reblob(armored: str, edit) -> str:
    lines = armored.splitlines()
    return sshsig._armor(edit(base64.b64decode("".join(lines[1:-1]))))


def test_sshsig_rejects_structural_damage(key):
    k = signing.load_private_key(key)
    armored = signing.sshsig_sign(b"data", k)
    cases = {
        "does not start with SSHSIG": lambda b: b"SSHSIH" + b[6:],
        "unsupported SSHSIG version 2": lambda b: b[:6] + struct.pack(">I", 2) + b[10:],
        "unexpected trailing bytes": lambda b: b + b"\0",
        "truncated": lambda b: b[:-5],
        "accepts only 'sha512'": lambda b: b.replace(b"\x00\x00\x00\x06sha512", b"\x00\x00\x00\x06sha256"),
        "reserved field is not empty": lambda b: b.replace(b"capture-manifest\x00\x00\x00\x00",
                                                           b"capture-manifest\x00\x00\x00\x01x"),
    }
    for message, edit in cases.items():
        with pytest.raises(SignatureError, match=message):
            signing.sshsig_verify(b"data", _reblob(armored, edit))


def test_one_armor_encoding_only(key):
    """Issue 17 finding 12: the block ssh-keygen writes, and no other spelling of the same signature."""
    armored = signing.sshsig_sign(b"data", signing.load_private_key(key))
    signing.sshsig_verify(b"data", armored)
    begin, *b64, end = armored.splitlines()
    one_line = "".join(b64)
    variants = {
        "extra padding": armored.replace(f"\n{end}", f"==\n{end}"),
        "one long line": f"{begin}\n{one_line}\n{end}\n",
        "64 columns": "\n".join([begin, *(one_line[i:i + 64] for i in range(0, len(one_line), 64)), end]) + "\n",
        "CRLF": armored.replace("\n", "\r\n"),
        "trailing space": armored.replace(f"\n{end}", f" \n{end}"),
        "no final newline": armored.rstrip("\n"),
        "text after END": armored + "more\n",
        "blank line before BEGIN": "\n" + armored,
        "blank line inside": armored.replace(f"\n{end}", f"\n\n{end}"),
    }
    for name, text in variants.items():
        with pytest.raises(SignatureError):
            signing.sshsig_verify(b"data", text)
            pytest.fail(f"accepted: {name}")


def test_fingerprint_format(key):
    fp = signing.fingerprint(pub_of(key))
    assert fp.startswith("SHA256:") and len(fp) == 7 + 43 and not fp.endswith("=")


# --------------------------------------------------------------------------- signed manifests


def test_sign_verify_round_trip(tmp_path, key, body):
    signed = signing.sign_bytes(body, key, "alice@example.com")
    allowed = signing.AllowedSigners.load(allowed_file(tmp_path, f"alice@example.com {pub_of(key)}"))
    info, got_body = signing.verify_signed_bytes(signed, allowed, "m.toml")
    assert got_body + signed[len(got_body):] == signed and signed[len(got_body):].startswith(b"[signature]\n")
    assert manifest.parse_body(got_body) == manifest.parse_body(body)
    assert info == signing.SignatureInfo("alice@example.com", pub_of(key), signing.fingerprint(pub_of(key)),
                                         "capture-manifest", str(tmp_path / "allowed_signers"))


def test_trailer_is_toml_and_signature_round_trips_exactly(key, body):
    k = signing.load_private_key(key)
    signed = signing.sign_bytes(body, key)
    b, trailer = manifest.split_signed(signed)
    fields = manifest.parse_trailer(trailer)
    assert fields == {"format": "sshsig", "namespace": "capture-manifest", "principal": "alice@example.com",
                      "public_key": signing.public_key_line(k), "signature": signing.sshsig_sign(b, k)}
    # The whole file is valid TOML too (body + [signature] table).
    import tomllib
    assert tomllib.loads(signed.decode())["signature"]["format"] == "sshsig"


def test_principal_needs_escaping_round_trips(tmp_path, key, body):
    principal = "Zoë \\ O'Neil@lab"
    signed = signing.sign_bytes(body, key, principal)
    allowed = signing.AllowedSigners.load(allowed_file(tmp_path, f'"{principal}" {pub_of(key)}'))
    info, _ = signing.verify_signed_bytes(signed, allowed, "m")
    assert info.principal == principal


@pytest.mark.parametrize("principal", ["", "a,b", 'a"b', "a\nb", "tab\tin"])
def test_bad_principal_refused(key, body, principal):
    with pytest.raises(UsageError, match="principal"):
        signing.sign_bytes(body, key, principal)


def test_no_private_material_in_output(key, body):
    k = signing.load_private_key(key)
    seed = k.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())
    signed = signing.sign_bytes(body, key)
    for form in (seed, seed.hex().encode(), base64.b64encode(seed)[:40], key.read_bytes().splitlines()[2]):
        assert form not in signed


def test_sign_replaces_existing_trailer(tmp_path, key, body):
    other = tmp_path / "other"
    signing.generate_key(other, comment="bob@example.com")
    once = signing.sign_bytes(body, key)
    twice = signing.sign_bytes(once, other)
    assert twice.count(b"[signature]") == 1
    assert manifest.split_signed(twice)[0] == manifest.split_signed(once)[0]
    allowed = signing.AllowedSigners.load(allowed_file(tmp_path, f"bob@example.com {pub_of(other)}"))
    assert signing.verify_signed_bytes(twice, allowed, "m")[0].principal == "bob@example.com"
    assert signing.sign_bytes(twice, other) == twice  # idempotent


def test_body_without_final_newline_gets_one(tmp_path, key, body):
    signed = signing.sign_bytes(body.rstrip(b"\n"), key)
    b, _ = manifest.split_signed(signed)
    assert b == body + b"\n"  # newline, then a blank line before [signature]
    allowed = signing.AllowedSigners.load(allowed_file(tmp_path, f"* {pub_of(key)}"))
    signing.verify_signed_bytes(signed, allowed, "m")


def test_sign_file_atomic_keeps_mode_and_verifies(tmp_path, key, body):
    path = tmp_path / "m.toml"
    path.write_bytes(body)
    path.chmod(0o644)
    signing.sign_file(path, key)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert not list(tmp_path.glob(".m.toml.*"))
    allowed = signing.AllowedSigners.load(allowed_file(tmp_path, f"alice@example.com {pub_of(key)}"))
    signing.verify_signed_bytes(path.read_bytes(), allowed, str(path))


@pytest.mark.parametrize("content,error,match", [
    (b"just some text\n", ManifestError, "not valid TOML"),
    (b"a = 1\n", ManifestError, "no schema_version"),
    (b"\xff\xfe garbage", ManifestError, "not UTF-8"),
    (b"", ManifestError, "file is empty"),
])
def test_sign_file_refuses_garbage(tmp_path, key, content, error, match):
    path = tmp_path / "m.toml"
    path.write_bytes(content)
    with pytest.raises(error, match=match):
        signing.sign_file(path, key)
    assert path.read_bytes() == content


def test_sign_refuses_content_after_trailer(tmp_path, key, body):
    path = tmp_path / "m.toml"
    original = signing.sign_bytes(body, key) + b"\n[extra]\nx = 1\n"
    path.write_bytes(original)
    with pytest.raises(ManifestError, match="content follows the \\[signature\\] table"):
        signing.sign_file(path, key)
    assert path.read_bytes() == original


def test_sign_with_bad_key_leaves_file_alone(tmp_path, body):
    path = tmp_path / "m.toml"
    path.write_bytes(body)
    with pytest.raises(KeyError_):
        signing.sign_file(path, tmp_path / "no-key")
    assert path.read_bytes() == body


def test_write_signed(tmp_path, key, body):
    path = tmp_path / "out.toml"
    data = signing.write_signed(path, body, key, "ci@lab")
    assert path.read_bytes() == data
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask  # shareable, unlike the private key
    path.chmod(0o640)
    signing.write_signed(path, body, key, "ci@lab")
    assert stat.S_IMODE(path.stat().st_mode) == 0o640  # an existing file keeps its mode
    assert manifest.split_signed(data)[0].startswith(body)


# --------------------------------------------------------------------------- tampering


@pytest.fixture
def signed_and_allowed(tmp_path, key, body):
    signed = signing.sign_bytes(body, key, "alice@example.com")
    allowed = signing.AllowedSigners.load(allowed_file(tmp_path, f"alice@example.com {pub_of(key)}"))
    signing.verify_signed_bytes(signed, allowed, "m")  # the untampered file verifies
    return signed, allowed


@pytest.mark.parametrize("mask", [0x01, 0x20, 0x80])
def test_every_byte_flip_is_rejected(signed_and_allowed, mask):
    signed, allowed = signed_and_allowed
    accepted = []
    for i in range(len(signed)):
        tampered = bytearray(signed)
        tampered[i] ^= mask
        try:
            signing.verify_signed_bytes(bytes(tampered), allowed, "m")
        except SignatureError:
            continue
        accepted.append(i)
    assert accepted == [], f"flips at {accepted[:5]} were accepted"


def test_flip_errors_are_signature_errors_in_body(signed_and_allowed):
    signed, allowed = signed_and_allowed
    body_len = len(manifest.split_signed(signed)[0])
    for i in range(body_len):
        tampered = bytearray(signed)
        tampered[i] ^= 0x01
        with pytest.raises(SignatureError):
            signing.verify_signed_bytes(bytes(tampered), allowed, "m")


@pytest.mark.parametrize("suffix,match", [
    (b"[models]\nrepo_id = \"evil\"\n", "content was added after"),
    (b"[[models]]\nrepo_id = \"evil\"\n", "content was added after"),
    (b"extra = 1\n", "unexpected key 'extra'"),
    (b"# a harmless-looking comment\n", "was altered"),
    (b"\n", "was altered"),
])
def test_appended_content_is_rejected(signed_and_allowed, suffix, match):
    signed, allowed = signed_and_allowed
    with pytest.raises(SignatureError, match=match):
        signing.verify_signed_bytes(signed + suffix, allowed, "m")


def test_inserted_line_before_trailer_is_rejected(signed_and_allowed):
    signed, allowed = signed_and_allowed
    tampered = signed.replace(b"\n[signature]", b"\nnote = 1\n[signature]")
    with pytest.raises(SignatureError, match="changed after signing"):
        signing.verify_signed_bytes(tampered, allowed, "m")


def test_trailer_field_swaps_are_rejected(tmp_path, signed_and_allowed):
    signed, allowed = signed_and_allowed
    other = Ed25519PrivateKey.generate()
    with pytest.raises(SignatureError, match="public_key in \\[signature\\] is not the key"):
        signing.verify_signed_bytes(
            signed.replace(pub_of_signed(signed).encode(), signing.public_key_line(other).encode()), allowed, "m")
    with pytest.raises(SignatureError, match="format 'minisign'"):
        signing.verify_signed_bytes(signed.replace(b'format = "sshsig"', b'format = "minisign"'), allowed, "m")
    with pytest.raises(SignatureError, match="namespace 'file'"):
        signing.verify_signed_bytes(signed.replace(b'namespace = "capture-manifest"', b'namespace = "file"'), allowed, "m")
    with pytest.raises(TrustError, match="not for principal 'mallory@example.com'"):
        signing.verify_signed_bytes(signed.replace(b"alice@example.com", b"mallory@example.com"), allowed, "m")


def pub_of_signed(signed: bytes) -> str:
    return manifest.parse_trailer(manifest.split_signed(signed)[1])["public_key"]


def test_not_signed(body):
    with pytest.raises(SignatureError, match="not signed") as info:
        signing.verify_signed_bytes(body, signing.AllowedSigners.empty(), "m.toml")
    assert info.value.hint == "sign it: capture sign m.toml --key KEY"
    assert info.value.exit_code == 4


def test_signature_made_over_other_body(tmp_path, key, body, signed_and_allowed):
    signed, allowed = signed_and_allowed
    other_body = manifest.dumps({**h200_manifest(), "kind": "trial"})
    transplanted = other_body + b"\n" + manifest.split_signed(signed)[1]
    with pytest.raises(SignatureError, match="changed after signing"):
        signing.verify_signed_bytes(transplanted, allowed, "m")

"""Signing, the trust half: allowed-signers files as OpenSSH reads them (patterns, namespaces, validity,
cert-authority, malformed lines) and the verdicts they give. Real keys, real files, no mocks.

The lookup order and every attack on it: tests/test_trust_root.py; the same semantics against the real
ssh-keygen: tests/test_trust_differential.py.
"""

from __future__ import annotations

import base64
import datetime as dt
import re
import struct

import pytest

from capture import signing
from capture.errors import TrustError, UsageError
from signing_helpers import allowed_file, body, key, pub_of  # noqa: F401 (fixtures)

UTC = dt.timezone.utc


@pytest.fixture(autouse=True)
def _isolated_home(home):
    """Every test here runs with the isolated HOME of tests/conftest.py."""
    return home


# --------------------------------------------------------------------------- trust


def test_trust_needs_allowed_signers(key, body):
    signed = signing.sign_bytes(body, key)
    with pytest.raises(TrustError, match="no allowed-signers file was found") as info:
        signing.verify_signed_bytes(signed, None, "m")
    assert "--allowed-signers" in info.value.hint and info.value.exit_code == 4


@pytest.mark.parametrize("content", ["", "# only a comment\n\n   \n"])
def test_empty_allowed_signers_trusts_nobody(tmp_path, key, body, content):
    path = tmp_path / "allowed_signers"
    path.write_text(content)
    allowed = signing.AllowedSigners.load(path)
    assert allowed.signers == ()
    with pytest.raises(TrustError, match="lists no signers"):
        signing.verify_signed_bytes(signing.sign_bytes(body, key), allowed, "m")
    with pytest.raises(TrustError, match="lists no signers"):
        signing.verify_signed_bytes(signing.sign_bytes(body, key), signing.AllowedSigners.empty(), "m")


def test_untrusted_key_names_principal_and_fingerprint(tmp_path, key, body):
    stranger = tmp_path / "stranger"
    signing.generate_key(stranger)
    allowed = signing.AllowedSigners.load(allowed_file(tmp_path, f"alice@example.com {pub_of(key)}"))
    signed = signing.sign_bytes(body, stranger, "alice@example.com")
    fp = signing.fingerprint(pub_of(stranger))
    with pytest.raises(TrustError, match=re.escape(f"signer alice@example.com ({fp}) is not trusted: key {fp} is not listed")) as info:
        signing.verify_signed_bytes(signed, allowed, "m")
    assert pub_of(stranger) in info.value.hint


def test_missing_allowed_signers_file_is_usage_error(tmp_path):
    with pytest.raises(UsageError, match="no such allowed-signers file"):
        signing.AllowedSigners.load(tmp_path / "absent")
    with pytest.raises(UsageError, match="is a folder"):
        signing.AllowedSigners.load(tmp_path)


@pytest.mark.parametrize("patterns,principal,trusted", [
    ("alice@example.com", "alice@example.com", True),
    ("alice@example.com", "Alice@example.com", False),  # case-sensitive, as ssh-keygen
    ("*@example.com", "alice@example.com", True),
    ("*@example.com", "alice@example.org", False),
    ("alice@example.???", "alice@example.com", True),
    ("alice@example.???", "alice@example.co", False),
    ("bob@x,alice@example.com", "alice@example.com", True),
    ("!mallory@*,*@example.com", "alice@example.com", True),
    ("!mallory@*,*@example.com", "mallory@example.com", False),
    ("*@example.com,!mallory@*", "mallory@example.com", False),  # a negative match vetoes wherever it is
    ("!bob@example.com", "alice@example.com", False),  # negation alone never trusts
    ("[ab]lice", "alice", False),  # no character classes in ssh patterns
    ("[ab]lice", "[ab]lice", True),
])
def test_principal_patterns(tmp_path, key, patterns, principal, trusted):
    allowed = signing.AllowedSigners.load(allowed_file(tmp_path, f'"{patterns}" {pub_of(key)}'))
    assert allowed.is_trusted(principal, pub_of(key), "capture-manifest") is trusted


@pytest.mark.parametrize("namespaces,trusted", [
    ("capture-manifest", True), ("capture-*", True), ("git,capture-manifest", True), ("git", False),
    ("!capture-manifest,*", False), ("file,!git", False),
])
def test_namespaces_option(tmp_path, key, namespaces, trusted):
    allowed = signing.AllowedSigners.load(allowed_file(tmp_path, f'alice@example.com namespaces="{namespaces}" {pub_of(key)}'))
    assert allowed.signers[0].namespaces == namespaces
    assert allowed.is_trusted("alice@example.com", pub_of(key), "capture-manifest") is trusted


def test_namespace_reason_in_error(tmp_path, key, body):
    allowed = signing.AllowedSigners.load(allowed_file(tmp_path, f'alice@example.com namespaces="git" {pub_of(key)}'))
    with pytest.raises(TrustError, match="allows the key only for namespaces 'git'"):
        signing.verify_signed_bytes(signing.sign_bytes(body, key), allowed, "m")


def test_valid_after_and_before(tmp_path, key):
    line = f'alice@example.com valid-after="20250101Z",valid-before="202512311200Z" {pub_of(key)}'
    allowed = signing.AllowedSigners.load(allowed_file(tmp_path, line))
    s = allowed.signers[0]
    assert s.valid_after_epoch_s == int(dt.datetime(2025, 1, 1, tzinfo=UTC).timestamp())
    assert s.valid_before_epoch_s == int(dt.datetime(2025, 12, 31, 12, tzinfo=UTC).timestamp())

    def trusted(when: dt.datetime) -> bool:
        return allowed.is_trusted("alice@example.com", pub_of(key), "capture-manifest", now=when)

    assert not trusted(dt.datetime(2024, 12, 31, 23, 59, 59, tzinfo=UTC))
    assert trusted(dt.datetime(2025, 1, 1, tzinfo=UTC))  # "at or after"
    assert trusted(dt.datetime(2025, 12, 31, 12, tzinfo=UTC))  # "at or before"
    assert not trusted(dt.datetime(2025, 12, 31, 12, 0, 1, tzinfo=UTC))
    assert trusted(dt.datetime(2025, 6, 1, tzinfo=UTC).timestamp())  # epoch seconds work too
    assert "expired" in allowed.explain("alice@example.com", pub_of(key), now=dt.datetime(2026, 1, 1, tzinfo=UTC))
    assert "not valid yet" in allowed.explain("alice@example.com", pub_of(key), now=dt.datetime(2020, 1, 1, tzinfo=UTC))


def test_local_time_without_z(tmp_path, key, monkeypatch):
    line = f'alice@example.com valid-after="20250101120000" {pub_of(key)}'
    after = signing.AllowedSigners.load(allowed_file(tmp_path, line)).signers[0].valid_after_epoch_s
    assert after == int(dt.datetime(2025, 1, 1, 12).timestamp())  # naive = local time


def test_cert_authority_line_does_not_trust_a_plain_key(tmp_path, key):
    allowed = signing.AllowedSigners.load(allowed_file(tmp_path, f"*@example.com cert-authority {pub_of(key)}"))
    assert allowed.signers[0].cert_authority
    assert not allowed.is_trusted("alice@example.com", pub_of(key))
    assert "cert-authority" in allowed.explain("alice@example.com", pub_of(key))


def test_allowed_signers_file_format(tmp_path, key):
    other = tmp_path / "other"
    signing.generate_key(other)
    path = allowed_file(
        tmp_path,
        "# team keys",
        "",
        f"   bob@example.com\t{pub_of(other)} bob's laptop",
        f'"alice@example.com,carol@example.com" NAMESPACES="capture-manifest",Valid-After="20200101" {pub_of(key)} a comment',
        "ci@example.com ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQC7 ci",
        "   # indented comment",
    )
    allowed = signing.AllowedSigners.load(path)
    assert [s.principals for s in allowed.signers] == ["bob@example.com", "alice@example.com,carol@example.com"]
    assert allowed.skipped == (f"{path}:5: ssh-rsa key (capture trusts only Ed25519 keys)",)
    assert allowed.signers[1].source == f"{path}:4"
    assert allowed.signers[1].options == 'NAMESPACES="capture-manifest",Valid-After="20200101"'
    assert allowed.is_trusted("carol@example.com", pub_of(key))
    assert allowed.is_trusted("bob@example.com", pub_of(other))
    assert not allowed.is_trusted("bob@example.com", pub_of(key))
    assert "not for principal 'bob@example.com'" in allowed.explain("bob@example.com", pub_of(key))


@pytest.mark.parametrize("line,match", [
    ("alice@example.com", "missing key"),
    ("alice@example.com namespaces=\"x\"", "missing key"),
    ("alice@example.com namespaces=capture-manifest {k}", "namespaces: missing quote"),
    ("alice@example.com nope {k}", "unknown key option"),
    ("alice@example.com namespaces=\"a\",namespaces=\"b\" {k}", 'multiple "namespaces" clauses'),
    ("alice@example.com namespaces=\"a\", {k}", "unexpected end-of-options"),
    ("alice@example.com namespaces=\"a {k}", "unmatched quote"),
    ("alice@example.com valid-after=\"2025\" {k}", "invalid \"valid-after\" time '2025'"),
    ("alice@example.com valid-before=\"20251301\" {k}", "invalid \"valid-before\" time"),
    ("\"alice@example.com {k}", "unmatched quote in the principals"),
    ("alice@example.com ssh-ed25519 not*base64", "invalid ssh-ed25519 key"),
    ("alice@example.com ssh-rsa AAAAC3NzaC1lZDI1NTE5AAAAIFBjQQghzQTn6Y+n5efDgb9rFP2jYU/VQ9PZkghQFSDl", "only Ed25519"),
    ("alice@example.com ssh-ed25519", "invalid key"),
])
def test_malformed_allowed_signers_line_is_skipped(tmp_path, key, line, match):
    """As ssh-keygen does, a line that does not parse is skipped and the rest of the file still counts."""
    path = allowed_file(tmp_path, "# fine", line.format(k=pub_of(key)), f"alice@example.com {pub_of(key)}")
    allowed = signing.AllowedSigners.load(path)
    assert len(allowed.skipped) == 1 and allowed.skipped[0].startswith(f"{path}:2: ")
    assert re.search(match, allowed.skipped[0]), allowed.skipped[0]
    assert allowed.is_trusted("alice@example.com", pub_of(key))
    assert [s.source for s in allowed.signers] == [f"{path}:3"]


def test_match_pattern_list():
    m = signing.match_pattern_list
    assert m("a.b", "a.b") and not m("axb", "a.b")  # '.' is literal
    assert m("", "*") and not m("", "?")
    assert m("host3", "!host1,!host2,*") and not m("host3", "!host1,!host2")


# --------------------------------------------------------------------------- finding allowed signers
# The lookup order and every attack on it: tests/test_trust_root.py.


# --------------------------------------------------------------------------- OpenSSH semantics without ssh-keygen
# (tests/test_trust_differential.py checks these and many more against the real ssh-keygen)


@pytest.mark.parametrize("text,expected", [
    ("20250101Z", 1735689600), ("20250101z", 1735689600), ("20250101UTC", 1735689600),
    ("202501011230Z", 1735734600), ("20250101123059Z", 1735734659),
    ("2025 101Z", 1735689600),  # glibc strptime: a short field padded with a space
    ("20250230Z", 1740873600),  # rolls over to 2 March, as timegm does
    ("19700101Z", 0),  # parsed, but 0 means "not set": valid-after/valid-before refuse it
    ("19700101000001Z", 1), ("19691231235959Z", None), ("20251301Z", None), ("2025010Z", None),
    ("20250101236000Z", None), ("20250101+0000", None), ("", None), ("Z", None),
])
def test_parse_absolute_time(text, expected):
    assert signing.trust.parse_absolute_time(text) == expected


def test_patterns_work_on_bytes_with_openssh_limits():
    m = signing.match_pattern_list
    assert m("é", "??") and not m("é", "?")  # é is two bytes in UTF-8
    assert m("a" * 1030, "a" * 1021 + "*") and not m("a" * 1030, "a" * 1022 + "*")  # 1,023 bytes: char sub[1024]
    assert not m("alice", "*," + "a" * 1023)  # a too-long subpattern fails the whole list
    assert m("x" * 3000 + "y", "*x*x*x*y") and not m("x" * 3000, "*x*x*x*y")


def test_a_key_is_compared_as_a_key(tmp_path, key):
    raw = base64.b64decode(pub_of(key).split()[1])[-32:]
    short = base64.b64encode(struct.pack(">I", 7) + b"ED25519" + struct.pack(">I", 32) + raw).decode()
    allowed = signing.AllowedSigners.load(allowed_file(tmp_path, f"alice@example.com ssh-ed25519 {short}"))
    assert allowed.is_trusted("alice@example.com", pub_of(key))  # as sshkey_read reads it
    assert allowed.signers[0].public_key == pub_of(key)


def test_unicode_space_is_not_a_separator(tmp_path, key):
    allowed = signing.AllowedSigners.load(allowed_file(tmp_path, f"alice@example.com\u00a0{pub_of(key)}"))
    assert allowed.signers == () and not allowed.is_trusted("alice@example.com", pub_of(key))
    assert "1 line(s) skipped" in allowed.explain("alice@example.com", pub_of(key))

"""`capture export --format in-toto`: verified with securesystemslib's DSSE implementation."""

from __future__ import annotations

import base64
import hashlib
import json

import pytest

from capture._cli import main
from capture.errors import SignatureError
from capture.results import intoto
from test_results_helpers import h200_manifest, keys  # noqa: F401

dsse = pytest.importorskip("securesystemslib.dsse", reason="securesystemslib is a dev dependency")
from securesystemslib.signer import SSlibKey  # noqa: E402


@pytest.fixture
def exported(tmp_path, keys, capsys):
    src = tmp_path / "run.toml"
    raw = keys["alice"].write(src, h200_manifest())
    out = tmp_path / "run.intoto.json"
    assert main(["export", str(src), "--format", "in-toto", "--key", str(keys["alice"].key), "-o", str(out)]) == 0
    pem = tmp_path / "alice.pem"
    assert main(["export", "--format", "pubkey-pem", "--key", str(keys["alice"].key) + ".pub", "-o", str(pem)]) == 0
    capsys.readouterr()
    return raw, out, pem


def _sslib_key(pem: bytes) -> SSlibKey:
    from cryptography.hazmat.primitives.serialization import load_pem_public_key
    return SSlibKey.from_crypto(load_pem_public_key(pem))


def test_envelope_verifies_with_securesystemslib(exported, keys):
    raw, out, pem = exported
    env = dsse.Envelope.from_dict(json.loads(out.read_text()))
    # securesystemslib's standard path, as capture/results/intoto.py documents it: no keyid to set
    key = _sslib_key(pem.read_bytes())
    verified = env.verify([key], threshold=1)
    assert list(verified) == [key.keyid] == [env.signatures[key.keyid].keyid]
    assert key.keyid == intoto.keyid(intoto.load_public_key(keys["alice"].key))
    stmt = json.loads(env.payload)
    assert stmt["_type"] == "https://in-toto.io/Statement/v1"
    assert stmt["predicateType"] == intoto.PREDICATE_TYPE
    assert stmt["subject"] == [{"name": "run.toml", "digest": {"sha256": hashlib.sha256(raw).hexdigest()}}]
    assert stmt["predicate"]["accelerator"]["model"] == "NVIDIA H200"
    assert stmt["predicate"]["trial"]["stats"]["tokens_per_s"] == pytest.approx(64113.23398891535)
    assert stmt["predicate"]["signature"]["principal"] == "alice@lab"
    assert env.payload_type == "application/vnd.in-toto+json"


def test_tampered_envelope_fails_in_securesystemslib(exported, keys):
    raw, out, pem = exported
    doc = json.loads(out.read_text())
    stmt = json.loads(base64.b64decode(doc["payload"]))
    stmt["predicate"]["trial"]["stats"]["tokens_per_s"] = 1e9
    doc["payload"] = base64.b64encode(json.dumps(stmt).encode()).decode()
    key = _sslib_key(pem.read_bytes())
    from securesystemslib.exceptions import VerificationError
    with pytest.raises(VerificationError):
        dsse.Envelope.from_dict(doc).verify([key], threshold=1)
    with pytest.raises(SignatureError):
        intoto.verify_envelope(doc, intoto.load_public_key(keys["alice"].key))


@pytest.mark.parametrize("doc, reason", [
    ('{"payload": ' + "9" * 5000 + "}", "not a DSSE envelope (not JSON: an integer of more than 4,300 digits)"),
    ("[" * 100_000 + "]" * 100_000, "not a DSSE envelope (not JSON: arrays or objects nested too deeply to read)"),
    (b"{\"payload\": \"\xff\"}", "not a DSSE envelope (not JSON: not UTF-8 text)"),
    ('{"payload": "x"', "not a DSSE envelope (not JSON: Expecting ',' delimiter at line 1, column 16)"),
])
def test_a_hostile_envelope_is_one_line(keys, doc, reason):
    with pytest.raises(SignatureError) as info:
        intoto.verify_envelope(doc, intoto.load_public_key(keys["alice"].key))
    assert info.value.message == reason


def test_documented_example_runs(exported):
    """The verification example in capture/results/intoto.py's docstring, run as written."""
    import os
    import re
    import textwrap

    raw, out, pem = exported
    doc = intoto.__doc__ or ""
    example = textwrap.dedent(doc.split("::", 1)[1].split("\n\n  The manifest", 1)[0]).strip("\n")
    example = re.sub(r"  # .*", "", example)
    cwd = os.getcwd()
    os.chdir(out.parent)
    try:
        (out.parent / "key.pem").write_bytes(pem.read_bytes())
        scope: dict = {"json": json}
        exec(compile(example, "intoto-example", "exec"), scope)  # noqa: S102 - our own documentation
    finally:
        os.chdir(cwd)
    assert scope["envelope"].verify([scope["key"]], threshold=1)


def test_pae_matches_the_dsse_spec_example():
    # DSSE protocol.md: PAE("http://example.com/HelloWorld", "hello world")
    assert intoto.pae("http://example.com/HelloWorld", b"hello world") == \
        b"DSSEv1 29 http://example.com/HelloWorld 11 hello world"


def test_pem_of_private_and_public_key_agree(keys):
    assert intoto.public_key_pem(keys["alice"].key) == intoto.public_key_pem(str(keys["alice"].key) + ".pub")
    assert intoto.public_key_pem(keys["alice"].key).startswith(b"-----BEGIN PUBLIC KEY-----")


def test_tampered_manifest_is_not_exported(tmp_path, keys, capsys):
    src = tmp_path / "run.toml"
    raw = keys["alice"].write(src, h200_manifest())
    src.write_bytes(raw.replace(b"580.159.04", b"580.159.05", 1))
    out = tmp_path / "x.json"
    assert main(["export", str(src), "--format", "in-toto", "--key", str(keys["alice"].key), "-o", str(out)]) == 4
    assert not out.exists()
    assert "Traceback" not in capsys.readouterr().err


def test_usage_errors(tmp_path, keys, capsys):
    assert main(["export", "--format", "in-toto", "--key", str(keys["alice"].key)]) == 2
    assert main(["export", str(tmp_path / "x.toml"), "--format", "pubkey-pem", "--key", str(keys["alice"].key)]) == 2
    assert main(["export", str(tmp_path / "x.toml"), "--format", "in-toto", "--key", str(tmp_path / "nokey")]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 3 and "Traceback" not in err

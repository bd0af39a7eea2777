"""`capture export --format in-toto`: a manifest as an in-toto Statement v1 in a DSSE envelope.

So that supply-chain tools (in-toto, securesystemslib, ``cosign verify-blob-attestation``) can
consume a result without knowing our TOML trailer:

- Statement: ``_type`` https://in-toto.io/Statement/v1; one subject, the manifest file (its name
  and the sha256 of its exact bytes); ``predicateType`` :data:`PREDICATE_TYPE`; ``predicate``
  the manifest's content as JSON (the body's tables, plus the ``signature`` table when signed).
- Envelope (DSSE v1): ``payloadType`` application/vnd.in-toto+json, ``payload`` base64 of the
  statement's JSON bytes, one signature: Ed25519 over ``PAE(payloadType, payload)`` with the same
  key that signs manifests.
- ``keyid`` (:func:`keyid`): the key's default keyid as securesystemslib computes it, the sha256 (hex)
  of the canonical JSON ``{"keytype":"ed25519","keyval":{"public":"<hex of the 32-byte key>"},
  "scheme":"ed25519"}``, so the standard path finds the key with no keyid of its own to set::

      from cryptography.hazmat.primitives.serialization import load_pem_public_key
      from securesystemslib.dsse import Envelope
      from securesystemslib.signer import SSlibKey

      key = SSlibKey.from_crypto(load_pem_public_key(open("key.pem", "rb").read()))
      envelope = Envelope.from_dict(json.load(open("run.intoto.json")))
      envelope.verify([key], threshold=1)  # {keyid: key}; raises VerificationError otherwise

  The manifest's own SSH identity (its fingerprint ``SHA256:...``) stays in the predicate's
  ``signature`` table. (Envelopes exported before this keyid carried the SSH fingerprint.)

Verifiers need the public key as PEM (SubjectPublicKeyInfo): ``--format pubkey-pem``.
"""

from __future__ import annotations

import base64
import datetime as _dt
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from capture import _json
from capture._safe_read import KEY_MAX_BYTES, read_regular
from capture.errors import KeyError_, SignatureError
from capture.signing import AllowedSigners
from capture.verify.open import OpenedManifest, open_manifest

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PAYLOAD_TYPE = "application/vnd.in-toto+json"
PREDICATE_TYPE = "https://capture.dev/manifest/v1"
"""Identifies the predicate as a capture manifest, schema version 1 (an identifier, not a URL to fetch)."""


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE v1 Pre-Authentication Encoding: ``"DSSEv1" SP LEN(type) SP type SP LEN(body) SP body``."""
    t = payload_type.encode("utf-8")
    return b"DSSEv1 %d %s %d %s" % (len(t), t, len(payload), payload)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, (_dt.datetime, _dt.date, _dt.time)):
        return value.isoformat()
    return value


def statement(opened: OpenedManifest, name: str) -> dict[str, Any]:
    """The in-toto Statement for a manifest opened through the door, stored under file name ``name``.

    A signed manifest must carry a valid signature (its signer need not be trusted here: the
    envelope's own signature says who attests); a tampered one, or one whose body holds a
    disguised ``signature`` table, never gets this far (exit 4 / exit 3).
    """
    if opened.signature.state == "invalid":
        raise opened.error()
    predicate = _jsonable(opened.data)
    if opened.trailer is not None:
        predicate["signature"] = dict(opened.trailer)
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": name, "digest": {"sha256": hashlib.sha256(opened.raw).hexdigest()}}],
        "predicateType": PREDICATE_TYPE,
        "predicate": predicate,
    }


def _public(key: Ed25519PrivateKey | Ed25519PublicKey) -> Ed25519PublicKey:
    return key.public_key() if isinstance(key, Ed25519PrivateKey) else key


def keyid(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    """securesystemslib's default keyid of an Ed25519 key (``SSlibKey.from_crypto`` computes the same)."""
    raw = _public(key).public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    canonical = json.dumps({"keytype": "ed25519", "scheme": "ed25519", "keyval": {"public": raw.hex()}},
                           sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()


def envelope(payload: bytes, key: Ed25519PrivateKey, payload_type: str = PAYLOAD_TYPE) -> dict[str, Any]:
    return {
        "payloadType": payload_type,
        "payload": base64.b64encode(payload).decode("ascii"),
        "signatures": [{"keyid": keyid(key), "sig": base64.b64encode(key.sign(pae(payload_type, payload))).decode("ascii")}],
    }


def export_intoto(path: str | os.PathLike[str], key_path: str | os.PathLike[str]) -> bytes:
    """The DSSE envelope (JSON bytes, newline-terminated) attesting the manifest at ``path``."""
    from capture.signing import load_private_key

    key = load_private_key(key_path)
    # Trust is not asked for (an empty list: no search); the signature must still be valid.
    opened = open_manifest(path, AllowedSigners.empty(), require_trusted=False)
    stmt = statement(opened, Path(path).name)
    payload = json.dumps(stmt, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return (json.dumps(envelope(payload, key), indent=2) + "\n").encode("utf-8")


def load_public_key(key_path: str | os.PathLike[str]) -> Ed25519PublicKey:
    """An Ed25519 public key from a private key file or its ``.pub`` (``ssh-ed25519 AAAA...``)."""
    from capture.signing import load_private_key

    p = Path(key_path)
    try:
        first_line = read_regular(p, KEY_MAX_BYTES, KeyError_, "key file").split(b"\n", 1)[0].strip()
    except OSError:
        first_line = b""  # load_private_key below names the problem
    if first_line.startswith(b"ssh-"):
        try:
            key = serialization.load_ssh_public_key(first_line)
        except (ValueError, UnsupportedAlgorithm):
            raise KeyError_(f"{p}: not a valid public key line", "use the KEY.pub written by `capture keygen`") from None
        if not isinstance(key, Ed25519PublicKey):
            raise KeyError_(f"{p}: not an Ed25519 key", "make one with `capture keygen`")
        return key
    return load_private_key(p).public_key()


def public_key_pem(key_path: str | os.PathLike[str]) -> bytes:
    """The public half in PEM (SubjectPublicKeyInfo), as cosign and securesystemslib read it."""
    return load_public_key(key_path).public_bytes(serialization.Encoding.PEM,
                                                  serialization.PublicFormat.SubjectPublicKeyInfo)


def verify_envelope(doc: bytes | str | dict[str, Any], key: Ed25519PublicKey) -> dict[str, Any]:
    """Check a DSSE envelope made by :func:`export_intoto`; returns the Statement."""
    try:
        env = _json.loads(doc) if isinstance(doc, (bytes, str)) else doc
        payload = base64.b64decode(env["payload"], validate=True)
        sigs = [base64.b64decode(s["sig"], validate=True) for s in env["signatures"]]
        payload_type = env["payloadType"]
    except _json.JsonError as exc:
        raise SignatureError(f"not a DSSE envelope (not JSON: {exc.reason})", "export it again with `capture export`") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise SignatureError(f"not a DSSE envelope ({type(exc).__name__}: {exc})", "export it again with `capture export`") from None
    for sig in sigs:
        try:
            key.verify(sig, pae(payload_type, payload))
        except InvalidSignature:
            continue
        return json.loads(payload)
    raise SignatureError("no envelope signature verifies with this key", "check that the key is the one that exported it")

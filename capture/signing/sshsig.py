"""SSHSIG (OpenSSH ``PROTOCOL.sshsig``) over Ed25519: the wire format, signing and verifying bytes.

No files and no TOML here: this module turns bytes and a key into an armored signature and back.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import struct

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from capture.errors import SignatureError, UsageError


NAMESPACE = "capture-manifest"
HASH_ALG = "sha512"
FORMAT = "sshsig"

_MAGIC = b"SSHSIG"
_SIG_VERSION = 1
_ARMOR_BEGIN = "-----BEGIN SSH SIGNATURE-----"
_ARMOR_END = "-----END SSH SIGNATURE-----"
_ARMOR_WIDTH = 70  # ssh-keygen wraps the base64 at 70 columns
_ED25519 = "ssh-ed25519"
_TRAILER_KEYS = ("format", "namespace", "principal", "public_key", "signature")

# Key types sshkey_read() knows; in an allowed-signers line, a first word that is not one of
# these starts the options field.
_PLAIN_KEY_TYPES = (
    "ssh-ed25519", "ssh-rsa", "ssh-dss", "ecdsa-sha2-nistp256", "ecdsa-sha2-nistp384",
    "ecdsa-sha2-nistp521", "sk-ecdsa-sha2-nistp256", "sk-ssh-ed25519",
)
_KEY_TYPES = frozenset(
    [t if t.startswith("ssh-") or t.startswith("ecdsa-") else t + "@openssh.com" for t in _PLAIN_KEY_TYPES]
    + [t + "-cert-v01@openssh.com" for t in _PLAIN_KEY_TYPES]
)

_KEYGEN_HINT = "make a new key with `capture keygen -o KEYFILE`"


# --------------------------------------------------------------------------- wire format


def _string(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


class _Reader:
    """Reads the SSH wire encoding (RFC 4251 uint32 and string) and fails loudly on short data."""

    def __init__(self, data: bytes, what: str) -> None:
        self._data = data
        self._pos = 0
        self._what = what

    def _take(self, n: int) -> bytes:
        if self._pos + n > len(self._data):
            raise SignatureError(f"{self._what} is truncated", "the signature was damaged; sign the manifest again")
        out = self._data[self._pos:self._pos + n]
        self._pos += n
        return out

    def raw(self, n: int) -> bytes:
        return self._take(n)

    def u32(self) -> int:
        return struct.unpack(">I", self._take(4))[0]

    def string(self) -> bytes:
        return self._take(self.u32())

    def done(self) -> None:
        if self._pos != len(self._data):
            raise SignatureError(f"{self._what} has {len(self._data) - self._pos} unexpected trailing bytes",
                                 "the signature was damaged; sign the manifest again")


def _ed25519_blob(public: Ed25519PublicKey) -> bytes:
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return _string(_ED25519.encode()) + _string(raw)


def _as_public(key: Ed25519PrivateKey | Ed25519PublicKey) -> Ed25519PublicKey:
    return key.public_key() if isinstance(key, Ed25519PrivateKey) else key


def public_key_line(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    """``ssh-ed25519 AAAA...`` without a comment, as in ``authorized_keys``."""
    return "%s %s" % (_ED25519, base64.b64encode(_ed25519_blob(_as_public(key))).decode("ascii"))


def fingerprint(public_key: str) -> str:
    """``SHA256:...`` of a public key line, as ``ssh-keygen -l`` prints it."""
    fields = public_key.split()
    try:
        blob = base64.b64decode(fields[1], validate=True)
    except (IndexError, binascii.Error):
        raise SignatureError(f"not a public key line: {public_key[:40]!r}",
                             "a public key line reads `ssh-ed25519 AAAA...`") from None
    digest = hashlib.sha256(blob).digest()
    return "SHA256:" + base64.b64encode(digest).decode("ascii").rstrip("=")


# --------------------------------------------------------------------------- SSHSIG


def _signed_data(data: bytes, namespace: str) -> bytes:
    # PROTOCOL.sshsig: MAGIC || string(namespace) || string(reserved) || string(hash_alg) || string(H(message))
    return (_MAGIC + _string(namespace.encode("utf-8")) + _string(b"") + _string(HASH_ALG.encode())
            + _string(hashlib.sha512(data).digest()))


def sshsig_sign(data: bytes, key: Ed25519PrivateKey, namespace: str = NAMESPACE) -> str:
    """Sign ``data``; returns the armored block ``ssh-keygen -Y sign`` would write (ending in a newline)."""
    if not namespace:
        raise UsageError("the signature namespace is empty", f"use {NAMESPACE!r}")
    signature = key.sign(_signed_data(data, namespace))
    blob = (_MAGIC + struct.pack(">I", _SIG_VERSION) + _string(_ed25519_blob(key.public_key()))
            + _string(namespace.encode("utf-8")) + _string(b"") + _string(HASH_ALG.encode())
            + _string(_string(_ED25519.encode()) + _string(signature)))
    return _armor(blob)


def _armor(blob: bytes) -> str:
    """``sshsig_armor``: the BEGIN line, the base64 in lines of 70, the END line, each ending in a newline."""
    b64 = base64.b64encode(blob).decode("ascii")
    lines = [b64[i:i + _ARMOR_WIDTH] for i in range(0, len(b64), _ARMOR_WIDTH)]
    return "\n".join([_ARMOR_BEGIN, *lines, _ARMOR_END]) + "\n"


def _dearmor(armored: str) -> bytes:
    """The signature blob of an armored block written exactly as ssh-keygen writes it.

    ssh-keygen reads any line width, CR, spaces and whatever follows the END line; capture accepts
    one encoding only (the one :func:`_armor` and ``ssh-keygen -Y sign`` write), so one signature
    has one byte encoding and one content id (docs/trust.md).
    """
    head, tail = _ARMOR_BEGIN + "\n", "\n" + _ARMOR_END + "\n"
    if not armored.startswith(head) or not armored.endswith(tail) or len(armored) <= len(head) + len(tail):
        raise SignatureError("the signature is not an armored SSH signature block",
                             f"it must start with {_ARMOR_BEGIN} and end with {_ARMOR_END}; sign again")
    try:
        blob = base64.b64decode(armored[len(head):-len(tail)].replace("\n", ""), validate=True)
    except (binascii.Error, ValueError):
        raise SignatureError("the signature block is not valid base64", "the signature was damaged; sign again") from None
    if _armor(blob) != armored:
        raise SignatureError("the signature block is not in the one encoding ssh-keygen writes "
                             "(base64 in lines of 70, exact padding, nothing else)",
                             "sign again with `capture sign` or `ssh-keygen -Y sign`") from None
    return blob


def sshsig_verify(data: bytes, armored: str, namespace: str = NAMESPACE) -> str:
    """Check an armored SSHSIG signature over ``data``; returns the signer's public key line.

    Only Ed25519 signatures with hash sha512 in ``namespace`` are accepted.
    """
    blob = _dearmor(armored)
    r = _Reader(blob, "the signature")
    if r.raw(len(_MAGIC)) != _MAGIC:
        raise SignatureError("the signature does not start with SSHSIG", "it is not an SSH signature; sign again")
    version = r.u32()
    if version != _SIG_VERSION:
        raise SignatureError(f"unsupported SSHSIG version {version}", "sign again with `capture sign` or ssh-keygen -Y sign")
    public_blob = r.string()
    sig_namespace = r.string().decode("utf-8", "replace")
    if r.string():  # ssh-keygen ignores it; capture wants the one encoding ssh-keygen writes
        raise SignatureError("the signature's reserved field is not empty",
                             "sign again with `capture sign` or `ssh-keygen -Y sign`")
    hash_alg = r.string().decode("utf-8", "replace")
    sig_blob = r.string()
    r.done()
    if sig_namespace != namespace:
        raise SignatureError(f"the signature is for namespace {sig_namespace!r}, not {namespace!r}",
                             f"sign with `capture sign` or `ssh-keygen -Y sign -n {namespace}`")
    if hash_alg != HASH_ALG:
        raise SignatureError(f"the signature uses hash {hash_alg!r}; capture accepts only {HASH_ALG!r}",
                             "sign again with `capture sign` (ssh-keygen's default is sha512)")
    pk = _Reader(public_blob, "the signature's public key")
    key_type = pk.string().decode("utf-8", "replace")
    if key_type != _ED25519:
        raise SignatureError(f"the signature was made with a {key_type} key; capture accepts only Ed25519",
                             _KEYGEN_HINT)
    raw_public = pk.string()
    pk.done()
    sr = _Reader(sig_blob, "the signature value")
    sig_type = sr.string().decode("utf-8", "replace")
    raw_sig = sr.string()
    sr.done()
    if sig_type != _ED25519 or len(raw_public) != 32 or len(raw_sig) != 64:
        raise SignatureError("the signature's key or value is malformed", "the signature was damaged; sign again")
    public = Ed25519PublicKey.from_public_bytes(raw_public)
    try:
        public.verify(raw_sig, _signed_data(data, namespace))
    except InvalidSignature:
        raise SignatureError("the signature does not match the content: the manifest was changed after signing",
                             "find out who changed it; re-sign only content you have checked") from None
    return public_key_line(public)

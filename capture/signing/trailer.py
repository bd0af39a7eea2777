"""The ``[signature]`` trailer of a signed manifest: render it, sign a body, verify a file's bytes.

A signed manifest is ``BODY + TRAILER`` (shared/DESIGN.md, decision 1). The signature covers the
exact bytes of BODY; nothing is re-serialised, and the body is parsed only after the signature
and the signer have been checked.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

import tomli_w
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from capture import manifest
from capture._atomic import atomic_write
from capture.errors import ManifestError, SignatureError, TrustError, UsageError
from capture.signing.sshsig import FORMAT, NAMESPACE, _TRAILER_KEYS, fingerprint, public_key_line, sshsig_sign, sshsig_verify
from capture.signing.keys import _check_text_field, default_principal, load_private_key
from capture.signing.trust import AllowedSigners, _allowed_signers_line


# --------------------------------------------------------------------------- signed manifests


def _toml_string(value: str) -> str:
    return tomli_w.dumps({"v": value})[len("v = "):].rstrip("\n")


def _render_trailer(principal: str, public_key: str, armored: str) -> bytes:
    lines = [
        manifest.TRAILER_LINE.decode(),
        f'format = "{FORMAT}"',
        f"namespace = {_toml_string(NAMESPACE)}",
        f"principal = {_toml_string(principal)}",
        f"public_key = {_toml_string(public_key)}",
        # A multi-line basic string: TOML drops the newline right after the opening quotes, so the
        # value is exactly the armored block; base64 and the armor lines need no escaping.
        f'signature = """\n{armored}"""',
    ]
    return ("\n".join(lines) + "\n").encode("utf-8")


def make_trailer(body: bytes, key: Ed25519PrivateKey, principal: str) -> bytes:
    """The ``[signature]`` table for ``body`` (which must end with a newline)."""
    if not body.endswith(b"\n"):
        raise ValueError("the body must end with a newline before the [signature] line")
    _check_principal(principal)
    return _render_trailer(principal, public_key_line(key), sshsig_sign(body, key, NAMESPACE))


def _check_principal(principal: str) -> None:
    _check_text_field(principal, "principal")
    if "," in principal or '"' in principal:
        raise UsageError(f"principal {principal!r} contains a comma or a quote",
                         "allowed-signers files use those to separate and quote principals; pick a plain name")


def _prepare_body(raw: bytes, source: str) -> bytes:
    try:
        body, _ = manifest.split_signed(raw)
    except SignatureError:
        raise ManifestError(f"{source}: content follows the [signature] table",
                            "move it above [signature] (or delete the [signature] table), then sign again") from None
    manifest.parse_body(body, source)  # refuse to sign anything that is not a manifest
    if not body.endswith(b"\n"):
        body += b"\n"
    if not body.endswith(b"\n\n"):
        body += b"\n"  # a blank line before [signature], for the reader; it is signed like the rest
    return body


def sign_bytes(raw: bytes, key_path: str | os.PathLike[str], principal: str | None = None,
               source: str = "manifest") -> bytes:
    """``BODY + TRAILER`` for a manifest; an existing trailer is replaced."""
    body = _prepare_body(raw, source)
    key = load_private_key(key_path)
    return body + make_trailer(body, key, principal if principal is not None else default_principal(key_path))


def sign_file(path: str | os.PathLike[str], key_path: str | os.PathLike[str], principal: str | None = None) -> None:
    """Sign (or re-sign) a manifest file in place, atomically, keeping its permissions."""
    raw = manifest.read_bytes(path)
    signed = sign_bytes(raw, key_path, principal, source=str(path))
    atomic_write(path, signed, mode=_shareable_mode(path))


def write_signed(path: str | os.PathLike[str], body: bytes, key_path: str | os.PathLike[str],
                 principal: str | None = None) -> bytes:
    """Write ``body`` and its signature trailer atomically; returns the bytes written."""
    signed = sign_bytes(body, key_path, principal, source=str(path))
    atomic_write(path, signed, mode=_shareable_mode(path))
    return signed


def _shareable_mode(path: str | os.PathLike[str]) -> int:
    """An existing file keeps its mode; a new one gets 0666 less the umask, as open() would give it.

    (A bare temporary file is 0600, which is right for keys and wrong for manifests people share.)
    """
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        pass
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            umask = next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        umask = 0o022
    return 0o666 & ~umask


# --------------------------------------------------------------------------- verification


@dataclass(frozen=True)
class SignatureInfo:
    """Who signed a manifest, as established by :func:`verify_signed_bytes`."""

    principal: str
    public_key: str
    fingerprint: str
    namespace: str
    allowed_signers: str | None


def verify_signed_bytes(raw: bytes, allowed: AllowedSigners | None, source: str) -> tuple[SignatureInfo, bytes]:
    """Check the signature over the exact bytes of BODY, then the signer's trust; returns (info, BODY).

    Only after this returns may BODY be parsed (verify before parse). Commands do not call this
    directly: they open manifests through :func:`capture.verify.open.open_manifest`.
    """
    info, body = check_signature_bytes(raw, source)
    check_trust(info, allowed, source)
    return SignatureInfo(info.principal, info.public_key, info.fingerprint, info.namespace,
                         allowed.path if allowed else None), body


def check_signature_bytes(raw: bytes, source: str) -> tuple[SignatureInfo, bytes]:
    """Steps (1)-(6): the trailer and the signature over BODY's exact bytes, no trust yet.

    Raises :class:`SignatureError` (exit 4); ``allowed_signers`` of the result is None.
    """
    # (1) split at the [signature] line; nothing may follow the trailer table
    body, trailer = manifest.split_signed(raw)
    if trailer is None:
        raise SignatureError(f"{source}: not signed (no [signature] table)", f"sign it: capture sign {source} --key KEY")
    # (2) the trailer is a TOML table with exactly the keys we write
    fields = manifest.parse_trailer(trailer, source)
    unknown = sorted(set(fields) - set(_TRAILER_KEYS))
    missing = [k for k in _TRAILER_KEYS if not isinstance(fields.get(k), str)]
    if unknown or missing:
        what = f"unexpected key {unknown[0]!r}" if unknown else f"missing or non-string {missing[0]!r}"
        raise SignatureError(f"{source}: [signature] has {what}", f"re-sign with `capture sign {source} --key KEY`")
    # (3) format and namespace before any cryptography
    if fields["format"] != FORMAT:
        raise SignatureError(f"{source}: signature format {fields['format']!r} is not supported", f'capture writes format = "{FORMAT}"')
    if fields["namespace"] != NAMESPACE:
        raise SignatureError(f"{source}: signature namespace {fields['namespace']!r} is not {NAMESPACE!r}",
                             f"re-sign with `capture sign {source} --key KEY`")
    # (4) the trailer is byte for byte what capture writes for these values, so no byte of the
    #     file (not even a comment or blank line after the table) is outside the signature's reach
    if _render_trailer(fields["principal"], fields["public_key"], fields["signature"]) != trailer:
        raise SignatureError(f"{source}: the [signature] table was altered (extra lines, comments or spacing)",
                             f"re-sign with `capture sign {source} --key KEY`")
    # (5) PROTOCOL.sshsig verification: MAGIC, version, namespace, hash algorithm, then the
    #     Ed25519 signature over MAGIC || namespace || reserved || hash_alg || H(BODY)
    try:
        signer = sshsig_verify(body, fields["signature"], NAMESPACE)
    except SignatureError as exc:
        raise SignatureError(f"{source}: {exc.message}", exc.hint) from None
    # (6) the key named in the trailer is the key inside the signature
    if fields["public_key"].strip() != signer:
        raise SignatureError(f"{source}: public_key in [signature] is not the key that made the signature",
                             "the trailer was edited; re-sign the manifest")
    return SignatureInfo(fields["principal"], signer, fingerprint(signer), NAMESPACE, None), body


def check_trust(info: SignatureInfo, allowed: AllowedSigners | None, source: str) -> None:
    """Step (7): the allowed-signers file lists this principal with this key for this namespace.

    Raises :class:`TrustError` (exit 4) naming the line to add.
    """
    principal = info.principal
    if allowed is None:
        raise TrustError(f"{source}: signature valid ({principal}, {info.fingerprint}) but no allowed-signers file was found",
                         "pass --allowed-signers FILE, set $CAPTURE_ALLOWED_SIGNERS, or list it in "
                         "~/.config/capture/allowed_signers (in a results repository: its root's .capture/allowed_signers)")
    if not allowed.is_trusted(principal, info.public_key, NAMESPACE):
        raise TrustError(f"{source}: signer {principal} ({info.fingerprint}) is not trusted: "
                         f"{allowed.explain(principal, info.public_key, NAMESPACE)}",
                         f"if you trust this key, add to {allowed.path or 'your allowed-signers file'}: "
                         f"{_allowed_signers_line(principal, info.public_key)}")

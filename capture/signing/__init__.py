"""Signing wing: SSHSIG over Ed25519 (``sshsig``), key files (``keys``), allowed signers (``trust``)
and the manifest's ``[signature]`` trailer (``trailer``). Commands never call the verification here
directly: they open manifests through :func:`capture.verify.open.open_manifest`.

Signature format and trust follow OpenSSH (``PROTOCOL.sshsig``, ssh-keygen ALLOWED SIGNERS), so
``ssh-keygen -Y verify`` and capture reach the same verdict on the same files.
"""

from capture.signing.keys import (
    default_key_path,
    default_principal,
    ensure_default_key,
    generate_key,
    load_private_key,
)
from capture.signing.sshsig import FORMAT, HASH_ALG, NAMESPACE, fingerprint, public_key_line, sshsig_sign, sshsig_verify
from capture.signing.trailer import (
    SignatureInfo,
    _render_trailer,
    check_signature_bytes,
    check_trust,
    make_trailer,
    sign_bytes,
    sign_file,
    verify_signed_bytes,
    write_signed,
)
from capture.signing.openssh import match_pattern_list
from capture.signing.trust import AllowedSigner, AllowedSigners, find_allowed_signers

__all__ = [
    "FORMAT", "HASH_ALG", "NAMESPACE", "AllowedSigner", "AllowedSigners", "SignatureInfo",
    "check_signature_bytes", "check_trust",
    "default_key_path", "default_principal", "ensure_default_key", "find_allowed_signers", "fingerprint",
    "generate_key", "load_private_key", "make_trailer", "match_pattern_list", "public_key_line",
    "sign_bytes", "sign_file", "sshsig_sign", "sshsig_verify", "verify_signed_bytes", "write_signed",
    "_render_trailer",
]

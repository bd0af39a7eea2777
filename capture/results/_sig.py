"""Signature status of a manifest for commands that read without requiring trust.

`compare` and `show` print whether each signature is valid and trusted, but still show the
content; `pin` and tree verification refuse instead. Both go through
:func:`capture.signing.verify_signed_bytes` so there is one implementation of the check.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

from capture.errors import SignatureError, TrustError
from capture.manifest import split_signed


@dataclass(frozen=True)
class SignatureStatus:
    state: str
    """``trusted``, ``untrusted`` (valid signature, signer not allowed), ``invalid``, ``unsigned``."""
    reason: str | None = None
    principal: str | None = None
    fingerprint: str | None = None
    allowed_signers: str | None = None

    @property
    def label(self) -> str:
        who = f" by {self.principal} ({self.fingerprint})" if self.principal else ""
        if self.state == "trusted":
            return f"signature valid, signer trusted{who}"
        if self.state == "untrusted":
            return f"signature valid, signer NOT trusted: {self.reason}"
        if self.state == "unsigned":
            return "NOT signed"
        return f"signature INVALID: {self.reason}"


@functools.lru_cache(maxsize=64)
def _load_allowed(path: str, mtime_ns: int):  # mtime in the key: an edited file is re-read
    from capture.signing import AllowedSigners
    return AllowedSigners.load(Path(path))


def load_allowed(path: str | os.PathLike[str] | None):
    """``AllowedSigners`` for a path (cached per file and modification time), or None."""
    if path is None:
        return None
    p = Path(path)
    try:
        mtime = p.stat().st_mtime_ns
    except OSError:
        mtime = -1  # let AllowedSigners.load produce its own one-line error
    return _load_allowed(str(p), mtime)


def signature_status(raw: bytes, source: str, allowed_signers: str | os.PathLike[str] | None = None,
                     manifest_path: str | os.PathLike[str] | None = None) -> SignatureStatus:
    """Check without raising. The allowed-signers file is the explicit one or the usual search."""
    from capture import signing

    if split_signed(raw)[1] is None:
        return SignatureStatus("unsigned", "no [signature] table")
    found = signing.find_allowed_signers(Path(manifest_path or source), allowed_signers)
    allowed = load_allowed(found) if found is not None else None
    try:
        info, _ = signing.verify_signed_bytes(raw, allowed, source)
    except TrustError as exc:
        return SignatureStatus("untrusted", _short(exc.message, source), allowed_signers=str(found) if found else None)
    except SignatureError as exc:
        return SignatureStatus("invalid", _short(exc.message, source))
    return SignatureStatus("trusted", None, info.principal, info.fingerprint,
                           str(found) if found else None)


def _short(message: str, source: str) -> str:
    """Messages start with the file name, which the caller already shows."""
    return message.removeprefix(f"{source}: ")

"""STAND-IN (helper `decide`) for helper `door`'s one door; the lead replaces it with door's file.

Implements only the shared contract (/work/HELPERS.md, contract 1) on top of today's
``capture.results._sig.signature_status`` and ``capture.manifest.parse_body``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from capture.errors import SignatureError, TrustError
from capture.manifest import parse_body, read_bytes, split_signed


@dataclass(frozen=True)
class SignatureStatus:
    state: str
    """``ok``, ``unsigned``, ``invalid`` or ``untrusted``."""
    principal: str | None = None
    fingerprint: str | None = None
    reason: str | None = None
    allowed_signers: str | None = None

    @property
    def trusted(self) -> bool:
        return self.state == "ok"


@dataclass(frozen=True)
class OpenedManifest:
    path: str
    raw: bytes
    body: bytes
    data: dict[str, Any]
    signature: SignatureStatus


def open_manifest(path: str | os.PathLike[str], trust: Any = None, require_trusted: bool = True) -> OpenedManifest:
    from capture.results._sig import signature_status

    p = str(path)
    raw = read_bytes(p)
    body, _ = split_signed(raw)
    data = parse_body(body, p)  # malformed (3) before unsigned (4)
    old = signature_status(raw, p, trust if isinstance(trust, (str, os.PathLike)) else None, Path(p))
    state = {"trusted": "ok"}.get(old.state, old.state)
    status = SignatureStatus(state, old.principal, old.fingerprint, old.reason, old.allowed_signers)
    if require_trusted and state != "ok":
        cls = TrustError if state == "untrusted" else SignatureError
        raise cls(f"{p}: {state}: {old.reason}", "sign it with a trusted key")
    return OpenedManifest(p, raw, body, data, status)

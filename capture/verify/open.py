"""The one door: every command that reads a manifest opens it here, and only here is it parsed.

:func:`open_manifest` reads the file once (a regular file, at most
:data:`~capture._safe_read.MANIFEST_MAX_BYTES`), splits it once at the ``[signature]`` line,
checks the signature once over the exact bytes of the body, then the signer's trust, and parses
and validates the body once against the schema (:mod:`capture.schema`). The order and the exit
codes (shared/DESIGN.md):

- (1) unreadable, too large, not a regular file → :class:`ManifestError` (3);
- (2) **unsigned**: the body is parsed first, so a file that is no manifest at all is
  *malformed* (3), and only a well-formed one is *unsigned* (4);
- (3) **signed**: signature over the exact bytes, then trust; a failure is *invalid* or
  *untrusted* (4), decided before any byte of the body is parsed;
- (4) parse and validate: TOML, header, field types, nesting, no disguised ``signature`` table
  → *malformed* (3) naming the field.

With ``require_trusted=True`` (verify, pin) anything but a valid signature by a trusted signer
raises (exit 4). With ``False`` (show, compare, diff, export) the state is reported in
:attr:`OpenedManifest.signature` and the data is still returned, parsed and validated the same way.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from capture import manifest as mf
from capture._escape import printable
from capture.errors import ManifestError, NotAManifest, SignatureError, TrustError, UnsignedError
from capture.signing.trailer import SignatureInfo, check_signature_bytes, check_trust
from capture.signing.trust import AllowedSigners
import capture.verify.trust_root as trust_root

log = logging.getLogger(__name__)

STATES = ("ok", "unsigned", "invalid", "untrusted")
"""Signature states, in the report vocabulary (ok, drift, malformed, unsigned, invalid, untrusted, error)."""

Trust = AllowedSigners | trust_root.TrustRoot | str | os.PathLike[str] | None
"""An allowed-signers file already loaded, a trust root already chosen, its path (``--allowed-signers``), or None for the
verifier's default (:func:`capture.verify.trust_root.choose`: ``$CAPTURE_ALLOWED_SIGNERS``, a
results repository's root ``.capture/allowed_signers``, the personal file)."""


@dataclass(frozen=True)
class SignatureStatus:
    """What the door found about a manifest's signature."""

    state: str
    """``ok`` (valid, signer trusted), ``unsigned``, ``invalid`` (tampered, malformed trailer) or
    ``untrusted`` (valid signature, signer not in the allowed signers)."""
    reason: str | None = None
    """One line, without the file name, when the state is not ``ok``."""
    hint: str | None = None
    principal: str | None = None
    fingerprint: str | None = None
    public_key: str | None = None
    allowed_signers: str | None = None
    """The allowed-signers file that decided trust (None when none was found or needed)."""

    @property
    def trusted(self) -> bool:
        return self.state == "ok"

    @property
    def label(self) -> str:
        """One line for people (escaped: principals and reasons come from the file)."""
        who = f" by {self.principal} ({self.fingerprint})" if self.principal else ""
        if self.state == "ok":
            text = f"signature valid, signer trusted{who}"
        elif self.state == "untrusted":
            text = f"signature valid, signer NOT trusted: {self.reason}"
        elif self.state == "unsigned":
            text = "NOT signed"
        else:
            text = f"signature INVALID: {self.reason}"
        return printable(text)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"state": self.state}
        for k in ("reason", "hint", "principal", "fingerprint", "public_key", "allowed_signers"):
            v = getattr(self, k)
            if v is not None:
                out[k] = v
        return out


@dataclass(frozen=True)
class OpenedManifest:
    """A manifest read, split, verified, parsed and validated once."""

    path: str
    raw: bytes
    """Every byte of the file (its sha256 is the content id)."""
    body: bytes
    """The bytes the signature covers (all of ``raw`` for an unsigned file)."""
    data: dict[str, Any]
    """The parsed body, validated against :mod:`capture.schema`."""
    signature: SignatureStatus
    trailer: dict[str, str] | None = None
    """The ``[signature]`` table's fields when the signature is valid (``ok`` or ``untrusted``)."""

    def error(self) -> SignatureError:
        """The exit-4 error for a manifest whose signature is not ``ok``."""
        return _error(self.path, self.signature)


# --------------------------------------------------------------------------- allowed signers


@functools.lru_cache(maxsize=64)
def _load_allowed(path: str, mtime_ns: int, size: int) -> AllowedSigners:  # an edited file is re-read
    allowed = AllowedSigners.load(Path(path))
    for why in allowed.skipped:  # once per file: OpenSSH skips these lines too, and so do we
        log.warning("allowed signers: line skipped, as ssh-keygen skips it: %s", printable(why))
    return allowed


def load_allowed(path: str | os.PathLike[str]) -> AllowedSigners:
    """``AllowedSigners`` for a file, parsed once per file and modification (one cache for every
    command: tree verification finds the same file for thousands of manifests)."""
    p = Path(path)
    try:
        st = p.stat()
        key = (st.st_mtime_ns, st.st_size)
    except OSError:
        key = (-1, -1)  # let AllowedSigners.load produce its own one-line error
    return _load_allowed(str(p), *key)


def resolve_trust(trust: Trust, manifest_path: str | os.PathLike[str]) -> AllowedSigners | None:
    """The allowed signers that decide trust for ``manifest_path``; None when no file is chosen.

    Every command takes its trust root from here (verify, show, compare, decide, pin, export):
    the verifier's choice (:mod:`capture.verify.trust_root`); files found beside the manifest are
    reported as ignored."""
    if isinstance(trust, AllowedSigners):  # chosen by the caller (pin, --trust-from)
        return trust
    if isinstance(trust, trust_root.TrustRoot):  # chosen once per folder by a tree run
        return load_allowed(trust.path) if trust.path is not None else None
    found = trust_root.choose(manifest_path, trust).path
    return load_allowed(found) if found is not None else None


# --------------------------------------------------------------------------- the door


def _short(message: str, source: str) -> str:
    """Messages start with the file name, which the caller already shows."""
    return message.removeprefix(f"{source}: ")


def _error(source: str, status: SignatureStatus) -> SignatureError:
    cls = {"untrusted": TrustError, "unsigned": UnsignedError}.get(status.state, SignatureError)
    err = cls(f"{source}: {status.reason}", status.hint)
    err.status = status  # type: ignore[attr-defined]  # who signed, for a report that names the signer
    return err


def _signature(raw: bytes, source: str, trust: Trust) -> SignatureStatus:
    """Steps (3): signature over the exact bytes, then trust. Never parses the body."""
    try:
        info: SignatureInfo = check_signature_bytes(raw, source)[0]
    except SignatureError as exc:
        return SignatureStatus("invalid", _short(exc.message, source), exc.hint)
    allowed = resolve_trust(trust, source)
    who = dict(principal=info.principal, fingerprint=info.fingerprint, public_key=info.public_key,
               allowed_signers=allowed.path if allowed else None)
    try:
        check_trust(info, allowed, source)
    except TrustError as exc:
        return SignatureStatus("untrusted", _short(exc.message, source), exc.hint, **who)
    return SignatureStatus("ok", **who)


def open_manifest(path: str | os.PathLike[str], trust: Trust = None,
                  require_trusted: bool = True, skip_other: bool = False) -> OpenedManifest:
    """Read, split, verify and parse one manifest (see the module docstring for the order).

    Raises :class:`ManifestError` (3) for a malformed file; with ``require_trusted`` also
    :class:`SignatureError`/:class:`TrustError` (4) unless the signature is valid and trusted.
    A bad explicit allowed-signers file is a :class:`UsageError` (2). With ``skip_other`` (a
    folder walk), a file without a manifest header raises :class:`NotAManifest`.
    """
    source = str(path)
    # (1) read once
    raw = mf.read_bytes(path)
    if skip_other and not mf.has_header(raw):
        raise NotAManifest(f"{source}: not a manifest (no schema_version line, no [signature] table); skipped",
                           "a trial config or other TOML file kept beside manifests is not checked")
    # (2) split once; content after the trailer is a tampered file, but its body still decides 3 vs 4
    try:
        body, trailer = mf.split_signed(raw)
    except SignatureError as exc:
        m = mf._TRAILER_RE.search(raw)
        body, trailer = raw[:m.start()] if m else raw, b""  # b"": signed, with a broken trailer
        status = SignatureStatus("invalid", _short(exc.message, source), exc.hint)
    else:
        status = (SignatureStatus("unsigned", "not signed (no [signature] table)",
                                  f"sign it: capture sign {source} --key KEY")
                  if trailer is None else _signature(raw, source, trust))
    # (3) signed but not ok, and trust required: refuse before parsing a byte of the body
    if require_trusted and status.state in ("invalid", "untrusted") and trailer is not None:
        raise _error(source, status)
    # (4) parse and validate once: malformed (3) beats unsigned (4)
    data = mf.parse_body(body, source)
    if require_trusted and not status.trusted:
        raise _error(source, status)
    fields = mf.parse_trailer(raw[len(body):], source) if status.state in ("ok", "untrusted") else None
    return OpenedManifest(source, raw, body, data, status, fields)


def try_open(path: str | os.PathLike[str], trust: Trust = None, require_trusted: bool = True,
             skip_other: bool = False) -> OpenedManifest | ManifestError | SignatureError:
    """:func:`open_manifest`, with its refusal returned instead of raised (for tree runs)."""
    try:
        return open_manifest(path, trust, require_trusted, skip_other)
    except (ManifestError, SignatureError) as exc:
        return exc

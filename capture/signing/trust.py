"""Allowed-signers files (ssh-keygen ALLOWED SIGNERS, git's ``gpg.ssh.allowedSignersFile``): parsing and matching.

``PRINCIPALS [OPTIONS] KEYTYPE BASE64 [COMMENT]`` per line.

Capture trusts exactly what ``ssh-keygen -Y verify`` (OpenSSH 9.2p1, ``sshsig.c``) trusts, and reads
the file the way OpenSSH does, byte for byte (docs/trust.md lists the sources and every known
difference):

* lines end at ``\\n`` only (``getline``); a NUL byte ends the line (C strings); the file need not
  be UTF-8;
* a line that does not parse is skipped, as ``check_allowed_keys_line`` skips it; the other lines
  still count (skipped lines are kept in :attr:`AllowedSigners.skipped`, as data);
* fields are split by OpenSSH's own rules (``strdelimw``, ``sshkey_read``,
  ``sshkey_advance_past_options``): the separators are ASCII space and tab (and CR/LF after the
  principals), never a non-breaking space or any other Unicode white space;
* principals and namespaces are ``match_pattern_list`` pattern-lists over bytes (``?`` is one
  byte, a subpattern of 1,023 bytes or more never matches, case-sensitive), matched without
  backtracking;
* options as ``sshsigopt_parse`` reads them (names case-insensitive), times as
  ``parse_absolute_time`` reads them (``strptime`` and ``mktime``/``timegm``);
* the key is compared as a key (type and the 32 public bytes), not as base64 text.
"""

from __future__ import annotations

import base64
import datetime as _dt
import os
from dataclasses import dataclass, field
from pathlib import Path

from capture._safe_read import ALLOWED_SIGNERS_MAX_BYTES, read_regular
from capture.errors import UsageError
from capture.signing.openssh import (  # noqa: F401 - match_pattern, parse_absolute_time: public API
    _ED25519, _ParsedLine, _bytes, _key_of, _match_pattern_list, _parse_line, match_pattern,
    match_pattern_list, parse_absolute_time,
)
from capture.signing.sshsig import NAMESPACE, fingerprint


# --------------------------------------------------------------------------- the file


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")


def _allowed_signers_line(principal: str, public_key: str) -> str:
    shown = f'"{principal}"' if any(c in principal for c in " \t\r\n,") else principal
    return f'{shown} namespaces="{NAMESPACE}" {public_key}'


_KEY_NOT_LISTED = "key not listed"


@dataclass(frozen=True)
class AllowedSigner:
    """One line of an allowed-signers file that OpenSSH would use (an Ed25519 key)."""

    principals: str
    """Pattern-list of principals (``*``, ``?``, ``!`` negation), as in ssh_config PATTERNS."""
    options: str
    """The raw options field ("" when absent)."""
    key_type: str
    key_b64: str
    """The key's canonical base64 (the line may spell it differently; :attr:`key_raw` is compared)."""
    namespaces: str | None = None
    """Pattern-list from ``namespaces="..."``; None means any namespace."""
    cert_authority: bool = False
    """A CA line only vouches for certificates; it never trusts a plain key such as ours."""
    valid_after_epoch_s: int | None = None
    valid_before_epoch_s: int | None = None
    source: str = ""
    """``file:line`` the entry came from."""
    key_raw: bytes = b""
    """The 32 public bytes of the Ed25519 key: what is compared."""

    @property
    def public_key(self) -> str:
        return f"{self.key_type} {self.key_b64}"

    def why_not(self, principal: str, public_key: str, namespace: str, now_epoch_s: int) -> str | None:
        """None if this line trusts the signature, else the reason it does not (sshsig.c
        ``check_allowed_keys_line``)."""
        if _key_of(public_key) != self.key_raw:
            return _KEY_NOT_LISTED
        if self.cert_authority:
            return f"{self.source}: is a cert-authority line, which vouches only for certificates"
        if "\0" in principal or _match_pattern_list(_bytes(principal), _bytes(self.principals)) != 1:
            return f"{self.source}: lists the key for {self.principals!r}, not for principal {principal!r}"
        if self.namespaces is not None and _match_pattern_list(_bytes(namespace), _bytes(self.namespaces)) != 1:
            return f"{self.source}: allows the key only for namespaces {self.namespaces!r}, not {namespace!r}"
        if self.valid_after_epoch_s is not None and now_epoch_s < self.valid_after_epoch_s:
            return f"{self.source}: the key is not valid yet (valid-after)"
        if self.valid_before_epoch_s is not None and now_epoch_s > self.valid_before_epoch_s:
            return f"{self.source}: the key has expired (valid-before)"
        return None


def _string(data: bytes) -> bytes:
    return len(data).to_bytes(4, "big") + data


@dataclass(frozen=True)
class AllowedSigners:
    """The signers a verifier trusts, from an allowed-signers file."""

    path: str | None
    signers: tuple[AllowedSigner, ...]
    skipped: tuple[str, ...] = field(default=())
    """``file:line: reason`` for each line OpenSSH would skip (malformed, foreign key type): data
    for a warning, never an error; the other lines still count, as in ssh-keygen."""

    @classmethod
    def empty(cls) -> AllowedSigners:
        return cls(None, ())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> AllowedSigners:
        p = Path(path)
        try:
            data = read_regular(p, ALLOWED_SIGNERS_MAX_BYTES, UsageError, "allowed-signers file")
        except FileNotFoundError:
            raise UsageError(f"{p}: no such allowed-signers file", "check the path given to --allowed-signers "
                             "or $CAPTURE_ALLOWED_SIGNERS") from None
        except IsADirectoryError:
            raise UsageError(f"{p}: is a folder, not an allowed-signers file", "name the file itself") from None
        except PermissionError:
            raise UsageError(f"{p}: permission denied", "make the allowed-signers file readable") from None
        return cls.from_bytes(data, str(p))

    @classmethod
    def from_bytes(cls, data: bytes, path: str = "allowed_signers") -> AllowedSigners:
        signers, skipped = [], []
        # OpenSSH reads the file with getline(3): a line ends at "\n" and nowhere else. str.splitlines
        # also breaks at \r, \v, \f, \x1c-\x1e, U+0085, U+2028 and U+2029, which would let a comment
        # that a reviewer sees on one line smuggle in a second entry.
        for number, line in enumerate(data.split(b"\n"), start=1):
            where = f"{path}:{number}"
            parsed, why = _parse_line(line)
            if parsed is None:
                if why:
                    skipped.append(f"{where}: {why}")
                continue
            o = parsed.parsed
            signers.append(AllowedSigner(
                principals=_text(parsed.principals), options=_text(parsed.options), key_type="ssh-ed25519",
                key_b64=base64.b64encode(_string(_ED25519) + _string(parsed.key)).decode(), namespaces=None if o.namespaces is None else _text(o.namespaces),
                cert_authority=o.cert_authority, valid_after_epoch_s=o.valid_after or None,
                valid_before_epoch_s=o.valid_before or None, source=where, key_raw=parsed.key))
        return cls(path, tuple(signers), tuple(skipped))

    @staticmethod
    def _now(now: _dt.datetime | float | None) -> int:
        if now is None:
            return int(_dt.datetime.now(_dt.timezone.utc).timestamp())
        if isinstance(now, _dt.datetime):
            return int(now.timestamp())
        return int(now)

    def is_trusted(self, principal: str, public_key_line: str, namespace: str = NAMESPACE,
                   now: _dt.datetime | float | None = None) -> bool:
        """True if some line allows this principal to sign with this key in this namespace, now."""
        t = self._now(now)
        return any(s.why_not(principal, public_key_line, namespace, t) is None for s in self.signers)

    def explain(self, principal: str, public_key_line: str, namespace: str = NAMESPACE,
                now: _dt.datetime | float | None = None) -> str:
        """Why :meth:`is_trusted` says no, in one line (the lines that list the key come first)."""
        where = self.path or "the allowed signers"
        skipped = f" ({len(self.skipped)} line(s) skipped as malformed: {self.skipped[0]})" if self.skipped else ""
        if not self.signers:
            return f"{where} lists no signers{skipped}"
        t = self._now(now)
        reasons = [s.why_not(principal, public_key_line, namespace, t) for s in self.signers]
        specific = [r for r in reasons if r and r != _KEY_NOT_LISTED]
        if specific:
            return specific[0]
        return f"key {fingerprint(public_key_line)} is not listed in {where}{skipped}"


def find_allowed_signers(manifest_path: str | os.PathLike[str], explicit: str | os.PathLike[str] | None = None) -> Path | None:
    """The allowed-signers file that decides trust for ``manifest_path`` (None: nobody is trusted):
    :func:`capture.verify.trust_root.choose`, the verifier's choice, never a file beside the data."""
    from capture.verify.trust_root import choose

    return choose(manifest_path, explicit).path

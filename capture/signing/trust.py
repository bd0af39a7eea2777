"""Allowed-signers files (ssh-keygen ALLOWED SIGNERS, git's ``gpg.ssh.allowedSignersFile``): parsing and matching.

``PRINCIPALS [OPTIONS] KEYTYPE BASE64 [COMMENT]`` per line.
"""

from __future__ import annotations

import base64
import binascii
import datetime as _dt
import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path


from capture._safe_read import ALLOWED_SIGNERS_MAX_BYTES, read_regular
from capture.errors import SignatureError, UsageError
from capture.paths import config_dir
from capture.signing.sshsig import NAMESPACE, _KEY_TYPES, _Reader, fingerprint


# --------------------------------------------------------------------------- allowed signers


@functools.lru_cache(maxsize=256)
def _pattern_regex(pattern: str) -> re.Pattern[str]:
    parts = (".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
    return re.compile("".join(parts), re.DOTALL)


def match_pattern_list(value: str, patterns: str) -> bool:
    """ssh's ``match_pattern_list``: comma-separated ``*``/``?`` globs; a matching ``!`` pattern vetoes.

    Case-sensitive, as ssh-keygen matches principals and namespaces.
    """
    positive = False
    for pattern in patterns.split(","):
        negated = pattern.startswith("!")
        if negated:
            pattern = pattern[1:]
        if _pattern_regex(pattern).fullmatch(value):
            if negated:
                return False
            positive = True
    return positive


def _parse_time(text: str) -> int:
    """``YYYYMMDD[Z]`` or ``YYYYMMDDHHMM[SS][Z]`` to epoch seconds; local time unless it ends in Z."""
    utc = text.endswith("Z")
    digits = text[:-1] if utc else text
    formats = {8: "%Y%m%d", 12: "%Y%m%d%H%M", 14: "%Y%m%d%H%M%S"}
    if not digits.isdigit() or len(digits) not in formats:
        raise ValueError(text)
    when = _dt.datetime.strptime(digits, formats[len(digits)])
    if utc:
        when = when.replace(tzinfo=_dt.timezone.utc)
    return int(when.timestamp())


def _allowed_signers_line(principal: str, public_key: str) -> str:
    shown = f'"{principal}"' if re.search(r"\s", principal) else principal
    return f'{shown} namespaces="{NAMESPACE}" {public_key}'


_KEY_NOT_LISTED = "key not listed"


@dataclass(frozen=True)
class AllowedSigner:
    """One line of an allowed-signers file."""

    principals: str
    """Pattern-list of principals (``*``, ``?``, ``!`` negation), as in ssh_config PATTERNS."""
    options: str
    """The raw options field ("" when absent)."""
    key_type: str
    key_b64: str
    namespaces: str | None = None
    """Pattern-list from ``namespaces="..."``; None means any namespace."""
    cert_authority: bool = False
    """A CA line only vouches for certificates; it never trusts a plain key such as ours."""
    valid_after_epoch_s: int | None = None
    valid_before_epoch_s: int | None = None
    source: str = ""
    """``file:line`` the entry came from."""

    @property
    def public_key(self) -> str:
        return f"{self.key_type} {self.key_b64}"

    def why_not(self, principal: str, public_key: str, namespace: str, now_epoch_s: int) -> str | None:
        """None if this line trusts the signature, else the reason it does not."""
        if public_key.split()[:2] != [self.key_type, self.key_b64]:
            return _KEY_NOT_LISTED
        if self.cert_authority:
            return f"{self.source}: is a cert-authority line, which vouches only for certificates"
        if not match_pattern_list(principal, self.principals):
            return f"{self.source}: lists the key for {self.principals!r}, not for principal {principal!r}"
        if self.namespaces is not None and not match_pattern_list(namespace, self.namespaces):
            return f"{self.source}: allows the key only for namespaces {self.namespaces!r}, not {namespace!r}"
        if self.valid_after_epoch_s is not None and now_epoch_s < self.valid_after_epoch_s:
            return f"{self.source}: the key is not valid yet (valid-after)"
        if self.valid_before_epoch_s is not None and now_epoch_s > self.valid_before_epoch_s:
            return f"{self.source}: the key has expired (valid-before)"
        return None


def _parse_options(opts: str, where: str) -> dict[str, object]:
    out: dict[str, object] = {}
    rest = opts
    while rest:
        lower = rest.lower()
        if lower.startswith("cert-authority"):
            out["cert_authority"] = True
            rest = rest[len("cert-authority"):]
        else:
            for name in ("namespaces", "valid-after", "valid-before"):
                if lower.startswith(name + "="):
                    break
            else:
                raise UsageError(f"{where}: unsupported option in {opts!r}",
                                 "options are cert-authority, namespaces=\"...\", valid-after=\"...\", valid-before=\"...\"")
            if name in out:
                raise UsageError(f"{where}: option {name} given twice", "keep one")
            rest = rest[len(name) + 1:]
            if not rest.startswith('"'):
                raise UsageError(f"{where}: the value of {name} must be in double quotes", f'write {name}="..."')
            end = rest.find('"', 1)
            if end < 0:
                raise UsageError(f"{where}: unterminated quote in option {name}", "close the double quote")
            value = rest[1:end]
            rest = rest[end + 1:]
            if name == "namespaces":
                out[name] = value
            else:
                try:
                    out[name] = _parse_time(value)
                except ValueError:
                    raise UsageError(f"{where}: invalid {name} time {value!r}",
                                     "use YYYYMMDD[Z] or YYYYMMDDHHMM[SS][Z]") from None
        if not rest:
            break
        if not rest.startswith(",") or len(rest) == 1:
            raise UsageError(f"{where}: options must be separated by single commas in {opts!r}",
                             'e.g. namespaces="capture-manifest",valid-after="20250101"')
        rest = rest[1:]
    return out


def _split_options(text: str) -> tuple[str, str]:
    """Split at the first whitespace outside double quotes."""
    quoted = False
    for i, c in enumerate(text):
        if c == '"':
            quoted = not quoted
        elif c in " \t" and not quoted:
            return text[:i], text[i:].lstrip(" \t")
    return text, ""


def _parse_line(line: str, where: str) -> AllowedSigner | None:
    text = line.strip(" \t\r\n")
    if not text or text.startswith("#"):
        return None
    if text.startswith('"'):
        end = text.find('"', 1)
        if end < 0:
            raise UsageError(f"{where}: unterminated quote in the principals", "close the double quote")
        principals, rest = text[1:end], text[end + 1:]
        if rest and rest[0] not in " \t":
            raise UsageError(f"{where}: expected a space after the quoted principals", "separate the fields with spaces")
    else:
        principals, _, rest = text.replace("\t", " ").partition(" ")
    rest = rest.lstrip(" \t")
    if not principals:
        raise UsageError(f"{where}: no principals", "each line is: PRINCIPALS [OPTIONS] ssh-ed25519 BASE64")
    if not rest:
        raise UsageError(f"{where}: missing key", "each line is: PRINCIPALS [OPTIONS] ssh-ed25519 BASE64")
    options = ""
    first = rest.split(None, 1)[0]
    if first not in _KEY_TYPES:
        options, rest = _split_options(rest)
        if not rest:
            raise UsageError(f"{where}: missing key after the options", "each line is: PRINCIPALS [OPTIONS] ssh-ed25519 BASE64")
    fields = rest.split(None, 2)
    if len(fields) < 2 or fields[0] not in _KEY_TYPES:
        raise UsageError(f"{where}: invalid key {fields[0]!r}" if fields else f"{where}: missing key",
                         "the key is a type and base64, e.g. ssh-ed25519 AAAAC3Nza...")
    key_type, key_b64 = fields[0], fields[1]
    try:
        embedded = _Reader(base64.b64decode(key_b64, validate=True), "key").string().decode("ascii", "replace")
    except (binascii.Error, SignatureError):
        embedded = None
    if embedded != key_type:
        raise UsageError(f"{where}: invalid {key_type} key (bad base64 or wrong type inside)",
                         "copy the key from the signer's .pub file")
    parsed = _parse_options(options, where) if options else {}
    return AllowedSigner(
        principals=principals, options=options, key_type=key_type, key_b64=key_b64,
        namespaces=parsed.get("namespaces"),  # type: ignore[arg-type]
        cert_authority=bool(parsed.get("cert_authority", False)),
        valid_after_epoch_s=parsed.get("valid-after"),  # type: ignore[arg-type]
        valid_before_epoch_s=parsed.get("valid-before"),  # type: ignore[arg-type]
        source=where,
    )


@dataclass(frozen=True)
class AllowedSigners:
    """The signers a verifier trusts, from an allowed-signers file."""

    path: str | None
    signers: tuple[AllowedSigner, ...]

    @classmethod
    def empty(cls) -> AllowedSigners:
        return cls(None, ())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> AllowedSigners:
        p = Path(path)
        try:
            text = read_regular(p, ALLOWED_SIGNERS_MAX_BYTES, UsageError, "allowed-signers file").decode("utf-8")
        except FileNotFoundError:
            raise UsageError(f"{p}: no such allowed-signers file", "check the path given to --allowed-signers "
                             "or $CAPTURE_ALLOWED_SIGNERS") from None
        except IsADirectoryError:
            raise UsageError(f"{p}: is a folder, not an allowed-signers file", "name the file itself") from None
        except PermissionError:
            raise UsageError(f"{p}: permission denied", "make the allowed-signers file readable") from None
        except UnicodeDecodeError as exc:
            raise UsageError(f"{p}: not UTF-8 text (byte {exc.start})", "an allowed-signers file is plain text") from None
        signers = []
        # OpenSSH reads the file with getline(3): a line ends at "\n" and nowhere else. str.splitlines
        # also breaks at \r, \v, \f, \x1c-\x1e, U+0085, U+2028 and U+2029, which would let a comment
        # that a reviewer sees on one line smuggle in a second entry.
        for number, line in enumerate(text.split("\n"), start=1):
            entry = _parse_line(line, f"{p}:{number}")
            if entry is not None:
                signers.append(entry)
        return cls(str(p), tuple(signers))

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
        if not self.signers:
            return f"{where} lists no signers"
        t = self._now(now)
        reasons = [s.why_not(principal, public_key_line, namespace, t) for s in self.signers]
        specific = [r for r in reasons if r and r != _KEY_NOT_LISTED]
        if specific:
            return specific[0]
        return f"key {fingerprint(public_key_line)} is not listed in {where}"


def find_allowed_signers(manifest_path: str | os.PathLike[str], explicit: str | os.PathLike[str] | None = None) -> Path | None:
    """--allowed-signers > $CAPTURE_ALLOWED_SIGNERS > ``allowed_signers`` or ``.capture/allowed_signers``
    in the manifest's folder or a parent > ``~/.config/capture/allowed_signers``; None if none exists."""
    if explicit:
        return Path(explicit)
    env = os.environ.get("CAPTURE_ALLOWED_SIGNERS", "")
    if env:
        return Path(env).expanduser()
    folder = Path(os.path.abspath(manifest_path)).parent
    for candidate_dir in (folder, *folder.parents):
        for name in ("allowed_signers", ".capture/allowed_signers"):
            candidate = candidate_dir / name
            if candidate.is_file():
                return candidate
    home = config_dir() / "allowed_signers"
    return home if home.is_file() else None

"""Ports of the OpenSSH 9.2p1 functions that read an allowed-signers line, over bytes.

``match_pattern``/``match_pattern_list`` (match.c), ``parse_absolute_time`` and ``strdelimw``
(misc.c, with glibc ``strptime``), ``sshkey_read``/``sshkey_advance_past_options`` (sshkey.c,
authfile.c), ``b64_pton`` (openbsd-compat/base64.c), ``sshsigopt_parse`` and
``parse_principals_key_and_options`` (sshsig.c). :mod:`capture.signing.trust` builds the file
reader on them; docs/trust.md says what each one accepts.
"""

from __future__ import annotations

import base64
import binascii
import functools
import re
import time
from dataclasses import dataclass

from capture.signing.sshsig import _KEY_TYPES

_ED25519 = b"ssh-ed25519"
_WHITESPACE = b" \t\r\n"  # misc.c WHITESPACE (strdelimw)
_BLANK = b" \t"  # skip_space, sshkey_read, sshkey_advance_past_options
_C_SPACE = b" \t\n\v\f\r"  # isspace() in the C locale (b64_pton, strptime)
_SUBPATTERN_MAX = 1023  # match_pattern_list: char sub[1024]


# --------------------------------------------------------------------------- match.c


@functools.lru_cache(maxsize=512)
def _segment_regex(segment: bytes) -> re.Pattern[bytes]:
    # A fixed-length pattern of literals and "any byte": no quantifier, so no backtracking.
    return re.compile(b"".join(b"." if c == 0x3F else re.escape(bytes([c])) for c in segment), re.DOTALL)


def _segment_at(s: bytes, pos: int, segment: bytes) -> bool:
    if b"?" not in segment:
        return s.startswith(segment, pos)
    return len(s) - pos >= len(segment) and _segment_regex(segment).match(s, pos) is not None


def _segment_find(s: bytes, segment: bytes, start: int, end: int) -> int:
    if b"?" not in segment:
        return s.find(segment, start, end)
    m = _segment_regex(segment).search(s, start, end)
    return m.start() if m else -1


def match_pattern(s: bytes, pattern: bytes) -> bool:
    """OpenSSH ``match_pattern``: ``*`` is any run of bytes, ``?`` exactly one byte, the rest literal.

    Linear in practice: the pattern is cut at each ``*`` and every piece is placed at its leftmost
    possible position (which is enough when the only wildcards are ``*`` and ``?``).
    """
    pieces = pattern.split(b"*")
    if len(pieces) == 1:
        return len(s) == len(pattern) and _segment_at(s, 0, pattern)
    first, *middle, last = pieces
    if len(s) < len(first) + len(last):
        return False
    end = len(s) - len(last)
    if not _segment_at(s, 0, first) or not _segment_at(s, end, last):
        return False
    pos = len(first)
    for piece in middle:
        if piece:
            found = _segment_find(s, piece, pos, end)
            if found < 0:
                return False
            pos = found + len(piece)
    return True


def _match_pattern_list(s: bytes, patterns: bytes) -> int:
    """OpenSSH ``match_pattern_list(s, patterns, dolower=0)``: 1 match, 0 none, -1 negated match."""
    got_positive = 0
    i, n = 0, len(patterns)
    while i < n:
        negated = patterns[i] == 0x21  # "!"
        if negated:
            i += 1
        comma = patterns.find(b",", i)
        stop = n if comma < 0 else comma
        if stop - i >= _SUBPATTERN_MAX:
            return 0  # "If subpattern too long, return failure (no match)."
        sub = patterns[i:stop]
        i = stop + 1 if comma >= 0 else stop
        if match_pattern(s, sub):
            if negated:
                return -1
            got_positive = 1
    return got_positive


def _bytes(text: str | bytes) -> bytes:
    return text if isinstance(text, bytes) else text.encode("utf-8", "surrogateescape")


def match_pattern_list(value: str | bytes, patterns: str | bytes) -> bool:
    """ssh's ``match_pattern_list``: comma-separated ``*``/``?`` globs; a matching ``!`` pattern vetoes.

    Over UTF-8 bytes and case-sensitive, as ssh-keygen matches principals and namespaces.
    """
    return _match_pattern_list(_bytes(value), _bytes(patterns)) == 1


# --------------------------------------------------------------------------- misc.c: parse_absolute_time


def _strptime_number(buf: bytes, pos: int, low: int, high: int, width: int) -> tuple[int, int] | None:
    """glibc strptime's ``get_number``: skip C white space, then 1..width digits while they fit."""
    while pos < len(buf) and buf[pos] in _C_SPACE:
        pos += 1
    if pos >= len(buf) or not 0x30 <= buf[pos] <= 0x39:
        return None
    val = 0
    while True:
        val = val * 10 + buf[pos] - 0x30
        pos += 1
        width -= 1
        if not (width > 0 and val * 10 <= high and pos < len(buf) and 0x30 <= buf[pos] <= 0x39):
            break
    return (val, pos) if low <= val <= high else None


# (separator before the field, low, high, digits) for %Y %m %d %H %M %S
_TIME_FIELDS = ((b"", 0, 9999, 4), (b"-", 1, 12, 2), (b"-", 1, 31, 2),
                (b"T", 0, 23, 2), (b":", 0, 59, 2), (b":", 0, 61, 2))


def parse_absolute_time(text: str | bytes) -> int | None:
    """OpenSSH 9.2 ``parse_absolute_time``: epoch seconds, or None where OpenSSH refuses the text.

    ``YYYYMMDD``, ``YYYYMMDDHHMM`` or ``YYYYMMDDHHMMSS``, each optionally ending in ``Z`` or ``UTC``
    (either case) for UTC, else local time (``mktime`` with ``tm_isdst = 0``, as OpenSSH's zeroed
    ``struct tm`` asks). The digits go through glibc ``strptime`` as OpenSSH arranges them, so its
    quirks hold too (a field may be shorter and padded with white space; Feb 31 rolls over to March;
    seconds go up to 61). A time before 1970 is refused.
    """
    s = _bytes(text)
    n = len(s)
    utc = False
    if n > 1 and s[-1:].lower() == b"z":
        utc, n = True, n - 1
    elif n > 3 and s[-3:].lower() == b"utc":
        utc, n = True, n - 3
    if n not in (8, 12, 14):
        return None
    cuts = (0, 4, 6, 8, 10, 12, 14)[:{8: 4, 12: 6, 14: 7}[n]]
    fields = len(cuts) - 1
    buf = b"".join(_TIME_FIELDS[k][0] + s[cuts[k]:cuts[k + 1]] for k in range(fields))
    pos = 0
    values = []
    for sep, low, high, width in _TIME_FIELDS[:fields]:
        if sep:
            if buf[pos:pos + 1] != sep:
                return None
            pos += 1
        got = _strptime_number(buf, pos, low, high, width)
        if got is None:
            return None
        values.append(got[0])
        pos = got[1]
    if pos != len(buf):
        return None
    year, month, day, hour, minute, second = (values + [0, 0, 0])[:6]
    if utc:
        # timegm, valid for year 0..9999 (calendar.timegm would refuse year 0 through datetime)
        days = _days_from_civil(year, month) + day - 1
        epoch = days * 86400 + hour * 3600 + minute * 60 + second
    else:
        try:
            epoch = int(time.mktime((year, month, day, hour, minute, second, 0, 0, 0)))
        except (OverflowError, ValueError):
            return None
    return epoch if epoch >= 0 else None


def _days_from_civil(year: int, month: int) -> int:
    """Days from 1970-01-01 to the first of ``month`` (proleptic Gregorian)."""
    y = year - (month <= 2)
    era = y // 400
    yoe = y - era * 400
    mp = (month + 9) % 12
    doy = (153 * mp + 2) // 5
    doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
    return era * 146097 + doe - 719468


# --------------------------------------------------------------------------- keys (sshkey_read)


def _b64_pton(text: bytes) -> bytes | None:
    """ISC ``b64_pton`` as OpenSSH uses it: C white space anywhere is skipped, padding must be
    exact, the bits after the last byte must be zero, no partial group without padding."""
    data = bytes(c for c in text if c not in _C_SPACE)
    if not data or not re.fullmatch(rb"[A-Za-z0-9+/]*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?", data):
        return None if data else b""
    if len(data) % 4:
        return None
    try:
        raw = base64.b64decode(data, validate=True)
    except binascii.Error:
        return None
    return raw if base64.b64encode(raw) == data else None  # trailing bits must be zero


def _ed25519_from_blob(blob: bytes) -> bytes | None:
    """``sshkey_fromb`` for an Ed25519 key: the 32 public bytes, or None.

    The inner type may be ``ssh-ed25519`` or the short name ``ED25519`` in any case (a trailing NUL
    allowed), as ``sshkey_type_from_name`` and ``sshbuf_get_cstring`` read it; nothing may follow.
    """
    def string(at: int) -> tuple[bytes, int] | None:
        if at + 4 > len(blob):
            return None
        size = int.from_bytes(blob[at:at + 4], "big")
        if at + 4 + size > len(blob):
            return None
        return blob[at + 4:at + 4 + size], at + 4 + size

    got = string(0)
    if got is None:
        return None
    name, at = got
    if b"\0" in name[:-1]:
        return None
    name = name.removesuffix(b"\0")
    if name != _ED25519 and name.lower() != b"ed25519":
        return None
    got = string(at)
    if got is None or len(got[0]) != 32 or got[1] != len(blob):
        return None
    return got[0]


def _read_key(line: bytes, pos: int) -> tuple[bytes | None, str]:
    """``sshkey_read`` at ``pos``: (Ed25519 public bytes, "") or (None, why not)."""
    rest = line[pos:]
    space = _strcspn(rest, _BLANK)
    if space == len(rest):
        return None, "missing key" if not rest.strip(_C_SPACE) else "invalid key"
    key_type = rest[:space]
    if key_type != _ED25519:
        known = key_type.decode("ascii", "replace") in _KEY_TYPES
        return None, (f"{key_type.decode('ascii', 'replace')} key (capture trusts only Ed25519 keys)"
                      if known else "invalid key or options")
    p = space + _strspn(rest, _BLANK, space)
    if p == len(rest):
        return None, "invalid key (no base64)"
    blob_text = rest[p:p + _strcspn(rest[p:], _BLANK)]
    blob = _b64_pton(blob_text)
    raw = _ed25519_from_blob(blob) if blob else None
    if raw is None:
        return None, "invalid ssh-ed25519 key (bad base64 or wrong type inside)"
    return raw, ""


def _key_of(public_key_line: str) -> bytes | None:
    """The 32 Ed25519 public bytes of ``ssh-ed25519 BASE64 [comment]`` (as the signature names it)."""
    raw, _ = _read_key(_bytes(public_key_line) + b" ", 0) if public_key_line else (None, "")
    return raw


# --------------------------------------------------------------------------- sshsig.c: one line


def _strspn(s: bytes, chars: bytes, start: int = 0) -> int:
    i = start
    while i < len(s) and s[i] in chars:
        i += 1
    return i - start


def _strcspn(s: bytes, chars: bytes) -> int:
    for i, c in enumerate(s):
        if c in chars:
            return i
    return len(s)


def _strdelimw(line: bytes, pos: int) -> tuple[bytes | None, int | None]:
    """misc.c ``strdelimw``: the next token (a double quote starts a quoted run) and where the
    next one starts; (None, _) for an unmatched quote, (token, None) when nothing follows."""
    stop = next((i for i in range(pos, len(line)) if line[i] in _WHITESPACE + b'"'), None)
    if stop is None:
        return line[pos:], None
    if line[stop] == 0x22:
        close = line.find(b'"', stop + 1)
        if close < 0:
            return None, None
        return line[pos:stop] + line[stop + 1:close], close + 1 + _strspn(line, _WHITESPACE, close + 1)
    return line[pos:stop], stop + 1 + _strspn(line, _WHITESPACE, stop + 1)


def _advance_past_options(line: bytes, pos: int) -> int | None:
    """authfile.c ``sshkey_advance_past_options``: the first space or tab outside double quotes."""
    quoted = False
    i = pos
    while i < len(line) and (quoted or line[i] not in _BLANK):
        if line[i] == 0x5C and line[i + 1:i + 2] == b'"':
            i += 1
        elif line[i] == 0x22:
            quoted = not quoted
        i += 1
    return None if i == len(line) and quoted else i


def _dequote(opts: bytes, pos: int) -> tuple[bytes | None, int]:
    """misc.c ``opt_dequote``: a double-quoted value with ``\\"`` for a quote."""
    if opts[pos:pos + 1] != b'"':
        return None, pos
    out = bytearray()
    i = pos + 1
    while i < len(opts) and opts[i] != 0x22:
        if opts[i] == 0x5C and opts[i + 1:i + 2] == b'"':
            i += 1
        out.append(opts[i])
        i += 1
    if i >= len(opts):
        return None, i
    return bytes(out), i + 1


@dataclass(frozen=True)
class _Options:
    cert_authority: bool = False
    namespaces: bytes | None = None
    valid_after: int = 0
    valid_before: int = 0


def _parse_options(opts: bytes) -> tuple[_Options | None, str]:
    """sshsig.c ``sshsigopt_parse``."""
    ca, namespaces, after, before = False, None, 0, 0
    i, n = 0, len(opts)
    while i < n and opts[i] not in _BLANK:
        lower = opts[i:i + 16].lower()
        if lower.startswith(b"cert-authority"):
            ca, i = True, i + len(b"cert-authority")
        elif lower.startswith(b"namespaces="):
            if namespaces is not None:
                return None, 'multiple "namespaces" clauses'
            namespaces, i = _dequote(opts, i + len(b"namespaces="))
            if namespaces is None:
                return None, "namespaces: missing quote"
        elif lower.startswith((b"valid-after=", b"valid-before=")):
            name = "valid-after" if lower.startswith(b"valid-after=") else "valid-before"
            if (after if name == "valid-after" else before) != 0:
                return None, f'multiple "{name}" clauses'
            value, i = _dequote(opts, i + len(name) + 1)
            if value is None:
                return None, f"{name}: missing quote"
            when = parse_absolute_time(value)
            if not when:
                return None, f'invalid "{name}" time {value.decode("utf-8", "replace")!r}'
            if name == "valid-after":
                after = when
            else:
                before = when
        if i >= n or opts[i] in _BLANK:
            break
        if opts[i] != 0x2C:
            return None, "unknown key option"
        i += 1
        if i >= n:
            return None, "unexpected end-of-options"
    if after and before and before <= after:
        return None, '"valid-before" time is before "valid-after"'
    return _Options(ca, namespaces, after, before), ""


def _parse_line(line: bytes) -> tuple[_ParsedLine | None, str]:
    """sshsig.c ``parse_principals_key_and_options`` (without the principal shortcut: every line
    is parsed, so skipped lines can be reported); (None, "") for a blank or comment line."""
    line = line.split(b"\0", 1)[0]
    cp = _strspn(line, _BLANK)
    if cp == len(line) or line[cp] == 0x23:  # "#"
        return None, ""
    principals, cp2 = _strdelimw(line, cp)
    if principals is None:
        return None, "invalid line (unmatched quote in the principals)"
    if cp2 is None:
        return None, "invalid line (missing key)"
    key, why = _read_key(line, cp2)
    opts = b""
    first = line[cp2:cp2 + _strcspn(line[cp2:], _BLANK)]
    if key is None and (first == _ED25519 or first.decode("ascii", "replace") in _KEY_TYPES):
        return None, why  # a key type is never a valid options field, so OpenSSH skips the line here too
    if key is None:
        end = _advance_past_options(line, cp2)
        if end is None:
            return None, "invalid options (unmatched quote)"
        if end == len(line):
            return None, f"missing key ({why})" if why.startswith("missing") else "missing key"
        opts = line[cp2:end]
        key, why = _read_key(line, end + 1 + _strspn(line, _BLANK, end + 1))
        if key is None:
            return None, why
    options, why = _parse_options(opts)
    if options is None:
        return None, f"bad options: {why}"
    return _ParsedLine(principals, opts, key, options), ""


@dataclass(frozen=True)
class _ParsedLine:
    principals: bytes
    options: bytes
    key: bytes
    parsed: _Options

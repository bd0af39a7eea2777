"""Text from files, made safe for a terminal: control characters never reach it raw.

A manifest, a trailer's principal, an allowed-signers comment or a file name can hold ``\\r``,
``\\n``, ``\\x1b[...`` (terminal escapes) or bidirectional overrides. Printed raw they can move the
cursor, erase a line and print a forged ``OK`` row in ``capture verify DIR``. Every report line and
every ``error:`` line goes through :func:`printable`, which writes such characters as Python-style
escapes (``\\x1b``, ``\\n``, ``\\u202e``).
"""

from __future__ import annotations

import re
import unicodedata

# C0 and C1 controls, DEL, and the Unicode format characters that reorder or hide text
# (bidi embeddings/overrides/isolates, zero-width joiners, line/paragraph separators, BOM).
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")


def _escape(m: re.Match[str]) -> str:
    c = m.group(0)
    if c == "\n":
        return "\\n"
    if c == "\r":
        return "\\r"
    if c == "\t":
        return "\\t"
    o = ord(c)
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}"


def printable(text: object) -> str:
    """``str(text)`` with control and text-reordering characters escaped; ordinary text unchanged."""
    s = str(text)
    if _UNSAFE.search(s) is None and s.isprintable():
        return s
    s = _UNSAFE.sub(_escape, s)
    # Anything else Unicode calls a control or unassigned-format character.
    return "".join(c if c.isprintable() or c == " " or unicodedata.category(c) not in ("Cc", "Cf", "Cs", "Co")
                   else f"\\u{ord(c):04x}" for c in s)


def printable_lines(text: str) -> str:
    """Each line of ``text`` made :func:`printable`, keeping the line breaks we put there ourselves."""
    return "\n".join(printable(line) for line in text.split("\n"))

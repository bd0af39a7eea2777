"""STAND-IN (helper `integrations`): minimal credential redaction until helper `probes`' module
of the same name is merged; the lead replaces this file with that one. Only ``redact_text`` is
relied on (by ``capture exec``, for the recorded command line).
"""

from __future__ import annotations

import re

MASK = "<redacted>"

_URL_USERINFO = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)[^/\s@]+@", re.I)
_TOKENS = re.compile(
    r"\bhf_[A-Za-z0-9]{10,}|\b(?:ghp|gho|ghu|ghs|ghr)_[A-Za-z0-9]{20,}|\bgithub_pat_\w{20,}|\bglpat-[\w-]{20,}"
    r"|\bxox[abprs]-[\w-]{10,}|\bsk-[A-Za-z0-9_-]{20,}|\bAKIA[0-9A-Z]{16}\b|\bAIza[\w-]{30,}"
    r"|\beyJ[\w-]{10,}\.[\w-]{10,}\.[\w-]*"
)
_ASSIGNMENT = re.compile(
    r"(?P<key>[\w.-]*(?:token|secret|password|passwd|api[_-]?key|access[_-]?key|credential|auth)[\w.-]*)"
    r"(?P<sep>\s*[=:]\s*)(?P<value>[^\s&]+)", re.I)
_QUERY = re.compile(r"(?P<key>[?&](?:[\w.-]*(?:token|key|sig|secret|pass|auth|cred)[\w.-]*)=)[^&\s]+", re.I)


def redact_text(s: str) -> str:
    """``s`` with URL user info, known token shapes and ``secret=value`` assignments masked."""
    s = _URL_USERINFO.sub(lambda m: f"{m.group('scheme')}{MASK}@", s)
    s = _QUERY.sub(lambda m: f"{m.group('key')}{MASK}", s)
    s = _ASSIGNMENT.sub(lambda m: f"{m.group('key')}{m.group('sep')}{MASK}", s)
    return _TOKENS.sub(MASK, s)

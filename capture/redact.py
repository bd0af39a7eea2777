"""Credentials never reach a manifest, a report, a log or an export: one place that removes them.

Two kinds of evidence, used together:

- **structure**: where a credential sits in a URL or a command line: the userinfo of a URL
  (``https://user:pw@host``, ``https://TOKEN@host``; ``ssh://git@host`` keeps its user, not a
  password), ``user:password@host`` without a scheme, query parameters and fragment parameters
  whose key names a credential (``token``, ``sig``, ``key``, ``pwd``, ``jwt``, ``ticket``,
  ``pat``, ``X-Goog-Signature``, ``X-Amz-*``, ``access_token`` ...), flag and assignment forms
  (``--password=...``, ``token: ...``, ``Bearer ...``), and names of variables or keys
  (``*_TOKEN``, ``*_SECRET`` ...);
- **value**: what a credential looks like wherever it sits: provider token formats (Hugging Face,
  GitHub, GitLab, Slack, OpenAI-style, AWS, Google API keys, JWTs, private key blocks) and, in
  a URL path, an opaque run (20+ letters and digits mixing upper case, lower case and digits; hex
  digests and file names are not opaque).

A URL that cannot be parsed is not returned as it came: it is scrubbed as free text, and withheld
whole (:data:`REDACTED`) if anything credential-like is left. Every probe, the trial config
recorder and the fingerprint's final pass call this module; nothing else redacts.
"""

from __future__ import annotations

import re
import urllib.parse
from typing import Any

REDACTED = "<redacted>"
"""What stands where a credential was removed from free text or a whole value was withheld."""

# --------------------------------------------------------------------------- evidence

_SECRET_KEY = re.compile(
    r"token|secret|passw|pwd|pass$|^pw$|key|sig|auth|cred|session|cookie|jwt|ticket|^pat$|otp|"
    r"private|bearer|x-amz-|x-goog-|^code$|^skoid$|^sktid$",
    re.I,
)
"""Query and fragment keys whose value is a credential (Azure SAS: `sig`, `skoid`, `sktid`)."""

SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH|PRIVATE|COOKIE|SESSION|JWT", re.I)
"""Variable names that announce a credential."""
_BENIGN_NAME_WORDS = re.compile(
    r"tokeni[sz]\w*|(?:bos|eos|pad|unk|sep|cls|mask|start|end|decoder_start)_tokens?|tokens?_(?:id|ids|per\w*)|"
    r"(?:max|num|min)_(?:new_)?tokens|key_value|kv_heads|monkey|author\w*",
    re.I,
)
"""Words inside names that contain TOKEN, KEY or AUTH and hold no credential (tokenizer, pad_token ...)."""


def name_is_secret(name: str) -> bool:
    """A variable or key name that announces a credential (``HF_TOKEN``, ``api_key``; not ``tokenizer``)."""
    return bool(SECRET_NAME.search(_BENIGN_NAME_WORDS.sub("", name)))
SUSPICIOUS_NAME = re.compile(r"PASS|PWD|CRED|CERT|SIGN|API|ACCESS|SALT|HMAC|LICEN[CS]E|ACCOUNT|USER", re.I)
"""Names where a long opaque value is presumably a credential even without a telltale word."""

_TOKEN_FORMATS = (
    r"\bhf_[A-Za-z0-9]{10,}",
    r"\b(?:ghp|gho|ghu|ghs|ghr)_[A-Za-z0-9]{16,}", r"\bgithub_pat_\w{20,}", r"\bglpat-[\w-]{16,}",
    r"\bgl(?:dt|rt|cbt|ptt|oas)-[\w-]{16,}",
    r"\bxox[abprse]-[\w-]{10,}", r"\bsk-(?:proj-|ant-)?[A-Za-z0-9_-]{20,}", r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b",
    r"\bAIza[\w-]{30,}", r"\bya29\.[\w-]{20,}", r"\bnvapi-[\w-]{12,}", r"\bnpm_[A-Za-z0-9]{30,}",
    r"\bpypi-[\w-]{30,}", r"\bdop_v1_[0-9a-f]{40,}", r"\bSG\.[\w-]{16,}\.[\w-]{16,}",
    r"\beyJ[\w-]{8,}\.[\w-]{8,}(?:\.[\w-]*)?",  # JWT (header.payload[.signature])
    r"-----BEGIN [A-Z ]*PRIVATE KEY-----(?:.*?-----END [A-Z ]*PRIVATE KEY-----)?",
    r"\bbot\d{6,}:[\w-]{30,}",  # Telegram bot token
    r"\b[rs]k_(?:live|test)_[A-Za-z0-9]{16,}", r"\bdapi[0-9a-f]{32}\b",  # Stripe, Databricks
)
TOKEN_VALUE = re.compile("|".join(_TOKEN_FORMATS), re.S)
"""Credentials recognised by their own format, wherever they appear."""

_OPAQUE = re.compile(r"[A-Za-z0-9]{20,}")
_HEX_DIGEST = re.compile(r"(?:[0-9a-fA-F]{2}){16,}(?:\.[A-Za-z0-9]+)*")
_OPAQUE_BLOB = re.compile(r"[0-9a-fA-F]{32,}|[A-Za-z0-9+/_-]{24,}={0,2}")

# A URL in free text (scheme://... up to whitespace or a quote).
_URL_IN_TEXT = re.compile(r"""[A-Za-z][A-Za-z0-9+.-]*://[^\s"'<>`]+""")
# user:password@host without a scheme (scp-like ``git@host:path`` has no colon before the @).
_BARE_USERINFO = re.compile(r"(?<![\w.+-])([\w.%+~-]+):([^\s/@:]+)@(?=[\w\[])")
# --password=VALUE, --token VALUE, password: VALUE, api_key=VALUE, "token" = VALUE
_ASSIGNMENT = re.compile(
    r"""(?P<key>(?:--?)?[\w.-]*?(?:token(?!i[sz])|secret|passw(?:or)?d|passwd|pwd|api[_-]?key|access[_-]?key|"""
    r"""private[_-]?key|(?<![a-z])keys?(?![a-z])|auth|credential|cookie|session|jwt|ticket|signature|(?<![a-z])sig(?![a-z]))[\w.-]*)"""
    r"""(?P<sep>\s*[=:]\s*|\s+(?=\S))(?P<value>"[^"]*"|'[^']*'|[^\s,;&"']+)""",
    re.I,
)
_AUTH_SCHEME = re.compile(r"\b(bearer|basic|token|digest)\s+[\w.~+/=-]{8,}", re.I)


def is_secret_key(key: str) -> bool:
    """A query, fragment, flag or config key whose value is a credential."""
    return bool(_SECRET_KEY.search(key.strip().lstrip("-")))


def _opaque(segment: str) -> bool:
    """A URL path segment that holds a credential: an unbroken run of 20+ letters and digits mixing
    upper case, lower case and digits scattered through it (3+ digits in 2+ places). Hex digests are not opaque (they name content), nor are
    file names, whose words are short and separated (``PyYAML-6.0.1-cp311-manylinux_2_17.whl``)."""
    for run in _OPAQUE.findall(segment):
        if _HEX_DIGEST.fullmatch(run):
            continue
        digit_runs = re.findall(r"[0-9]+", run)
        if re.search(r"[a-z]", run) and re.search(r"[A-Z]", run) and len(digit_runs) >= 2 \
                and sum(map(len, digit_runs)) >= 3:  # random: digits scattered, not a year in a name
            return True
    return False


_B64ISH = re.compile(r"(?<![A-Za-z0-9+/_=-])[A-Za-z0-9+/_-]{30,512}={0,2}(?![A-Za-z0-9+/_=-])")
_UUIDISH = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
_MIXED_MIN_BITS = 4.4
"""Shannon entropy per character above which a 30+ character run of base64 letters that mixes upper
case, lower case and digits is taken for a key (random keys: ~4.7; paths and flag names: < 4.3)."""


def _bits_per_char(text: str) -> float:
    import math
    from collections import Counter

    n = len(text)
    return -sum(c / n * math.log2(c / n) for c in Counter(text).values())


def _random_run(piece: str) -> bool:
    return (not piece.startswith("/") and _UUIDISH.search(piece) is None and re.search(r"[a-z]", piece) is not None
            and re.search(r"[A-Z]", piece) is not None and re.search(r"[0-9]", piece) is not None
            and _bits_per_char(piece) >= _MIXED_MIN_BITS)


def secret_shaped(value: str) -> bool:
    """A value that is a credential by its shape alone, wherever it is: a provider token format, an
    opaque run (:func:`_opaque`), or a 30+ character run of base64 letters that mixes cases and digits
    with the entropy of a random key (an AWS secret access key, a Stripe or Azure key). Hex digests
    are not secret-shaped here (URLs and manifests are full of them); see :func:`looks_secret`."""
    v = value.strip().strip("'\"")
    if TOKEN_VALUE.search(v) or _opaque(v):
        return True
    return any(_random_run(m.group(0)) for m in _B64ISH.finditer(v))


def _token_segment(segment: str) -> bool:
    """A URL path segment or bare fragment that is a token: besides :func:`_opaque` runs, a piece of
    16+ letters and digits mixing upper case, lower case and digits (an entitlement token such as
    Cloudsmith's ``dl.cloudsmith.io/<token>/``); file names and words are split at ``.-_~``."""
    if _opaque(segment) or secret_shaped(segment):
        return True
    for piece in re.split(r"[-_.~+]", segment):
        if len(piece) >= 16 and piece.isalnum() and piece.isascii() and not _HEX_DIGEST.fullmatch(piece) \
                and re.search(r"[a-z]", piece) and re.search(r"[A-Z]", piece) and re.search(r"[0-9]", piece) \
                and sum(map(len, _WORDISH.findall(piece))) * 2 < len(piece):  # not mostly words: MyProject2023Build
            return True
    return False


_WORDISH = re.compile(r"[A-Z]?[a-z]{3,}|[A-Z]{3,}")


# --------------------------------------------------------------------------- URLs


def _redact_pairs(text: str, sep: str) -> str:
    """``k=v&k2=v2``: drop the pairs whose key names a credential; redact token values in the rest."""
    kept = []
    for pair in text.split(sep):
        key, eq, value = pair.partition("=")
        if eq and is_secret_key(urllib.parse.unquote_plus(key)):
            continue
        if not eq and TOKEN_VALUE.search(urllib.parse.unquote_plus(key)):
            continue
        if TOKEN_VALUE.search(urllib.parse.unquote_plus(value)):
            continue
        kept.append(pair)
    return sep.join(kept)


def redact_url(url: str) -> str:
    """A URL with its credentials removed (structure first, then token formats in what is left).

    ``https://user:token@host/x`` -> ``https://host/x`` (over http(s) a lone user name is often the
    token itself, so the whole userinfo goes); ``ssh://git:pw@host/x`` -> ``ssh://git@host/x``;
    credential query and fragment parameters are dropped; a token in the path becomes
    :data:`REDACTED`; ``user:pw@host:path`` (no scheme) loses its userinfo; an unparsable URL is
    scrubbed as text, or withheld whole.
    """
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError:
        return _unparsable(url)
    if not parts.scheme or not parts.netloc:  # scp-like "git@host:x", "user:pw@host:x", a path
        return _scrub(url, urls=False)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        scheme = parts.scheme.lower().rsplit("+", 1)[-1]
        user = userinfo.split(":", 1)[0]
        keep_user = scheme in ("ssh", "sftp") and user and not TOKEN_VALUE.search(user) and not _opaque(user)
        netloc = f"{user}@{host}" if keep_user else host
    path = "/".join(REDACTED if (TOKEN_VALUE.search(urllib.parse.unquote(seg)) or _token_segment(urllib.parse.unquote(seg)))
                    else seg for seg in parts.path.split("/"))
    query = _redact_pairs(parts.query, "&") if parts.query else ""
    fragment = parts.fragment
    if fragment:
        if "=" in fragment or TOKEN_VALUE.search(fragment):
            fragment = _redact_pairs(fragment, "&")
        elif _token_segment(urllib.parse.unquote(fragment)):  # a bare #fragment that is a token
            fragment = ""
    return urllib.parse.urlunsplit((parts.scheme, netloc, path, query, fragment))


def _unparsable(text: str) -> str:
    """A URL that does not parse: scrub it as free text; withhold it if anything is still suspicious."""
    cleaned = _scrub(text, urls=False)
    if "@" in cleaned or "=" in cleaned or _opaque(cleaned) or REDACTED in cleaned:
        return REDACTED
    return cleaned


# --------------------------------------------------------------------------- free text


def _scrub(text: str, urls: bool = True) -> str:
    if urls:
        text = _URL_IN_TEXT.sub(lambda m: redact_url(m.group(0)), text)
    text = _BARE_USERINFO.sub("", text)
    text = _AUTH_SCHEME.sub(lambda m: f"{m.group(1)} {REDACTED}", text)
    text = _ASSIGNMENT.sub(_assignment, text)
    text = TOKEN_VALUE.sub(REDACTED, text)
    text = _B64ISH.sub(lambda m: REDACTED if _random_run(m.group(0)) else m.group(0), text)
    return text


def _assignment(m: re.Match[str]) -> str:
    value = m.group("value")
    if value == REDACTED or value.startswith("<redacted"):
        return m.group(0)
    if m.group("sep").strip() == "" and not m.group("key").startswith("-"):
        # "token VALUE" in prose: only when the value itself looks like a credential
        if not (TOKEN_VALUE.search(value) or _OPAQUE_BLOB.search(value)):
            return m.group(0)
    return f"{m.group('key')}{m.group('sep')}{REDACTED}"


_MAYBE = re.compile(
    r"@|://|bearer|basic|digest|token|secret|passw|pwd|key|auth|credential|cookie|session|jwt|ticket|sig|"
    r"hf_|gh[pousr]_|github_pat_|gl[a-z]{2,4}-|xox|sk-|AKIA|ASIA|AIza|ya29\.|nvapi-|npm_|pypi-|dop_v1_|SG\.|eyJ|"
    r"-----BEGIN|bot\d",
    re.I,
)
"""Everything :func:`_scrub` can act on contains one of these: most strings (versions, paths,
hashes) are passed by this one search instead of five substitutions."""


def redact_text(text: str) -> str:
    """Free text (a variable's value, a flag string, an error message) with every credential removed."""
    if not text or (not _MAYBE.search(text) and not _B64ISH.search(text)):
        return text
    return _scrub(text)


def looks_secret(name: str, value: str) -> bool:
    """A named value (an environment variable, a config key) that must not be recorded as it is:
    its name announces a credential, free-text redaction would change it, or it is secret-shaped
    (a variable whose whole value is 32+ hex digits too: W&B and Databricks keys look like that, and a
    variable rarely holds a bare digest)."""
    if name_is_secret(name):
        return True
    if redact_text(value) != value or secret_shaped(value) or re.fullmatch(r"\s*[0-9a-fA-F]{32,}\s*", value):
        return True
    return bool(SUSPICIOUS_NAME.search(name) and _OPAQUE_BLOB.search(value))


def redact_value(value: Any) -> Any:
    """Every string inside a TOML-ready value (dicts, lists, scalars) passed through :func:`redact_text`."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, dict):
        return {k: redact_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [redact_value(v) for v in value]
    if isinstance(value, tuple):
        return tuple(redact_value(v) for v in value)
    return value


# --------------------------------------------------------------------------- TOML text (trial configs)


def _toml_string_end(text: str, i: int) -> int:
    """Index just past the string literal that starts at ``text[i]`` (one of ``" ' \"\"\" '''``)."""
    quote = text[i]
    if text.startswith(quote * 3, i):
        j = i + 3
        while j < len(text):
            if quote == '"' and text[j] == "\\":
                j += 2
                continue
            if text.startswith(quote * 3, j):
                j += 3
                extra = 0
                while j < len(text) and text[j] == quote and extra < 2:  # up to two more quotes end the content
                    j += 1
                    extra += 1
                return j
            j += 1
        return len(text)
    j = i + 1
    while j < len(text) and text[j] != "\n":
        if quote == '"' and text[j] == "\\":
            j += 2
            continue
        if text[j] == quote:
            return j + 1
        j += 1
    return j


def _toml_string_value(token: str) -> str | None:
    from capture._toml import TomlError, loads

    try:
        value = loads("v = " + token)["v"]
    except (TomlError, KeyError):  # TomlError: also a 5,000-digit integer token
        return None
    return value if isinstance(value, str) else None


def _basic_string(value: str) -> str:
    import json

    return json.dumps(value, ensure_ascii=False)


def toml_without_comments(text: str, redact_strings: bool = True) -> str:
    """TOML text with every comment removed (``#`` inside a string is left alone) and, with
    ``redact_strings``, every string value that holds a credential rewritten without it (a value
    under a key that names a credential, ``token = "..."``, becomes :data:`REDACTED` whole).

    A line that held only a comment is dropped; trailing blanks before a comment go. The result
    parses to the same document as ``text`` except for the redacted strings.
    """
    out: list[str] = []
    statement = ""  # normal-state text since the last newline, "," or "{": the key being assigned
    key = ""
    i = 0
    line_had_content = False
    while i < len(text):
        ch = text[i]
        if ch in "\"'":
            end = _toml_string_end(text, i)
            token = text[i:end]
            if redact_strings:
                value = _toml_string_value(token)
                after = text[end:].lstrip(" \t")[:1]
                is_key = after in ("=", ".") or ("=" not in statement and statement.lstrip().startswith("["))
                if value is not None and not is_key:
                    if name_is_secret(key.strip().strip("\"'")):
                        token = _basic_string(REDACTED)
                    else:
                        cleaned = redact_text(value)
                        if cleaned != value:
                            token = _basic_string(cleaned)
            out.append(token)
            statement += token
            line_had_content = True
            i = end
            continue
        if ch == "#":
            j = text.find("\n", i)
            j = len(text) if j < 0 else j
            while out and out[-1] in (" ", "\t"):
                out.pop()
            if not line_had_content:  # a comment-only line: drop the whole line, newline included
                while out and out[-1] != "\n" and out[-1].strip() == "":
                    out.pop()
                i = j + 1 if j < len(text) else j
                continue
            i = j
            continue
        if ch == "\n":
            line_had_content = False
            statement = ""
        elif ch in ",{":
            statement = ""
        elif ch == "=":
            key = statement
        elif not ch.isspace():
            line_had_content = True
            if ch == "[" and not statement.strip():
                key = ""
        if ch not in "\n,{":
            statement += ch
        out.append(ch)
        i += 1
    return "".join(out)


# --------------------------------------------------------------------------- command lines (capture exec)

_FLAG_SECRET = re.compile(r"(?:^|_)(?:pass(?:word|wd|phrase|in|out)?|pwd|pw|otp|jwt|pin)(?:$|_)|token|secret|auth|credential|"
                          r"api_?key|access_?key|private_?key|(?:^|_)key$|cookie|session|bearer", re.I)
"""Option names (without dashes) whose value is a credential: ``--pass``, ``--passphrase``,
``--auth``, ``--hf-token``, ``--api-key``, ``--db-password`` ..."""
_USER_FLAGS = ("-u", "--user", "--proxy-user")
"""curl/wget-style ``USER:PASSWORD`` options: the part after the first colon is the password."""
_KEY_VALUE = re.compile(r"^(?P<key>[+~]*[A-Za-z_][\w.-]*)=(?P<value>.*)$", re.S)


def _flag_is_secret(name: str) -> bool:
    bare = name.lstrip("-+~").replace("-", "_").replace(".", "_")
    return bool(bare) and bool(_FLAG_SECRET.search(_BENIGN_NAME_WORDS.sub("", bare)))


def _redact_json(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: (REDACTED if isinstance(k, str) and (name_is_secret(k) or _flag_is_secret(k)) and v not in (None, "")
                    else _redact_json(v)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_redact_json(v) for v in obj]
    if isinstance(obj, str):
        return REDACTED if secret_shaped(obj) else redact_text(obj)
    return obj


def _redact_arg(arg: str) -> str:
    stripped = arg.strip()
    if stripped[:1] in ("{", "[") and len(stripped) <= 1_000_000:
        import json

        try:
            parsed = json.loads(stripped)
        except (ValueError, RecursionError):
            parsed = None
        if isinstance(parsed, (dict, list)):
            cleaned = _redact_json(parsed)
            return arg if cleaned == parsed else json.dumps(cleaned, ensure_ascii=False)
    m = _KEY_VALUE.match(arg)
    if m and (name_is_secret(m.group("key")) or _flag_is_secret(m.group("key"))) and m.group("value"):
        return f"{m.group('key')}={REDACTED}"
    return redact_text(arg)


def redact_argv(argv: list[str] | tuple[str, ...]) -> list[str]:
    """A command line as ``capture exec`` records it, credentials removed by structure:

    - the value of an option that takes a secret, given apart or attached (``--pass X``,
      ``--passphrase X``, ``--auth X``, ``--hf-token=X``, ``--password X``);
    - the password of ``-u USER:PASSWORD`` / ``--user USER:PASSWORD`` (curl), also ``-uUSER:PASSWORD``;
    - ``KEY=VALUE`` arguments whose key names a credential (``token=X``, ``db.password=X``);
    - JSON arguments: the value under every key that names a credential, at any depth;
    - and in every argument what :func:`redact_text` finds (URLs with credentials, token formats,
      ``Bearer X``), or a whole argument that is secret-shaped (:func:`secret_shaped`).
    """
    out: list[str] = []
    mask_next = user_next = False
    for arg in argv:
        if mask_next:
            mask_next = False
            if not (arg.startswith("--") and len(arg) > 2):  # `--auth --verbose`: a switch, not a value
                out.append(REDACTED)
                continue
        if user_next:
            user, colon, _ = arg.partition(":")
            out.append(f"{redact_text(user)}:{REDACTED}" if colon else redact_text(arg))
            user_next = False
            continue
        if arg.startswith("-") and not arg.startswith("---") and len(arg) > 1:
            name, eq, value = arg.partition("=")
            if arg in _USER_FLAGS:
                user_next = True
                out.append(arg)
                continue
            if arg.startswith("-u") and not arg.startswith("--") and ":" in arg[2:]:
                out.append(f"-u{redact_text(arg[2:].partition(':')[0])}:{REDACTED}")
                continue
            if name in _USER_FLAGS and eq:
                out.append(f"{name}={redact_text(value.partition(':')[0])}:{REDACTED}" if ":" in value else arg)
                continue
            if (name.startswith("--") or len(name) > 3) and _flag_is_secret(name):  # --pass, -passin (openssl)
                if eq:
                    out.append(f"{name}={REDACTED}" if value else arg)
                else:
                    out.append(arg)
                    mask_next = True
                continue
        out.append(REDACTED if secret_shaped(arg) and not arg.startswith(("/", "./", "../")) else _redact_arg(arg))
    return out

"""Sign and verify manifests: SSHSIG (OpenSSH ``PROTOCOL.sshsig``) over Ed25519, with ``cryptography``.

A signed manifest is ``BODY + TRAILER`` (shared/DESIGN.md, decision 1). The signature covers the
exact bytes of BODY; nothing is re-serialised, and the body is parsed only after the signature
and the signer have been checked. The signature is the same armored block that
``ssh-keygen -Y sign -n capture-manifest`` writes, so either tool verifies what the other signs.

Trust follows ssh-keygen's ALLOWED SIGNERS format (git's ``gpg.ssh.allowedSignersFile``):
``PRINCIPALS [OPTIONS] KEYTYPE BASE64 [COMMENT]`` per line.
"""

from __future__ import annotations

import base64
import binascii
import datetime as _dt
import functools
import getpass
import hashlib
import os
import re
import socket
import stat
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import tomli_w
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import dsa, ec, ed448, rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from capture import manifest
from capture._atomic import atomic_write
from capture.errors import KeyError_, ManifestError, SignatureError, TrustError, UsageError

NAMESPACE = "capture-manifest"
HASH_ALG = "sha512"
FORMAT = "sshsig"

_MAGIC = b"SSHSIG"
_SIG_VERSION = 1
_ARMOR_BEGIN = "-----BEGIN SSH SIGNATURE-----"
_ARMOR_END = "-----END SSH SIGNATURE-----"
_ARMOR_WIDTH = 70  # ssh-keygen wraps the base64 at 70 columns
_ED25519 = "ssh-ed25519"
_TRAILER_KEYS = ("format", "namespace", "principal", "public_key", "signature")

# Key types sshkey_read() knows; in an allowed-signers line, a first word that is not one of
# these starts the options field.
_PLAIN_KEY_TYPES = (
    "ssh-ed25519", "ssh-rsa", "ssh-dss", "ecdsa-sha2-nistp256", "ecdsa-sha2-nistp384",
    "ecdsa-sha2-nistp521", "sk-ecdsa-sha2-nistp256", "sk-ssh-ed25519",
)
_KEY_TYPES = frozenset(
    [t if t.startswith("ssh-") or t.startswith("ecdsa-") else t + "@openssh.com" for t in _PLAIN_KEY_TYPES]
    + [t + "-cert-v01@openssh.com" for t in _PLAIN_KEY_TYPES]
)

_KEYGEN_HINT = "make a new key with `capture keygen -o KEYFILE`"


# --------------------------------------------------------------------------- wire format


def _string(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


class _Reader:
    """Reads the SSH wire encoding (RFC 4251 uint32 and string) and fails loudly on short data."""

    def __init__(self, data: bytes, what: str) -> None:
        self._data = data
        self._pos = 0
        self._what = what

    def _take(self, n: int) -> bytes:
        if self._pos + n > len(self._data):
            raise SignatureError(f"{self._what} is truncated", "the signature was damaged; sign the manifest again")
        out = self._data[self._pos:self._pos + n]
        self._pos += n
        return out

    def raw(self, n: int) -> bytes:
        return self._take(n)

    def u32(self) -> int:
        return struct.unpack(">I", self._take(4))[0]

    def string(self) -> bytes:
        return self._take(self.u32())

    def done(self) -> None:
        if self._pos != len(self._data):
            raise SignatureError(f"{self._what} has {len(self._data) - self._pos} unexpected trailing bytes",
                                 "the signature was damaged; sign the manifest again")


def _ed25519_blob(public: Ed25519PublicKey) -> bytes:
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return _string(_ED25519.encode()) + _string(raw)


def _as_public(key: Ed25519PrivateKey | Ed25519PublicKey) -> Ed25519PublicKey:
    return key.public_key() if isinstance(key, Ed25519PrivateKey) else key


def public_key_line(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    """``ssh-ed25519 AAAA...`` without a comment, as in ``authorized_keys``."""
    return "%s %s" % (_ED25519, base64.b64encode(_ed25519_blob(_as_public(key))).decode("ascii"))


def fingerprint(public_key: str) -> str:
    """``SHA256:...`` of a public key line, as ``ssh-keygen -l`` prints it."""
    fields = public_key.split()
    try:
        blob = base64.b64decode(fields[1], validate=True)
    except (IndexError, binascii.Error):
        raise SignatureError(f"not a public key line: {public_key[:40]!r}",
                             "a public key line reads `ssh-ed25519 AAAA...`") from None
    digest = hashlib.sha256(blob).digest()
    return "SHA256:" + base64.b64encode(digest).decode("ascii").rstrip("=")


# --------------------------------------------------------------------------- keys


def _check_text_field(value: str, what: str) -> None:
    if not value or any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        raise UsageError(f"{what} {value!r} is empty or contains control characters",
                         f"pass a plain {what} such as alice@example.com")


def generate_key(path: str | os.PathLike[str], comment: str | None = None, overwrite: bool = False) -> str:
    """Write a new Ed25519 key: ``path`` (OpenSSH format, mode 0600) and ``path.pub``.

    Returns the public key line written to ``path.pub`` (with the comment, if any).
    """
    path = Path(path)
    pub_path = Path(str(path) + ".pub")
    if comment is not None:
        _check_text_field(comment, "key comment")
    if path.is_dir():
        raise UsageError(f"{path}: is a folder", "name a file for the new key, e.g. `capture keygen -o ./id_ed25519`")
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise UsageError(f"{folder}: no such folder for the new key", f"create it first: mkdir -p {folder}")
    if not overwrite:
        for existing in (path, pub_path):
            if existing.exists() or existing.is_symlink():
                raise UsageError(f"{existing} already exists; refusing to overwrite a key",
                                 "choose another path with `capture keygen -o KEYFILE`, "
                                 "or delete the old key first if you really mean to replace it")
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                serialization.NoEncryption())
    line = public_key_line(key) + (f" {comment}" if comment else "")
    atomic_write(path, private, mode=0o600)
    atomic_write(pub_path, (line + "\n").encode("utf-8"), mode=0o644)
    return line


def _looks_like_public_key(data: bytes) -> bool:
    first = data.strip().split(b" ", 1)[0].decode("ascii", "replace")
    return first in _KEY_TYPES


def load_private_key(path: str | os.PathLike[str]) -> Ed25519PrivateKey:
    """Load an unencrypted Ed25519 private key (OpenSSH or PKCS#8 PEM), refusing unsafe files."""
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise KeyError_(f"{path}: no such key file", _KEYGEN_HINT) from None
    except OSError as exc:
        raise KeyError_(f"{path}: cannot read the key ({exc.strerror})", "check the path and its permissions") from None
    if stat.S_ISDIR(st.st_mode):
        raise KeyError_(f"{path}: is a folder, not a key file", "pass the private key file, e.g. --key ~/.config/capture/id_ed25519")
    try:
        data = path.read_bytes()
    except PermissionError:
        raise KeyError_(f"{path}: permission denied reading the key", "run as the key's owner, or fix its owner with chown") from None
    except OSError as exc:
        raise KeyError_(f"{path}: cannot read the key ({exc.strerror})", "check the path and the disk") from None
    if _looks_like_public_key(data):
        private = str(path)[:-4] if str(path).endswith(".pub") else "the file without .pub"
        raise KeyError_(f"{path}: is a public key; signing needs the private key", f"pass {private} instead")
    # Same rule as ssh's "UNPROTECTED PRIVATE KEY FILE": a key others can read is not private.
    if st.st_mode & 0o077:
        raise KeyError_(f"{path}: permissions {stat.S_IMODE(st.st_mode):04o} are too open for a private key",
                        f"chmod 600 {path}")
    text = data.lstrip()
    if text.startswith(b"-----BEGIN OPENSSH PRIVATE KEY-----"):
        if _openssh_cipher(data) not in (None, "none"):
            raise _passphrase_error(path)
        loader = lambda: serialization.load_ssh_private_key(data, password=None)  # noqa: E731
    elif text.startswith(b"-----BEGIN ") and b"PRIVATE KEY-----" in text.split(b"\n", 1)[0]:
        if text.startswith(b"-----BEGIN ENCRYPTED PRIVATE KEY-----") or b"Proc-Type: 4,ENCRYPTED" in data:
            raise _passphrase_error(path)
        loader = lambda: serialization.load_pem_private_key(data, password=None)  # noqa: E731
    else:
        raise KeyError_(f"{path}: not an OpenSSH or PEM private key", _KEYGEN_HINT)
    try:
        key = loader()
    except TypeError:
        raise _passphrase_error(path) from None
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise KeyError_(f"{path}: cannot load the private key ({str(exc).splitlines()[0].rstrip('.')})", _KEYGEN_HINT) from None
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyError_(f"{path}: holds {_key_kind(key)} key; capture signs with Ed25519 keys only", _KEYGEN_HINT)
    return key


def _key_kind(key: object) -> str:
    for cls, name in ((rsa.RSAPrivateKey, "an RSA"), (ec.EllipticCurvePrivateKey, "an ECDSA"),
                      (dsa.DSAPrivateKey, "a DSA"), (ed448.Ed448PrivateKey, "an Ed448")):
        if isinstance(key, cls):
            return name
    return f"a {type(key).__name__}"


def _passphrase_error(path: Path) -> KeyError_:
    return KeyError_(f"{path}: the key is protected by a passphrase, which capture cannot use unattended",
                     "make a dedicated signing key without one: `capture keygen -o KEYFILE`")


def _openssh_cipher(data: bytes) -> str | None:
    """The cipher name of an ``openssh-key-v1`` file ("none" when unencrypted); None if unreadable."""
    lines = data.decode("ascii", "replace").strip().splitlines()
    try:
        blob = base64.b64decode("".join(lines[1:-1]), validate=False)
        if not blob.startswith(b"openssh-key-v1\0"):
            return None
        reader = _Reader(blob[len(b"openssh-key-v1\0"):], "key")
        return reader.string().decode("ascii", "replace")
    except (binascii.Error, SignatureError):
        return None


def _config_dir() -> Path:
    xdg = os.environ.get("XDG_CONFIG_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".config"
    return base / "capture"


def default_key_path() -> Path:
    """``$CAPTURE_KEY``, else ``~/.config/capture/id_ed25519`` (``$XDG_CONFIG_HOME`` honoured)."""
    env = os.environ.get("CAPTURE_KEY", "")
    if env:
        return Path(env).expanduser()
    return _config_dir() / "id_ed25519"


def _user_at_host() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # a container user with no passwd entry
        user = str(os.getuid())
    return f"{user}@{socket.gethostname() or 'localhost'}"


def default_principal(key_path: str | os.PathLike[str]) -> str:
    """The comment of ``KEY.pub`` if it has one, else ``user@hostname``."""
    try:
        fields = Path(str(key_path) + ".pub").read_text(encoding="utf-8").strip().split(None, 2)
    except (OSError, UnicodeDecodeError):
        fields = []
    if len(fields) == 3 and fields[2].strip():
        return fields[2].strip()
    return _user_at_host()


def _allowed_signers_line(principal: str, public_key: str) -> str:
    shown = f'"{principal}"' if re.search(r"\s", principal) else principal
    return f'{shown} namespaces="{NAMESPACE}" {public_key}'


def ensure_default_key() -> Path:
    """The default signing key, created on first use and trusted in ``~/.config/capture/allowed_signers``."""
    path = default_key_path()
    if path.exists():
        return path
    if os.environ.get("CAPTURE_KEY"):
        raise KeyError_(f"$CAPTURE_KEY names {path}, which does not exist",
                        f"create it with `capture keygen -o {path}` or unset CAPTURE_KEY")
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    principal = _user_at_host()
    line = generate_key(path, comment=principal)
    allowed = _config_dir() / "allowed_signers"
    try:
        old = allowed.read_bytes()
    except FileNotFoundError:
        old = b""
    if old and not old.endswith(b"\n"):
        old += b"\n"
    entry = _allowed_signers_line(principal, " ".join(line.split()[:2]))
    atomic_write(allowed, old + (entry + "\n").encode("utf-8"), mode=0o644)
    sys.stderr.write(f"capture: created signing key {path} for {principal}; its public half is trusted in {allowed}\n")
    return path


# --------------------------------------------------------------------------- SSHSIG


def _signed_data(data: bytes, namespace: str) -> bytes:
    # PROTOCOL.sshsig: MAGIC || string(namespace) || string(reserved) || string(hash_alg) || string(H(message))
    return (_MAGIC + _string(namespace.encode("utf-8")) + _string(b"") + _string(HASH_ALG.encode())
            + _string(hashlib.sha512(data).digest()))


def sshsig_sign(data: bytes, key: Ed25519PrivateKey, namespace: str = NAMESPACE) -> str:
    """Sign ``data``; returns the armored block ``ssh-keygen -Y sign`` would write (ending in a newline)."""
    if not namespace:
        raise UsageError("the signature namespace is empty", f"use {NAMESPACE!r}")
    signature = key.sign(_signed_data(data, namespace))
    blob = (_MAGIC + struct.pack(">I", _SIG_VERSION) + _string(_ed25519_blob(key.public_key()))
            + _string(namespace.encode("utf-8")) + _string(b"") + _string(HASH_ALG.encode())
            + _string(_string(_ED25519.encode()) + _string(signature)))
    b64 = base64.b64encode(blob).decode("ascii")
    lines = [b64[i:i + _ARMOR_WIDTH] for i in range(0, len(b64), _ARMOR_WIDTH)]
    return "\n".join([_ARMOR_BEGIN, *lines, _ARMOR_END]) + "\n"


def _dearmor(armored: str) -> bytes:
    lines = [line.strip() for line in armored.strip().splitlines()]
    if len(lines) < 3 or lines[0] != _ARMOR_BEGIN or lines[-1] != _ARMOR_END:
        raise SignatureError("the signature is not an armored SSH signature block",
                             f"it must start with {_ARMOR_BEGIN} and end with {_ARMOR_END}; sign again")
    try:
        return base64.b64decode("".join(lines[1:-1]), validate=True)
    except binascii.Error:
        raise SignatureError("the signature block is not valid base64", "the signature was damaged; sign again") from None


def sshsig_verify(data: bytes, armored: str, namespace: str = NAMESPACE) -> str:
    """Check an armored SSHSIG signature over ``data``; returns the signer's public key line.

    Only Ed25519 signatures with hash sha512 in ``namespace`` are accepted.
    """
    blob = _dearmor(armored)
    r = _Reader(blob, "the signature")
    if r.raw(len(_MAGIC)) != _MAGIC:
        raise SignatureError("the signature does not start with SSHSIG", "it is not an SSH signature; sign again")
    version = r.u32()
    if version != _SIG_VERSION:
        raise SignatureError(f"unsupported SSHSIG version {version}", "sign again with `capture sign` or ssh-keygen -Y sign")
    public_blob = r.string()
    sig_namespace = r.string().decode("utf-8", "replace")
    r.string()  # reserved: ignored, as ssh-keygen does; the signed data always has it empty
    hash_alg = r.string().decode("utf-8", "replace")
    sig_blob = r.string()
    r.done()
    if sig_namespace != namespace:
        raise SignatureError(f"the signature is for namespace {sig_namespace!r}, not {namespace!r}",
                             f"sign with `capture sign` or `ssh-keygen -Y sign -n {namespace}`")
    if hash_alg != HASH_ALG:
        raise SignatureError(f"the signature uses hash {hash_alg!r}; capture accepts only {HASH_ALG!r}",
                             "sign again with `capture sign` (ssh-keygen's default is sha512)")
    pk = _Reader(public_blob, "the signature's public key")
    key_type = pk.string().decode("utf-8", "replace")
    if key_type != _ED25519:
        raise SignatureError(f"the signature was made with a {key_type} key; capture accepts only Ed25519",
                             _KEYGEN_HINT)
    raw_public = pk.string()
    pk.done()
    sr = _Reader(sig_blob, "the signature value")
    sig_type = sr.string().decode("utf-8", "replace")
    raw_sig = sr.string()
    sr.done()
    if sig_type != _ED25519 or len(raw_public) != 32 or len(raw_sig) != 64:
        raise SignatureError("the signature's key or value is malformed", "the signature was damaged; sign again")
    public = Ed25519PublicKey.from_public_bytes(raw_public)
    try:
        public.verify(raw_sig, _signed_data(data, namespace))
    except InvalidSignature:
        raise SignatureError("the signature does not match the content: the manifest was changed after signing",
                             "find out who changed it; re-sign only content you have checked") from None
    return public_key_line(public)


# --------------------------------------------------------------------------- signed manifests


def _toml_string(value: str) -> str:
    return tomli_w.dumps({"v": value})[len("v = "):].rstrip("\n")


def _render_trailer(principal: str, public_key: str, armored: str) -> bytes:
    lines = [
        manifest.TRAILER_LINE.decode(),
        f'format = "{FORMAT}"',
        f"namespace = {_toml_string(NAMESPACE)}",
        f"principal = {_toml_string(principal)}",
        f"public_key = {_toml_string(public_key)}",
        # A multi-line basic string: TOML drops the newline right after the opening quotes, so the
        # value is exactly the armored block; base64 and the armor lines need no escaping.
        f'signature = """\n{armored}"""',
    ]
    return ("\n".join(lines) + "\n").encode("utf-8")


def make_trailer(body: bytes, key: Ed25519PrivateKey, principal: str) -> bytes:
    """The ``[signature]`` table for ``body`` (which must end with a newline)."""
    if not body.endswith(b"\n"):
        raise ValueError("the body must end with a newline before the [signature] line")
    _check_principal(principal)
    return _render_trailer(principal, public_key_line(key), sshsig_sign(body, key, NAMESPACE))


def _check_principal(principal: str) -> None:
    _check_text_field(principal, "principal")
    if "," in principal or '"' in principal:
        raise UsageError(f"principal {principal!r} contains a comma or a quote",
                         "allowed-signers files use those to separate and quote principals; pick a plain name")


def _prepare_body(raw: bytes, source: str) -> bytes:
    try:
        body, _ = manifest.split_signed(raw)
    except SignatureError:
        raise ManifestError(f"{source}: content follows the [signature] table",
                            "move it above [signature] (or delete the [signature] table), then sign again") from None
    manifest.parse_body(body, source)  # refuse to sign anything that is not a manifest
    if not body.endswith(b"\n"):
        body += b"\n"
    if not body.endswith(b"\n\n"):
        body += b"\n"  # a blank line before [signature], for the reader; it is signed like the rest
    return body


def sign_bytes(raw: bytes, key_path: str | os.PathLike[str], principal: str | None = None,
               source: str = "manifest") -> bytes:
    """``BODY + TRAILER`` for a manifest; an existing trailer is replaced."""
    body = _prepare_body(raw, source)
    key = load_private_key(key_path)
    return body + make_trailer(body, key, principal if principal is not None else default_principal(key_path))


def sign_file(path: str | os.PathLike[str], key_path: str | os.PathLike[str], principal: str | None = None) -> None:
    """Sign (or re-sign) a manifest file in place, atomically, keeping its permissions."""
    raw = manifest.read_bytes(path)
    signed = sign_bytes(raw, key_path, principal, source=str(path))
    atomic_write(path, signed, mode=_shareable_mode(path))


def write_signed(path: str | os.PathLike[str], body: bytes, key_path: str | os.PathLike[str],
                 principal: str | None = None) -> bytes:
    """Write ``body`` and its signature trailer atomically; returns the bytes written."""
    signed = sign_bytes(body, key_path, principal, source=str(path))
    atomic_write(path, signed, mode=_shareable_mode(path))
    return signed


def _shareable_mode(path: str | os.PathLike[str]) -> int:
    """An existing file keeps its mode; a new one gets 0666 less the umask, as open() would give it.

    (A bare temporary file is 0600, which is right for keys and wrong for manifests people share.)
    """
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        pass
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            umask = next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        umask = 0o022
    return 0o666 & ~umask


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
            text = p.read_bytes().decode("utf-8")
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
    home = _config_dir() / "allowed_signers"
    return home if home.is_file() else None


# --------------------------------------------------------------------------- verification


@dataclass(frozen=True)
class SignatureInfo:
    """Who signed a manifest, as established by :func:`verify_signed_bytes`."""

    principal: str
    public_key: str
    fingerprint: str
    namespace: str
    allowed_signers: str | None


def verify_signed_bytes(raw: bytes, allowed: AllowedSigners | None, source: str) -> tuple[SignatureInfo, bytes]:
    """Check the signature over the exact bytes of BODY, then the signer's trust; returns (info, BODY).

    Only after this returns may BODY be parsed (verify before parse).
    """
    # (1) split at the [signature] line; nothing may follow the trailer table
    body, trailer = manifest.split_signed(raw)
    if trailer is None:
        raise SignatureError(f"{source}: not signed (no [signature] table)", f"sign it: capture sign {source} --key KEY")
    # (2) the trailer is a TOML table with exactly the keys we write
    fields = manifest.parse_trailer(trailer, source)
    unknown = sorted(set(fields) - set(_TRAILER_KEYS))
    missing = [k for k in _TRAILER_KEYS if not isinstance(fields.get(k), str)]
    if unknown or missing:
        what = f"unexpected key {unknown[0]!r}" if unknown else f"missing or non-string {missing[0]!r}"
        raise SignatureError(f"{source}: [signature] has {what}", f"re-sign with `capture sign {source} --key KEY`")
    # (3) format and namespace before any cryptography
    if fields["format"] != FORMAT:
        raise SignatureError(f"{source}: signature format {fields['format']!r} is not supported", f'capture writes format = "{FORMAT}"')
    if fields["namespace"] != NAMESPACE:
        raise SignatureError(f"{source}: signature namespace {fields['namespace']!r} is not {NAMESPACE!r}",
                             f"re-sign with `capture sign {source} --key KEY`")
    # (4) the trailer is byte for byte what capture writes for these values, so no byte of the
    #     file (not even a comment or blank line after the table) is outside the signature's reach
    if _render_trailer(fields["principal"], fields["public_key"], fields["signature"]) != trailer:
        raise SignatureError(f"{source}: the [signature] table was altered (extra lines, comments or spacing)",
                             f"re-sign with `capture sign {source} --key KEY`")
    # (5) PROTOCOL.sshsig verification: MAGIC, version, namespace, hash algorithm, then the
    #     Ed25519 signature over MAGIC || namespace || reserved || hash_alg || H(BODY)
    try:
        signer = sshsig_verify(body, fields["signature"], NAMESPACE)
    except SignatureError as exc:
        raise SignatureError(f"{source}: {exc.message}", exc.hint) from None
    # (6) the key named in the trailer is the key inside the signature
    if fields["public_key"].strip() != signer:
        raise SignatureError(f"{source}: public_key in [signature] is not the key that made the signature",
                             "the trailer was edited; re-sign the manifest")
    principal = fields["principal"]
    info = SignatureInfo(principal, signer, fingerprint(signer), NAMESPACE, allowed.path if allowed else None)
    # (7) trust: the allowed-signers file must list this principal with this key for this namespace
    if allowed is None:
        raise TrustError(f"{source}: signature valid ({principal}, {info.fingerprint}) but no allowed-signers file was found",
                         "pass --allowed-signers FILE or set $CAPTURE_ALLOWED_SIGNERS")
    if not allowed.is_trusted(principal, signer, NAMESPACE):
        raise TrustError(f"{source}: signer {principal} ({info.fingerprint}) is not trusted: "
                         f"{allowed.explain(principal, signer, NAMESPACE)}",
                         f"if you trust this key, add to {allowed.path or 'your allowed-signers file'}: "
                         f"{_allowed_signers_line(principal, signer)}")
    return info, body

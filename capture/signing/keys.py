"""Key files: generate, load, the default key and principal."""

from __future__ import annotations

import base64
import binascii
import getpass
import os
import socket
import stat
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.utils import CryptographyDeprecationWarning
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed448, rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from capture import paths
from capture._atomic import atomic_write
from capture._safe_read import ALLOWED_SIGNERS_MAX_BYTES, KEY_MAX_BYTES, read_if_present, read_regular
from capture.errors import KeyError_, SignatureError, UsageError
from capture.signing.sshsig import _KEY_TYPES, _KEYGEN_HINT, _Reader, public_key_line
from capture.signing.trust import _allowed_signers_line


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
        data = read_regular(path, KEY_MAX_BYTES, KeyError_, "key file")
    except FileNotFoundError:
        raise KeyError_(f"{path}: no such key file", _KEYGEN_HINT) from None
    except IsADirectoryError:
        raise KeyError_(f"{path}: is a folder, not a key file", "pass the private key file") from None
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
    loader: Callable[[], object]
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
        with warnings.catch_warnings():  # a DSA key: cryptography warns on load; the one-line error below says it
            warnings.simplefilter("ignore", CryptographyDeprecationWarning)
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
                      (ed448.Ed448PrivateKey, "an Ed448")):
        if isinstance(key, cls):
            return name
    # Not `dsa.DSAPrivateKey`: reading the dsa module's names warns onto the user's terminal (cryptography 51).
    return "a DSA" if type(key).__name__.startswith("DSA") else f"a {type(key).__name__}"


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


def default_key_path() -> Path:
    """``$CAPTURE_KEY``, else ``~/.config/capture/id_ed25519`` (``$XDG_CONFIG_HOME`` honoured):
    :func:`capture.paths.default_key_path`."""
    return paths.default_key_path()


def _user_at_host() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # a container user with no passwd entry
        user = str(os.getuid())
    return f"{user}@{socket.gethostname() or 'localhost'}"


def default_principal(key_path: str | os.PathLike[str]) -> str:
    """The comment of ``KEY.pub`` if it has one, else ``user@hostname``."""
    try:
        pub = read_regular(str(key_path) + ".pub", KEY_MAX_BYTES, KeyError_, "public key file")
        fields = pub.decode("utf-8").strip().split(None, 2)
    except (OSError, UnicodeDecodeError, KeyError_):
        fields = []
    if len(fields) == 3 and fields[2].strip():
        return fields[2].strip()
    return _user_at_host()




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
    allowed = paths.personal_allowed_signers()
    old = read_if_present(allowed, ALLOWED_SIGNERS_MAX_BYTES, KeyError_, "allowed-signers file",
                          "check the file's permissions") or b""
    if old and not old.endswith(b"\n"):
        old += b"\n"
    entry = _allowed_signers_line(principal, " ".join(line.split()[:2]))
    atomic_write(allowed, old + (entry + "\n").encode("utf-8"), mode=0o644, follow_link=True)  # a dotfiles link stays
    sys.stderr.write(f"capture: created signing key {path} for {principal}; its public half is trusted in {allowed}\n")
    return path

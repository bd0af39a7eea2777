"""Fixtures shared by several test modules (each used to carry its own copy).

- ``home``: an isolated HOME and config folder, so no test reads or writes the user's own key or
  allowed signers (was copied in test_cli_core, test_signing, test_sshkeygen_interop).
- ``test_signer``: a real Ed25519 key made by capture.signing and an allowed-signers file trusting it.
- ``h200_body``: the body of a real manifest signed on an NVIDIA H200
  (tests/fixtures/manifests/h200-trial-llama-1b.toml), to re-sign with ``test_signer``.
- ``sign_body``: sign any bytes as a manifest body, bypassing `capture sign`'s own checks, as an
  attacker with a trusted key (or ssh-keygen) could.

The terminal the suite is started from is not part of any test: ``COLUMNS`` and ``LINES`` are set
to the width and height the commands use when there is no terminal (100 × 24) before any test runs,
so an exported ``COLUMNS=80`` in the user's shell (or a pytest-xdist worker's) changes no result.
A test about wrapping sets its own width.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
FIXTURES = TESTS / "fixtures"
if str(TESTS) not in sys.path:  # test modules import shared helpers (test_results_helpers, fakes)
    sys.path.insert(0, str(TESTS))


def pytest_configure(config: pytest.Config) -> None:
    os.environ["COLUMNS"], os.environ["LINES"] = "100", "24"


@pytest.fixture()
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An isolated HOME so no test reads or writes the user's own key or allowed signers."""
    h = tmp_path / "home"
    h.mkdir(exist_ok=True)
    monkeypatch.setenv("HOME", str(h))
    for name in ("XDG_CONFIG_HOME", "CAPTURE_KEY", "CAPTURE_ALLOWED_SIGNERS"):
        monkeypatch.delenv(name, raising=False)
    return h


@dataclass(frozen=True)
class KeySigner:
    key: Path
    principal: str
    allowed: Path
    """An allowed-signers file that trusts ``key`` for ``principal``."""

    def sign(self, body: bytes) -> bytes:
        from capture import signing

        if not body.endswith(b"\n"):
            body += b"\n"
        return body + signing.make_trailer(body, signing.load_private_key(self.key), self.principal)


@pytest.fixture(scope="session")
def test_signer(tmp_path_factory: pytest.TempPathFactory) -> KeySigner:
    from capture import signing

    folder = tmp_path_factory.mktemp("test-signer")
    key = folder / "id_ed25519"
    signing.generate_key(key, "ci@capture")
    allowed = folder / "allowed_signers"
    pub = signing.public_key_line(signing.load_private_key(key))
    allowed.write_text(f'ci@capture namespaces="capture-manifest" {pub}\n')
    return KeySigner(key, "ci@capture", allowed)


@pytest.fixture(scope="session")
def h200_body() -> bytes:
    from capture import manifest as mf

    return mf.split_signed((FIXTURES / "manifests" / "h200-trial-llama-1b.toml").read_bytes())[0]


@pytest.fixture()
def sign_body(test_signer: KeySigner) -> Callable[[bytes], bytes]:
    return test_signer.sign

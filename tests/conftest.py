"""Fixtures shared by several test modules (each used to carry its own copy).

- ``home``: an isolated HOME and config folder, so no test reads or writes the user's own key or
  allowed signers (was copied in test_cli_core, test_signing, test_sshkeygen_interop).
- ``test_signer``: a real Ed25519 key made by capture.signing and an allowed-signers file trusting it.
- ``h200_body``: the body of a real manifest signed on an NVIDIA H200
  (tests/fixtures/manifests/h200-trial-llama-1b.toml), to re-sign with ``test_signer``.
- ``sign_body``: sign any bytes as a manifest body, bypassing `capture sign`'s own checks, as an
  attacker with a trusted key (or ssh-keygen) could.
- ``cgroup_1500m``: the procs file of a real 1.5 GB memory cgroup (tests/memory_cgroups.py), for
  the trials run under a host memory limit; skipped where none can be made.
- ``tiny_cpu_trial``: one real tiny trial on this CPU (no recovery, no report, 2.5 an hour, a target of
  1e6 tokens), run once per test session even across pytest-xdist workers; the readers' tests copy it.

The terminal the suite is started from is not part of any test: ``COLUMNS`` and ``LINES`` are set
to the width and height the commands use when there is no terminal (100 × 24) before any test runs,
so an exported ``COLUMNS=80`` in the user's shell (or a pytest-xdist worker's) changes no result.
A test about wrapping sets its own width.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
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


@dataclass(frozen=True)
class TinyTrial:
    path: Path
    """The signed manifest (read it, copy it; do not change it: other tests read the same file)."""
    allowed: Path
    """An allowed-signers file that trusts the key it was signed with."""


@pytest.fixture(scope="session")
def tiny_cpu_trial(tmp_path_factory: pytest.TempPathFactory) -> TinyTrial:
    """`capture trial --example tiny --no-report --no-recovery --price-per-hour 2.5 --target-tokens 1e6`
    in its own HOME, once per session: the first pytest-xdist worker to ask runs it under a lock in
    the session's shared temporary folder, the others wait for it and read the same files."""
    base = tmp_path_factory.getbasetemp()
    # Under pytest-xdist a worker's folder is pytest-N/popen-gwK/: pytest-N/ belongs to this session.
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    work = shared / "tiny-cpu-trial"
    out, allowed = work / "tiny.toml", work / ".config" / "capture" / "allowed_signers"
    with open(shared / "tiny-cpu-trial.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.exists():
            work.mkdir(exist_ok=True)
            env = dict(os.environ, HOME=str(work), XDG_CONFIG_HOME=str(work / ".config"), CAPTURE_LOG_LEVEL="ERROR")
            env.pop("CAPTURE_KEY", None)
            proc = subprocess.run([sys.executable, "-m", "capture", "trial", "--example", "tiny", "-o", str(out),
                                   "--no-report", "--no-recovery", "--price-per-hour", "2.5", "--target-tokens", "1e6"],
                                  cwd=work, env=env, capture_output=True, text=True, timeout=600)
            assert proc.returncode == 0 and out.exists(), proc.stderr[-2000:]
    return TinyTrial(out, allowed)


@pytest.fixture()
def cgroup_1500m() -> Iterator[Path]:
    from memory_cgroups import held_cgroup

    for procs in held_cgroup(1500 * 2**20):
        if procs is None:
            pytest.skip("no memory cgroup can be made here (needs root and a writable /sys/fs/cgroup)")
        yield procs

"""What the signing tests share: a manifest body from real H200 readings, a fresh key, allowed-signers files."""

from __future__ import annotations

from pathlib import Path

import pytest

from capture import manifest, signing
from test_results_helpers import h200_stack


def h200_manifest() -> dict:
    """A fingerprint manifest body built from the readings of a real H200 (tests/fixtures/h200/probe.json)."""
    m = manifest.new_manifest("fingerprint")
    m["created_utc"] = "2025-06-01T12:00:00Z"
    m.update(h200_stack())
    return m


@pytest.fixture
def body() -> bytes:
    return manifest.dumps(h200_manifest())


@pytest.fixture
def key(tmp_path) -> Path:
    path = tmp_path / "id_ed25519"
    signing.generate_key(path, comment="alice@example.com")
    return path


def allowed_file(tmp_path: Path, *lines: str, name: str = "allowed_signers") -> Path:
    p = tmp_path / name
    p.write_text("".join(line + "\n" for line in lines))
    return p


def pub_of(key_path: Path) -> str:
    return " ".join(Path(str(key_path) + ".pub").read_text().split()[:2])

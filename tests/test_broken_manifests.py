"""One broken manifest per error case (tests/fixtures/broken/, named by scenario), each through the
door: ``open_manifest`` raises ManifestError (exit 3) with a message naming the problem."""

from __future__ import annotations

from pathlib import Path

import pytest

from capture._cli import main
from capture.errors import ManifestError
from capture.verify.open import open_manifest

BROKEN = Path(__file__).parent / "fixtures" / "broken"

EXPECTED = {
    "empty": "file is empty",
    "only-whitespace": "file is empty",
    "not-utf8": "not UTF-8",
    "not-toml": "not valid TOML",
    "truncated": "not valid TOML",
    "no-schema-version": "no schema_version",
    "schema-version-is-a-string": "schema_version must be an integer",
    "future-schema": "newer than this capture understands",
    "unknown-kind": "kind must be one of",
    "created-is-a-toml-date": "created_utc missing or not a string",
    "host-is-a-string": r"\[host\] must be a table",
    "count-is-a-string": "accelerator.count must be an integer, found a string",
    "count-is-nan": "accelerator.count must be an integer, found the float nan",
    "figure-is-inf": "trial.stats.tokens_per_s is inf",
    "driver-is-a-number": "nvidia.driver_version must be a string, found a float",
    "probe-models-is-a-number": "probe.models must be an array of strings",
    "device-index-is-a-list": r"nvidia.devices\[0\].index must be an integer, found an array",
    "unit-field-is-a-string": "trial.checkpoint.duration_s must be a number .its name carries a unit.",
    "code-path-is-a-number": "code.path must be a string",
    "disguised-signature-subtable": "holds a 'signature' table that is not the trailer",
    "disguised-dotted-signature-key": "holds a 'signature' table that is not the trailer",
    "disguised-trailer-inner-spaces": "holds a 'signature' table that is not the trailer",
    "key-with-control-character": "has a key with control characters",
    "nested-30-deep": "nests more than 24 tables or arrays deep",
}


def test_every_broken_file_has_a_case():
    assert sorted(p.stem for p in BROKEN.glob("*.toml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_broken_manifest_is_exit_3_naming_the_problem(name: str, home: Path, capsys):
    path = BROKEN / f"{name}.toml"
    for require in (True, False):
        with pytest.raises(ManifestError, match=EXPECTED[name]):
            open_manifest(path, require_trusted=require)
    assert main(["verify", str(path)]) == 3
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "Traceback" not in err and "\x1b" not in err

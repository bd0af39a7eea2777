"""The manifest body: stable TOML, schema checks, the trailer split."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from capture import manifest as mf
from capture.errors import ManifestError, SignatureError


def _sample() -> dict:
    m = mf.new_manifest("fingerprint")
    m["python"] = {"version": "3.11.7", "packages": {"torch": {"version": "2.13.0"}, "numpy": {"version": "2.4.6"}}}
    m["accelerator"] = {"vendor": "none", "count": 0, "model": "cpu"}
    m["nvidia"] = {"skipped": "no NVIDIA driver"}
    return m


def test_dumps_is_stable_and_ordered():
    m = _sample()
    shuffled = dict(reversed(list(m.items())))
    shuffled["python"] = {"packages": {"numpy": {"version": "2.4.6"}, "torch": {"version": "2.13.0"}}, "version": "3.11.7"}
    assert mf.dumps(m) == mf.dumps(shuffled)
    text = mf.dumps(m).decode()
    # stack sections in SECTION_ORDER: accelerator before nvidia before python
    assert text.index("[accelerator]") < text.index("[nvidia]") < text.index("[python]")
    assert text.startswith("schema_version = 1\nkind = \"fingerprint\"\ncreated_utc = ")


def test_none_is_dropped_and_round_trip():
    m = _sample()
    m["host"] = {"hostname": "h", "libc": None, "cores": (1, 2)}
    data = tomllib.loads(mf.dumps(m).decode())
    assert data["host"] == {"hostname": "h", "cores": [1, 2]}
    assert mf.parse_body(mf.dumps(m)) == data


def test_body_may_not_carry_a_signature_table():
    m = _sample()
    m["signature"] = {"x": 1}
    with pytest.raises(ValueError):
        mf.dumps(m)


def test_value_cannot_fake_the_trailer_line():
    m = _sample()
    m["trial"] = {"config_toml": "a = 1\n[signature]\nb = 2\n"}
    with pytest.raises(ValueError, match=r"\[signature\]"):
        mf.dumps(m)


def test_split_signed():
    body = mf.dumps(_sample())
    trailer = b'[signature]\nformat = "sshsig"\n'
    assert mf.split_signed(body) == (body, None)
    assert mf.split_signed(body + trailer) == (body, trailer)
    with pytest.raises(SignatureError, match="added after"):
        mf.split_signed(body + trailer + b"[extra]\nx = 1\n")


def test_write_is_atomic_and_leaves_no_temp(tmp_path: Path):
    out = tmp_path / "m.toml"
    mf.write(out, _sample())
    assert [p.name for p in tmp_path.iterdir()] == ["m.toml"]
    assert mf.load_unverified(out).data["kind"] == "fingerprint"


BROKEN = {
    "empty.toml": (b"", "empty"),
    "whitespace.toml": (b"  \n\n", "empty"),
    "not-utf8.toml": (b'schema_version = 1\nkind = "fingerprint"\nx = "\xff\xfe"\n', "not UTF-8"),
    "not-toml.toml": (b"this is { not toml\n", "not valid TOML"),
    "truncated.toml": (b'schema_version = 1\nkind = "fingerpr', "not valid TOML"),
    "no-schema.toml": (b'kind = "fingerprint"\ncreated_utc = "x"\n', "no schema_version"),
    "schema-string.toml": (b'schema_version = "1"\nkind = "fingerprint"\ncreated_utc = "x"\n', "must be an integer"),
    "future-schema.toml": (b'schema_version = 99\nkind = "fingerprint"\ncreated_utc = "x"\n', "newer than this capture"),
    "bad-kind.toml": (b'schema_version = 1\nkind = "selfie"\ncreated_utc = "x"\n', "kind must be one of"),
    "wrong-type-section.toml": (b'schema_version = 1\nkind = "fingerprint"\ncreated_utc = "x"\npython = 3\n', r"\[python\] must be a table"),
    "wrong-type-models.toml": (b'schema_version = 1\nkind = "fingerprint"\ncreated_utc = "x"\n[models]\na = 1\n', r"\[models\] must be an array"),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_manifests_are_one_line_errors(tmp_path: Path, name: str):
    data, match = BROKEN[name]
    p = tmp_path / name
    p.write_bytes(data)
    with pytest.raises(ManifestError, match=match) as info:
        mf.load_unverified(p)
    assert "\n" not in info.value.message and info.value.hint
    assert info.value.exit_code == 3


def test_missing_file_and_folder(tmp_path: Path):
    with pytest.raises(ManifestError, match="no such file"):
        mf.read_bytes(tmp_path / "nope.toml")
    with pytest.raises(ManifestError, match="is a folder"):
        mf.read_bytes(tmp_path)


def test_atomic_write_modes(tmp_path: Path):
    import os

    from capture._atomic import atomic_write

    umask = os.umask(0o022)
    try:
        new = tmp_path / "new.toml"
        atomic_write(new, b"x")
        assert new.stat().st_mode & 0o777 == 0o644  # like open(), not mkstemp's 0600
        new.chmod(0o640)
        atomic_write(new, b"y")
        assert new.stat().st_mode & 0o777 == 0o640  # an existing file keeps its mode
        key = tmp_path / "key"
        atomic_write(key, b"k", mode=0o600)
        assert key.stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(umask)


def _real_bodies() -> list[bytes]:
    """Bodies of real signed manifests: this project's committed H200 runs and the trial fixture."""
    root = Path(__file__).resolve().parent.parent
    files = sorted((root / "manifests").glob("[!.]*/*/*.toml")) + [Path(__file__).parent / "fixtures/manifests/h200-trial-llama-1b.toml"]
    # a signed body ends with the blank line before [signature]
    return [mf.split_signed(f.read_bytes())[0].rstrip(b"\n") + b"\n" for f in files]


def test_sections_rendered_apart_join_into_the_same_bytes() -> None:
    """capture fingerprint renders each section where its probe ran and joins them: byte for byte
    what rendering the whole body gives, for every real manifest, with any subset rendered apart."""
    bodies = _real_bodies()
    assert len(bodies) >= 5
    for body in bodies:
        data = mf.parse_body(body)
        assert mf.dumps(data) == body
        tables = {k: v for k, v in mf.ordered(data).items() if isinstance(v, dict)}
        everything = {k: mf.section_text(k, v) for k, v in tables.items()}
        assert mf.dumps(data, everything) == body
        some = {k: t for i, (k, t) in enumerate(everything.items()) if i % 2}
        assert mf.dumps(data, some) == body


def test_an_array_of_tables_is_written_in_one_go() -> None:
    data = {**mf.new_manifest(), "host": {"os": "x"}, "models": [{"repo": "a/b", "files": {"f": "1"}}]}
    rendered = {"host": "[host]\nos = \"NOT USED\"\n"}  # would show if the joined path were taken
    assert mf.dumps(data, rendered) == mf.dumps(data)


@pytest.mark.parametrize("key, allowed", [
    ("naïve", True), ("\u200b", True), ("\x85", True), ("tab\there", False), ("del\x7f", False), ("nul\x00", False),
])
def test_keys_are_refused_for_control_characters_only(key: str, allowed: bool) -> None:
    """Text that is not printable (a zero-width space, NEL) is allowed; C0 controls and DEL are not,
    whether the key is checked on the fast path or not."""
    from capture import schema

    body = {"schema_version": 1, "kind": "fingerprint", "notes": {key: "x"}}
    if allowed:
        schema.validate(body)
    else:
        with pytest.raises(ManifestError, match="has a key with control characters"):
            schema.validate(body)

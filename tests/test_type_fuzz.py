"""Type fuzz over a real H200 manifest, re-signed with a test key: zero uncaught exceptions.

Issue 17 finding 6: wrong types inside validly signed manifests (a count that is a string, inf or
nan, a date where a string belongs, a number where a list belongs) crashed show, compare and pin.
Each mutation here replaces one value (a leaf or a whole table) of
tests/fixtures/manifests/h200-trial-llama-1b.toml with a value of another type, signs the result
with a trusted test key, and runs it through show, compare, diff, export, verify (signature only,
and the full comparison against a live stack probed once), and every few mutations pin. Every
command must return its documented code; anything else (an exception that escapes the CLI's
error handling) fails the test and names the mutation.

Seeded, so a failure reproduces; ``CAPTURE_FUZZ_MUTATIONS`` sets how many (default 700; each runs the seven
commands). Each mutation takes a place not yet mutated (the manifest has about 1,000), so 700 reach
700 different places: more than 1,000 random picks did (about 650).
"""

from __future__ import annotations

import copy
import datetime as dt
import io
import os
import random
import tomllib
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import pytest
import tomli_w

from capture._cli import _parser
from capture.errors import CaptureError
from capture.verify import verify_file

SEED = 20261202
MUTATIONS = int(os.environ.get("CAPTURE_FUZZ_MUTATIONS", "700"))
PIN_EVERY = 40
pytestmark = pytest.mark.timeout(900)

REPLACEMENTS: tuple[Any, ...] = (
    "", "x", "1", "nan", "\x1b[2K\rOK forged", "a" * 300, 0, 1, -1, 2**63 - 1, -(2**63), 1.5, -0.0,
    float("nan"), float("inf"), float("-inf"), True, False,
    dt.datetime(2026, 12, 2, 10, 0, tzinfo=dt.timezone.utc), dt.datetime(2026, 12, 2, 10, 0), dt.date(2026, 12, 2),
    dt.time(10, 0), [], [1], ["a", 2], [[1]], [{"k": 1}], {}, {"k": "v"}, {"index": [1]},
)


def _paths(data: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every table, array and leaf of the manifest (a path is a tuple of keys and indexes)."""
    out = [prefix] if prefix else []
    if isinstance(data, dict):
        for k, v in data.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(data, list):
        for i, v in enumerate(data[:3]):
            out += _paths(v, prefix + (i,))
    return out


def _replace(data: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    new = copy.deepcopy(data)
    node: Any = new
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    return new


def _run(parser, args: list[str]) -> int:
    """What capture._cli.main does with a parsed command line, without rebuilding the parser."""
    ns = parser.parse_args(args)
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = int(ns.func(ns) or 0)
        except CaptureError as exc:
            code = exc.exit_code
    assert "Traceback" not in err.getvalue(), err.getvalue()
    return code


@pytest.fixture(scope="module")
def live_stack() -> dict[str, Any]:
    from capture.fingerprint import collect
    from capture.probes import ProbeOptions

    return collect(ProbeOptions(progress=False), kind="fingerprint", raise_user_errors=False)


def test_type_fuzz_has_no_uncaught_exception(tmp_path: Path, test_signer, h200_body: bytes, live_stack, home):
    from test_results_helpers import git, make_results_repo

    parser = _parser()
    base_data = tomllib.loads(h200_body.decode())
    base = tmp_path / "base.toml"
    base.write_bytes(test_signer.sign(h200_body))
    repo = make_results_repo(tmp_path / "results")
    (repo / ".capture" / "allowed_signers").write_text(test_signer.allowed.read_text())
    git(repo, "commit", "-qam", "trust the test signer")
    allowed = ["--allowed-signers", str(test_signer.allowed)]
    rng = random.Random(SEED)
    paths = _paths(base_data)
    rng.shuffle(paths)  # each place once before any twice
    seen_codes: dict[str, set[int]] = {}
    failures: list[str] = []
    for i in range(MUTATIONS):
        path = paths[i % len(paths)]
        value = rng.choice(REPLACEMENTS)
        what = f"mutation {i}: {'.'.join(map(str, path))} = {value!r}"
        try:
            body = tomli_w.dumps(_replace(base_data, path, value)).encode()
        except (TypeError, ValueError):
            continue  # not expressible in TOML at that place
        f = tmp_path / "m.toml"
        f.write_bytes(test_signer.sign(body))
        runs = {
            "show": (["show", str(f), *allowed], {0, 3}),
            "compare": (["compare", str(base), str(f), *allowed], {0, 1, 3}),
            "diff": (["diff", str(base), str(f)], {0, 1, 3}),
            "export": (["export", str(f), "--format", "in-toto", "--key", str(test_signer.key),
                        "-o", str(tmp_path / "out.json")], {0, 3}),
            "verify": (["verify", str(f), "--signature-only", *allowed], {0, 3}),
        }
        if i % PIN_EVERY == 0:
            runs["pin"] = (["pin", str(f), "--repo", str(repo)], {0, 3})
        for name, (args, allowed_codes) in runs.items():
            try:
                code = _run(parser, args)
            except Exception as exc:  # noqa: BLE001 - the point: nothing may escape
                failures.append(f"{what}: {name} raised {type(exc).__name__}: {exc}")
                continue
            seen_codes.setdefault(name, set()).add(code)
            if code not in allowed_codes:
                failures.append(f"{what}: {name} exit {code}")
        try:
            v = verify_file(f, test_signer.allowed, live=live_stack)
            assert v.status in ("OK", "DRIFT", "MALFORMED"), v
        except Exception as exc:  # noqa: BLE001
            failures.append(f"{what}: verify (stack) raised {type(exc).__name__}: {exc}")
        if len(failures) > 20:
            break
    assert failures == [], "\n".join(failures)
    # The fuzz reached both sides of the door in every command.
    assert all(3 in codes and codes - {3} for codes in seen_codes.values()), seen_codes


DECIDE_MUTATIONS = int(os.environ.get("CAPTURE_FUZZ_DECIDE_MUTATIONS", "300"))
DECIDE_SECTIONS = ("trial", "scaling", "accelerator", "nvidia", "created_utc", "kind", "models")


def test_decide_type_fuzz_has_no_uncaught_exception(tmp_path: Path, test_signer, h200_body: bytes, home):
    """Issue 25: `decide` (terminal, --json and the site) raised on one wrong-typed field in any file,
    signed or not (``trial.fit.cards = 7``). Each mutation of a field decide reads is written twice,
    signed by a trusted key and unsigned, beside the original, and decided in all three forms."""
    parser = _parser()
    base_data = tomllib.loads(h200_body.decode())
    folder = tmp_path / "runs"
    folder.mkdir()
    (folder / "base.toml").write_bytes(test_signer.sign(h200_body))
    allowed = ["--allowed-signers", str(test_signer.allowed)]
    rng = random.Random(SEED + 25)
    paths = [p for p in _paths(base_data) if p[0] in DECIDE_SECTIONS]
    assert ("trial", "fit", "cards") in paths
    forced = [(("trial", "fit", "cards"), 7), (("trial", "fit"), "x"), (("trial", "run"), [1])]
    failures: list[str] = []
    for i in range(DECIDE_MUTATIONS):
        path, value = forced[i] if i < len(forced) else (rng.choice(paths), rng.choice(REPLACEMENTS))
        what = f"mutation {i}: {'.'.join(map(str, path))} = {value!r}"
        try:
            body = tomli_w.dumps(_replace(base_data, path, value)).encode()
        except (TypeError, ValueError):
            continue
        (folder / "signed.toml").write_bytes(test_signer.sign(body))
        (folder / "unsigned.toml").write_bytes(body)
        forms = {"text": [], "json": ["--json"]}
        if i % 2 == 0:
            forms["site"] = ["-o", str(tmp_path / "site")]
        for name, extra in forms.items():
            try:
                code = _run(parser, ["decide", str(folder), *allowed, *extra])
            except Exception as exc:  # noqa: BLE001 - the point: nothing may escape
                failures.append(f"{what}: decide {name} raised {type(exc).__name__}: {exc}")
                continue
            if code != 0:
                failures.append(f"{what}: decide {name} exit {code}")
        if len(failures) > 20:
            break
    assert failures == [], "\n".join(failures)

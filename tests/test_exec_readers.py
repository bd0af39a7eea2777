"""`capture exec` leaves the command's stdout alone, and every reader shows what the command did.

Real commands run under the real `capture exec` (a child process, its own key in an isolated
config folder); the readers (`show`, `compare`, `diff`, `index.md`, `decide`) read the signed
manifests it wrote.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from integrations_helpers import child_env

from capture import manifest as mf
from capture._cli import main
from capture.results.index import render_markdown
from capture.results.summary import summarize

# bytes a JSON-writing tool might print, plus what no text decoder should touch: no final newline
PAYLOAD = "import sys; sys.stdout.buffer.write(b'{\"a\": [1, 2]}\\n\\xff\\x00 no newline at the end'); sys.stdout.flush()"


def _exec(home, cwd, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "capture", "exec", *args], env=child_env(home), cwd=cwd,
                          capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """One command that succeeds and one that fails (exit 3), each with an --output."""
    home = tmp_path_factory.mktemp("exec-home")
    (home / "out.bin").write_bytes(b"x" * 100)
    ok = _exec(home, home, "-o", "ok.toml", "--no-report", "--output", "out.bin", "--", sys.executable, "-c", PAYLOAD)
    failed = _exec(home, home, "-o", "failed.toml", "--no-report", "--output", "out.bin", "--", sys.executable, "-c",
                   "import sys; print('partial'); sys.exit(3)")
    assert ok.returncode == 0, ok.stderr.decode()[-2000:]
    assert failed.returncode == 3, failed.stderr.decode()[-2000:]
    return home, ok, failed, home / "cfg" / "capture" / "allowed_signers"


def test_stdout_is_byte_identical_to_the_command(records, tmp_path):
    home, ok, failed, _ = records
    direct = subprocess.run([sys.executable, "-c", PAYLOAD], capture_output=True, timeout=60)
    assert ok.stdout == direct.stdout  # `capture exec -- cmd > data.json` writes exactly what cmd writes
    assert failed.stdout == b"partial\n"
    assert b"capture: manifest ok.toml" in ok.stderr.splitlines()  # the path as given, on stderr
    # the shell redirect people write: the file holds the command's bytes and nothing else
    subprocess.run(f"{sys.executable} -m capture exec -o r.toml --no-report -- {sys.executable} -c "
                   "'import json; print(json.dumps({\"k\": 1}))' > data.json", shell=True, cwd=tmp_path,
                   env=child_env(home), check=True, timeout=120, capture_output=True)
    assert json.loads((tmp_path / "data.json").read_text()) == {"k": 1}


def test_show_diff_compare_say_the_command_failed(records, capsys, monkeypatch):
    home, _, _, trust = records
    monkeypatch.setenv("COLUMNS", "100")
    ok, failed = str(home / "ok.toml"), str(home / "failed.toml")
    assert main(["show", failed, "--allowed-signers", str(trust)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "exit status  FAILED (exit 3)" in lines
    # the command wraps at spaces under a hanging indent; where it breaks depends on the interpreter's path
    start = next(i for i, x in enumerate(lines) if x.startswith("command "))
    end = next(i for i, x in enumerate(lines) if x.startswith("exit status "))
    assert "sys.exit(3)" in " ".join(x.strip() for x in lines[start:end])
    assert all(x.startswith(" ") for x in lines[start + 1:end])
    assert any(x.startswith("wall time ") for x in lines) and any(x.startswith("outputs ") and "out.bin" in x
                                                                    for x in lines)
    assert main(["show", ok, "--allowed-signers", str(trust)]) == 0
    assert "exit status  succeeded (exit 0)" in capsys.readouterr().out.splitlines()
    main(["diff", ok, failed])
    out = capsys.readouterr().out
    assert "FAILED (exit 3)" in out and "succeeded (exit 0)" in out
    main(["diff", ok, failed, "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert doc["exec"]["b"]["failed"] is True and doc["exec"]["b"]["exit_code"] == 3 and doc["exec"]["a"]["failed"] is False
    main(["compare", ok, failed, "--allowed-signers", str(trust)])
    out = capsys.readouterr().out
    assert "Commands (capture exec)" in out and "FAILED (exit 3)" in " ".join(out.split())
    assert all(len(x) <= 100 for x in out.splitlines())


def test_index_and_decide_say_the_command_failed(records, capsys):
    home, _, _, trust = records
    rows = []
    for name in ("ok.toml", "failed.toml"):
        raw = (home / name).read_bytes()
        rows.append(summarize(mf.parse_body(mf.split_signed(raw)[0]), raw, name).to_json())
    md = render_markdown(rows).decode()
    failed_row = next(x for x in md.splitlines() if "failed.toml" in x)
    assert "FAILED (exit 3)" in failed_row and "1 output(s)" in failed_row
    assert "ok (exit 0)" in next(x for x in md.splitlines() if "ok.toml" in x)
    assert main(["decide", str(home / "ok.toml"), str(home / "failed.toml"), "--allowed-signers", str(trust),
                 "--json"]) == 0
    notes = {f["path"].rsplit("/", 1)[1]: f["note"] for f in json.loads(capsys.readouterr().out)["files"]}
    assert "FAILED (exit 3)" in notes["failed.toml"] and "succeeded (exit 0)" in notes["ok.toml"]

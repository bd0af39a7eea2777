"""`capture exec` around real commands: exit status passed through, signals forwarded, outputs hashed."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time

from integrations_helpers import SCRIPTS, child_env, read_signed, verify

from capture.exec import hash_outputs, redact_argv


def _exec(args, home, cwd, **kw):
    return subprocess.run([sys.executable, "-m", "capture", "exec", *args], env=child_env(home), cwd=cwd,
                          capture_output=True, text=True, timeout=120, **kw)


def test_failing_command_keeps_its_exit_status_and_its_failure_is_signed(tmp_path):
    out, run = tmp_path / "outdir", tmp_path / "run.toml"
    res = _exec(["-o", str(run), "--output", str(out), "--output", str(tmp_path / "never"), "--",
                 sys.executable, str(SCRIPTS / "exec_child.py"), str(out), "3", "--token", "hf_abcdefghijklmnopqrs"],
                tmp_path, tmp_path)
    assert res.returncode == 3, res.stderr
    assert res.stdout.splitlines() == ["side only: None"]  # the command's output only; capture's goes to stderr
    assert f"capture: manifest {run}" in res.stderr.splitlines()
    verify(run, tmp_path, tmp_path)
    m = read_signed(run, tmp_path)
    e = m["exec"]
    assert e["exit_code"] == 3 and e["succeeded"] is False and "signal" not in e and e["wall_time_s"] > 0
    assert e["command"][-2:] == ["--token", "<redacted>"] and "hf_abc" not in run.read_text()
    folder, missing = e["outputs"]
    files = sorted(p for p in out.rglob("*") if p.is_file())
    lines = "".join(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.relative_to(out).as_posix()}\n" for p in files)
    assert folder["sha256"] == hashlib.sha256(lines.encode()).hexdigest() and folder["files"] == 2
    assert missing == {"path": str(tmp_path / "never"), "exists": False}
    # the Recorder inside the command joined the same manifest
    assert m["kind"] == "trial" and e["recorder_tables"] == 1
    assert m["trial"]["run"]["measured_steps"] == 3 and m["trial"]["config_source"].startswith("capture exec:")
    assert (tmp_path / "run.html").exists()


def test_sigterm_is_forwarded_to_the_command_and_recorded(tmp_path):
    ready = tmp_path / "ready"
    code = f"import pathlib, time; pathlib.Path({str(ready)!r}).write_text('x'); time.sleep(60)"
    run = tmp_path / "run.toml"
    proc = subprocess.Popen([sys.executable, "-m", "capture", "exec", "-o", str(run), "--", sys.executable, "-c", code],
                            env=child_env(tmp_path), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    e = read_signed(run, tmp_path)["exec"]
    assert e["signal"] == "SIGTERM" and e["exit_code"] == 143 and e["wall_time_s"] < 60


def test_capture_errors_come_before_the_command_starts(tmp_path):
    marker = tmp_path / "ran"
    cmd = [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    res = _exec(["-o", str(tmp_path / "no" / "such" / "run.toml"), "--", *cmd], tmp_path, tmp_path)
    assert res.returncode == 2 and res.stderr.startswith("error: -o: folder") and "hint:" in res.stderr
    assert not marker.exists()
    res = _exec([], tmp_path, tmp_path)
    assert res.returncode == 2 and "no command given" in res.stderr and "Traceback" not in res.stderr
    res = _exec(["--", "no-such-command-xyz"], tmp_path, tmp_path)
    assert res.returncode == 127 and "command not found" in res.stderr


def test_success_passes_zero_and_hashes_a_file(tmp_path):
    f = tmp_path / "a.bin"
    code = f"open({str(f)!r}, 'wb').write(b'abc')"
    res = _exec(["-o", "ok.toml", "--output", str(f), "--", sys.executable, "-c", code], tmp_path, tmp_path)
    assert res.returncode == 0, res.stderr
    verify(tmp_path / "ok.toml", tmp_path, tmp_path)
    m = read_signed(tmp_path / "ok.toml", tmp_path)
    assert m["kind"] == "fingerprint" and m["exec"]["succeeded"] is True
    assert m["exec"]["outputs"][0]["sha256"] == hashlib.sha256(b"abc").hexdigest()


def test_redaction_and_parallel_hashes(tmp_path):
    assert redact_argv(["train.py", "--password", "hunter2", "https://u:p@host/x", "--lr", "1e-3"]) == \
        ["train.py", "--password", "<redacted>", "https://host/x", "--lr", "1e-3"]  # capture.redact drops userinfo
    for i in range(20):
        (tmp_path / f"f{i}").write_bytes(os.urandom(1000))
    serial = hash_outputs([tmp_path], workers=1)
    assert hash_outputs([tmp_path], workers=8) == serial and serial[0].files == 20



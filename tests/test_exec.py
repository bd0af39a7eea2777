"""`capture exec` around real commands: exit status passed through, signals forwarded, outputs hashed."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
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




# --------------------------------------------------------------------------- issue 25: signals, outputs, side folder, usage


def _start(tmp_path, code: str, *extra: str) -> tuple[subprocess.Popen, object]:
    """`capture exec` around a python child that writes its pid to `ready` and then runs ``code``."""
    ready = tmp_path / "ready"
    child = f"import os, pathlib, time; pathlib.Path({str(ready)!r}).write_text(str(os.getpid())); {code}"
    proc = subprocess.Popen([sys.executable, "-m", "capture", "exec", "-o", str(tmp_path / "run.toml"), "--no-report", *extra,
                             "--", sys.executable, "-c", child],
                            env=child_env(tmp_path), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    while not (ready.exists() and ready.read_text()):
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    return proc, int(ready.read_text())



@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT, signal.SIGALRM, signal.SIGHUP])
def test_every_catchable_signal_reaches_the_command_and_capture_records_it(tmp_path, sig):
    """SLURM's --signal=USR1 and friends: capture forwards them; the command decides what they mean."""
    proc, _pid = _start(tmp_path, "time.sleep(60)")
    proc.send_signal(sig)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err
    e = read_signed(tmp_path / "run.toml", tmp_path)["exec"]
    assert e["signal"] == sig.name and e["exit_code"] == 128 + sig and "Traceback" not in err


def test_a_signal_the_command_handles_is_delivered_and_capture_waits(tmp_path):
    got, armed = tmp_path / "got", tmp_path / "armed"
    code = (f"import signal, sys; signal.signal(signal.SIGUSR1, lambda *a: (pathlib.Path({str(got)!r}).write_text('usr1'), "
            f"sys.exit(0))); pathlib.Path({str(armed)!r}).write_text('1'); time.sleep(60)")
    proc, _pid = _start(tmp_path, code)
    deadline = time.monotonic() + 60  # the handler is installed after `ready`: a signal before it would end the child
    while not armed.exists():
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signal.SIGUSR1)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and got.read_text() == "usr1", err
    assert read_signed(tmp_path / "run.toml", tmp_path)["exec"]["succeeded"] is True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purpose
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_the_command_is_never_orphaned_when_capture_is_killed(tmp_path):
    proc, pid = _start(tmp_path, "time.sleep(60)")
    proc.kill()  # SIGKILL: nothing in capture runs; the kernel tells the command (PR_SET_PDEATHSIG)
    proc.communicate(timeout=30)
    deadline = time.monotonic() + 20
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), "the command outlived capture"


def test_outputs_that_cannot_be_read_are_recorded_with_the_reason(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "weights.bin").write_bytes(b"w" * 100)
    os.mkfifo(folder / "log.fifo")
    (folder / "zero").symlink_to("/dev/zero")
    (folder / "dangling").symlink_to(tmp_path / "nowhere")
    (folder / "loop").symlink_to(folder, target_is_directory=True)
    args = ["--output", str(fifo), "--output", "/proc/self/mem", "--output", str(folder)]
    res = _exec(["-o", "run.toml", "--no-report", *args, "--", sys.executable, "-c", "pass"], tmp_path, tmp_path)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    pipe, mem, out = read_signed(tmp_path / "run.toml", tmp_path)["exec"]["outputs"]
    assert pipe["exists"] is True and "not a regular file" in pipe["error"] and "sha256" not in pipe
    assert mem["exists"] is True and "cannot read" in mem["error"]
    assert out["kind"] == "folder" and out["files"] == 1
    assert out["sha256"] == hashlib.sha256(f"{hashlib.sha256(b'w' * 100).hexdigest()}  weights.bin\n".encode()).hexdigest()


def test_hostile_files_left_in_the_side_folder_neither_hang_nor_crash(tmp_path):
    secret = tmp_path / "secret.json"
    secret.write_text('{"run": {"stolen": "from a file capture may read"}}')
    code = ("import json, os; d = os.environ['CAPTURE_EXEC_DIR']; j = lambda n: os.path.join(d, n); "
            "os.mkfifo(j('recorder-1.json')); os.symlink('/nonexistent', j('recorder-2.json')); "
            "open(j('recorder-3.json'), 'w').write('[' * 200000 + ']' * 200000); "
            "os.symlink('/dev/zero', j('recorder-4.json')); "
            f"os.symlink({str(secret)!r}, j('recorder-5.json')); "
            "import functools; open(j('recorder-6.json'), 'w').write(json.dumps({'x': functools.reduce(lambda a, _: [a], range(30), 1)})); "
            "[open(j(f'junk-{i}'), 'w').close() for i in range(2000)]; "
            "open(j('recorder-7.json'), 'w').write(json.dumps({'run': {'measured_steps': 3}}))")
    res = _exec(["-o", "run.toml", "--no-report", "--", sys.executable, "-c", code], tmp_path, tmp_path)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    m = read_signed(tmp_path / "run.toml", tmp_path)
    assert m["exec"]["recorder_tables"] == 1 and m["trial"]["run"] == {"measured_steps": 3}
    assert "stolen" not in (tmp_path / "run.toml").read_text()


@pytest.mark.parametrize("target", ["folder", "fifo", "symlink", "device"])
def test_o_writes_only_a_regular_file_or_a_new_path_and_refuses_before_the_command(tmp_path, target):
    marker = tmp_path / "ran"
    path = tmp_path / "target.toml"
    if target == "folder":
        path.mkdir()
    elif target == "fifo":
        os.mkfifo(path)
    elif target == "symlink":
        (tmp_path / "real.toml").write_text("keep\n")
        path.symlink_to(tmp_path / "real.toml")
    else:
        path = Path(os.devnull)
    before = os.lstat(path)
    res = _exec(["-o", str(path), "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')"], tmp_path, tmp_path)
    assert res.returncode == 2 and res.stderr.startswith(f"error: -o {path}: is a") and "Traceback" not in res.stderr, res.stderr
    assert not marker.exists()
    after = os.lstat(path)
    assert (after.st_mode, after.st_ino) == (before.st_mode, before.st_ino)


def test_usage_errors_come_before_the_command_starts(tmp_path):
    marker = tmp_path / "ran"
    cmd = ["--", sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    (tmp_path / "run.html").mkdir()  # where the report would go
    res = _exec(["-o", "run.toml", *cmd], tmp_path, tmp_path)
    assert res.returncode == 2 and "-o (its report)" in res.stderr
    res = _exec(["-o", "x.toml", "--principal", "a\x1bb", *cmd], tmp_path, tmp_path)
    assert res.returncode == 2 and "control characters" in res.stderr
    res = _exec(["-o", "x.toml", "--key", str(tmp_path / "nokey"), *cmd], tmp_path, tmp_path)
    assert res.returncode == 2 and "no such key file" in res.stderr
    assert not marker.exists()

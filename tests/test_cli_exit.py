"""The ``capture`` command leaves without tearing the interpreter down (capture._cli.run): the exit
code, everything written to stdout and stderr, and the atexit handlers all survive; a non-daemon
thread still running makes it exit the usual way, so that thread finishes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(code: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=300)


def test_exit_code_streams_and_atexit_handlers_survive(tmp_path: Path) -> None:
    done = _run("""
        import atexit, sys
        from capture import _cli
        atexit.register(lambda: print("atexit ran"))
        sys.argv = ["capture", "verify", "/nonexistent"]
        _cli.run()
    """, tmp_path)
    assert done.returncode == 3
    assert done.stderr.startswith("error: /nonexistent")
    assert done.stdout == "atexit ran\n"


def test_a_whole_manifest_reaches_a_pipe(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "capture", "fingerprint", "--code", str(ROOT)], capture_output=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    assert len(done.stdout) > 10_000
    assert tomllib.loads(done.stdout.decode())["kind"] == "fingerprint"


def test_a_running_non_daemon_thread_is_waited_for(tmp_path: Path) -> None:
    marker = tmp_path / "finished"
    done = _run(f"""
        import sys, threading, time
        from capture import _cli
        def late():
            time.sleep(0.5)
            open({str(marker)!r}, "w").write("done")
        def main(args=None):
            threading.Thread(target=late).start()
            return 7
        _cli.main = main
        _cli.run()
    """, tmp_path)
    assert done.returncode == 7, done.stderr
    assert marker.read_text() == "done"

"""The probes' fan-out (capture/probes/_fanout.py): forked children and threads give the same
results; a child that dies or cannot report costs its own job only; user errors cross the pipe
intact; forking is refused where it is unsafe. Fork cases run in a fresh interpreter, where the
thread count is known (pytest and earlier tests may leave threads running)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from capture.errors import UsageError
from capture.probes import _fanout

ROOT = Path(__file__).resolve().parent.parent


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=full_env, timeout=300, cwd=ROOT)


def test_forked_jobs_report_values_errors_and_deaths_in_order() -> None:
    done = _python("""
        import json, os, signal
        from capture.errors import ArtifactMismatch
        from capture.probes import _fanout

        def fails():
            raise ArtifactMismatch("blob x does not match", "re-download it")

        def dies():
            os.kill(os.getpid(), signal.SIGKILL)

        def unpicklable():
            return lambda: None

        jobs = [lambda: {"a": [1, 2.5, "x"]}, fails, dies, unpicklable, lambda: os.getpid()]
        outcomes, how, why = _fanout.run(jobs, "fork")
        out = {"how": how, "parent": os.getpid(), "outcomes": []}
        for ok, value in outcomes:
            if ok:
                out["outcomes"].append(["ok", value])
            else:
                out["outcomes"].append([type(value).__name__, str(value), getattr(value, "hint", None),
                                        getattr(value, "exit_code", None)])
        print(json.dumps(out))
    """)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["how"] == "fork"
    first, failed, died, unpicklable, pid = out["outcomes"]
    assert first == ["ok", {"a": [1, 2.5, "x"]}]
    assert failed == ["ArtifactMismatch", "blob x does not match", "re-download it", 6]
    assert died[0] == "RuntimeError" and "killed by signal 9" in died[1]
    assert unpicklable[0] == "RuntimeError" and "not picklable" in unpicklable[1]
    assert pid[0] == "ok" and pid[1] != out["parent"]  # it really ran in another process


def test_threads_give_the_same_outcomes_in_this_process() -> None:
    def fails() -> None:
        raise UsageError("bad", "fix")

    outcomes, how, why = _fanout.run([lambda: 1, fails, lambda: os.getpid()], "threads")
    assert how == "threads" and why == "CAPTURE_FANOUT=threads"
    assert outcomes[0] == (True, 1)
    assert outcomes[1][0] is False and isinstance(outcomes[1][1], UsageError)
    assert outcomes[2] == (True, os.getpid())


def test_output_buffered_before_the_fork_is_written_once() -> None:
    done = _python("""
        import sys
        from capture.probes import _fanout
        sys.stdout.write("before ")  # still in the buffer: stdout is a pipe
        _fanout.run([lambda: None] * 4, "fork")
        sys.stdout.write("after")
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "before after"


@pytest.mark.parametrize("setup, reason", [
    ("import threading, time; threading.Thread(target=time.sleep, args=(5,), daemon=True).start()", "threads"),
    ("import torch", "torch is loaded"),
])
def test_fork_is_refused_where_it_is_unsafe(setup: str, reason: str) -> None:
    done = _python(f"""
        {setup}
        from capture.probes import _fanout
        print(repr(_fanout.choose("fork")))
    """)
    assert done.returncode == 0, done.stderr
    how, why = eval(done.stdout)  # noqa: S307 - our own repr of a tuple of two strings
    assert how == "threads" and reason in why


def test_auto_forks_only_with_cpus_to_spare() -> None:
    done = _python("""
        import os
        from capture.probes import _fanout
        print(repr((_fanout.choose("auto"), _fanout.usable_cpus())))
    """)
    assert done.returncode == 0, done.stderr
    (how, why), cpus = eval(done.stdout)  # noqa: S307
    assert how == ("fork" if cpus >= _fanout.MIN_CPUS else "threads")
    assert f"{cpus} usable CPUs" in why


def test_the_environment_chooses_and_a_bad_value_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CAPTURE_FANOUT", "threads")
    assert _fanout.choose() == ("threads", "CAPTURE_FANOUT=threads")
    monkeypatch.setenv("CAPTURE_FANOUT", "processes\n")
    with pytest.raises(UsageError, match="CAPTURE_FANOUT"):
        _fanout.choose()


def _fingerprint(tmp_path: Path, mode: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CAPTURE_FANOUT": mode, "HF_HUB_CACHE": str(tmp_path / "hub")}
    return subprocess.run([sys.executable, "-m", "capture", "fingerprint", "--code", str(ROOT), *args],
                          capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)


def test_fork_and_threads_write_the_same_manifest(tmp_path: Path) -> None:
    import tomllib

    forked = _fingerprint(tmp_path, "fork", "--timings")
    threaded = _fingerprint(tmp_path, "threads", "--timings")
    assert forked.returncode == threaded.returncode == 0, forked.stderr + threaded.stderr
    assert "one forked process each" in forked.stderr and "one thread each" in threaded.stderr
    from capture import manifest as mf

    a, b = tomllib.loads(forked.stdout), tomllib.loads(threaded.stdout)
    # the sections rendered in each probe's own process join into what one rendering gives
    assert mf.dumps(a) == forked.stdout.encode() and mf.dumps(b) == threaded.stdout.encode()
    assert {"host", "python", "framework", "toolchain", "code", "environment"} <= a.keys()
    a.pop("created_utc"), b.pop("created_utc")  # the second each was written in
    assert a == b


def test_a_user_error_in_a_forked_probe_is_the_same_one_line_error(tmp_path: Path) -> None:
    forked = _fingerprint(tmp_path, "fork", "--model", "org/not-cached")
    threaded = _fingerprint(tmp_path, "threads", "--model", "org/not-cached")
    assert forked.returncode == threaded.returncode == 2
    assert forked.stderr == threaded.stderr
    assert forked.stderr.startswith("error: ") and "hf download org/not-cached" in forked.stderr
    assert forked.stdout == ""


def test_each_child_holds_only_its_own_pipe() -> None:
    """A forked child keeps one pipe beyond stdio, its own write end: not its siblings' read ends."""
    done = _python("""
        import json, os
        from capture.probes import _fanout

        def pipes():
            out = []
            for name in os.listdir("/proc/self/fd"):
                try:
                    if int(name) > 2 and os.readlink(f"/proc/self/fd/{name}").startswith("pipe:"):
                        out.append(int(name))
                except FileNotFoundError:  # the descriptor listdir itself used
                    pass
            return sorted(out)

        outcomes, how, _ = _fanout.run([pipes] * 5, "fork")
        print(json.dumps([how, [value for ok, value in outcomes]]))
    """)
    assert done.returncode == 0, done.stderr
    how, per_child = json.loads(done.stdout)
    assert how == "fork"
    assert all(len(fds) == 1 for fds in per_child), per_child


@pytest.mark.parametrize("mode", ["fork", "threads"])
def test_site_packages_is_listed_once_per_fingerprint(tmp_path: Path, mode: str) -> None:
    """The packages and framework probes both read the import path's folders: listed once, before
    the fan-out, and inherited by the forked probes."""
    log = tmp_path / "listdir.log"
    done = _python(f"""
        import os, site, sys
        real = os.listdir
        def counted(path="."):
            with open({str(log)!r}, "a") as f:
                f.write(os.fspath(path) + "\\n")
            return real(path)
        os.listdir = counted
        from capture.fingerprint import collect
        from capture.probes import ProbeOptions
        m = collect(ProbeOptions(progress=False), fanout={mode!r})
        assert "torch" in m["python"]["packages"] and m["framework"]["version"]
        print(site.getsitepackages()[0])
    """)
    assert done.returncode == 0, done.stderr
    site_packages = done.stdout.strip()
    listed = log.read_text().splitlines()
    assert listed.count(site_packages) == 1, [p for p in listed if "site-packages" in p]

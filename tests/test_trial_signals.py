"""Nothing left behind: a real `capture trial` (a subprocess, a tiny GPT-2 on the CPU) stopped by
SIGTERM, SIGINT or SIGHUP in each of its stages ends its child processes, removes its scratch
folder (checkpoints, DCP folders, worker files), writes no manifest and no report, and exits
128 + the signal with one line on stderr.

The trial is told where to wait by the test-only hook of capture.trial.scratch
(CAPTURE_TRIAL_TEST_PAUSE=STAGE=FILE: the process that reaches STAGE writes a line to FILE and
waits), or, where the stage is its children (the preflight's all-reduce ranks, torchrun's ranks),
the test waits until those children are running. SIGINT goes to the whole process group, as
Ctrl-C at a terminal sends it; SIGTERM (``timeout``) and SIGHUP (a closed terminal) to the trial only.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from local_ports import free_port
from tiny_configs import gpt2_model

from capture.trial.scratch import PAUSE_ENV, PREFIX

ROOT = Path(__file__).resolve().parent.parent

CONFIG = """
[trial]
name = "signals"
seed = 5
device = "cpu"
warmup_steps = 1
measured_steps = 2
""" + gpt2_model(specials=False) + """[trial.batch]
max_seq_len = 32
micro_batch_size = 2
[trial.data]
source = "synthetic"
synthetic_sequences = 32
[trial.validation]
batches = 1
"""



def _descendants(pid: int) -> dict[int, str]:
    """pid -> command line of every live descendant of ``pid``."""
    parent_of, cmd = {}, {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_bytes()
            cmd[int(name)] = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        parent_of[int(name)] = int(stat[stat.rfind(b")") + 2:].split()[1])
    out: dict[int, str] = {}
    frontier = {pid}
    while frontier:
        frontier = {c for c, p in parent_of.items() if p in frontier and c not in out}
        out.update({c: cmd[c] for c in frontier})
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:].split()[0] != b"Z"


def _env(tmp_path: Path) -> dict[str, str]:
    return dict(os.environ, XDG_CONFIG_HOME=str(tmp_path / "cfg"), OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


def _start(args: list[str], tmp_path: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """The trial in a session of its own (its process group is the test's to signal)."""
    return subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)


def _wait_until(proc: subprocess.Popen[bytes], stage: str, begun: Callable[[], bool]) -> None:
    """Until ``begun()`` says the stage has begun; failing where the trial ended first or it never does."""
    deadline = time.monotonic() + 400
    while True:
        assert proc.poll() is None, f"the trial ended before {stage}: {proc.stderr.read().decode()[-2000:]}"  # type: ignore[union-attr]
        assert time.monotonic() < deadline, f"{stage} never began"
        if begun():
            return
        time.sleep(0.05)


# (stage, how the test knows it has begun, signal)
STAGES = [
    ("fingerprint", "pause", signal.SIGTERM),
    ("preflight", "capture.preflight._allreduce_worker", signal.SIGINT),
    ("load", "pause", signal.SIGHUP),
    ("steps", "pause", signal.SIGTERM),
    ("checkpoint", "pause", signal.SIGINT),
    ("fit_search", "pause", signal.SIGHUP),
    ("recovery.checkpoint_written", "pause", signal.SIGTERM),
    ("recovery.restore_ready", "pause", signal.SIGINT),
    ("scaling", "capture.trial._dist_worker", signal.SIGTERM),
    ("report", "pause", signal.SIGHUP),
    ("manifest", "pause", signal.SIGTERM),
]


@pytest.mark.slow  # a trial subprocess each (torch, transformers, a fresh process per recovery worker)
@pytest.mark.parametrize("stage, begun, sig", STAGES, ids=[s[0] for s in STAGES])
def test_a_signal_in_each_stage_leaves_nothing_behind(tmp_path, stage, begun, sig):
    cfg = tmp_path / "signals.toml"
    cfg.write_text(CONFIG)
    work = tmp_path / "work"
    work.mkdir()
    out = tmp_path / "out" / "trial.toml"
    out.parent.mkdir()
    args = [sys.executable, "-m", "capture", "trial", str(cfg), "-o", str(out)]
    if stage != "preflight":
        args.append("--no-preflight")
    if stage not in ("report", "manifest"):
        args.append("--no-report")
    if not stage.startswith("recovery"):
        args.append("--no-recovery")  # its own cases below; the others need not wait for it
    if stage == "fit_search":
        args += ["--find-max-batch", "--max-batch", "4"]
    if stage == "scaling":
        args += ["--nproc", "2", "--strategy", "ddp", "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    if stage == "recovery.restore_ready":
        args += ["--workdir", str(work)]  # the scratch goes inside --workdir, and is removed from there too
    flag = tmp_path / "paused.txt"
    env = _env(tmp_path)
    if begun == "pause":
        env[PAUSE_ENV] = f"{stage}={flag}"
    proc = _start(args, tmp_path, env)

    def has_begun() -> bool:
        if begun != "pause":
            return any(begun in c for c in _descendants(proc.pid).values())
        return bool(flag.exists() and flag.read_text().strip()) and (
            stage != "recovery.restore_ready" or bool(list(work.glob(f"{PREFIX}*/recovery/checkpoint.pt"))))

    try:
        _wait_until(proc, stage, has_begun)
        children = _descendants(proc.pid)
        scratch = list(tmp_path.rglob(f"{PREFIX}*"))
        assert bool(scratch) == (stage not in ("fingerprint", "preflight")), scratch  # made after the preflight
        if stage.startswith("recovery."):
            assert any("capture.trial._recover_worker" in c for c in children.values()), children
            assert list(scratch[0].glob("recovery/checkpoint.pt"))  # the case of the issue: a checkpoint on disk
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)  # Ctrl-C: the terminal signals the whole foreground group
        else:
            os.kill(proc.pid, sig)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    err = stderr.decode()
    assert proc.returncode == 128 + sig, err[-2000:]
    assert err.splitlines()[-1] == f"error: interrupted by {signal.Signals(sig).name}", err[-2000:]
    assert "Traceback" not in err
    assert [p for p in children if _alive(p)] == []  # every child ended
    assert list(tmp_path.rglob(f"{PREFIX}*")) == []  # checkpoints, DCP folders, worker files: gone
    assert sorted(p.name for p in out.parent.iterdir()) == []  # no manifest, no report, no temporary file


KILLED = ["scaling.item.ddp", "recovery.restore_ready"]  # each rank of the DDP launch waits; the restoring process waits


@pytest.mark.slow
@pytest.mark.parametrize("stage", KILLED)
def test_a_trial_killed_outright_takes_its_children_and_the_next_trial_removes_its_scratch(tmp_path, stage):
    """SIGKILL (the kernel's out-of-memory killer, ``kill -9``) cannot be caught: the trial runs no
    clean-up. Its children end with it all the same (the kernel signals them: the recovery worker,
    torchrun, which stops its ranks; before, torchrun and its ranks trained on alone), and the next
    trial in the same folder removes the scratch the killed one left, saying so."""
    cfg = tmp_path / "signals.toml"
    cfg.write_text(CONFIG)
    work = tmp_path / "work"
    out = tmp_path / "out" / "trial.toml"
    out.parent.mkdir()
    common = [sys.executable, "-m", "capture", "trial", str(cfg), "--no-preflight", "--no-report", "--workdir", str(work)]
    args = common + ["-o", str(out)]
    args += (["--no-recovery", "--nproc", "2", "--strategy", "ddp"] if stage.startswith("scaling") else [])
    flag = tmp_path / "paused.txt"
    env = _env(tmp_path)
    env[PAUSE_ENV] = f"{stage}={flag}"
    proc = _start(args, tmp_path, env)

    def has_begun() -> bool:
        paused = flag.read_text().splitlines() if flag.exists() else []
        return len(paused) == (2 if stage.startswith("scaling") else 1) \
            and (stage.startswith("scaling") or bool(list(work.glob(f"{PREFIX}*/recovery/checkpoint.pt"))))

    try:
        _wait_until(proc, stage, has_begun)
        children = _descendants(proc.pid)
        assert children
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 90
    while [p for p in children if _alive(p)] and time.monotonic() < deadline:
        time.sleep(0.2)
    survivors = [p for p in children if _alive(p)]
    for pid in survivors:  # a failing run leaves none behind either
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert [children[p] for p in survivors] == []  # every child ended with it
    left = list(work.glob(f"{PREFIX}*"))
    assert len(left) == 1 and not out.exists()
    env.pop(PAUSE_ENV, None)
    again = subprocess.run(common + ["--no-recovery", "-o", str(tmp_path / "again.toml")], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=400)
    assert again.returncode == 0, again.stderr[-2000:]
    said = [line for line in again.stderr.splitlines() if line.startswith("capture: removed ")]
    assert len(said) == 1 and said[0].startswith(f"capture: removed {left[0]} (")
    assert f"the scratch folder of trial process {proc.pid}, which ended without removing it" in said[0]
    assert list(work.glob(f"{PREFIX}*")) == []  # the killed trial's and the second one's own


def test_only_a_dead_trials_own_scratch_is_swept(tmp_path):
    """What the sweep removes: a folder whose owner (on this boot, in this pid namespace) is gone,
    or whose pid now belongs to another process (a different start time). What it leaves: a live
    trial's, another boot's or namespace's (its pid means nothing here), one with no owner or a
    hostile one (garbage, a link, a FIFO, a negative pid), and a link named like a scratch folder."""
    import json

    from capture.trial import scratch

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    dead = scratch._identity(gone.pid)
    gone.wait()
    me = scratch._identity(os.getpid())
    assert dead is not None and me is not None and scratch._identity(gone.pid) is None

    def folder(name: str, owner: object = None, raw: bytes | None = None) -> Path:
        path = tmp_path / f"{PREFIX}{name}"
        path.mkdir()
        (path / "checkpoint.pt").write_bytes(b"\0" * 1000)
        if owner is not None or raw is not None:
            (path / scratch.OWNER).write_bytes(raw if raw is not None else json.dumps(owner).encode())
        return path

    removed = {folder("dead", dead), folder("reused", dict(me, start=str(int(me["start"]) + 1)))}
    kept = {folder("live", me), folder("other-boot", dict(dead, boot_id="0" * 32)),
            folder("other-ns", dict(dead, pid_namespace="pid:[1]")), folder("no-owner"),
            folder("garbage", raw=b"\xff{"), folder("list", [1, 2]), folder("negative", dict(dead, pid=-1)),
            folder("bool", dict(dead, pid=True))}
    linked = folder("linked-owner")
    (linked / scratch.OWNER).symlink_to(tmp_path / f"{PREFIX}dead" / scratch.OWNER)
    fifo = folder("fifo-owner")
    os.mkfifo(fifo / scratch.OWNER)
    target = tmp_path / "not-scratch"
    target.mkdir()
    (target / "keep.txt").write_text("kept")
    (tmp_path / f"{PREFIX}link").symlink_to(target)
    kept |= {linked, fifo}
    swept = scratch.sweep_stale(tmp_path)
    assert {s.path for s in swept} == removed
    assert all(s.size_bytes >= 1000 for s in swept) and {s.pid for s in swept} == {dead["pid"], me["pid"]}
    assert all(p.is_dir() for p in kept) and (target / "keep.txt").read_text() == "kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([p.name for p in kept] + ["not-scratch", f"{PREFIX}link"])

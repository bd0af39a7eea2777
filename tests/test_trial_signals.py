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

import os
import signal
import subprocess
import sys
import time
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
    env = dict(os.environ, XDG_CONFIG_HOME=str(tmp_path / "cfg"), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    if begun == "pause":
        env[PAUSE_ENV] = f"{stage}={flag}"
    proc = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 400
        while True:
            assert proc.poll() is None, f"the trial ended before {stage}: {proc.stderr.read().decode()[-2000:]}"
            assert time.monotonic() < deadline, f"{stage} never began"
            if begun == "pause" and flag.exists() and flag.read_text().strip():
                if stage != "recovery.restore_ready" or list(work.glob(f"{PREFIX}*/recovery/checkpoint.pt")):
                    break
            if begun != "pause" and any(begun in c for c in _descendants(proc.pid).values()):
                break
            time.sleep(0.05)
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

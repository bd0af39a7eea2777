"""How the recovery stage's processes share memory (capture.trial.recover_memory): on a device
the budget of early builds; on a CPU the host's memory, shared with the trial process, where a
process past it is killed by the kernel. Decisions from given figures, the stage run one process
at a time or skipped as decided, and a real memory cgroup where the old plan was killed."""

from __future__ import annotations

import os
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from memory_cgroups import in_cgroup
from test_trial_recover import CPU, _config

from capture.trial import hostmem, recover
from capture.trial.recover_memory import MemoryBudget, budget_from_trial, checkpoint_bytes, room_to_start

MIB, GIB = 2**20, 2**30


def _trial(device_type: str, peak: int, checkpoint: int | None = 50 * MIB, method: str = "full") -> dict:
    trial = {"fit": {"limit_bytes": 64 * GIB, "measured_bytes": peak},
             "memory": {"estimate": {"weights": {"bytes": 40 * MIB}, "gradients": {"bytes": 4 * MIB},
                                     "optimizer_state": {"bytes": 80 * MIB}},
                        "framework_overhead_bytes": 300 * MIB, "measured": {"device_type": device_type}},
             "run": {"method": method}}
    if checkpoint is not None:
        trial["checkpoint"] = {"size_bytes": checkpoint}
    return trial


def _host(total: int, available: int) -> hostmem.HostMemory:
    return hostmem.HostMemory(total, "memory cgroup limit (t)", available, "limit less its working set (t)")


def test_on_a_device_the_device_decides_and_the_host_holds_the_checkpoint_copy():
    """The device's memory decides early builds and overlap as before; the host's is checked for
    what a restoring process holds there: a process like this one (held 3 GiB, of which 1 GiB the
    libraries it shares) and its host copy of the checkpoint (here 40 GiB, a full 8B fine-tune's)."""
    held, shared, ckpt = 3 * GIB, GIB, 40 * GIB

    def budget(total: int, available: int) -> MemoryBudget:
        made = budget_from_trial(_trial("cuda", 60 * GIB, checkpoint=ckpt), _host(total, available), held, shared)
        assert made is not None
        return made

    need = held + (held - shared) + ckpt
    roomy = budget(256 * GIB, 200 * GIB)
    assert (roomy.limit_bytes, roomy.peak_bytes, roomy.build_bytes, roomy.start_bytes) == (64 * GIB, 60 * GIB,
                                                                                           340 * MIB, 0)
    assert (roomy.host_need_bytes, roomy.host_limit_bytes) == (need, held + 200 * GIB)
    assert roomy.fits_early_build() and roomy.fits_overlap() and roomy.refusal is roomy.warning is None
    assert roomy.to_manifest()["start_bytes"] == 0 and roomy.to_manifest()["host_need_bytes"] == need

    # a 64 GB container with 45 GiB available: the copy fits, not with 25 % to spare: one at a time
    tight = budget(64 * GIB, 45 * GIB)
    assert tight.refusal is None and tight.warning is not None and "within 25% of it" in tight.warning
    assert not tight.fits_overlap() and tight.fits_early_build()  # the device still has room for a build
    assert tight.to_manifest()["overlap"] is False

    # past what is available now, within the whole: the file cache may give the rest
    cache = budget(64 * GIB, 30 * GIB)
    assert cache.refusal is None and not cache.fits_overlap() and "the file cache may give" in cache.warning

    # a 32 GB container: it cannot hold the copy at all; skipped before a process is started
    over = budget(32 * GIB, 28 * GIB)
    assert over.refusal is not None and over.warning is None and "host copy of the checkpoint" in over.refusal
    assert "memory cgroup limit (t), less this process's RSS" in over.refusal

    # nothing readable about the host: the device's figures alone, as before
    blind = budget_from_trial(_trial("cuda", 60 * GIB), hostmem.HostMemory(None, "", None, ""), held, shared)
    assert blind == MemoryBudget(64 * GIB, 60 * GIB, 340 * MIB)
    assert "host_need_bytes" not in blind.to_manifest()


def test_a_scratch_folder_held_in_memory_counts_the_checkpoint_file_too(tmp_path, monkeypatch):
    """``--workdir /dev/shm/...``: the checkpoint file takes the host's memory beside the copy read
    from it. On this machine's own mounts (tmp_path, wherever it lies: the figure follows what
    hostmem.memory_backed says, tested against ``stat -f``), then on a tmpfs as given."""
    held, shared, ckpt = 3 * GIB, GIB, 40 * GIB
    trial, host = _trial("cuda", 60 * GIB, checkpoint=ckpt), _host(256 * GIB, 200 * GIB)
    here = budget_from_trial(trial, host, held, shared, scratch=tmp_path)
    fs = hostmem.memory_backed(tmp_path)
    assert here is not None and here.scratch_in_memory == fs
    assert here.host_need_bytes == held + (held - shared) + ckpt * (2 if fs else 1)

    monkeypatch.setattr(hostmem, "memory_backed", lambda path, root=None: "tmpfs")
    shm = budget_from_trial(trial, host, held, shared, scratch=Path("/dev/shm/cw/.capture-trial-x"))
    assert shm is not None and shm.host_need_bytes == held + (held - shared) + 2 * ckpt
    assert shm.to_manifest()["scratch_in_memory"] == "tmpfs" and shm.refusal is None
    # an 80 GiB container: the process with its copy (42 GiB) fits, with the file beside it (82 GiB) not
    over = budget_from_trial(trial, _host(80 * GIB, 70 * GIB), held, shared, scratch=Path("/dev/shm/cw\nx"))
    assert over is not None and over.refusal is not None
    assert "checkpoint file in the scratch folder, held in memory (tmpfs: /dev/shm/cw\\nx)" in over.refusal
    cpu = budget_from_trial(_trial("cpu", GIB), _host(16 * GIB, 12 * GIB), 400 * MIB, 100 * MIB,
                            scratch=Path("/dev/shm/cw"))
    assert cpu is not None and cpu.peak_bytes == 400 * MIB + GIB - 100 * MIB + 2 * 50 * MIB


def test_the_checkpoint_is_as_written_else_from_the_estimate():
    assert checkpoint_bytes(_trial("cpu", GIB)) == 50 * MIB
    assert checkpoint_bytes(_trial("cpu", GIB, checkpoint=None)) == 40 * MIB + 80 * MIB
    assert checkpoint_bytes(_trial("cpu", GIB, checkpoint=None, method="lora")) == 4 * MIB + 80 * MIB
    assert checkpoint_bytes({"checkpoint": {"size_bytes": "7"}, "memory": {}}) == 0  # hostile: no figure


def test_on_a_cpu_the_host_decides_overlap_sequence_or_refusal():
    """held 400 MiB of which 100 shared (the libraries: charged once); a restoring process needs
    the trial's peak less those, plus the checkpoint's host copy; a fresh process's imports 200."""
    held, shared = 400 * MIB, 100 * MIB

    def budget(peak: int, total: int, available: int) -> MemoryBudget:
        made = budget_from_trial(_trial("cpu", peak), _host(total, available), held, shared)
        assert made is not None
        return made

    roomy = budget(GIB, 16 * GIB, 12 * GIB)
    need = GIB - shared + 50 * MIB
    assert (roomy.limit_bytes, roomy.peak_bytes, roomy.start_bytes) == (held + 12 * GIB, held + need, 200 * MIB)
    assert roomy.fits_overlap() and roomy.fits_early_build() and roomy.refusal is roomy.warning is None

    # room for the restoring process, not for one more process's imports beside it: one at a time
    tight = budget(GIB, 2 * GIB, need + 150 * MIB)
    assert not tight.fits_overlap() and not tight.fits_early_build() and tight.refusal is None
    assert tight.warning is not None and "within 25% of it: the kernel may kill the run" in tight.warning

    # past what is available now, within the whole limit: the file cache may give the rest
    cache = budget(GIB, 2 * GIB, need - 100 * MIB)
    assert cache.refusal is None and not cache.fits_overlap()
    assert cache.warning is not None and "the file cache may give the rest" in cache.warning

    # past the whole limit less what this process holds: refused, with both figures and sources
    over = budget(GIB, held + need - MIB, 300 * MIB)
    assert over.refusal is not None and over.warning is None
    assert "memory cgroup limit (t), less this process's RSS" in over.refusal
    assert "killed by the kernel" in over.refusal and over.to_manifest()["refusal"] == over.refusal

    # nothing readable about the host: the device figures, no refusal
    blind = budget_from_trial(_trial("cpu", GIB), hostmem.HostMemory(None, "", None, ""), held, shared)
    assert blind is not None and blind.refusal is None and blind.limit_bytes == 64 * GIB


def test_room_to_start_is_the_imports_beside_this_process():
    assert room_to_start(200 * MIB, _host(GIB, 600 * MIB), held=300 * MIB)
    assert not room_to_start(200 * MIB, _host(GIB, 150 * MIB), held=300 * MIB)
    assert room_to_start(200 * MIB, hostmem.HostMemory(None, "", None, ""), held=300 * MIB)
    # on an accelerator: a process like this one (held 3 GiB, 1 GiB of it the shared libraries)
    assert room_to_start(None, _host(64 * GIB, 10 * GIB), held=3 * GIB, shared=GIB)
    assert not room_to_start(None, _host(8 * GIB, GIB), held=3 * GIB, shared=GIB)


# --------------------------------------------------------------------------- the stage as decided


def test_one_process_at_a_time_still_restores_bit_exact(tmp_path):
    """The plan where the host has room for the restoring process but not for a second one's
    imports beside it: each fresh process starts when the one before it ended."""
    threads = torch.get_num_threads()
    tight = MemoryBudget(limit_bytes=1000, peak_bytes=900, build_bytes=200, start_bytes=100)
    try:
        table = recover.run_recoverability(_config(tmp_path), CPU, tmp_path, sensitivity=False, budget=tight)
    finally:
        torch.set_num_threads(threads)
    assert table["verdict"] == "bit-exact" and table["resume_again"]["verdict"] == "bit-exact"
    assert table["plan"]["fresh_processes"] == "each started when the one before it ended (memory)"
    assert table["plan"]["early_build"] is False
    assert table["memory_budget"] == tight.to_manifest() and table["memory_budget"]["overlap"] is False
    assert "worker_start" not in table["phases"]["overlapped"]  # its imports were waited for
    assert not (tmp_path / "recovery").exists()


def test_a_refused_stage_runs_nothing_and_leaves_nothing(tmp_path):
    said: list[str] = []
    refused = MemoryBudget(1000, 2000, 200, 100, refusal="the recovery check's restoring process is 2 GiB; " * 4)
    table = recover.run_recoverability(_config(tmp_path), CPU, tmp_path, budget=refused, progress=said.append)
    assert set(table) == {"skipped", "memory_budget"}
    assert table["skipped"].startswith("the restoring process does not fit the host's memory: the recovery check")
    assert table["memory_budget"]["refusal"] == refused.refusal
    assert len(said) == 1 and all(len(line) <= 91 for line in said[0].splitlines())  # 100 with "capture: "
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- a real memory cgroup


@pytest.mark.slow
def test_in_a_cgroup_the_stage_is_never_killed(tmp_path, cgroup_1500m):
    """In a 1.5 GB cgroup, the tiny example at micro-batch 80 (steps at about 1.2 GB): before,
    the restoring process was started beside the trial process and a second one's imports and
    was killed (SIGKILL, "failed"). Now the stage runs its processes as the host allows, or says
    why it cannot: whichever, it is decided from the figures it records, and nothing is killed."""
    env = dict(os.environ, XDG_CONFIG_HOME=str(tmp_path / "cfg"), PYTHONUNBUFFERED="1")
    env.pop("CAPTURE_KEY", None)
    out = tmp_path / "run.toml"
    proc = in_cgroup(cgroup_1500m, [sys.executable, "-m", "capture", "trial", "--example", "tiny", "--micro-batch",
                                     "80", "--no-preflight", "--no-report", "-o", str(out)], tmp_path, env)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    trial = tomllib.loads(out.read_text())["trial"]
    rec, budget = trial["recovery"], trial["recovery"]["memory_budget"]
    assert "SIGKILL" not in str(rec) and not str(rec.get("verdict", "")).startswith("failed")
    # what the process and its children could get: its RSS (at most its peak; libraries' pages may be
    # charged to another group) + what the cgroup still allows; not the host's memory
    assert budget["limit_bytes"] <= 1500 * 2**20 + trial["fit"]["measured_bytes"]
    if "skipped" in rec:
        assert budget["refusal"] in rec["skipped"] and "killed by the kernel" in budget["refusal"]
    else:
        assert rec["verdict"] == "bit-exact"
        assert rec["plan"]["fresh_processes"] == ("started while another trains" if budget["overlap"] else
                                                  "each started when the one before it ended (memory)")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".capture")) == []


def test_the_budget_is_recorded_on_the_attempt_the_table_comes_from(tmp_path, monkeypatch):
    """Deterministic mode falls back to the run's settings when an op has no deterministic
    implementation (a GPU's case, driven here through the stage's own attempt seam): the table is
    the second attempt's, and it still records the budget both attempts were planned by."""
    calls: list[bool] = []

    def attempt(det, *args, early=None):
        calls.append(det.enabled)
        verdict = ("failed: RuntimeError: scatter_add_cuda_kernel does not have a deterministic implementation"
                   if det.enabled else "bit-exact")
        return {"verdict": verdict, "deterministic": det.to_manifest(), "phases": {}}

    monkeypatch.setattr(recover, "_attempt", attempt)
    budget = MemoryBudget(1000, 500, 200, 100)
    table = recover.run_recoverability(_config(tmp_path, deterministic=True), CPU, tmp_path, budget=budget)
    assert calls == [True, False]
    assert table["verdict"] == "bit-exact" and table["deterministic"]["fallback_op"] == "scatter_add_cuda_kernel"
    assert table["memory_budget"] == budget.to_manifest()

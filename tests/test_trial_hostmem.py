"""The host memory a CPU trial can get (capture/trial/hostmem.py), and the trial's checks on it.

A CPU run past that memory is killed by the kernel without a manifest, so the trial reads
MemTotal/MemAvailable and its memory cgroup's limit, and stops before a build or a step that
cannot fit. Layouts: this development VM's own (cgroup v1 hybrid, captured in
tests/fixtures/hostmem), a Docker container on cgroup v1 without a cgroup namespace
(tests/fixtures/container), and cgroup v2 as the kernel documents it (Documentation/admin-guide/
cgroup-v2.rst: ``0::PATH``, ``memory.max``, ``memory.current``, ``inactive_file``). Then the
real thing: a trial inside a memory cgroup made for the test, and a container with
``--memory`` on the real dockerd.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from memory_cgroups import in_cgroup, mounted_tmpfs

from capture.trial import hostmem

FIX = Path(__file__).parent / "fixtures"
ROOT = Path(__file__).resolve().parents[1]
GIB, MIB = 1 << 30, 1 << 20
MEMINFO = "MemTotal:       24683784 kB\nMemFree:        20000000 kB\nMemAvailable:   24310612 kB\n"


def _tree(tmp_path: Path, cgroup: str, mountinfo: str, files: dict[str, str], meminfo: str = MEMINFO) -> Path:
    root = tmp_path / "root"
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/meminfo").write_text(meminfo)
    (root / "proc/self/cgroup").write_text(cgroup)
    (root / "proc/self/mountinfo").write_text(mountinfo)
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


V1_CGROUP = (FIX / "hostmem/v1-hybrid.cgroup").read_text()
V1_MOUNTINFO = (FIX / "hostmem/v1-hybrid.mountinfo").read_text()
V1_GROUP = "sys/fs/cgroup/memory/process_api/a572a8b8b7f0f835678c45329979829c"
V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot\n"


def test_v1_hybrid_layout_of_this_vm_limit_and_working_set(tmp_path):
    stat = "cache 300\ninactive_file 100\nhierarchical_memory_limit 9223372036854771712\ntotal_inactive_file 104857600\n"
    root = _tree(tmp_path, V1_CGROUP, V1_MOUNTINFO, {
        f"{V1_GROUP}/memory.limit_in_bytes": "1572864000\n",
        f"{V1_GROUP}/memory.usage_in_bytes": f"{500 * MIB}\n",
        f"{V1_GROUP}/memory.stat": stat})
    host = hostmem.read(root)
    assert host.total_bytes == 1572864000
    assert host.total_source == f"memory cgroup limit (/{V1_GROUP}/memory.limit_in_bytes), below MemTotal"
    assert host.available_bytes == 1572864000 - (500 - 100) * MIB  # usage less inactive file pages
    assert host.available_source.startswith("memory cgroup limit less its working set (/sys/fs/cgroup/memory/")


def test_v1_parent_limit_through_hierarchical_memory_limit(tmp_path):
    root = _tree(tmp_path, V1_CGROUP, V1_MOUNTINFO, {
        f"{V1_GROUP}/memory.limit_in_bytes": "9223372036854771712\n",  # the leaf: no limit
        f"{V1_GROUP}/memory.usage_in_bytes": f"{100 * MIB}\n",
        f"{V1_GROUP}/memory.stat": f"hierarchical_memory_limit {2 * GIB}\ntotal_inactive_file 0\n"})
    host = hostmem.read(root)
    assert (host.total_bytes, host.available_bytes) == (2 * GIB, 2 * GIB - 100 * MIB)
    assert host.total_source == f"memory cgroup limit (/{V1_GROUP}/memory.stat), below MemTotal"  # where it was read


def test_no_limit_anywhere_reads_meminfo(tmp_path):
    root = _tree(tmp_path, V1_CGROUP, V1_MOUNTINFO, {
        f"{V1_GROUP}/memory.limit_in_bytes": "9223372036854771712\n",
        f"{V1_GROUP}/memory.usage_in_bytes": "280375296\n",
        f"{V1_GROUP}/memory.stat": "hierarchical_memory_limit 9223372036854771712\ntotal_inactive_file 99074048\n",
        "sys/fs/cgroup/unified/memory.max": "max\n"})
    assert hostmem.read(root) == hostmem.HostMemory(
        24683784 * 1024, "MemTotal of /proc/meminfo (host memory)", 24310612 * 1024, "MemAvailable of /proc/meminfo")


def test_v1_container_without_a_cgroup_namespace_reads_its_mount(tmp_path):
    """Docker on cgroup v1 (this machine's dockerd): /proc/self/cgroup says /docker/ID and the
    memory hierarchy is mounted with that group as its root: the mount point is the group."""
    cgroup = (FIX / "container/docker-20.10-cgroupv1-bookworm/proc/1/cgroup").read_text()
    gid = cgroup.split("memory:")[1].split("\n")[0]
    mountinfo = (FIX / "container/docker-20.10-cgroupv1-bookworm/proc/self/mountinfo").read_text()
    mountinfo = mountinfo.replace("/docker/e2e0b7aff45393efd5d44ce997e65bd1db2f538bb9111db5a03ff0bfaa9746e1", gid)
    root = _tree(tmp_path, cgroup, mountinfo, {
        "sys/fs/cgroup/memory/memory.limit_in_bytes": f"{GIB}\n",
        "sys/fs/cgroup/memory/memory.usage_in_bytes": f"{GIB // 4}\n",
        "sys/fs/cgroup/memory/memory.stat": f"hierarchical_memory_limit {GIB}\ntotal_inactive_file 0\n"})
    host = hostmem.read(root)
    assert (host.total_bytes, host.available_bytes) == (GIB, GIB - GIB // 4)
    assert "/sys/fs/cgroup/memory/memory.limit_in_bytes" in host.total_source


def test_v2_container_with_a_cgroup_namespace(tmp_path):
    root = _tree(tmp_path, "0::/\n", V2_MOUNT, {
        "sys/fs/cgroup/memory.max": f"{GIB}\n", "sys/fs/cgroup/memory.current": f"{300 * MIB}\n",
        "sys/fs/cgroup/memory.stat": f"anon 1\nfile 2\ninactive_file {100 * MIB}\nactive_file 5\n"})
    host = hostmem.read(root)
    assert (host.total_bytes, host.available_bytes) == (GIB, GIB - 200 * MIB)
    assert host.total_source == "memory cgroup limit (/sys/fs/cgroup/memory.max), below MemTotal"


def test_v2_a_parents_memory_max_bounds_the_group(tmp_path):
    """systemd on cgroup v2: the session's scope has no limit, its user slice does; the walk goes
    up to the mount, and the tightest headroom anywhere on the way is what is left."""
    scope = "sys/fs/cgroup/user.slice/user-0.slice/session-3.scope"
    root = _tree(tmp_path, "0::/user.slice/user-0.slice/session-3.scope\n", V2_MOUNT, {
        f"{scope}/memory.max": "max\n", f"{scope}/memory.current": f"{50 * MIB}\n",
        "sys/fs/cgroup/user.slice/user-0.slice/memory.max": "max\n",
        "sys/fs/cgroup/user.slice/memory.max": f"{3 * GIB}\n",
        "sys/fs/cgroup/user.slice/memory.current": f"{2 * GIB}\n",
        "sys/fs/cgroup/user.slice/memory.stat": "inactive_file 0\n"})
    host = hostmem.read(root)
    assert (host.total_bytes, host.available_bytes) == (3 * GIB, GIB)
    assert "/sys/fs/cgroup/user.slice/memory.max" in host.total_source


def test_v2_the_limit_and_the_headroom_can_come_from_different_groups(tmp_path):
    """A nearly full child under a roomier but smaller-limited parent: the total is the parent's
    limit, what is left is the child's; each source names its own file."""
    root = _tree(tmp_path, "0::/a.slice/b.scope\n", V2_MOUNT, {
        "sys/fs/cgroup/a.slice/b.scope/memory.max": f"{4 * GIB}\n",
        "sys/fs/cgroup/a.slice/b.scope/memory.current": f"{4 * GIB - 100 * MIB}\n",
        "sys/fs/cgroup/a.slice/memory.max": f"{3 * GIB}\n", "sys/fs/cgroup/a.slice/memory.current": f"{GIB}\n"})
    host = hostmem.read(root)
    assert (host.total_bytes, host.available_bytes) == (3 * GIB, 100 * MIB)
    assert host.total_source == "memory cgroup limit (/sys/fs/cgroup/a.slice/memory.max), below MemTotal"
    assert host.available_source == ("memory cgroup limit less its working set "
                                     "(/sys/fs/cgroup/a.slice/b.scope/memory.max), below MemAvailable")


def test_v2_mount_point_escapes_and_a_group_the_mount_does_not_show(tmp_path):
    """mountinfo writes a space as \\040; a path outside the mount's root (a container without a
    namespace) falls back to the mount point itself."""
    mountinfo = "30 23 0:26 /system.slice/docker-1.scope /sys/fs/my\\040cgroup rw - cgroup2 cgroup2 rw\n"
    root = _tree(tmp_path, "0::/other.slice/x\n", mountinfo, {
        "sys/fs/my cgroup/memory.max": f"{GIB}\n", "sys/fs/my cgroup/memory.current": "0\n"})
    assert hostmem.read(root).total_bytes == GIB


@pytest.mark.parametrize("value", ["max", "12abc", "-5", "1e9", "", "9" * 30, "0x10", "1 2", "\x00", "9223372036854771712"])
def test_a_value_that_is_not_a_plain_number_is_no_limit(tmp_path, value):
    root = _tree(tmp_path, "0::/\n", V2_MOUNT, {"sys/fs/cgroup/memory.max": value, "sys/fs/cgroup/memory.current": "1"})
    assert hostmem.read(root).total_source == "MemTotal of /proc/meminfo (host memory)"


@pytest.mark.parametrize("cgroup, mountinfo", [
    ("0::/../../etc\n", V2_MOUNT),  # a path that climbs out of the mount is not followed
    ("", V2_MOUNT), ("0::/\n", ""),
    ("garbage\n\x00::\n4:memory\n", "not mountinfo at all\n- - -\n"),
    ("0::relative\n", V2_MOUNT),
])
def test_hostile_or_missing_cgroup_files_leave_meminfo(tmp_path, cgroup, mountinfo):
    root = _tree(tmp_path, cgroup, mountinfo, {"etc/memory.max": "1\n", "sys/fs/cgroup/x": ""})
    host = hostmem.read(root)
    assert (host.total_bytes, host.available_bytes) == (24683784 * 1024, 24310612 * 1024)


def test_nothing_readable_is_no_figure_and_no_refusal(tmp_path):
    root = tmp_path / "empty"
    root.mkdir()
    host = hostmem.read(root)
    assert host.total_bytes is None and host.available_bytes is None
    assert hostmem.check(10**15, 0, "x", host) == hostmem.Check(None, None)


def test_check_refuses_past_what_the_process_can_get_and_warns_within_the_tolerance():
    host = hostmem.HostMemory(8 * GIB, "t", 4 * GIB, "MemAvailable of /proc/meminfo")
    held = GIB
    fits = hostmem.check(3 * GIB, held, "the memory estimate", host)
    assert (fits.refusal, fits.warning, fits.over) == (None, None, False)  # 3 GiB x 1.25 < 5 GiB
    assert fits.figures == ("the memory estimate is 3.00 GiB; this process can get 5.00 GiB (1.00 GiB it holds + "
                            "4.00 GiB available: MemAvailable of /proc/meminfo)")
    near = hostmem.check(int(4.5 * GIB), held, "the memory estimate", host)
    assert near.refusal is None and "within 25% of it: the kernel may kill the run" in (near.warning or "")
    over = hostmem.check(5 * GIB + 1, held, "the memory estimate", host)
    assert over.warning is None and over.refusal is not None and over.over and not near.over
    assert over.refusal.startswith(over.figures) and over.figures.startswith("the memory estimate is 5.00 GiB; this process can get 5.00 GiB (1.00 GiB it "
                                   "holds + 4.00 GiB available: MemAvailable of /proc/meminfo)")
    assert "killed by the kernel" in over.refusal


def test_search_limit_is_what_the_process_can_get_when_that_is_less():
    from capture.trial.devmem import rss_bytes

    tight = hostmem.HostMemory(64 * GIB, "t", GIB, "memory cgroup limit less its working set (/x)")
    limit, src = hostmem.search_limit(64 * GIB, "MemTotal of /proc/meminfo (host memory)", tight)
    held = rss_bytes() or 0
    assert held < limit - GIB + 64 * MIB and limit >= GIB  # its RSS (read a moment apart) + 1 GiB
    assert src == ("this process's RSS + available (memory cgroup limit less its working set (/x)), "
                   "below MemTotal of /proc/meminfo (host memory)")
    roomy = hostmem.HostMemory(64 * GIB, "t", 63 * GIB, "a")
    assert hostmem.search_limit(2 * GIB, "--memory-limit", roomy) == (2 * GIB, "--memory-limit")


def test_a_checkpoint_in_a_memory_held_folder_is_checked_against_the_hosts_memory(tmp_path):
    """A tmpfs's own size says nothing of a container's limit: its files are counted against the
    host's (here given) available memory, and the write is refused before a byte."""
    import torch

    from capture.trial import checkpoint_io

    state = {"model": {"w": torch.zeros(2 * MIB // 4)}, "step": 2}  # 2 MiB of fp32
    with mounted_tmpfs(tmp_path / "shm", "64m") as shm:
        assert hostmem.memory_backed(shm) == "tmpfs"
        tight = hostmem.HostMemory(64 * GIB, "t", MIB, "what the test gives")
        with pytest.raises(checkpoint_io.NoSpace, match=r"^the checkpoint needs 2\.00 MiB in .*/shm, a tmpfs whose "
                           r"files take the host's memory, and 1\.00 MiB is available \(what the test gives\) "
                           r"\(hint: give the trial a work folder on disk with --workdir"):
            checkpoint_io.check_space(state, shm / "checkpoint.pt", tight)
        checkpoint_io.check_space(state, shm / "checkpoint.pt", hostmem.HostMemory(64 * GIB, "t", 3 * MIB, "a"))
        checkpoint_io.check_space(state, shm / "checkpoint.pt", hostmem.HostMemory(None, "", None, ""))  # not known
        assert list(shm.iterdir()) == []


# --------------------------------------------------------------------------- real cgroups


@pytest.mark.slow
def test_a_cpu_trial_past_its_cgroup_stops_before_the_step_or_the_build_with_a_manifest(tmp_path, cgroup_1500m):
    """Before this check, the tiny example at micro-batch 4096 (estimate 25.6 GiB) in a 1.5 GB
    cgroup was killed by the kernel at its first step: exit 137, no manifest, its scratch folder
    left behind. Now both the step and an 8B model's build stop first, and the manifest says why."""
    import tomllib

    env = dict(os.environ, XDG_CONFIG_HOME=str(tmp_path / "cfg"), PYTHONUNBUFFERED="1")
    env.pop("CAPTURE_KEY", None)
    for example, extra, failed_at in (("tiny", ["--micro-batch", "4096"], "training step 1 of 23 (not started: estimated)"),
                                      ("llama-3.1-8b-lora", [], "building the model")):
        out = tmp_path / f"{example}.toml"
        proc = in_cgroup(cgroup_1500m, [sys.executable, "-m", "capture", "trial", "--example", example, *extra,
                                         "--no-preflight", "--no-report", "-o", str(out)], tmp_path, env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr and "killed by the kernel" in proc.stderr
        lines = proc.stderr.splitlines()
        first = next(i for i, line in enumerate(lines) if line.startswith(("capture: the memory estimate (",
                                                                          "capture: this process with")))
        last = next(i for i, line in enumerate(lines) if "killed by the kernel" in line)
        assert first < last and all(len(line) <= 100 for line in lines[first:last + 1])  # wrapped, 100 columns
        fit = tomllib.loads(out.read_text())["trial"]["fit"]
        assert fit["fits"] is False and fit["failed_at"] == failed_at
        assert "memory cgroup limit" in fit["oom"] and fit["limit_bytes"] == 1500 * MIB
        assert "memory cgroup limit" in fit["limit_source"]
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".capture")) == []  # no scratch left


@pytest.mark.docker
def test_a_container_with_a_memory_limit_reads_it(tmp_path):
    """The real dockerd's ``--memory``: inside the container the limit is the total, whatever
    MemTotal (the host's) says."""
    from capture.errors import DockerUnavailable
    from capture.image import docker_client

    try:
        client = docker_client()
        base = os.environ.get("CAPTURE_LOCAL_BASE", "capture-local/bookworm-python:base")
        client.images.get(base)
    except (DockerUnavailable, Exception) as exc:  # noqa: BLE001 - no daemon or no base: CI has both
        pytest.skip(f"no Docker daemon or local base here ({exc}); CI starts both with .ci/docker.sh")
    code = ("import sys; sys.path.insert(0, '/code'); from capture.trial import hostmem; h = hostmem.read(); "
            "print(h.total_bytes, h.available_bytes); print(h.total_source)")
    out = client.containers.run(base, ["python3", "-I", "-c", code], mem_limit="300m", network_mode="none",
                                volumes={str(ROOT): {"bind": "/code", "mode": "ro"}}, remove=True)
    total, avail, source = out.decode().split(maxsplit=2)
    assert int(total) == 300 * MIB and 0 < int(avail) <= 300 * MIB
    assert source.strip().startswith("memory cgroup limit (/sys/fs/cgroup/") and "below MemTotal" in source


# --------------------------------------------------------------------------- scratch held in memory


def _stat_fs(path: Path) -> str:
    """The filesystem type as coreutils' ``stat -f`` names it, of the nearest existing folder."""
    while not path.exists():
        path = path.parent
    return subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_memory_backed_agrees_with_stat_on_this_machines_mounts(tmp_path):
    """Differential against coreutils' ``stat -f`` (statfs): whichever of these paths lie on a
    tmpfs or ramfs here, and through a link into one."""
    link = tmp_path / "to-shm"
    link.symlink_to("/dev/shm")
    paths = [Path("/"), Path("/dev/shm"), Path("/dev/shm/capture-not-made/x"), Path("/proc"), Path("/sys/fs/cgroup"),
             tmp_path, link / "x", Path("/run"), Path("/tmp")]
    for path in paths:
        fs = _stat_fs(path)
        assert hostmem.memory_backed(path) == (fs if fs in hostmem.MEMORY_FILESYSTEMS else None), (path, fs)


def test_memory_backed_reads_the_mount_on_top_and_escaped_points(tmp_path):
    docker = (FIX / "container/docker-20.10-cgroupv1-bookworm/proc/self/mountinfo").read_text()
    root = _tree(tmp_path, "", docker + "200 91 0:60 / /dev/shm/big rw - ext4 /dev/sdb rw\n"
                                        "201 76 0:61 / /mnt/my\\040scratch rw - ramfs none rw\n"
                                        "202 76 0:62 / /srv rw - tmpfs tmpfs rw\n"
                                        "203 202 0:63 / /srv rw - xfs /dev/sdc rw\n", {})
    assert hostmem.memory_backed("/dev/shm/cw/recovery", root) == "tmpfs"  # docker's 64 MB shm
    assert hostmem.memory_backed("/dev/shm/big/cw", root) is None  # a disk mounted inside it
    assert hostmem.memory_backed("/mnt/my scratch/cw", root) == "ramfs"
    assert hostmem.memory_backed("/mnt/my", root) is None  # not a prefix by characters alone
    assert hostmem.memory_backed("/srv/cw", root) is None  # an xfs mounted over the tmpfs: the top one
    assert hostmem.memory_backed("/work", tmp_path / "nothing") is None  # no mountinfo: not known, not in memory


# --------------------------------------------------------------------------- the scaling step's ranks


def test_before_ranks_counts_each_rank_and_the_agent_less_what_they_share():
    host = hostmem.HostMemory(8 * GIB, "t", 2 * GIB, "memory cgroup limit less its working set (t)")
    # a CPU: 350 MiB measured once imported, 100 of it the libraries: 250 each, 9 processes for 8 ranks
    assert hostmem.before_ranks(2, 350 * MIB, host, held=400 * MIB, shared=100 * MIB) is None
    refusal = hostmem.before_ranks(8, 350 * MIB, host, held=400 * MIB, shared=100 * MIB)
    assert refusal is not None and "8 rank process(es) and torchrun's agent, each 250.00 MiB" in refusal
    assert "is 2.59 GiB; this process can get 2.39 GiB" in refusal  # 400 MiB + 9 x 250 MiB against 400 MiB + 2 GiB
    # an accelerator: a process like this one (3 GiB held, 1 GiB shared): 2 GiB each
    assert hostmem.before_ranks(1, None, hostmem.HostMemory(64 * GIB, "t", 8 * GIB, "a"), 3 * GIB, GIB) is None
    assert hostmem.before_ranks(8, None, hostmem.HostMemory(64 * GIB, "t", 8 * GIB, "a"), 3 * GIB, GIB) is not None
    assert hostmem.before_ranks(64, None, hostmem.HostMemory(None, "", None, ""), 3 * GIB, GIB) is None  # not known


@pytest.mark.slow
def test_ranks_the_host_cannot_hold_are_not_launched(tmp_path, cgroup_1500m):
    """Before this check, the tiny example's scaling step with four (or eight) CPU ranks in a
    1.5 GB cgroup was not killed: its ranks thrashed, the launch hung until ``timeout`` stopped it
    (240 and 400 s). Now it ends at once with exit 2, the figures and a hint, and leaves no scratch.
    Eight ranks: about 2.5 GB of imports against 1.5, far from the line on any torch build."""
    env = dict(os.environ, XDG_CONFIG_HOME=str(tmp_path / "cfg"), PYTHONUNBUFFERED="1")
    env.pop("CAPTURE_KEY", None)
    out = tmp_path / "scaling.toml"
    proc = in_cgroup(cgroup_1500m, [sys.executable, "-m", "capture", "trial", "--example", "tiny", "--nproc", "8",
                                    "--no-recovery", "--no-preflight", "--no-report", "-o", str(out)], tmp_path, env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "scaling: measure:" not in proc.stderr  # no rank was started
    error = next(line for line in proc.stderr.splitlines() if line.startswith("error: "))
    assert error.startswith("error: scaling: not launched: 8 rank process(es) and torchrun's agent, each ")
    assert "memory cgroup limit" in error and "hint: run fewer ranks (--nproc)" in proc.stderr
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".capture")) == []


@pytest.mark.slow
def test_a_checkpoint_past_the_cgroup_in_a_tmpfs_is_refused_not_killed(tmp_path, cgroup_1500m):
    """Before this check, a 2 GiB checkpoint written to a 4 GB tmpfs (its size far above the
    1.5 GB cgroup, as /dev/shm is in a container) passed the free-space check; the writer was
    killed by the kernel (exit 137) and left a 1.3 GB temporary file in the tmpfs, holding the
    memory after it. Now the write is refused with the figures and nothing is written. The tensor
    is allocated, not touched: its pages are not the process's until written."""
    script = ("import sys, torch\nfrom pathlib import Path\nfrom capture.trial import checkpoint_io\n"
              "w = torch.empty(2 * 2**30, dtype=torch.uint8)\n"
              "try:\n    checkpoint_io.save({'model': {'w': w}, 'step': 1}, Path(sys.argv[1]) / 'checkpoint.pt')\n"
              "except checkpoint_io.NoSpace as exc:\n    print('refused:', exc)\n")
    with mounted_tmpfs(tmp_path / "shm", "4g") as shm:
        proc = in_cgroup(cgroup_1500m, [sys.executable, "-c", script, str(shm)], tmp_path, dict(os.environ))
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.startswith("refused: the checkpoint needs 2.00 GiB in ")
        assert "a tmpfs whose files take the host's memory" in proc.stdout and "memory cgroup limit" in proc.stdout
        assert list(shm.iterdir()) == []

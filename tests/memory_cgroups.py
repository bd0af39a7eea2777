"""Real memory cgroups for the tests that run a trial under a memory limit (test_trial_hostmem,
test_trial_recover_memory): made where this process may (root, a writable /sys/fs/cgroup, v1 or
v2), entered by the child before it runs. The fixture ``cgroup_1500m`` is in conftest. Beside
them, real tmpfs mounts (:func:`mounted_tmpfs`): a small disk, or a folder whose files take memory."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def mounted_tmpfs(folder: Path, size: str) -> Iterator[Path]:
    """``folder`` (made here) with a new tmpfs of ``size`` (mount's ``size=``: ``4m``, ``4g``)
    mounted on it for the block; the test is skipped where this process may not mount (not root)."""
    import pytest

    folder.mkdir(parents=True, exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                      capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def memory_cgroup(limit_bytes: int) -> tuple[Path, Path] | None:
    """A new memory cgroup limited to ``limit_bytes`` (v1 or v2): (its procs file, its folder),
    None where this process may not make one (not root, a read-only /sys/fs/cgroup)."""
    name = f"capture-test-{uuid.uuid4().hex[:8]}"
    for parent, limit_file in ((Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"),
                               (Path("/sys/fs/cgroup"), "memory.max")):
        if not (parent / limit_file).exists() and not (parent / "cgroup.subtree_control").exists():
            continue
        group = parent / name
        try:
            if limit_file == "memory.max" and "memory" not in (parent / "cgroup.subtree_control").read_text().split():
                continue
            group.mkdir()
            (group / limit_file).write_text(str(limit_bytes))
            return group / "cgroup.procs", group
        except OSError:
            if group.is_dir():
                group.rmdir()
    return None


def held_cgroup(limit_bytes: int) -> Iterator[Path | None]:
    """The procs file of a new group for the test's life (None where none can be made); the group
    is removed once its last process is gone."""
    made = memory_cgroup(limit_bytes)
    if made is None:
        yield None
        return
    try:
        yield made[0]
    finally:
        for _ in range(50):
            try:
                made[1].rmdir()
                break
            except OSError:
                time.sleep(0.1)


def in_cgroup(procs: Path, args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run ``args`` inside the group (the child enters it before it execs)."""
    def enter() -> None:
        procs.write_text(str(os.getpid()))

    return subprocess.run(args, preexec_fn=enter, capture_output=True, text=True, cwd=cwd, env=env, timeout=600)

"""How much memory this process can get on its host: the kernel's figures and its memory cgroup's.

A CPU run past that memory is not an out-of-memory error the trial can catch: the kernel's OOM
killer ends the process (SIGKILL), and no manifest is written. Inside a container or a systemd
slice the limit is the memory cgroup's, often far below ``MemTotal`` (``docker run --memory 8g``
on a 64 GiB host still shows 64 GiB in /proc/meminfo). So the trial on a CPU reads both:

- **total**: ``MemTotal`` of /proc/meminfo, or the cgroup's limit where that is lower (v2:
  ``memory.max`` of this process's group and of every group above it; v1: ``memory.limit_in_bytes``
  and ``hierarchical_memory_limit`` of ``memory.stat``);
- **available**: ``MemAvailable`` of /proc/meminfo, or what the cgroup still allows where that is
  lower: limit less the group's working set (usage less inactive file pages, which the kernel
  reclaims before it kills; the working set as container runtimes count it).

The group is found as the kernel states it: this process's line in /proc/self/cgroup (``0::PATH``
for v2, ``N:...memory...:PATH`` for v1), under the mount of that hierarchy in /proc/self/mountinfo
(the mount's root subtracted from PATH, so a container with or without a cgroup namespace reads
its own group). Every file is read with a size bound; a value that is not a plain integer, "max",
or one at or above 2**62 (v1's "no limit", 9223372036854771712) is no limit.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from capture.probes.host import host_root, parse_meminfo_bytes

_READ_MAX = 1 << 20
NO_LIMIT = 1 << 62
"""At or above this a cgroup value means no limit (cgroup v1 writes PAGE_COUNTER_MAX pages)."""


@dataclass(frozen=True)
class HostMemory:
    total_bytes: int | None
    total_source: str
    available_bytes: int | None
    available_source: str


@dataclass(frozen=True)
class _Group:
    version: int
    path: Path  # this process's group directory
    top: Path  # the hierarchy's mount point (v2: the walk up stops here)


def _read(path: Path) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read(_READ_MAX).decode("utf-8", "replace")
    except (OSError, ValueError):
        return None


def _int(text: str | None) -> int | None:
    """A cgroup value: a plain non-negative integer below :data:`NO_LIMIT`, else None ("max", junk)."""
    value = (text or "").strip()
    if not re.fullmatch(r"[0-9]{1,20}", value):
        return None
    n = int(value)
    return n if n < NO_LIMIT else None


def _stat(text: str | None, key: str) -> int | None:
    for line in (text or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return _int(value)
    return None


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as three octal digits (``\\040``)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


@dataclass(frozen=True)
class _Mount:
    root: str  # the mounted folder of its filesystem
    point: str  # where it is mounted
    fstype: str
    options: list[str] | None  # the super options; None where the line has none


def _mounts(mountinfo: str) -> Iterator[_Mount]:
    """The lines of /proc/self/mountinfo (``ID PARENT MAJ:MIN ROOT POINT ... - FSTYPE SOURCE
    SUPER-OPTIONS``), escapes undone; a line without its five fields or its type is left out."""
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, after = left.split(" "), right.split(" ")
        if sep and len(fields) >= 5 and after[0]:
            yield _Mount(_unescape(fields[3]), _unescape(fields[4]), after[0],
                         after[2].split(",") if len(after) >= 3 else None)


def _under(path: str, top: str) -> bool:
    """``path`` is ``top`` or below it, by whole names (``/mnt/my scratch`` is not below ``/mnt/my``)."""
    return path == top or path.startswith(top.rstrip("/") + "/")


def _groups(root: Path) -> list[_Group]:
    """This process's memory cgroup(s): its v2 group and its v1 memory-controller group, each
    under the mount of its hierarchy (a v2 group without memory files, as in a hybrid layout,
    gives no limit). Empty where neither can be read."""
    cgroup, mountinfo = _read(root / "proc/self/cgroup"), _read(root / "proc/self/mountinfo")
    if not cgroup or not mountinfo:
        return []
    paths: dict[int, str] = {}  # version -> the group's path as the kernel names it
    for line in cgroup.splitlines():
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hid == "0" and controllers == "" and path.startswith("/"):
            paths[2] = path
        elif "memory" in controllers.split(",") and path.startswith("/"):
            paths[1] = path
    out: list[_Group] = []
    for mount in _mounts(mountinfo):
        if mount.options is None:
            continue
        version = 2 if mount.fstype == "cgroup2" else 1 if mount.fstype == "cgroup" and "memory" in mount.options else 0
        if version not in paths:
            continue
        path = paths.pop(version)
        rel = path[len(mount.root):] if _under(path, mount.root) else ""
        parts = [p for p in rel.split("/") if p]
        if any(p in (".", "..") for p in parts):
            continue
        top = root / mount.point.lstrip("/")
        group = top.joinpath(*parts)
        if not group.is_dir():  # a group the mount does not show (no cgroup namespace): the mount's own
            group = top
        out.append(_Group(version, group, top))
    return out


MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")
"""Filesystems whose files are held in memory (``/dev/shm``, a tmpfs ``/tmp``): a file written
there takes what a process could have had, and the kernel cannot reclaim it to disk."""


def memory_backed(path: str | os.PathLike[str], root: Path | None = None) -> str | None:
    """The filesystem type of ``path`` (as far as it exists, links resolved) where its files are
    held in memory (:data:`MEMORY_FILESYSTEMS`), else None: the mount in /proc/self/mountinfo with
    the longest mount point above it, the last one where several share that point (the one on top)."""
    mountinfo = _read((root or Path("/")) / "proc/self/mountinfo") or ""
    target = os.path.realpath(path)
    best, fstype = -1, ""
    for mount in _mounts(mountinfo):
        if _under(target, mount.point) and len(mount.point) >= best:
            best, fstype = len(mount.point), mount.fstype
    return fstype if fstype in MEMORY_FILESYSTEMS else None


@dataclass(frozen=True)
class _Bound:
    bytes: int
    file: Path  # the file that says so


def _tighter(a: _Bound | None, b: _Bound | None) -> _Bound | None:
    return b if a is None or (b is not None and b.bytes < a.bytes) else a


def _limits(group: _Group) -> tuple[_Bound | None, _Bound | None]:
    """(limit, limit less working set) of one group, each with the file it comes from; None where unlimited."""
    if group.version == 1:
        stat_file = group.path / "memory.stat"
        stat = _read(stat_file)
        limit = None
        for value, file in ((_int(_read(group.path / "memory.limit_in_bytes")), group.path / "memory.limit_in_bytes"),
                            (_stat(stat, "hierarchical_memory_limit"), stat_file)):  # a parent's, seen from here
            limit = _tighter(limit, _Bound(value, file) if value is not None else None)
        usage = _int(_read(group.path / "memory.usage_in_bytes"))
        if limit is None or usage is None:
            return limit, None
        inactive = _stat(stat, "total_inactive_file") or 0
        return limit, _Bound(max(0, limit.bytes - max(0, usage - inactive)), limit.file)
    limit = left = None
    level = group.path
    while True:  # v2: every group above counts (a parent's memory.max bounds its children)
        value = _int(_read(level / "memory.max"))
        if value is not None:
            limit = _tighter(limit, _Bound(value, level / "memory.max"))
            current = _int(_read(level / "memory.current"))
            if current is not None:
                inactive = _stat(_read(level / "memory.stat"), "inactive_file") or 0
                left = _tighter(left, _Bound(max(0, value - max(0, current - inactive)), level / "memory.max"))
        if level == group.top or level.parent == level:
            return limit, left
        level = level.parent


def read(root: Path | None = None) -> HostMemory:
    """This process's host memory. ``root``: where /proc and /sys are (tests pass a tree); by
    default /proc/meminfo is the host probe's (``$CAPTURE_HOST_ROOT``, else /) and the cgroup is
    this process's own."""
    meminfo = _read((root or host_root()) / "proc/meminfo") or ""
    root = root or Path("/")
    total, avail = parse_meminfo_bytes(meminfo, "MemTotal"), parse_meminfo_bytes(meminfo, "MemAvailable")
    total_src = "MemTotal of /proc/meminfo (host memory)"
    avail_src = "MemAvailable of /proc/meminfo"
    for group in _groups(root):
        limit, left = _limits(group)
        if limit is not None and (total is None or limit.bytes < total):
            total, total_src = limit.bytes, f"memory cgroup limit (/{limit.file.relative_to(root)}), below MemTotal"
        if left is not None and (avail is None or left.bytes < avail):
            avail, avail_src = left.bytes, (f"memory cgroup limit less its working set (/{left.file.relative_to(root)}), "
                                            "below MemAvailable")
    return HostMemory(total, total_src, avail, avail_src)


CPU_TOLERANCE = 0.5
"""The memory estimate's documented tolerance on a CPU (docs/trial.md): the C library's heap and
oneDNN's scratch are not modelled. Measured in a 1.5 GB cgroup, the tiny example at micro-batch
56 to 128 peaked 1.29 to 1.44 times its estimate (glibc keeps freed blocks below its mmap
threshold, up to 32 MiB, in its heap; with ``MALLOC_MMAP_THRESHOLD_=1048576`` the same run was
within 4 %, and its steps 2.4 times slower, so the trial measures the heap as the user's run has it)."""

WARN_WITHIN = 0.25
"""How close to what the host gives a need is warned about (a measured or exact figure)."""


@dataclass(frozen=True)
class Check:
    refusal: str | None  # the run cannot fit: stop before it starts
    warning: str | None  # it may not: within the estimate's tolerance of the limit
    figures: str = ""  # both figures and their sources, in words (where the host's are known)

    @property
    def over(self) -> bool:
        """The need is past what the process can get (what a refusal says)."""
        return self.refusal is not None


def check(need_bytes: int, held_bytes: int, what: str, host: HostMemory | None = None,
          within: float = WARN_WITHIN) -> Check:
    """Whether a process that holds ``held_bytes`` of host memory now can grow to ``need_bytes``
    (``what``: the figure, in words). Past what the host gives, the kernel kills it: a refusal
    names both figures and their sources; within ``within`` of it, a warning."""
    from capture.fmt import bytes_str

    host = host or read()
    if host.available_bytes is None:
        return Check(None, None)
    can = held_bytes + host.available_bytes
    figures = (f"{what} is {bytes_str(need_bytes)}; this process can get {bytes_str(can)} "
               f"({bytes_str(held_bytes)} it holds + {bytes_str(host.available_bytes)} available: "
               f"{host.available_source})")
    if need_bytes > can:
        return Check(f"{figures}; a process past that is killed by the kernel, not stopped with an error", None,
                     figures)
    if need_bytes * (1 + within) > can:
        return Check(None, f"{figures}; within {within:.0%} of it: the kernel may kill the run", figures)
    return Check(None, None, figures)


# --------------------------------------------------------------------------- the trial's checks on a CPU


def held_bytes() -> int:
    """This process's resident memory now (0 where it cannot be read)."""
    from capture.trial.devmem import rss_bytes

    return rss_bytes() or 0


def shared_bytes() -> int:
    """What of this process's RSS a fresh child shares with it (the libraries both map): 0 where
    it cannot be read."""
    from capture.trial.devmem import file_rss_bytes

    return file_rss_bytes() or 0


def fresh_process_bytes(start_bytes: int | None, held: int, shared: int) -> int:
    """What a fresh process of the trial's own (a recovery worker, a scaling rank) holds of the
    host's memory once imported, less the libraries' pages it shares with this one (``shared``):
    ``start_bytes`` where measured (a CPU: the framework's overhead); None on an accelerator, where
    it is a process like this one (``held``: its imports and the runtime's host memory)."""
    own = held if start_bytes is None else start_bytes
    return max(0, own - min(shared, own))


def _said(verdict: Check, say: Callable[[str], None]) -> str | None:
    from capture.termtable import say_wrapped

    for text in filter(None, (verdict.refusal, verdict.warning)):
        say_wrapped(text, say)
    return verdict.refusal


def before_build(config: Any, say: Callable[[str], None]) -> tuple[Any, str | None]:
    """Before the model is built: its weights, read from the model built on the meta device (which
    the estimate then reuses), against what the host can give. (meta build, refusal or None)."""
    from capture.trial import memory
    from capture.trial.build.model import build_meta

    meta = build_meta(config)
    weights = sum(p.nbytes for p in memory.plan_for(config, "cpu", built=meta).params)
    held = held_bytes()
    return meta, _said(check(held + weights, held, "this process with the model's weights"), say)


def before_steps(estimate_bytes: int, say: Callable[[str], None]) -> str | None:
    """Before the first step: the memory estimate with its CPU tolerance (:data:`CPU_TOLERANCE`)
    against what the host can give (refusal or None). A step past it is killed, not caught, and a
    run killed at its first step leaves no manifest: the estimate's upper bound decides."""
    from capture.fmt import bytes_str

    upper = int(estimate_bytes * (1 + CPU_TOLERANCE))
    what = f"the memory estimate ({bytes_str(estimate_bytes)}) with its CPU tolerance of +{CPU_TOLERANCE:.0%}"
    return _said(check(upper, held_bytes(), what, within=0.0), say)


def search_limit(limit: int, source: str, host: HostMemory | None = None) -> tuple[int, str]:
    """The max-batch search's limit on a CPU: no more than the process can get (what it holds +
    what is available), since a candidate past that is killed, not caught."""
    host, held = host or read(), held_bytes()
    if host.available_bytes is not None and held + host.available_bytes < limit:
        return held + host.available_bytes, f"this process's RSS + available ({host.available_source}), below {source}"
    return limit, source


def before_ranks(nproc: int, start_bytes: int | None, host: HostMemory | None = None, held: int | None = None,
                 shared: int | None = None) -> str | None:
    """Before the scaling step launches ``nproc`` ranks on this host (and torchrun's agent, which
    imports the framework too): their imports beside this process against what the host gives;
    the refusal, or None. ``start_bytes``: what one holds once imported, on a CPU the framework's
    overhead as measured; None on an accelerator, where it is a process like this one (the
    runtime's host memory). Less the libraries each shares with this one either way. Measured in a
    1.5 GB memory cgroup: the tiny example's eight CPU ranks were not killed but thrashed, the
    libraries' pages read again and again, and the launch hung (stopped by ``timeout`` after 400 s)."""
    from capture.fmt import bytes_str

    held = held_bytes() if held is None else held
    each = fresh_process_bytes(start_bytes, held, shared_bytes() if shared is None else shared)
    what = (f"{nproc} rank process(es) and torchrun's agent, each {bytes_str(each)} once imported (less the "
            "libraries they share), beside this one")
    return check(held + (nproc + 1) * each, held, what, host, within=0.0).refusal

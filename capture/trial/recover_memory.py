"""How the recovery stage's processes share memory (capture.trial.recover).

The stage runs the reference, a restoring process and a second resume; to save time it starts
and builds fresh processes while another one trains, where the memory allows. On an accelerator
that is the device's memory ([trial.fit]: its size and the trial's measured peak; a fresh process
takes none before it builds). On a CPU it is the host's, shared with the trial process itself,
which stays alive as their parent: there a process past what the host gives is killed by the
kernel (SIGKILL, no error to catch), so the stage first checks that one restoring process fits
beside the trial process at all, and skips with the figures where it does not
(capture.trial.hostmem). Measured in a 1.5 GB memory cgroup with the tiny example at micro-batch
80 (steps at a 1.18 GiB peak): the restoring process, started beside the trial process and a
second one's imports, was killed, and the stage said "failed"; run one process at a time it is
bit-exact. At 96 the restoring process does not fit even alone (killed when forced): skipped.

On an accelerator the device decides the overlap, and the host is still checked: the restoring
process reads the checkpoint once into host memory and keeps that copy for all its restores (a full
8B fine-tune's with AdamW is about 48 GB), beside the trial process; a container's memory limit is
often far below that. Its need is a process like this one (less the libraries it shares) plus the
copy; past the host's whole memory the stage is skipped, past what is available now (or within
25 % of it) its processes run one after another.

Where the trial's scratch is held in memory (``--workdir /dev/shm/...``, a tmpfs), the checkpoint
file takes the host's memory too, beside the copy read from it (and the first restoring process
writes the resumed run's checkpoint there while it holds the copy): the need counts it once more.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from capture._escape import printable
from capture.trial import hostmem


@dataclass(frozen=True)
class MemoryBudget:
    """Whether a fresh process may start or build its workload while another process trains."""

    limit_bytes: int
    """The device's memory ([trial.fit] limit_bytes); on a CPU what the trial process and its
    children can get when the stage starts (its RSS + what the host has available)."""
    peak_bytes: int
    """What the training processes hold at their peak: one training process on a device
    ([trial.fit] measured_bytes); on a CPU the trial process beside a restoring one, which holds
    the trial's peak and the checkpoint's host copy (read once, for every restore)."""
    build_bytes: int
    """What a built workload holds before its first step: weights and the framework's own."""
    start_bytes: int = 0
    """What a fresh process holds before it builds: on a CPU its imports (the framework's
    overhead); 0 on a device, where the imports take none of its memory."""
    refusal: str | None = None
    """Where one restoring process beside the trial process is past what the host gives (the stage is skipped)."""
    warning: str | None = None
    """Where it is within the estimate's tolerance of it (the kernel may kill it)."""
    host_need_bytes: int | None = None
    """On an accelerator, what the trial process and one restoring process hold of the host's
    memory (this process's RSS, a process like it less the libraries they share, the checkpoint's
    host copy); on a CPU ``peak_bytes`` says it."""
    host_limit_bytes: int | None = None
    """On an accelerator, what the trial process and its children can get of the host's memory
    (its RSS + what is available); on a CPU ``limit_bytes`` says it."""
    scratch_in_memory: str | None = None
    """The filesystem of the stage's scratch where its files are held in memory (tmpfs): the
    checkpoint file is then counted in the host's need beside its copy."""

    MARGIN = 0.05
    """Kept free of the memory when two processes share it (allocator slack, workspaces)."""

    def fits_early_build(self) -> bool:
        """Whether a fresh process may hold its built workload beside a training one (the first
        restore's during the reference, the second resume's during the first restore)."""
        return 0 < self.build_bytes and self.peak_bytes + self.build_bytes <= (1 - self.MARGIN) * self.limit_bytes

    def fits_overlap(self) -> bool:
        """Whether a fresh process may start (import) while another one trains, instead of after it:
        the device's memory (a CPU's: the host's), and on an accelerator the host's beside it."""
        if self.host_need_bytes is not None and self.host_limit_bytes is not None \
                and self.host_need_bytes * (1 + hostmem.WARN_WITHIN) > self.host_limit_bytes:
            return False
        return self.peak_bytes + self.start_bytes <= (1 - self.MARGIN) * self.limit_bytes

    def to_manifest(self) -> dict[str, Any]:
        out: dict[str, Any] = {"limit_bytes": self.limit_bytes, "peak_bytes": self.peak_bytes,
                               "build_bytes": self.build_bytes, "start_bytes": self.start_bytes,
                               "early_build": self.fits_early_build(), "overlap": self.fits_overlap()}
        for key in ("host_need_bytes", "host_limit_bytes", "scratch_in_memory", "refusal"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


def checkpoint_bytes(trial: Mapping[str, Any]) -> int:
    """The checkpoint's size: as the trial's own checkpoint stage wrote it (the same contents as the
    stage's), else from the estimate (the model's weights, or a LoRA run's trainable ones, and the
    optimizer's state)."""
    size = (trial.get("checkpoint") or {}).get("size_bytes")
    if isinstance(size, int) and size > 0:
        return size
    estimate = (trial.get("memory") or {}).get("estimate") or {}

    def term(name: str) -> int:
        value = (estimate.get(name) or {}).get("bytes")
        return int(value) if isinstance(value, int) else 0

    model = term("gradients") if (trial.get("run") or {}).get("method") == "lora" else term("weights")
    return model + term("optimizer_state")


def budget_from_trial(trial: Mapping[str, Any], host: hostmem.HostMemory | None = None,
                      held: int | None = None, shared: int | None = None,
                      scratch: Path | None = None) -> MemoryBudget | None:
    """The budget from what the trial measured ([trial.fit], [trial.memory]); None when unknown.
    Also from the host's memory now (``host``; ``held``: this process's RSS; ``shared``: the part
    of it a child shares, the libraries' pages, which the host holds once; each read when not
    given), with the refusal where one restoring process does not fit: on a CPU it holds the
    trial's peak, on an accelerator a process like this one; both the checkpoint's host copy, and
    the checkpoint file itself where ``scratch`` (the stage's folder) is held in memory."""
    fit, memory = trial.get("fit") or {}, trial.get("memory") or {}
    weights = ((memory.get("estimate") or {}).get("weights") or {}).get("bytes")
    limit, peak = fit.get("limit_bytes"), fit.get("measured_bytes")
    if not (isinstance(weights, int) and isinstance(limit, int) and isinstance(peak, int)):
        return None
    overhead = int(memory.get("framework_overhead_bytes") or 0)
    build = int(weights) + overhead
    on_cpu = (memory.get("measured") or {}).get("device_type") == "cpu"
    host = host or hostmem.read()
    held = hostmem.held_bytes() if held is None else held
    shared = hostmem.shared_bytes() if shared is None else shared
    in_memory = hostmem.memory_backed(scratch) if scratch is not None else None
    if host.available_bytes is None:
        return MemoryBudget(limit, peak, build, overhead if on_cpu else 0, scratch_in_memory=in_memory)
    ckpt = checkpoint_bytes(trial)
    file = (f", + the checkpoint file in the scratch folder, held in memory ({in_memory}: "
            f"{printable(scratch)[:200]})" if in_memory else "")
    if on_cpu:
        shared = min(shared, peak, overhead or peak)
        need = peak - shared + ckpt
        what = ("the recovery check's restoring process (the trial's peak less the libraries it shares, + its host "
                f"copy of the checkpoint{file}) beside this one")
    else:  # its imports and the framework's runtime on the host, as this process has them, and the copy
        need = hostmem.fresh_process_bytes(None, held, shared) + ckpt
        what = ("the recovery check's restoring process on the host (a process like this one less the libraries "
                f"it shares, + its host copy of the checkpoint{file}) beside this one")
    need += ckpt if in_memory else 0
    refusal, warning = _host_verdict(held, need, host, what)
    if on_cpu:
        return MemoryBudget(held + host.available_bytes, held + need, build - shared, overhead - shared,
                            refusal, warning, scratch_in_memory=in_memory)
    return MemoryBudget(limit, peak, build, 0, refusal, warning, held + need, held + host.available_bytes, in_memory)


def _host_verdict(held: int, need: int, host: hostmem.HostMemory, what: str) -> tuple[str | None, str | None]:
    """(refusal, warning) for a restoring process that needs ``need`` beside this process (``held``).
    Refused only where it cannot fit even with every page of the file cache given back: past the
    host's (or the cgroup's) whole memory less what this process holds of its own. Between that
    and what is available now the page cache may give the rest: a warning, and one process at a time."""
    whole = (None if host.total_bytes is None else
             replace(host, available_bytes=max(0, host.total_bytes - held),
                     available_source=f"{host.total_source}, less this process's RSS"))
    sure = hostmem.check(held + need, held, what, whole) if whole else hostmem.Check(None, None)
    if sure.refusal:
        return sure.refusal, None
    now = hostmem.check(held + need, held, what, host)
    warning = now.warning or (f"{now.figures}; the file cache may give the rest: its processes run one after "
                              "another, and the kernel may still kill one" if now.over else None)
    return None, warning


def room_to_start(start_bytes: int | None, host: hostmem.HostMemory | None = None, held: int | None = None,
                  shared: int | None = None) -> bool:
    """Whether a fresh process may start its imports now, beside this process as it is: on a CPU
    ``start_bytes`` (the framework's overhead); on an accelerator (None) a process like this one
    less the libraries they share, whose host memory is its imports and the runtime's."""
    host = host or hostmem.read()
    held = hostmem.held_bytes() if held is None else held
    if host.available_bytes is None:
        return True
    if start_bytes is None:
        start_bytes = hostmem.fresh_process_bytes(None, held, hostmem.shared_bytes() if shared is None else shared)
    return held + start_bytes <= (1 - MemoryBudget.MARGIN) * (held + host.available_bytes)

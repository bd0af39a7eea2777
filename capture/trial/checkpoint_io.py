"""Checkpoint files in the formats a user's training writes them, timed as the training sees them.

``[trial.checkpoint] format`` chooses:

- ``torch.save``: one file, streamed through :func:`capture._atomic.atomic_open` (temp file,
  fsync, rename). Training is blocked until the file is durable.
- ``safetensors``: one file; tensors as safetensors, the rest (step counters held as plain
  numbers, param groups, RNG tuples, the data position) as JSON in the file's metadata. Tensors
  that share storage (tied embeddings) are stored once. Written to a temp file, fsynced, renamed.
- ``dcp``: ``torch.distributed.checkpoint.save`` into a folder (works without a process group).
- ``dcp-async``: ``torch.distributed.checkpoint.async_save``: training is blocked while the state
  is staged to host memory (pinned on CUDA), then the files are written in a background thread.

Every save returns a :class:`SaveTiming`: ``blocked_s`` (until training may take its next step)
and ``durable_s`` (until the bytes are fsynced and renamed into place), which are equal for
the synchronous formats. :func:`load` reads any of them back into plain containers on the CPU.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from capture._atomic import atomic_open
from capture._escape import printable
from capture._safe_read import tree_bytes

if TYPE_CHECKING:
    from concurrent.futures import Future

    from capture.trial.hostmem import HostMemory

FORMATS = ("torch.save", "safetensors", "dcp", "dcp-async")
_SKELETON_KEY = "capture_skeleton"


@dataclass(frozen=True)
class SaveTiming:
    format: str
    path: Path
    size_bytes: int
    blocked_s: float
    durable_s: float

    def to_manifest(self) -> dict[str, Any]:
        return {"format": self.format, "size_bytes": self.size_bytes, "blocked_s": self.blocked_s,
                "durable_s": self.durable_s,
                "bytes_per_s": self.size_bytes / self.durable_s if self.durable_s else None}


def file_name(fmt: str) -> str:
    return {"torch.save": "checkpoint.pt", "safetensors": "checkpoint.safetensors"}.get(fmt, "checkpoint.dcp")


def size_of(path: Path) -> int:
    """The bytes of a checkpoint the trial has just written (a file or a DCP folder)."""
    size = tree_bytes(path)
    if size is None:
        raise FileNotFoundError(f"checkpoint {path} is not there to measure")
    return size


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class NoSpace(RuntimeError):
    """The checkpoint's tensors need more than the disk under it has free (checked before writing:
    torch.save that runs out of space fails at the end with "unexpected pos", not ENOSPC)."""


def tensor_bytes(state: Any) -> int:
    """The bytes of every tensor in a nested state (each storage once): what a checkpoint writes."""
    import torch

    seen: set[tuple[int, int]] = set()
    total, stack = 0, [state]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            key = (item.untyped_storage().data_ptr(), item.untyped_storage().nbytes())
            if key not in seen:
                seen.add(key)
                total += key[1]
        elif isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


def check_space(state: Mapping[str, Any], path: Path, host: HostMemory | None = None) -> None:
    """Raise :class:`NoSpace` when the state's tensors exceed the free space where ``path`` goes,
    or, where that folder is held in memory (a tmpfs such as /dev/shm), what the host has
    available (``host``: read when not given): a tmpfs's own size is often half the machine's
    memory, far above a container's limit, and its files count against that limit, so a write past
    it is not an ENOSPC but the kernel killing the process."""
    from capture.fmt import bytes_str
    from capture.trial import hostmem

    need = tensor_bytes(state)
    folder = Path(path).parent
    free = shutil.disk_usage(folder).free
    if need > free:
        raise NoSpace(f"the checkpoint needs {bytes_str(need)} and {printable(folder)[:200]} has {bytes_str(free)} free "
                      "(hint: free space there, or give the trial a work folder on a larger disk with --workdir)")
    fs = hostmem.memory_backed(folder)
    if fs is None:
        return
    host = host or hostmem.read()
    if host.available_bytes is not None and need > host.available_bytes:
        raise NoSpace(f"the checkpoint needs {bytes_str(need)} in {printable(folder)[:200]}, a {fs} whose files take "
                      f"the host's memory, and {bytes_str(host.available_bytes)} is available "
                      f"({host.available_source}) (hint: give the trial a work folder on disk with --workdir, "
                      "or the trial more memory)")


def save(state: Mapping[str, Any], path: Path, fmt: str = "torch.save", device_type: str = "cpu") -> SaveTiming:
    """Write ``state`` to ``path`` in ``fmt``; the caller has synchronised the device. Refuses
    (:class:`NoSpace`) before writing a byte when the disk cannot hold it."""
    path = Path(path)
    check_space(state, path)
    t0 = time.perf_counter()
    if fmt == "torch.save":
        import torch

        with atomic_open(path) as f:
            torch.save(dict(state), f)
        blocked = durable = time.perf_counter() - t0
    elif fmt == "safetensors":
        _save_safetensors(state, path)
        blocked = durable = time.perf_counter() - t0
    elif fmt in ("dcp", "dcp-async"):
        blocked, durable = _save_dcp(state, path, fmt == "dcp-async", device_type, t0)
    else:
        raise ValueError(f"unknown checkpoint format {fmt!r}")
    return SaveTiming(fmt, path, size_of(path), blocked, durable)


def load(path: Path, fmt: str = "torch.save", mmap: bool = False) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save` back, every tensor on the CPU. ``mmap``: a
    ``torch.save`` file is mapped, not copied (its pages are the tensors; unlinking the file then
    frees nothing until the tensors go, so only a reader that writes no checkpoint after uses it)."""
    path = Path(path)
    if fmt == "torch.save":
        import torch

        # weights_only: the file holds only tensors and plain containers (see capture.trial.state).
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    if fmt == "safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt", device="cpu") as f:
            skeleton = json.loads((f.metadata() or {})[_SKELETON_KEY])
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        return _rebuild(skeleton, tensors)
    if fmt in ("dcp", "dcp-async"):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

        out: dict[str, Any] = {}
        # What torch.distributed.checkpoint.format_utils.dcp_to_torch_save does: no template needed.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to load in a single process"
            _load_state_dict(out, storage_reader=FileSystemReader(str(path)), planner=_EmptyStateDictLoadPlanner(),
                             no_dist=True)
        opt = out.get("optimizer")
        if isinstance(opt, dict) and isinstance(opt.get("state"), dict):
            # DCP keys nested dicts by string paths: the optimizer's per-parameter ids come back as "0", "1", ...
            opt["state"] = {int(k) if isinstance(k, str) and k.isdigit() else k: v for k, v in opt["state"].items()}
        return out
    raise ValueError(f"unknown checkpoint format {fmt!r}")


def remove(path: Path) -> None:
    path = Path(path)
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()


def copy_timed(path: Path, destination: Path) -> dict[str, Any]:
    """Copy a written checkpoint to ``destination`` (a folder), fsync it there; time it."""
    path, destination = Path(path), Path(destination)
    destination.mkdir(parents=True, exist_ok=True)
    target = destination / path.name
    tmp = destination / (path.name + ".tmp")
    remove(tmp)
    t0 = time.perf_counter()
    if path.is_dir():
        shutil.copytree(path, tmp)
        for p in tmp.rglob("*"):
            if p.is_file():
                _fsync_path(p)
    else:
        shutil.copyfile(path, tmp)
        _fsync_path(tmp)
    remove(target)
    os.replace(tmp, target)
    seconds = time.perf_counter() - t0
    size = size_of(target)
    remove(target)
    return {"destination": str(destination), "size_bytes": size, "duration_s": seconds,
            "bytes_per_s": size / seconds if seconds else None,
            "note": "copied, fsynced at the destination, then removed there"}


# --------------------------------------------------------------------------- safetensors


def _split(value: Any, tensors: dict[str, Any], seen: dict[tuple[Any, ...], str]) -> Any:
    """A JSON skeleton of ``value``; tensors go into ``tensors`` (storage shared → stored once)."""
    import torch

    if isinstance(value, torch.Tensor):
        t = value.detach()
        ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype,
                 str(t.device)) if t.numel() else None
        if ident is not None and ident in seen:
            return {"t": seen[ident]}
        name = f"t{len(tensors)}"
        tensors[name] = t.contiguous()
        if ident is not None:
            seen[ident] = name
        return {"t": name}
    if isinstance(value, Mapping):
        return {"d": [[k, _split(v, tensors, seen)] for k, v in value.items()]}
    if isinstance(value, tuple):
        return {"u": [_split(v, tensors, seen) for v in value]}
    if isinstance(value, list):
        return {"l": [_split(v, tensors, seen) for v in value]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"v": value}
    raise TypeError(f"safetensors checkpoint: cannot store a {type(value).__name__}")


def _rebuild(node: Mapping[str, Any], tensors: Mapping[str, Any]) -> Any:
    if "t" in node:
        return tensors[node["t"]]
    if "d" in node:
        return {k: _rebuild(v, tensors) for k, v in node["d"]}
    if "u" in node:
        return tuple(_rebuild(v, tensors) for v in node["u"])
    if "l" in node:
        return [_rebuild(v, tensors) for v in node["l"]]
    return node["v"]


def _save_safetensors(state: Mapping[str, Any], path: Path) -> None:
    from safetensors.torch import save_file

    tensors: dict[str, Any] = {}
    skeleton = _split(dict(state), tensors, {})
    tmp = path.with_name(path.name + ".tmp")
    try:
        save_file(tensors, str(tmp), metadata={_SKELETON_KEY: json.dumps(skeleton)})
        _fsync_path(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


# --------------------------------------------------------------------------- torch.distributed.checkpoint


def _save_dcp(state: Mapping[str, Any], path: Path, asynchronous: bool, device_type: str,
              t0: float) -> tuple[float, float]:
    tmp = path.with_name(path.name + ".tmp")
    remove(tmp)
    remove(path)
    data = dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process"
        return _save_dcp_quiet(data, path, tmp, asynchronous, device_type, t0)


def _save_dcp_quiet(data: dict[str, Any], path: Path, tmp: Path, asynchronous: bool, device_type: str,
                    t0: float) -> tuple[float, float]:
    import torch.distributed.checkpoint as dcp

    if not asynchronous:
        dcp.save(data, checkpoint_id=str(tmp), no_dist=True)
        os.replace(tmp, path)
        blocked = time.perf_counter() - t0
        return blocked, blocked
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    cuda = device_type == "cuda"
    # Staged synchronously (training must not change the tensors while they are copied), into
    # pinned host memory on CUDA; the files are then written by DCP's background thread.
    stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                          use_async_staging=False, use_non_blocking_copy=cuda))
    try:
        result = dcp.async_save(data, checkpoint_id=str(tmp), async_stager=stager, no_dist=True)
        blocked = time.perf_counter() - t0
        # a Future either way: the response's upload half, or what older releases return
        future = cast("Future[Any]", getattr(result, "upload_completion", result))
        try:
            future.result()
        except BaseException:
            # Interrupted while the background writer runs: let it finish (bounded) before the
            # caller removes the folder it writes into, so nothing is written after the removal.
            with contextlib.suppress(BaseException):
                future.result(timeout=60)
            raise
    finally:
        stager.close()
    os.replace(tmp, path)
    return blocked, time.perf_counter() - t0

"""Distributed save and restore for the scaling step's recoverability check.

FSDP: model and optimizer are sharded, so they go through ``torch.distributed.checkpoint`` (DCP):
every rank writes its own shards, and any launch of the same world size reads them back into its
shards (``get_state_dict`` / ``set_state_dict`` translate between FSDP and DCP's layout).
DDP: the model and optimizer are replicated, so rank 0 alone writes them (one ``torch.save``).
Both: each rank writes what is its own, ``rank-R.pt``: the LR scheduler, grad scaler, its data
position and its RNG states (python, numpy, torch CPU, its CUDA/ROCm device). The ranks' dropout
streams differ, so each needs its own.

A checkpoint is written into ``DIR.tmp`` and renamed to ``DIR`` by rank 0 once every rank has
finished, so a crash leaves no folder that looks complete.
"""

from __future__ import annotations

import os
import shutil
import time
import types
from pathlib import Path
from typing import Any

from capture.trial import checkpoint_io, state

FORMAT = "capture-dist-2"
FORMATS = {
    "ddp": "rank 0: model + optimizer (torch.save, replicated); every rank: scheduler, scaler, RNG, data position",
    "fsdp": "torch.distributed.checkpoint (sharded model + optimizer); every rank: scheduler, scaler, RNG, data position",
}


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def unwrap(model: Any) -> Any:
    """The module under a DDP wrapper (FSDP2 shards in place, so there is nothing to unwrap)."""
    return getattr(model, "module", model)


def save(strategy: str, workload: Any, directory: Path, step: int, device: Any) -> dict[str, Any]:
    """Write the checkpoint of every rank into ``directory`` (collective: every rank calls it)."""
    dist = _dist()
    rank, world = dist.get_rank(), dist.get_world_size()
    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(directory, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    t0 = time.perf_counter()
    if strategy == "fsdp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(workload.model, workload.optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "dcp"))
    elif rank == 0:
        checkpoint_io.save({"model": unwrap(workload.model).state_dict(), "optimizer": workload.optimizer.state_dict()},
                           tmp / "replicated.pt")
    own: dict[str, Any] = {
        "format": FORMAT, "strategy": strategy, "step": step, "world_size": world, "rank": rank,
        "data_position": workload.loader.state_dict(), "rng": state.capture_rng(device, own_device_only=True),
    }
    if workload.scheduler is not None:
        own["scheduler"] = workload.scheduler.state_dict()
    if workload.scaler is not None:
        own["scaler"] = workload.scaler.state_dict()
    checkpoint_io.save(own, tmp / f"rank-{rank}.pt")
    state.sync(device)
    dist.barrier()
    write_s = time.perf_counter() - t0
    if rank == 0:
        os.replace(tmp, directory)
    dist.barrier()
    if not (directory / f"rank-{rank}.pt").exists():
        raise RuntimeError(f"rank {rank} cannot see its checkpoint file in {directory}: with several nodes, "
                           "--dist-dir must be on a filesystem every node shares")
    size = checkpoint_io.size_of(directory) if rank == 0 else 0
    return {"checkpoint_size_bytes": size, "checkpoint_write_s": write_s, "checkpoint_format": FORMATS[strategy]}


def load(strategy: str, workload: Any, directory: Path, device: Any) -> dict[str, Any]:
    """Restore every rank from ``directory`` into a freshly built, wrapped workload (collective)."""
    import torch

    dist = _dist()
    rank, world = dist.get_rank(), dist.get_world_size()
    directory = Path(directory)
    own_path = directory / f"rank-{rank}.pt"
    if not own_path.exists():
        raise RuntimeError(f"rank {rank}: no checkpoint file {own_path} (a different world size, or --dist-dir "
                           "not shared between the nodes)")
    t0 = time.perf_counter()
    # On the CPU: RNG states must be CPU tensors (numpy reads them; cuda.set_rng_state takes a CPU ByteTensor).
    own = checkpoint_io.load(own_path)
    if own.get("format") != FORMAT or own.get("strategy") != strategy or int(own["world_size"]) != world:
        raise RuntimeError(f"checkpoint {own_path} is {own.get('strategy')} for {own.get('world_size')} ranks; "
                           f"this launch is {strategy} with {world}")
    if strategy == "fsdp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(workload.model, workload.optimizer)
        loaded: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
        dcp.load(loaded, checkpoint_id=str(directory / "dcp"))
        set_state_dict(workload.model, workload.optimizer, model_state_dict=loaded["model"],
                       optim_state_dict=loaded["optim"])
    else:
        shared = torch.load(directory / "replicated.pt", map_location=device, weights_only=True)
        unwrap(workload.model).load_state_dict(shared["model"])
        workload.optimizer.load_state_dict(shared["optimizer"])
        del shared
    if workload.scheduler is not None and "scheduler" in own:
        workload.scheduler.load_state_dict(own["scheduler"])
    if workload.scaler is not None and "scaler" in own:
        workload.scaler.load_state_dict(own["scaler"])
    workload.loader.load_state_dict(own["data_position"])
    # last: loading the rest must not move a stream after it is set
    state.restore_rng(own["rng"], device, own_device_only=True)
    state.sync(device)
    return {"step": int(own["step"]), "restore_load_s": time.perf_counter() - t0}


def full_param_hash(strategy: str, model: Any) -> str | None:
    """sha256 over the full (unsharded) parameters, as :func:`capture.trial.state.param_hash`
    defines it; on rank 0, None elsewhere. Collective for FSDP: every rank must call it."""
    dist = _dist()
    if strategy == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if dist.get_rank() != 0:
            return None
        return state.param_hash(types.SimpleNamespace(state_dict=lambda: full))
    if dist.get_rank() != 0:
        return None
    return state.param_hash(unwrap(model))

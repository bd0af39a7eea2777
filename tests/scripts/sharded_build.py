"""A torchrun worker: the scaling step's FSDP build (capture.trial._dist_build.build_sharded) for each
config named, checked against the single-device build on the CPU.

    torchrun --standalone --nproc-per-node 2 tests/scripts/sharded_build.py OUT.json NAME=CONFIG.toml[:offload] ...

Rank 0 writes OUT.json: per case, whether every parameter and buffer (gathered from the shards)
equals the single-device build's, each rank's local element count, the build's record, and the
losses of two training steps (the sharded model trains).
"""

import itertools
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from capture.trial._dist_build import build_sharded
from capture.trial.config import load_config
from capture.trial.workload import build_workload

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = DeviceMesh("cpu", list(range(world)))
cpu = torch.device("cpu")
results = {}
for spec in sys.argv[2:]:
    name, _, rest = spec.partition("=")
    path, _, flag = rest.partition(":")
    config = load_config(path).with_overrides(device="cpu")
    wl, info = build_sharded(config, cpu, mesh, offload=flag == "offload")
    tensors = list(itertools.chain(wl.model.named_parameters(), wl.model.named_buffers()))
    local = sum(t.to_local().numel() if isinstance(t, DTensor) else 0 for _, t in wl.model.named_parameters())
    full = {n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone() for n, t in tensors}
    locals_ = [None] * world
    dist.all_gather_object(locals_, local)
    losses = [float(wl.train_step()) for _ in range(2)]
    if rank == 0:
        reference = build_workload(config, cpu).model
        want = dict(itertools.chain(reference.named_parameters(), reference.named_buffers()))
        mismatched = sorted(n for n in set(want) | set(full)
                            if n not in want or n not in full or not torch.equal(want[n].detach(), full[n]))
        results[name] = {"equal": not mismatched, "mismatched": mismatched[:5], "tensors": len(full),
                         "buffers": [n for n, _ in wl.model.named_buffers()],
                         "local_numel": locals_, "total_numel": sum(p.numel() for p in reference.parameters()),
                         "info": info, "losses": losses, "params_total": wl.params_total,
                         "optimizer_param_device": str(wl.optimizer.param_groups[0]["params"][0].device)}
    dist.barrier()
if rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(results, f)
dist.destroy_process_group()
os._exit(0)

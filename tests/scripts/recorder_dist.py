"""A torchrun worker: every rank trains its own tiny model under the Recorder; rank 1 is made slow.

    torchrun --standalone --nproc-per-node 2 tests/scripts/recorder_dist.py OUT.toml
"""

import sys
import time

import torch
import torch.distributed as dist

from capture import Recorder

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(rank)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
with Recorder("cpu", warmup_steps=1, tokens_per_step=8, model=model, run={"script": "recorder_dist.py"}) as rec:
    for x in rec.batches(torch.randn(8, 16) for _ in range(6)):
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if rank == 1:
            time.sleep(0.05)  # the straggler
        rec.step()
print(rank, rec.write_manifest(sys.argv[1]))
dist.destroy_process_group()

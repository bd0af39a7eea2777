"""One rank of the preflight all-reduce (started by capture.preflight.allreduce)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="capture.preflight._allreduce_worker")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--backend", choices=("nccl", "gloo"), required=True)
    p.add_argument("--init", required=True)
    p.add_argument("--bytes", type=int, required=True)
    p.add_argument("--iters", type=int, required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)

    import datetime

    import torch
    import torch.distributed as dist

    gpu = a.backend == "nccl"
    device = torch.device("cuda", a.rank) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    kwargs: dict[str, Any] = {"device_id": device} if gpu else {}
    dist.init_process_group(a.backend, init_method=a.init, rank=a.rank, world_size=a.world,
                            timeout=datetime.timedelta(seconds=120), **kwargs)
    try:
        x = torch.full((a.bytes // 4,), float(a.rank + 1), dtype=torch.float32, device=device)
        dist.all_reduce(x)
        want = a.world * (a.world + 1) / 2
        correct = bool((x == want).all().item())
        x.zero_()
        for _ in range(2):
            dist.all_reduce(x)
        if gpu:
            torch.cuda.synchronize(device)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(a.iters):
            dist.all_reduce(x)
        if gpu:
            torch.cuda.synchronize(device)
        seconds = (time.perf_counter() - t0) / a.iters
        correct = correct and bool((x == 0).all().item())
    finally:
        dist.destroy_process_group()
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump({"rank": a.rank, "seconds_per_iter": seconds, "correct": correct}, f)
    return 0


if __name__ == "__main__":
    code = main()
    # Not a normal interpreter exit: gloo's worker threads may still hold the last reference to
    # the all-reduced tensor and take the interpreter lock to drop it while Python finalizes,
    # which aborts the process (terminate called without an active exception) after its result
    # was written. The result file is closed; stdout and stderr are flushed here.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

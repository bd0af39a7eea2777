"""Run under `capture exec`: records a tiny loop with the Recorder, writes outputs, exits with argv[2].

    python tests/scripts/exec_child.py OUTDIR STATUS [--token SECRET]
"""

import sys
from pathlib import Path

import torch

from capture import Recorder

out, status = Path(sys.argv[1]), int(sys.argv[2])
model = torch.nn.Linear(8, 8)
with Recorder("cpu", warmup_steps=1, tokens_per_step=4, model=model) as rec:
    for _ in range(4):
        model(torch.randn(4, 8)).sum().backward()
        rec.step()
print("side only:", rec.write_manifest(None))  # under exec: the figures join exec's manifest
out.mkdir(parents=True, exist_ok=True)
(out / "weights.bin").write_bytes(bytes(range(256)) * 64)
(out / "sub").mkdir(exist_ok=True)
(out / "sub" / "log.txt").write_text("done\n")
sys.exit(status)

"""The host side of a large checkpoint: write, read back, pin, copy to the device, per allocator setting.

The recovery stage of an 8B full fine-tune spends most of its time moving a 48 GB state between
the device, host memory and a file (docs/measurements: two writes and two reads are 173 s of
245). This measures each move on its own, in a fresh process per variant (the allocator settings
are read once per process), on a state shaped like Llama-3.1-8B's (embedding, per-layer q/k/v/o
and MLP matrices, bf16) scaled to ``--gib``:

- write: ``torch.save`` of the device tensors (what the trial's checkpoint does; the trial keeps
  the user's format and settings, this only shows what each knob would change);
- read: ``torch.load(map_location="cpu")`` as the restoring process does, then one copy to the device;
- pin: the host copy into page-locked memory as the restoring process does (capture.trial.state.pin).

Baseline, by name: "default allocator" (no environment added). Variants: ``thp``
(``THP_MEM_ALLOC_ENABLE=1``: torch's CPU allocator advises transparent huge pages for large
buffers, so a 48 GB read takes 24 thousand page faults instead of 12 million), and for the read
``mmap`` (``torch.load(mmap=True)``: the file's pages are the host copy). Ratios are baseline /
variant (above 1: the variant is faster).

    python benchmarks/host_copy.py --device cuda --gib 16 --dir /dev/shm
    python benchmarks/host_copy.py --gib 1                      # CPU: write and read only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = {"default": {}, "thp": {"THP_MEM_ALLOC_ENABLE": "1"}}
# Llama-3.1-8B's matrices, in elements: q, k, v, o, gate, up, down per layer; the embedding.
_LAYER = (4096 * 4096, 1024 * 4096, 1024 * 4096, 4096 * 4096, 14336 * 4096, 14336 * 4096, 14336 * 4096)
_EMBED = 128256 * 4096


def _shapes(gib: float) -> list[int]:
    """Tensor sizes (elements, bf16) adding up to about ``gib``: the embedding, then whole layers."""
    total = int(gib * 2**30) // 2
    sizes = [min(_EMBED, total)]
    while sum(sizes) + sum(_LAYER) <= total:
        sizes.extend(_LAYER)
    return sizes


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _child(args: argparse.Namespace) -> dict[str, float]:
    """One measurement in this (fresh) process."""
    import torch

    out: dict[str, float] = {}
    path = Path(args.file)
    if args.op == "write":
        g = torch.Generator(device=args.device).manual_seed(0)
        tensors = {f"t{i}": torch.randn(n, device=args.device, generator=g, dtype=torch.bfloat16)
                   for i, n in enumerate(_shapes(args.gib))}
        _sync(args.device)
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(tensors, f)
            f.flush()
            os.fsync(f.fileno())
        out["write_s"] = time.perf_counter() - t0
        out["bytes"] = float(path.stat().st_size)
        return out
    t0 = time.perf_counter()
    host = torch.load(path, map_location="cpu", weights_only=True, mmap=args.op == "read-mmap")
    out["read_s"] = time.perf_counter() - t0
    if args.device.startswith("cuda"):
        t0 = time.perf_counter()
        on_device = {k: v.to(args.device) for k, v in host.items()}
        _sync(args.device)
        out["to_device_s"] = time.perf_counter() - t0
        del on_device
        if args.op == "read":
            from capture.trial import state

            t0 = time.perf_counter()
            state.pin(host)
            out["pin_s"] = time.perf_counter() - t0
    return out


def _run(op: str, variant: str, args: argparse.Namespace, file: Path) -> dict[str, float]:
    env = dict(os.environ, **VARIANTS[variant])
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    cmd = [sys.executable, __file__, "--child", op, "--file", str(file), "--device", args.device, "--gib", str(args.gib)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"host_copy: {op}/{variant} failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--gib", type=float, default=2.0, help="state size (default 2)")
    ap.add_argument("--dir", default=None, help="where the file goes (default: the temp folder)")
    ap.add_argument("--rounds", type=int, default=1, help="repeat the set (second round in reverse order)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", choices=("write", "read", "read-mmap"), help=argparse.SUPPRESS)
    ap.add_argument("--file", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        args.op = args.child
        print(json.dumps(_child(args)))
        return 0
    rows: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="host-copy-") as tmp:
        file = Path(tmp) / "state.pt"
        plan = [("write", "default"), ("write", "thp"), ("read", "default"), ("read", "thp"), ("read-mmap", "default")]
        for r in range(args.rounds):
            order = plan if r % 2 == 0 else plan[:2][::-1] + plan[2:][::-1]
            for op, variant in order:
                rows.setdefault(f"{op}/{variant}", []).append(_run(op, variant, args, file))
    best = {k: {m: min(x[m] for x in v) for m in v[0]} for k, v in rows.items()}
    if args.json:
        print(json.dumps({"device": args.device, "gib": args.gib, "best": best}, indent=1))
        return 0
    size = best["write/default"]["bytes"] / 1e9
    print(f"state {size:.1f} GB on {args.device}, file in {args.dir or tempfile.gettempdir()}; best of {args.rounds}")
    print(f"{'measure':<28}{'default s':>11}{'variant s':>11}{'ratio':>8}  variant")
    pairs = [("write_s", "write/default", "write/thp"), ("read_s", "read/default", "read/thp"),
             ("read_s", "read/default", "read-mmap/default"), ("to_device_s", "read/default", "read/thp"),
             ("to_device_s", "read/default", "read-mmap/default"), ("pin_s", "read/default", "read/thp")]
    for metric, base, other in pairs:
        if metric in best[base] and metric in best[other]:
            a, b = best[base][metric], best[other][metric]
            print(f"{metric:<28}{a:>11.2f}{b:>11.2f}{a / b:>8.2f}  {other}  ({size / a:.2f} vs {size / b:.2f} GB/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

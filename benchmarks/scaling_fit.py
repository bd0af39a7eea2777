"""The scaling step when one device is not enough, end to end through `capture trial` (issue 24 item 5).

Writes a from-config trial of the chosen shape (full fine-tune, AdamW, bf16 autocast on a GPU), runs

    capture trial CONFIG --nproc N --strategy both --rank-memory-limit LIMIT --memory-limit LIMIT \
        --no-recovery --no-preflight --no-report --steps S --warmup W [--fsdp-offload]

(`--memory-limit` too, so the single-device stage emulates the same card), reads `[scaling]` from
the manifest, prints the terminal table and checks, printing PASS or FAIL for each:

- the baseline records "does not fit on one device" (out of memory as a result, not a crash);
- some FSDP shape fits and has figures; DDP, when it does not fit, is recorded as such;
- the efficiency's reference is the smallest N that fits, and the reading names it;
- while FSDP was built, no rank's device grew by 3/4 of the model's weights or more (CUDA: the
  meta-device build; rank 0's full copy is on its CPU). On a CPU run rank 0's copy is its
  "device", so there only the other ranks are held to it.

    python benchmarks/scaling_fit.py --shape llama-8b --nproc 8 --limit 80GiB      # 8 GPUs: FSDP x2, x4 tried
    python benchmarks/scaling_fit.py --shape llama-3b --nproc 2 --limit 56GiB      # 2 GPUs
    python benchmarks/scaling_fit.py --shape gpt2-25m --nproc 2 --limit 340MiB --device cpu   # here, ~3 min

Exit 0 when every check passes, 1 otherwise. The manifest is kept (path printed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LLAMA_COMMON = """
[trial.optimizer]
name = "adamw"
lr = 1e-4
betas = [0.9, 0.95]

[trial.precision]
dtype = "bf16"
autocast = true

[trial.data]
source = "synthetic"
synthetic_sequences = 256
validation_fraction = 0.0

[trial.checkpoint]
enabled = false
"""

SHAPES = {
    # Llama-3.1-8B's shape (8.0 B parameters): 16 bytes a parameter with AdamW and fp32 weights = 128 GB.
    "llama-8b": ("""[trial]
name = "scaling-fit-llama-8b"
method = "full"
[trial.model]
source = "from_config"
architecture = "llama"
[trial.model.config]
hidden_size = 4096
intermediate_size = 14336
num_hidden_layers = 32
num_attention_heads = 32
num_key_value_heads = 8
vocab_size = 128256
max_position_embeddings = 8192
[trial.batch]
max_seq_len = 2048
micro_batch_size = 1
grad_accum = {ranks}
""" + LLAMA_COMMON),
    # Llama-3.2-3B's shape (3.2 B parameters, tied embeddings): 51 GB of weights, gradients and AdamW state.
    "llama-3b": ("""[trial]
name = "scaling-fit-llama-3b"
method = "full"
[trial.model]
source = "from_config"
architecture = "llama"
[trial.model.config]
hidden_size = 3072
intermediate_size = 8192
num_hidden_layers = 28
num_attention_heads = 24
num_key_value_heads = 8
vocab_size = 128256
max_position_embeddings = 8192
tie_word_embeddings = true
[trial.batch]
max_seq_len = 2048
micro_batch_size = 1
grad_accum = {ranks}
""" + LLAMA_COMMON),
    # The CPU test's model (tests/test_trial_scaling_fit.py): 25 M parameters, ~400 MiB of fp32 AdamW state.
    "gpt2-25m": ("""[trial]
name = "scaling-fit-gpt2-25m"
method = "full"
[trial.model]
source = "from_config"
architecture = "gpt2"
[trial.model.config]
vocab_size = 257
n_positions = 32
n_embd = 512
n_layer = 8
n_head = 8
bos_token_id = 256
eos_token_id = 256
[trial.optimizer]
name = "adamw"
lr = 1e-3
[trial.precision]
dtype = "fp32"
autocast = false
[trial.batch]
max_seq_len = 32
micro_batch_size = {ranks}
grad_accum = 1
[trial.data]
source = "corpus"
tokenizer = "bytes"
[trial.checkpoint]
enabled = false
"""),
}


def check(ok: bool, text: str, failures: list[str]) -> None:
    print(f"{'PASS' if ok else 'FAIL'}  {text}")
    if not ok:
        failures.append(text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b")
    ap.add_argument("--nproc", type=int, default=8)
    ap.add_argument("--limit", default="80GiB", help="--rank-memory-limit and --memory-limit")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--offload", action="store_true", help="add --fsdp-offload")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--out", default=None, help="manifest path (default: in a temporary folder, kept)")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="scaling-fit-"))
    config = work / f"{args.shape}.toml"
    config.write_text(SHAPES[args.shape].replace("{ranks}", str(args.nproc)))
    out = Path(args.out) if args.out else work / "trial.toml"
    cmd = [sys.executable, "-m", "capture", "trial", str(config), "--device", args.device, "--nproc", str(args.nproc),
           "--strategy", "both", "--rank-memory-limit", args.limit, "--memory-limit", args.limit, "--no-recovery",
           "--no-preflight", "--no-report", "--steps", str(args.steps), "--warmup", str(args.warmup), "-o", str(out),
           "--workdir", str(work / "trial-work"), "--dist-dir", str(work / "dist")]
    if args.offload:
        cmd.append("--fsdp-offload")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    if args.device == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")  # thread stacks count in RLIMIT_DATA
    print("$", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env)
    wall = time.perf_counter() - t0
    print(f"capture trial: exit {proc.returncode} after {wall:.0f} s; launch logs in {work / 'dist'}")
    if proc.returncode != 0:
        return 1
    body = out.read_bytes().split(b"\n[signature]\n")[0]
    t = tomllib.loads(body.decode())["scaling"]
    sys.path.insert(0, str(ROOT))
    from capture.trial.scaling_text import render_scaling

    print(render_scaling(t))
    failures: list[str] = []
    base = t.get("baseline", {})
    check(base.get("fits") is False and str(base.get("verdict", "")).startswith("does not fit on one device"),
          f"baseline: {base.get('verdict')}", failures)
    fitting = [(s["world_size"], "FSDP", s) for s in t.get("smaller_shapes", []) if s.get("fits")]
    fitting += [(t["world_size"], name.upper(), t[name]) for name in ("fsdp", "ddp") if t.get(name, {}).get("fits")]
    check(any(kind == "FSDP" for _, kind, _ in fitting), "an FSDP shape fits: " +
          ", ".join(f"{kind} x{n}" for n, kind, _ in fitting), failures)
    ref = t.get("efficiency_reference", {})
    smallest = min((n for n, _, _ in fitting), default=None)
    check(ref.get("world_size") == smallest and "smallest N that fits" in t.get("reading", ""),
          f"efficiency against {ref.get('shape')} (smallest fitting N: {smallest}); reading: {t.get('reading')}", failures)
    for n, kind, s in fitting:
        if kind != "FSDP" or not s.get("param_bytes_total"):
            continue
        grew = [(r["rank"], r["build_peak_memory_bytes"] - (r.get("memory_before_build_bytes") or 0)) for r in s["ranks"]
                if r.get("build_peak_memory_bytes") is not None]
        held = [(rank, g) for rank, g in grew if args.device == "cuda" or rank != 0]
        worst = max(held, key=lambda x: x[1], default=(None, 0))
        check(bool(held) and worst[1] < 0.75 * s["param_bytes_total"],
              f"FSDP x{n} build: largest growth rank {worst[0]} {worst[1] / 2**30:.2f} GiB, weights "
              f"{s['param_bytes_total'] / 2**30:.2f} GiB", failures)
    print(json.dumps({"shape": args.shape, "nproc": args.nproc, "limit": args.limit, "wall_s": round(wall, 1),
                      "elapsed_scaling_s": t.get("elapsed_s"), "relaunches": len(t.get("relaunches", [])),
                      "manifest": str(out), "failures": failures}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

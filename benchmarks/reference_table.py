"""The table of docs/measurements for the reference trials (benchmarks/reference_trials.sh): one
row per signed manifest, with memory (estimate against NVML's figure for the process), step time,
tokens/s, both MFU figures and the recovery stage's time, read from the manifests themselves,
each opened through the one door (capture.verify.open): signed by a key of the allowed-signers
file you name, or refused (exit 4) before a figure of it is printed.

    python benchmarks/reference_table.py --allowed-signers manifests/.capture/allowed_signers \
        manifests/nvidia-h100-80gb-hbm3-x1/2026-12-05/*.toml
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

GIB = 1024 ** 3


def _get(d: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(d, dict):
            return None
        d = d.get(part)
    return d


def _setting(t: dict[str, Any]) -> str:
    run = t.get("run", {})
    training = run.get("training", {}) if isinstance(run.get("training"), dict) else {}
    method = str(run.get("method", "?"))
    quant = _get(training, "quantization.method")
    parts = ["QLoRA " + str(quant) if method == "lora" and quant not in (None, "none") else method]
    parts.append("gc" if _get(training, "gradient_checkpointing.enabled") else "no gc")
    if _get(training, "loss.name") == "chunked":
        parts.append("chunked loss")
    return ", ".join(parts)


def row(path: Path, trust: Any) -> str:
    from capture.verify.open import open_manifest

    t = open_manifest(path, trust, require_trusted=True).data.get("trial", {})
    stats, mem, rec = t.get("stats", {}), t.get("memory", {}), t.get("recovery", {})
    batch = t.get("run", {})
    est, used = _get(mem, "estimate.total_bytes"), _get(mem, "measured.device_used_bytes")
    err = f"{(est - used) / used * 100:+.1f} %" if est and used else "-"
    rec_s = rec.get("elapsed_s")
    verdict = str(rec.get("verdict_kind") or rec.get("verdict", "-")).split(":")[0]
    recovery = (f"{verdict}, {rec_s:.0f} s" if rec_s
                else str(rec.get("skipped", rec.get("verdict", "-")))[:40])
    wall = _get(t, "cost.wall_total_s")
    cells = [t.get("run", {}).get("name", path.stem), _setting(t),
             f"{batch.get('micro_batch_size', '?')} x {batch.get('max_seq_len', '?')}",
             f"{est / GIB:.2f}" if est else "-", f"{used / GIB:.2f}" if used else "-", err,
             f"{stats['step_time_median_s']:.3f}" if stats.get("step_time_median_s") else "-",
             f"{stats['tokens_per_s']:,.0f}" if stats.get("tokens_per_s") else "-",
             f"{stats['mfu_6n'] * 100:.1f} / {stats['mfu_with_attention'] * 100:.1f}"
             if stats.get("mfu_6n") and stats.get("mfu_with_attention") else "-",
             recovery, f"{wall / 60:.1f}" if wall else "-", path.stem]
    return "| " + " | ".join(str(c) for c in cells) + " |"


def main(argv: list[str]) -> int:
    from capture.errors import CaptureError
    from capture.verify.open import load_allowed

    parser = argparse.ArgumentParser(description="the reference trials' table from their signed manifests")
    parser.add_argument("--allowed-signers", required=True, help="the allowed-signers file that decides trust")
    parser.add_argument("manifests", nargs="+", type=Path)
    args = parser.parse_args(argv)
    try:
        trust = load_allowed(args.allowed_signers)
        rows = [row(p, trust) for p in args.manifests]
    except CaptureError as exc:
        print(exc.diagnostics(), file=sys.stderr)
        return exc.exit_code
    print("| run | setting | micro-batch x seq | estimate GiB | device GiB (NVML) | estimate error | "
          "step s (median) | tokens/s | MFU % (6N / with attention) | recovery | trial min | manifest |")
    print("| --- " * 12 + "|")
    for line in rows:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

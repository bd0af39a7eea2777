"""`capture trial --find-max-batch` against the same trial without it (the named baseline).

Both run as fresh processes of this interpreter, interleaved (plain, search, plain, search, ...),
on the same example and flags. Prints each median wall time and their ratio (target: the search
costs at most 3x a plain tiny trial), the search phase's own time from the manifest, how many
candidates it tried and from where it started, its headline ("capped at N" when it hit
--max-batch), and each process's peak resident memory against the limit the search ran under
(memory bounded by that limit: the search only tries candidates near it).

    python benchmarks/find_max_batch.py [--rounds 1] [--device cpu] [--max-batch 1024]
    python benchmarks/find_max_batch.py --quick      # CI: 2 steps, no recovery, --max-batch 64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

BASELINE = "capture trial (same example and flags, without --find-max-batch)"


def run_trial(args: list[str], env: dict[str, str]) -> tuple[float, int]:
    """(wall seconds, peak resident bytes) of one `python -m capture trial ARGS`."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "capture", "trial", *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage: its peak RSS, not the sum
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.stderr.write(err.decode(errors="replace")[-2000:])
        raise SystemExit(f"capture trial {' '.join(args)} exited {proc.returncode}")
    return wall, usage.ru_maxrss * 1024  # Linux reports KiB


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--example", default="tiny")
    ap.add_argument("--max-batch", type=int, default=1024)
    ap.add_argument("--quick", action="store_true", help="CI: 2 steps, no recovery, --max-batch 64 (printed, not asserted)")
    ap.add_argument("--json", metavar="OUT", help="also write the figures as JSON")
    args = ap.parse_args()

    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    common = ["--example", args.example, "--device", args.device, "--no-report"]
    if args.quick:
        args.rounds, args.max_batch = 1, 64
        common += ["--steps", "2", "--warmup", "1", "--no-recovery"]
    plain_s, search_s, plain_rss, search_rss = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        env.setdefault("XDG_CONFIG_HOME", str(Path(tmp) / "config"))  # a throwaway signing key
        out = Path(tmp) / "search.toml"
        for _ in range(args.rounds):
            wall, rss = run_trial([*common, "-o", str(Path(tmp) / "plain.toml")], env)
            plain_s.append(wall)
            plain_rss.append(rss)
            wall, rss = run_trial([*common, "--find-max-batch", "--max-batch", str(args.max_batch), "-o", str(out)], env)
            search_s.append(wall)
            search_rss.append(rss)
        body = out.read_bytes().split(b"\n[signature]\n")[0]
        trial = tomllib.loads(body.decode())["trial"]
    search = trial["fit"]["search"]
    phase_s = trial["cost"]["phases"].get("fit_search_s")
    med_plain, med_search = statistics.median(plain_s), statistics.median(search_s)
    limit = search["limit_bytes"]
    print(f"example {args.example} on {args.device}, --max-batch {args.max_batch}, {args.rounds} round(s)"
          f"{' (quick: 2 steps, no recovery)' if args.quick else ''}")
    print(f"baseline {BASELINE}: median {med_plain:.1f} s ({', '.join(f'{t:.1f}' for t in plain_s)})")
    print(f"capture trial --find-max-batch: median {med_search:.1f} s ({', '.join(f'{t:.1f}' for t in search_s)})")
    print(f"ratio against the baseline (with the search / without): {med_search / med_plain:.2f}x   (target: <= 3x)")
    print(f"search phase: {phase_s:.1f} s; {len(search['candidates'])} candidates "
          f"({', '.join(str(c['micro_batch']) for c in search['candidates'])}), "
          f"started at {search.get('start_micro_batch', '-')}; headline: {search['headline']}")
    print(f"peak resident memory: {max(search_rss) / 2**30:.2f} GiB with the search, {max(plain_rss) / 2**30:.2f} GiB "
          f"without; the search ran under {limit / 2**30:.2f} GiB ({search['limit_source']}): "
          f"{max(search_rss) / limit:.2f}x of it")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "baseline": BASELINE, "plain_s": plain_s, "search_s": search_s, "ratio": med_search / med_plain,
            "search_phase_s": phase_s, "candidates": search["candidates"], "headline": search["headline"],
            "peak_rss_bytes": {"plain": max(plain_rss), "search": max(search_rss)}, "limit_bytes": limit,
            "quick": args.quick, "max_batch": args.max_batch, "device": args.device,
        }, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`capture trial`: run the staged trial and write a signed manifest with its results."""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Any

from capture.errors import UsageError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str, flag: str = "--memory-limit") -> int:
    """``85899345920``, ``80GiB``, ``141GB``, ``512 MiB`` → bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        raise UsageError(f"{flag}: {text!r} is not a size", "give bytes (85899345920) or a size with a unit (80GiB, 141GB)")
    value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise UsageError(f"{flag}: must be > 0, got {text!r}", "give the memory of the card to emulate")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("trial", help="run the staged trial and write a signed manifest with its results",
                       description="Run the staged trial (define, budget memory, measure, fit, restore, cost) "
                                   "and write its results, signed, after the stack they ran on.")
    p.add_argument("config", nargs="?", metavar="CONFIG.toml", help="the trial config (see docs/trial.md)")
    p.add_argument("--example", metavar="NAME", help="run a shipped example instead: tiny (CPU) or llama-1b")
    p.add_argument("--list-examples", action="store_true", help="print the shipped examples and exit")
    p.add_argument("-o", "--output", metavar="FILE",
                   help="manifest to write (default: trial-<name>-<UTC stamp>.toml in the current folder)")
    p.add_argument("--key", metavar="KEYFILE", help="signing key (default: $CAPTURE_KEY or ~/.config/capture/id_ed25519, created on first use)")
    p.add_argument("--principal", metavar="NAME", help="signer identity (default: the key's comment)")
    g = p.add_argument_group("overrides of the config")
    g.add_argument("--method", choices=("full", "lora"), help="full fine-tune or LoRA adapter")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), help="where to run (auto: CUDA/ROCm if present)")
    g.add_argument("--steps", type=int, metavar="N", help="measured steps")
    g.add_argument("--warmup", type=int, metavar="N", help="warm-up steps (excluded from the statistics)")
    g.add_argument("--micro-batch", type=int, metavar="N", help="micro-batch size")
    g = p.add_argument_group("stages")
    g.add_argument("--no-recovery", action="store_true", help="skip the checkpoint-restore check")
    g.add_argument("--no-preflight", action="store_true", help="skip the preflight health and performance checks")
    g.add_argument("--preflight-full", action="store_true", help="run the longer --full preflight instead of --quick")
    g.add_argument("--ignore-preflight-failure", action="store_true",
                   help="go on with the trial when a preflight check fails (the failure stays in the manifest)")
    g.add_argument("--recovery-deterministic", action=argparse.BooleanOptionalAction, default=None,
                   help="run the restore check's reference and restores under deterministic kernels "
                        "(default: [trial.recovery] deterministic, \"auto\": on for a GPU); the measured "
                        "steps keep the run's own settings")
    g.add_argument("--no-report", action="store_true", help="no terminal summary and no HTML report")
    g.add_argument("--find-max-batch", action="store_true",
                   help="search the largest micro-batch that completes full steps with the headroom free")
    g.add_argument("--headroom", type=float, default=0.10, metavar="F",
                   help="share of memory to keep free (default 0.10)")
    g.add_argument("--memory-limit", metavar="BYTES",
                   help="memory to fit into (emulates a smaller card; e.g. 80GiB). Default: the device's "
                        "memory; on a CPU, MemTotal or the memory cgroup's limit where lower")
    g.add_argument("--max-batch", type=int, default=1024, metavar="N", help="largest micro-batch the search tries (default 1024)")
    g.add_argument("--catalog", metavar="FILE", help="accelerator catalog overriding the shipped one")
    g.add_argument("--expandable-segments", action="store_true",
                   help="run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (added to what is set)")
    g = p.add_argument_group("cost")
    from capture.costs import parse_positive, parse_tokens

    g.add_argument("--price-per-hour", type=parse_positive, metavar="P",
                   help="price of the device per hour (default: the catalog's, if any)")

    t = g.add_mutually_exclusive_group()
    t.add_argument("--target-tokens", type=parse_tokens, metavar="N",
                   help="project the full run to N trained tokens (1e9, 2e9 or 2000000000)")
    t.add_argument("--target-epochs", type=parse_positive, metavar="N", help="project the full run to N epochs of the data set")
    g = p.add_argument_group("environment")
    g.add_argument("--workdir", metavar="DIR", help="scratch folder for checkpoints (default: a temporary folder beside the output)")
    g.add_argument("--hf-cache", metavar="DIR", help="hub cache folder (default: HF_HUB_CACHE / HF_HOME)")
    g.add_argument("--code", metavar="DIR", help="code folder to fingerprint (default: current folder)")
    g.add_argument("--deep", action="store_true", help="also record the cuDNN/NCCL actually loaded (costs seconds)")
    from capture.trial.scaling_args import add_arguments as add_scaling_arguments

    add_scaling_arguments(p)
    p.set_defaults(func=cmd_trial)

    p = sub.add_parser("estimate", help="the trial's memory estimate for a config, per term and per card, without a GPU",
                       description="Build the model on the meta device from its config (no weights, no GPU), replay the "
                                   "run's allocations and set the device total against the accelerator catalog.")
    p.add_argument("config", nargs="?", metavar="CONFIG.toml", help="the trial config (see docs/trial.md)")
    p.add_argument("--example", metavar="NAME", help="a shipped example instead")
    p.add_argument("--card", action="append", default=[], metavar="NAME", help="only this catalog card (repeatable)")
    p.add_argument("--micro-batch", type=int, metavar="N", help="micro-batch size (default: the config's)")
    p.add_argument("--headroom", type=float, default=0.10, metavar="F", help="share of memory to keep free (default 0.10)")
    p.add_argument("--max-batch", type=int, default=1024, metavar="N", help="largest micro-batch to consider (default 1024)")
    p.add_argument("--catalog", metavar="FILE", help="accelerator catalog overriding the shipped one")
    p.add_argument("--json", action="store_true", help="machine-readable result on stdout")
    p.set_defaults(func=cmd_estimate)


def _load(args: argparse.Namespace) -> Any:
    from capture.trial.config import load_config, load_example

    if bool(args.config) == bool(args.example):
        raise UsageError("give a config file or --example NAME (one of them)",
                         "e.g. `capture trial --example tiny` or `capture trial my-trial.toml`")
    return load_example(args.example) if args.example else load_config(args.config)


def _check_batch_flag(flag: str, value: int | None) -> None:
    """A micro-batch on the command line: 1 to the config's own bound (BATCH_MAX)."""
    from capture.trial.config import BATCH_MAX
    from capture.trial.config_read import check_int

    if value is not None:
        check_int(value, flag, 1, BATCH_MAX, f"e.g. {flag} 4 (sequences per micro-batch)")


def cmd_estimate(args: argparse.Namespace) -> int:
    import json

    if not 0 <= args.headroom < 1:
        raise UsageError(f"--headroom: must be in [0, 1), got {args.headroom:g}", "e.g. --headroom 0.1 keeps 10% free")
    for flag, value in (("--micro-batch", args.micro_batch), ("--max-batch", args.max_batch)):
        _check_batch_flag(flag, value)
    config = _load(args)
    from capture.trial.build.model import preflight
    from capture.trial.estimate import card_fits, estimate_config, render_text, to_json
    from capture.trial.fit import load_catalog

    catalog = load_catalog(args.catalog)
    names = []
    for wanted in args.card:
        found = catalog.find(wanted)
        if len(found) != 1:
            raise UsageError(f"--card: {wanted!r} " + ("is not in the catalog" if not found else
                             f"matches {len(found)} cards ({', '.join(c.name for c in found)})"),
                             "catalog cards: " + ", ".join(c.name for c in catalog.cards))
        names.append(found[0].name)
    preflight(config)
    mb = args.micro_batch or config.batch.micro_batch_size
    plan, est = estimate_config(config, "cuda", mb)
    fits = card_fits(plan, catalog, names or None, args.headroom, mb, args.max_batch, {mb: est.total_bytes})
    if args.json:
        sys.stdout.write(json.dumps(to_json(config, plan, est, fits, mb, args.headroom), indent=1) + "\n")
    else:
        import shutil

        sys.stdout.write(render_text(config, plan, est, fits, mb, args.headroom, shutil.get_terminal_size((100, 24)).columns))
    return 0


def cmd_trial(args: argparse.Namespace) -> int:
    from capture.trial.scratch import interruptible

    # SIGINT, SIGTERM, SIGHUP: children ended, scratch removed, nothing half-written, exit 128 + N
    with interruptible():
        return _trial(args)


def _trial(args: argparse.Namespace) -> int:
    from capture.trial.config import example_names, load_config, load_example
    from capture.trial.cost import PhaseTimer

    timer = PhaseTimer()
    if args.list_examples:
        for name in example_names():
            print(name)
        return 0
    if bool(args.config) == bool(args.example):
        raise UsageError("give a config file or --example NAME (one of them)",
                         "e.g. `capture trial --example tiny` or `capture trial my-trial.toml`")
    if not 0 <= args.headroom < 1:
        raise UsageError(f"--headroom: must be in [0, 1), got {args.headroom:g}", "e.g. --headroom 0.1 keeps 10% free")
    _check_batch_flag("--max-batch", args.max_batch)
    if args.target_tokens is not None and args.target_tokens < 1:
        raise UsageError(f"--target-tokens: must be >= 1, got {args.target_tokens}", "e.g. --target-tokens 1e9")
    if args.output:
        from capture._atomic import check_target

        check_target(args.output)  # a folder, FIFO, device or link: refused before the trial runs
        check_target(Path(args.output).with_suffix(".html"), "-o (its report)")
    if args.expandable_segments:  # before CUDA starts: the allocator reads it once
        conf = [c for c in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").split(",") if c and not c.startswith("expandable_segments")]
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(conf + ["expandable_segments:True"])
    if args.hf_cache:
        os.environ["HF_HUB_CACHE"] = str(Path(args.hf_cache).expanduser().resolve())  # the restore worker inherits it
    limit = parse_bytes(args.memory_limit) if args.memory_limit else None

    with timer.phase("config"):
        config = load_example(args.example) if args.example else load_config(args.config)
        overrides = {"method": args.method, "device": args.device, "measured_steps": args.steps,
                     "warmup_steps": args.warmup, "micro_batch_size": args.micro_batch,
                     "recovery_deterministic": args.recovery_deterministic}
        config = config.with_overrides(**overrides)

    from capture.trial.scaling_args import ScalingOptions

    scaling = ScalingOptions.from_args(args)
    if scaling is not None:  # check the flags and the batch split before spending minutes on the trial
        from capture.trial.scaling import plan_scaling

        plan_scaling(config, scaling)

    from capture.trial.runner import TrialOptions, run_trial

    opts = TrialOptions(
        output=Path(args.output) if args.output else None, key=Path(args.key) if args.key else None,
        principal=args.principal, recovery=not args.no_recovery, report=not args.no_report,
        find_max_batch=args.find_max_batch, headroom=args.headroom, memory_limit_bytes=limit,
        max_batch=args.max_batch, catalog=Path(args.catalog) if args.catalog else None,
        price_per_hour=args.price_per_hour, target_tokens=args.target_tokens, target_epochs=args.target_epochs,
        workdir=Path(args.workdir) if args.workdir else None, deep=args.deep,
        code=Path(args.code) if args.code else None,
        overrides={k: v for k, v in overrides.items() if v is not None},
        scaling=scaling,
        preflight=None if args.no_preflight else ("full" if args.preflight_full else "quick"),
        ignore_preflight_failure=args.ignore_preflight_failure,
    )
    outcome = run_trial(config, opts, timer)
    if outcome.terminal:
        sys.stdout.write(outcome.terminal if outcome.terminal.endswith("\n") else outcome.terminal + "\n")
    if outcome.html is not None:
        sys.stderr.write(f"capture: report {outcome.html}\n")
    fit = outcome.manifest.get("trial", {}).get("fit", {})
    if fit.get("fits") is False:
        sys.stderr.write(f"capture: {fit.get('verdict', 'does not fit')}\n")
    print(outcome.path)
    return 0

"""`capture preflight`: is this the card, and the machine, that was paid for?"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from capture.errors import EXIT_OK, UsageError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("preflight", help="health and performance checks of the accelerators against their catalog figures",
                       description="Read each visible device's health from its driver (NVML, amdsmi) and measure "
                                   "bf16 GEMM, memory copy, pinned host<->device, peer and all-reduce bandwidth "
                                   "against what the catalog says the SKU should do. Exit 0 pass (warnings "
                                   "printed), 5 when a check fails.")
    p.add_argument("-o", "--output", metavar="FILE", help="also write a signed manifest: the fingerprint plus [preflight]")
    p.add_argument("--json", action="store_true", help="the [preflight] table as JSON on stdout")
    m = p.add_mutually_exclusive_group()
    m.add_argument("--quick", dest="mode", action="store_const", const="quick",
                   help="about a second per figure (default; <= 20 s on one H200)")
    m.add_argument("--full", dest="mode", action="store_const", const="full",
                   help="longer runs for steadier figures; every GPU pair for peer copies")
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "rocm", "cpu"),
                   help="which devices to check (auto: the GPUs torch sees, else the CPU)")
    p.add_argument("--catalog", metavar="FILE", help="preflight catalog overriding the shipped one (see docs/preflight.md)")
    p.add_argument("--key", metavar="KEYFILE", help="signing key for -o (default: $CAPTURE_KEY or ~/.config/capture/id_ed25519)")
    p.add_argument("--principal", metavar="NAME", help="signer identity recorded with -o (default: the key comment)")
    p.add_argument("--all", dest="all_checks", action="store_true", help="list skipped checks in the table too")
    p.set_defaults(func=cmd_preflight, mode="quick")


def cmd_preflight(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    from capture.preflight.catalog import load_catalog
    from capture.preflight.report import render
    from capture.preflight.stage import failure_message, run_preflight

    if args.principal and not args.output:
        raise UsageError("--principal needs -o FILE", "add -o preflight.toml to write a signed manifest")
    if args.output:
        out = Path(args.output)
        if out.is_dir() or not out.parent.is_dir():
            raise UsageError(f"-o: {out} is a folder or its folder does not exist", "name the manifest file to write")
    key = None
    if args.output:  # fail on a bad key before spending time measuring
        from capture import signing

        key = Path(args.key) if args.key else signing.ensure_default_key()
        signing.load_private_key(key)
    catalog = load_catalog(args.catalog)
    result = run_preflight(args.mode, args.device, catalog, started=started)
    table = result.to_manifest()
    if args.output:
        from capture import manifest as mf
        from capture import signing
        from capture.fingerprint import collect
        from capture.probes import ProbeOptions

        manifest = collect(ProbeOptions(progress=False))
        manifest["preflight"] = table
        assert key is not None  # loaded above whenever -o is given
        signing.write_signed(args.output, mf.dumps(manifest), key, args.principal)
        sys.stderr.write(f"wrote {args.output}\n")
    if args.json:
        sys.stdout.write(json.dumps(table, indent=1) + "\n")
    else:
        sys.stdout.write(render(table, verbose=args.all_checks))
    sys.stdout.flush()
    if result.failed:
        raise failure_message(result)
    for c in result.warned:
        sys.stderr.write(f"warning: {c.name}" + (f" (device {c.device})" if c.device is not None else "") + f": {c.reason}\n")
    return EXIT_OK

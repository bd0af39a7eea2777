"""`capture decide`: which card, how many, for how long, across every run; `capture init`: a new
results repository."""

from __future__ import annotations

import argparse
import json
import os
import sys

from capture.errors import EXIT_OK, UsageError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("decide", help="rank the tested configurations of every trial by cost and time to a target")
    p.add_argument("inputs", nargs="+", metavar="DIR|FILE", help="a results folder, manifest files or globs")
    p.add_argument("--price", action="append", default=[], metavar="CARD=PRICE",
                   help="price per device and hour for a card (catalog name or part of the device name); repeatable")
    p.add_argument("--catalog", metavar="F", help="accelerator catalog over the shipped one (memory, price_per_hour)")
    from capture.costs import parse_positive, parse_tokens

    target = p.add_mutually_exclusive_group()
    target.add_argument("--target-tokens", type=parse_tokens, metavar="N",
                        help="the one target every configuration is projected and ranked to, in tokens "
                             "(1e9, 2e9 or 2000000000; default 1e9)")
    target.add_argument("--target-epochs", type=parse_positive, metavar="N", help="epochs of each run's training data")
    p.add_argument("--currency", metavar="NAME",
                   help="the currency of the decision and of --price (default: the catalog's, USD as shipped)")
    p.add_argument("--wide", action="store_true", help="print every column, whatever the terminal's width")
    p.add_argument("--allowed-signers", metavar="F", help="allowed-signers file (default: the usual search)")
    p.add_argument("--json", action="store_true", help="machine-readable result on stdout")
    p.add_argument("-o", "--output", metavar="SITE_DIR", help="also write the static site into this folder")
    p.set_defaults(func=cmd_decide)

    p = sub.add_parser("init", help="start a results repository: git, allowed_signers, README, optional CI")
    p.add_argument("dir", metavar="DIR")
    p.add_argument("--key", metavar="KEY.pub", help="public key to trust (default: your default key's .pub)")
    p.add_argument("--principal", metavar="NAME", help="principal for that key (default: the key's comment)")
    p.add_argument("--ci", action="store_true", help="also install the GitHub Actions workflow and the pre-commit hook")
    p.set_defaults(func=cmd_init)


def cmd_decide(args: argparse.Namespace) -> int:
    from capture.decide import rank, runs, site, text
    from capture.trial.fit import load_catalog

    if args.currency is not None and not args.currency.strip():
        raise UsageError("--currency: empty", "e.g. --currency EUR")
    if args.allowed_signers is not None and not os.path.isfile(args.allowed_signers):
        raise UsageError(f"--allowed-signers: {args.allowed_signers} is not a file",
                         "name an allowed-signers file, or leave the flag out for the usual search")
    prices = rank.parse_prices(args.price)
    catalog = load_catalog(args.catalog)
    found, files = runs.open_all(runs.expand(args.inputs), trust=args.allowed_signers)
    currency = args.currency.strip() if args.currency else catalog.currency
    groups = rank.decide(found, catalog, prices, args.target_tokens, args.target_epochs, currency)
    if args.output:
        index = site.write_site(args.output, groups, files, found, currency)
        sys.stderr.write(f"capture: site {index}\n")
    if args.json:
        sys.stdout.write(json.dumps(text.to_json(groups, files, currency), indent=1) + "\n")
    else:
        sys.stdout.write(text.render(groups, files, wide=args.wide, currency=currency))
    return EXIT_OK


def cmd_init(args: argparse.Namespace) -> int:
    from capture.decide.init import init_repository

    result = init_repository(args.dir, key=args.key, principal=args.principal, ci=args.ci)
    for path in result.written:
        sys.stdout.write(f"wrote {path}\n")
    sys.stdout.write(f"commit {result.commit[:12]} in {result.root}\n" if result.commit else "nothing to commit\n")
    return EXIT_OK

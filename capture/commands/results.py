"""Results-repository commands: pin, compare, show, export. (`verify DIR` lives in core.py and
calls :func:`capture.verify.tree.verify_paths`.)

`show` and `compare` display any manifest the door can parse, with its signature state first;
their exit code is 4 when a file is unsigned or its signature is invalid (nobody attests that
content), unless ``--allow-unsigned``; a valid signature by a signer you do not trust is labelled
"NOT trusted" and does not change the code (trust is checked by `verify` and `pin`)."""

from __future__ import annotations

import argparse
import json
import sys

from capture.errors import EXIT_DRIFT, EXIT_OK, EXIT_SIGNATURE, UsageError

_ALLOW_UNSIGNED = "display unsigned or tampered manifests and exit as if signed (default: exit 4 for them)"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pin", help="verify signed manifests, then commit them into a results repository")
    p.add_argument("files", nargs="*", metavar="FILE", help="signed manifest(s) to pin")
    p.add_argument("--reindex", action="store_true",
                   help="instead of pinning: recompute every row of index.json and index.md from the manifest it "
                        "lists (each verified again), and commit the index if this capture writes it differently")
    p.add_argument("--repo", required=True, metavar="DIR",
                   help="the results repository (a git work tree, or a folder in one) with .capture/allowed_signers")
    p.add_argument("-m", "--message", metavar="M", help="commit subject (default: a summary of the run)")
    p.add_argument("--tag", action="store_true", help="also create an annotated tag run/<content id> per new run")
    p.add_argument("--json", action="store_true", help="machine-readable result on stdout")
    p.set_defaults(func=cmd_pin)

    p = sub.add_parser("compare", help="two runs side by side: stack differences, then trial figures")
    p.add_argument("a", metavar="A")
    p.add_argument("b", metavar="B")
    p.add_argument("--allowed-signers", metavar="F", help="allowed-signers file for the trust header")
    p.add_argument("--allow-unsigned", action="store_true", help=_ALLOW_UNSIGNED)
    p.add_argument("--all", dest="everything", action="store_true",
                   help="list every stack difference and package with its whole value (default: a summary)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("show", help="a readable summary of one manifest")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--allowed-signers", metavar="F", help="allowed-signers file for the trust line")
    p.add_argument("--allow-unsigned", action="store_true", help=_ALLOW_UNSIGNED)
    p.add_argument("--json", action="store_true", help="machine-readable summary")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("export", help="a manifest as an in-toto attestation (DSSE), or the public key as PEM")
    p.add_argument("file", nargs="?", metavar="FILE", help="the manifest (not needed for --format pubkey-pem)")
    p.add_argument("--format", required=True, choices=("in-toto", "pubkey-pem"),
                   help="in-toto: Statement v1 in a DSSE envelope; pubkey-pem: the key's public half for verifiers")
    p.add_argument("--key", required=True, metavar="KEYFILE", help="Ed25519 key (private for in-toto; .pub is enough for pubkey-pem)")
    p.add_argument("-o", "--output", metavar="OUT", help="write here (atomically) instead of stdout")
    p.set_defaults(func=cmd_export)


def cmd_pin(args: argparse.Namespace) -> int:
    from capture.results.pin import pin

    if args.reindex:
        return _reindex(args)
    if not args.files:
        raise UsageError("no manifest to pin", "name one or more signed manifest files (or --reindex to rebuild the index)")
    result = pin(args.files, args.repo, message=args.message, tag=args.tag)
    if args.json:
        sys.stdout.write(json.dumps({
            "commit": result.commit, "tags": list(result.tags),
            "runs": [{"source": r.source, "path": r.path, "content_id": r.summary.content_id,
                      "already_pinned": r.already_pinned} for r in result.runs],
        }, indent=2) + "\n")
        return EXIT_OK
    for r in result.runs:
        state = "already pinned" if r.already_pinned else "pinned"
        sys.stdout.write(f"{state:<15} {r.path}  ({r.source})\n")
    if result.commit:
        sys.stdout.write(f"commit {result.commit[:12]} in {args.repo}" +
                         (f", tag {', '.join(result.tags)}" if result.tags else "") + "\n")
    else:
        sys.stderr.write("nothing new to commit\n")
    return EXIT_OK


def _reindex(args: argparse.Namespace) -> int:
    from capture.results.pin import reindex

    if args.files or args.tag:
        raise UsageError("--reindex takes no FILE and no --tag", "pin the files first, then run `capture pin --reindex --repo DIR`")
    result = reindex(args.repo, message=args.message)
    if args.json:
        sys.stdout.write(json.dumps({"commit": result.commit, "rows": result.rows, "changed": list(result.changed)},
                                    indent=2) + "\n")
        return EXIT_OK
    for rel in result.changed:
        sys.stdout.write(f"recomputed  {rel}\n")
    if result.commit:
        sys.stdout.write(f"commit {result.commit[:12]} in {args.repo}: {len(result.changed)} of {result.rows} rows "
                         "recomputed\n")
    else:
        sys.stderr.write(f"the index is current ({result.rows} rows); nothing to commit\n")
    return EXIT_OK


def _unattested(sides: list[tuple[str, object]], allow: bool) -> int | None:
    """Exit 4 (after the report was printed) for an unsigned or invalid file, unless allowed."""
    from capture._escape import printable

    bad = [(path, sig) for path, sig in sides if getattr(sig, "state", None) in ("unsigned", "invalid")]
    if not bad or allow:
        return None
    path, sig = bad[0]
    sys.stderr.write(f"error: {printable(path)}: {getattr(sig, 'label', '')}\n"
                     "hint: sign it (`capture sign FILE --key KEY`), or pass --allow-unsigned to read it anyway\n")
    return EXIT_SIGNATURE


def cmd_compare(args: argparse.Namespace) -> int:
    from capture.results.compare import compare_files, render

    c = compare_files(args.a, args.b, args.allowed_signers)
    if args.json:
        sys.stdout.write(json.dumps(c.to_json(), indent=2, default=str) + "\n")
    else:
        sys.stdout.write(render(c, everything=args.everything) + "\n")
    refused = _unattested([(c.a.path, c.a.signature), (c.b.path, c.b.signature)], args.allow_unsigned)
    if refused is not None:
        return refused
    # Like `capture diff`: 1 when the stacks differ. Trial figures of two runs always differ a little.
    return EXIT_DRIFT if c.stack or c.packages else EXIT_OK


def cmd_show(args: argparse.Namespace) -> int:
    from capture.results.show import load, render

    shown = load(args.file, args.allowed_signers)
    if args.json:
        sys.stdout.write(json.dumps(shown.to_json(), indent=2, default=str) + "\n")
    else:
        sys.stdout.write(render(shown) + "\n")
    refused = _unattested([(shown.path, shown.signature)], args.allow_unsigned)
    return EXIT_OK if refused is None else refused


def cmd_export(args: argparse.Namespace) -> int:
    from capture._atomic import atomic_write, check_target
    from capture.results import intoto

    if args.output:
        check_target(args.output)
    if args.format == "pubkey-pem":
        if args.file:
            raise UsageError("--format pubkey-pem takes no FILE", "run `capture export --format pubkey-pem --key KEYFILE`")
        data = intoto.public_key_pem(args.key)
    else:
        if not args.file:
            raise UsageError("--format in-toto needs the manifest FILE", "run `capture export FILE --format in-toto --key KEYFILE`")
        data = intoto.export_intoto(args.file, args.key)
    if args.output:
        atomic_write(args.output, data)
        sys.stderr.write(f"wrote {args.output}\n")
    else:
        sys.stdout.write(data.decode("utf-8"))
    return EXIT_OK

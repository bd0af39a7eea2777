"""Core commands: fingerprint, keygen, sign, verify, diff."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from capture.errors import EXIT_DRIFT, EXIT_OK, UsageError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fingerprint", help="probe this machine and write an unsigned manifest")
    p.add_argument("-o", "--output", metavar="FILE", help="write the manifest here (default: stdout)")
    p.add_argument("--model", action="append", default=[], metavar="REPO[@REV]|DIR",
                   help="a model revision from the local hub cache, or a local folder (repeatable)")
    p.add_argument("--dataset", action="append", default=[], metavar="REPO[@REV]|DIR",
                   help="a dataset revision from the local hub cache, or a local folder (repeatable)")
    p.add_argument("--code", metavar="DIR", help="the code folder to fingerprint (default: current folder)")
    p.add_argument("--deep", action="store_true",
                   help="also import torch (in a subprocess) to record the cuDNN/NCCL actually loaded; costs seconds")
    p.add_argument("--verify-artifacts", action="store_true",
                   help="re-hash every model/dataset blob and report mismatches (reads every byte)")
    p.add_argument("--hf-cache", metavar="DIR", help="hub cache folder (default: HF_HUB_CACHE / HF_HOME)")
    p.add_argument("--key", metavar="KEYFILE", help="sign the manifest with this key as it is written")
    p.add_argument("--principal", metavar="NAME", help="signer identity recorded with --key")
    p.add_argument("--timings", action="store_true", help="print how long each probe took on stderr")
    p.set_defaults(func=cmd_fingerprint)

    p = sub.add_parser("keygen", help="new Ed25519 signing key in OpenSSH format (+ KEYFILE.pub)")
    p.add_argument("-o", "--output", metavar="KEYFILE", help="default: ~/.config/capture/id_ed25519")
    p.add_argument("-C", "--comment", metavar="NAME", help="principal stored as the key comment (default user@host)")
    p.add_argument("--force", action="store_true", help="overwrite an existing key")
    p.set_defaults(func=cmd_keygen)

    p = sub.add_parser("sign", help="append (or replace) the signature trailer of a manifest, atomically")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--key", metavar="KEYFILE", help="private key (default: $CAPTURE_KEY or ~/.config/capture/id_ed25519)")
    p.add_argument("--principal", metavar="NAME", help="signer identity (default: the key comment)")
    p.set_defaults(func=cmd_sign)

    p = sub.add_parser("verify", help="signature → trust → parse → live fingerprint → compare")
    p.add_argument("files", nargs="+", metavar="FILE",
                   help="a manifest; several files, a folder or a glob verify a whole tree")
    trust = p.add_mutually_exclusive_group()
    trust.add_argument("--allowed-signers", metavar="F",
                       help="allowed-signers file (git's gpg.ssh.allowedSignersFile format); default: "
                            "$CAPTURE_ALLOWED_SIGNERS, else a results repository's root .capture/allowed_signers, "
                            "else ~/.config/capture/allowed_signers (docs/trust.md)")
    trust.add_argument("--trust-from", metavar="REV",
                       help="read the results repository's .capture/allowed_signers as it is at git revision REV "
                            "(the base branch of a pull request), so a change cannot trust itself")
    p.add_argument("--staged", action="store_true",
                   help="verify what git's index holds under the paths (what a commit would hold), not the work tree")
    p.add_argument("--policy", metavar="F", help="policy file that loosens or tightens fields (see README)")
    p.add_argument("--strict", action="store_true", help="also compare board UUIDs, serials and PCI bus ids")
    p.add_argument("--code", metavar="DIR", help="code folder to compare (default: the recorded path if present, else .)")
    p.add_argument("--signature-only", action="store_true", help="check signature and trust, not the live stack")
    p.add_argument("--verify-artifacts", action="store_true", help="re-hash model/dataset blobs while re-probing")
    p.add_argument("--json", action="store_true", help="machine-readable report on stdout")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("diff", help="what differs between two manifests (same comparison as verify)")
    p.add_argument("a", metavar="A")
    p.add_argument("b", metavar="B")
    p.add_argument("--policy", metavar="F", help="policy file (default: the verify policy)")
    p.add_argument("--strict", action="store_true", help="also compare board UUIDs, serials and PCI bus ids")
    p.add_argument("--all", dest="everything", action="store_true",
                   help="compare every field except timestamps (hostnames, environment, trial figures too)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_diff)


def cmd_fingerprint(args: argparse.Namespace) -> int:
    from capture import manifest as mf
    from capture.fingerprint import Timings, collect
    from capture.probes import ProbeOptions

    if args.principal and not args.key:
        raise UsageError("--principal needs --key", "add --key KEYFILE, or sign later with `capture sign`")
    options = ProbeOptions(
        models=tuple(args.model), datasets=tuple(args.dataset),
        code=Path(args.code) if args.code else None, verify_artifacts=args.verify_artifacts,
        deep=args.deep, hf_cache=Path(args.hf_cache) if args.hf_cache else None,
        progress=sys.stderr.isatty(),
    )
    if options.code is not None and not options.code.is_dir():
        raise UsageError(f"--code {args.code}: not a folder", "name the folder that holds your training code")
    if args.output:
        from capture._atomic import check_target
        check_target(args.output)  # a FIFO, device, link or folder is refused before probing
    if args.key:  # fail on a bad key before spending time probing
        from capture import signing
        signing.load_private_key(args.key)
    timings = Timings()
    t0 = time.perf_counter()
    rendered: dict[str, str] = {}
    manifest = collect(options, timings=timings, rendered=rendered)
    body = mf.dumps(manifest, rendered)
    if args.timings:
        from capture.fingerprint import format_timings
        sys.stderr.write(format_timings(timings, time.perf_counter() - t0))
    if args.key:
        from capture import signing
        if not args.output:
            sys.stdout.buffer.write(signing.sign_bytes(body, args.key, args.principal))
            return EXIT_OK
        signing.write_signed(args.output, body, args.key, args.principal)
    elif args.output:
        from capture._atomic import atomic_write
        atomic_write(args.output, body)
    else:
        sys.stdout.buffer.write(body)
        return EXIT_OK
    sys.stderr.write(f"wrote {args.output}\n")
    return EXIT_OK


def cmd_keygen(args: argparse.Namespace) -> int:
    from capture import signing

    from capture._atomic import check_target

    path = Path(args.output) if args.output else signing.default_key_path()
    if args.output and path.parent.is_dir():  # a missing folder is generate_key's own error
        for target in (path, Path(f"{path}.pub")):
            check_target(target)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    # the comment is the principal every command signs with for this key (sign, trial, exec, init, pin)
    pub = signing.generate_key(path, comment=args.comment or signing.keys._user_at_host(), overwrite=args.force)
    key_only = " ".join(pub.split()[:2])
    principal = signing.default_principal(path)
    sys.stdout.write(f"{pub}\n")
    sys.stderr.write(
        f"wrote {path} (private, mode 0600) and {path}.pub\n"
        f"hint: to trust it, add this line to an allowed-signers file:\n  {principal} namespaces=\"{signing.NAMESPACE}\" {key_only}\n"
    )
    return EXIT_OK


def cmd_sign(args: argparse.Namespace) -> int:
    from capture import signing

    key = args.key or os.environ.get("CAPTURE_KEY") or str(signing.default_key_path())
    signing.sign_file(args.file, key, args.principal)
    sys.stderr.write(f"signed {args.file}\n")
    return EXIT_OK


def _is_tree(files: list[str]) -> bool:
    """Several files, a folder or a glob verify as a tree (:mod:`capture.verify.tree` expands them)."""
    if len(files) > 1:
        return True
    f = files[0]
    return Path(f).is_dir() or (any(c in f for c in "*?[") and not Path(f).exists())


def cmd_verify(args: argparse.Namespace) -> int:
    from capture._escape import printable
    from capture.verify import Policy, format_report, verify_file

    policy = Policy.load(args.policy, args.strict) if args.policy else Policy.default(args.strict)
    if args.code is not None and not Path(args.code).is_dir():
        raise UsageError(f"--code {args.code}: not a folder", "name the folder that holds your training code")
    if args.staged or _is_tree(args.files):
        from capture.verify.tree import verify_paths

        return verify_paths(args.files, allowed_signers=args.allowed_signers, policy=policy,
                            stack=not args.signature_only, json_out=args.json, code_dir=args.code,
                            verify_artifacts=args.verify_artifacts, trust_from=args.trust_from, staged=args.staged)
    trust = args.allowed_signers
    if args.trust_from is not None:
        from capture.verify.trust_root import from_revision

        trust = from_revision(args.files, args.trust_from).allowed
    report = verify_file(args.files[0], allowed_signers=trust, policy=policy,
                         code_dir=args.code, stack=not args.signature_only,
                         verify_artifacts=args.verify_artifacts)
    if args.json:
        sys.stdout.write(json.dumps(report.to_json(), indent=2, default=str) + "\n")
    elif report.refused:
        # A rejected manifest: one-line reason and hint on stderr, as every other error.
        sys.stderr.write(f"error: {printable(report.path)}: {printable(report.reason)}\n")
        if report.hint:
            sys.stderr.write(f"hint: {printable(report.hint)}\n")
    else:
        sys.stdout.write(format_report(report) + "\n")
    return report.exit_code


def cmd_diff(args: argparse.Namespace) -> int:
    """Content of two manifests, signed or not (a fresh fingerprint is unsigned): the header says
    each file's signature state; the exit code is about the stacks (0 same, 1 differ, 3 malformed)."""
    from capture._escape import printable
    from capture.termtable import wrap
    from capture.verify import Policy, compare_manifests, open_manifest

    policy = Policy.everything() if args.everything else (
        Policy.load(args.policy, args.strict) if args.policy else Policy.default(args.strict))
    a = open_manifest(args.a, require_trusted=False)
    b = open_manifest(args.b, require_trusted=False)
    from capture.results.summary import exec_record

    diffs, compared = compare_manifests(a.data, b.data, policy)
    commands = {"a": exec_record(a.data), "b": exec_record(b.data)}
    if args.json:
        sys.stdout.write(json.dumps({
            "a": args.a, "b": args.b, "compared": compared, "policy": policy.source,
            "signatures": {"a": a.signature.to_json(), "b": b.signature.to_json()},
            "exec": {k: e.to_json() for k, e in commands.items() if e is not None},
            "differences": [d.to_json("a", "b") for d in diffs],
        }, indent=2, default=str) + "\n")
    else:
        for label, opened in (("A", a), ("B", b)):
            head, sig = f"{label}: {printable(opened.path)}", opened.signature.label
            if len(head) + 3 + len(sig) <= 100:
                sys.stdout.write(f"{head} — {sig}\n")
            else:  # the path whole on its line, the verdict below it within 100 columns
                sys.stdout.write(head + "\n" + "\n".join(wrap(sig, 100, "   ", "     ", cut_long=False)) + "\n")
            e = commands[label.lower()]
            if e is not None:  # what capture exec ran: a failed command reads FAILED
                sys.stdout.write(f"   command {printable(e.line())}; outputs: {printable(e.outputs_text())}\n")
        if diffs:
            sys.stdout.write(f"{len(diffs)} of {compared} compared fields differ:\n")
            sys.stdout.writelines(f"  {printable(x)}\n" for d in diffs for x in d.lines("A", "B", indent=2))
        else:
            sys.stdout.write(f"same stack: {compared} fields compared\n")
    return EXIT_DRIFT if diffs else EXIT_OK

"""Image commands: `capture image build|save|wheelhouse|lock` and `capture run`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from capture.errors import UsageError
from capture.image import FLAVOURS
from capture.image.locks import LOCKS


def _pip_source_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("where pip finds wheels (passed through to pip; nothing is stored)")
    g.add_argument("--index-url", metavar="URL", help="replace pip's index")
    g.add_argument("--extra-index-url", action="append", default=[], metavar="URL",
                   help="another index, e.g. the PyTorch wheel index of the flavour (repeatable)")
    g.add_argument("--find-links", action="append", default=[], metavar="DIR|URL",
                   help="a folder or page of wheels (repeatable)")


def _pip_args(args: argparse.Namespace) -> tuple[str, ...]:
    out: list[str] = []
    if args.index_url:
        out += ["--index-url", args.index_url]
    for url in args.extra_index_url:
        out += ["--extra-index-url", url]
    for link in args.find_links:
        out += ["--find-links", link]
    return tuple(out)


def register(sub: argparse._SubParsersAction) -> None:
    image = sub.add_parser("image", help="build, save and lock the CUDA/ROCm/CPU images")
    isub = image.add_subparsers(dest="image_command", metavar="SUBCOMMAND", parser_class=type(image))
    image.set_defaults(func=lambda a: _missing_subcommand(image))

    p = isub.add_parser("build", help="build an image with the docker SDK and print its ID")
    p.add_argument("flavour", choices=FLAVOURS)
    p.add_argument("--base-image", metavar="REF",
                   help="base to build on instead of the Dockerfile's pinned one (recorded in the base.* labels)")
    p.add_argument("--tag", metavar="T", help="image tag (default: capture-FLAVOUR:VERSION)")
    p.add_argument("--lock", choices=tuple(LOCKS), help="install another lock and its wheels (default: the "
                   "flavour's; rocm-wheels: torch from the ROCm wheel index; CI: standin, cpu)")
    p.add_argument("--wheelhouse", metavar="DIR", help="wheel folder (default: .cache/wheelhouse/LOCK)")
    p.add_argument("--no-cache", action="store_true", help="do not reuse Docker's layer cache")
    p.add_argument("--json", action="store_true", help="print the build result as JSON")
    _pip_source_flags(p)
    p.set_defaults(func=cmd_build)

    p = isub.add_parser("save", help="export an image and its base into one archive (docker load -i)")
    p.add_argument("ref", metavar="REF")
    p.add_argument("-o", "--output", required=True, metavar="ARCHIVE.tar")
    p.set_defaults(func=cmd_save)

    p = isub.add_parser("wheelhouse", help="download the locked wheels of a flavour on this host")
    p.add_argument("flavour", choices=tuple(LOCKS), metavar="LOCK", help=f"one of: {', '.join(LOCKS)}")
    p.add_argument("--dest", metavar="DIR", help="default: .cache/wheelhouse/LOCK")
    _pip_source_flags(p)
    p.set_defaults(func=cmd_wheelhouse)

    p = isub.add_parser("lock", help="regenerate a hash lock from pyproject.toml (uv pip compile, for the image's platform)")
    p.add_argument("flavour", choices=tuple(LOCKS), metavar="LOCK", help=f"one of: {', '.join(LOCKS)}")
    p.add_argument("-o", "--output", metavar="FILE", help="default: the lock shipped with capture")
    p.add_argument("--skip", choices=("torch",), help="leave the lock's torch build out, recorded as `# missing:` "
                   "(the lock then refuses to build)")
    p.add_argument("--no-index", action="store_true", help="resolve from --find-links only")
    _pip_source_flags(p)
    p.set_defaults(func=cmd_lock)

    p = sub.add_parser("run", help="run capture inside an image: by ID, network off, GPUs on request",
                       description="Run `capture ARGS...` in a container of the image. Example: "
                                   "capture run --image capture-cuda:0.1.0 --gpus all -- trial --example tiny")
    p.add_argument("--image", required=True, metavar="REF", help="image tag or ID (resolved to its ID; never pulled)")
    p.add_argument("--gpus", metavar="all|IDS", help="pass GPUs in: `all` or device indices like 0,1")
    p.add_argument("--vendor", choices=("nvidia", "amd"), help="GPU vendor (default: from the image's flavour label)")
    p.add_argument("--code", metavar="DIR", help="the code to fingerprint, mounted read-only at the same path and "
                   "made the working folder, with its git state (default: the git work tree of the current folder)")
    p.add_argument("--no-code", action="store_true", help="mount no code (the working folder is the image's empty /work)")
    p.add_argument("--cache", metavar="DIR", help="HF hub cache, mounted read-only "
                   "(default: the hub cache when it exists: $HF_HUB_CACHE, $HF_HOME/hub or ~/.cache/huggingface/hub)")
    p.add_argument("--out", default="out", metavar="DIR", help="output folder, mounted read-write at /out (default: ./out); "
                   "never the root, home or a system folder, nor the cache")
    p.add_argument("--key", metavar="KEYFILE", help="signing key (a regular file), mounted read-only "
                   "(default: $CAPTURE_KEY or ~/.config/capture/id_ed25519, created for a trial when absent)")
    p.add_argument("--allowed-signers", metavar="F", help="allowed-signers file, mounted read-only "
                   "(default: $CAPTURE_ALLOWED_SIGNERS or ~/.config/capture/allowed_signers when it exists)")
    p.add_argument("--dry-run", action="store_true", help="print every mount and what would be run as JSON; "
                   "create and start nothing")
    p.add_argument("args", nargs=argparse.REMAINDER, metavar="-- ARGS", help="the capture command to run inside")
    p.set_defaults(func=cmd_run)


def _missing_subcommand(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def cmd_build(args: argparse.Namespace) -> int:
    from capture.image import build

    result = build.build(args.flavour, base_image=args.base_image, tag=args.tag, lock_name=args.lock,
                         wheel_dir=Path(args.wheelhouse) if args.wheelhouse else None, no_cache=args.no_cache,
                         pip_args=_pip_args(args))
    if args.json:
        print(json.dumps({"image_id": result.image_id, "tag": result.tag, "flavour": result.flavour,
                          "lock": result.lock, "base_name": result.base_name, "base_digest": result.base_digest,
                          "labels": dict(result.labels)}, indent=2, sort_keys=True))
    else:
        print(result.image_id)
    sys.stderr.write(f"built {result.tag} ({result.image_id}); labels checked\n")
    return 0


def cmd_save(args: argparse.Namespace) -> int:
    from capture.image import save

    result = save.save(args.ref, Path(args.output))
    print(result.path)
    return 0


def cmd_wheelhouse(args: argparse.Namespace) -> int:
    from capture.image import wheelhouse

    wh = wheelhouse.prepare(args.flavour, Path(args.dest) if args.dest else None, pip_args=_pip_args(args))
    sys.stderr.write(f"{len(wh.files)} wheels, {wh.size_bytes / 2**20:.1f} MiB, match {wh.lock.path.name} "
                     f"(sha256 {wh.lock.sha256[:12]})\n")
    print(wh.path)
    return 0


def cmd_lock(args: argparse.Namespace) -> int:
    from capture.image import locks
    from capture.image.build import project_root

    index = (("--no-index",) if args.no_index else ()) + _pip_args(args)
    lock = locks.generate(args.flavour, project_root() / "pyproject.toml", index, skip_torch=args.skip == "torch",
                          out=Path(args.output) if args.output else None)
    state = "complete" if lock.complete else f"INCOMPLETE ({len(lock.missing)} missing)"
    sys.stderr.write(f"{len(lock.wheels)} wheels locked, {state}\n")
    print(f"{lock.path} sha256:{lock.sha256}")
    return 0


def _default_signers() -> Path | None:
    from capture.paths import personal_allowed_signers

    if os.environ.get("CAPTURE_ALLOWED_SIGNERS"):
        return Path(os.environ["CAPTURE_ALLOWED_SIGNERS"]).expanduser()
    path = personal_allowed_signers()
    return path if path.exists() else None


def _default_cache() -> Path | None:
    from capture.paths import hub_cache_dir

    cache = hub_cache_dir()
    return cache if cache.is_dir() else None


def _default_key() -> Path | None:
    from capture.paths import default_key_path

    key = default_key_path()
    return key if os.environ.get("CAPTURE_KEY") or key.exists() else None


def cmd_run(args: argparse.Namespace) -> int:
    from capture.image import docker_client, run
    from capture.paths import default_key_path

    command = list(args.args)
    if command and command[0] == "--":
        command = command[1:]
    if command and command[0] == "capture":  # the entrypoint already is capture
        command = command[1:]
    if not command:
        raise UsageError("nothing to run in the container",
                         "put the capture command after `--`, e.g. `capture run --image REF -- trial --example tiny`")
    if args.code and args.no_code:
        raise UsageError("--code and --no-code contradict each other", "pass one of them")
    cache = Path(args.cache) if args.cache else _default_cache()
    code = None if args.no_code else (Path(args.code) if args.code else run.default_code())
    key = Path(args.key) if args.key else _default_key()
    creates: list[str] = []
    if key is None and command[0] == "trial":
        # As `capture trial` on the host would: the default key, created on first use and trusted
        # in ~/.config/capture/allowed_signers, so what the container signs verifies here.
        creates.append(f"signing key {default_key_path()} (and its .pub, trusted in allowed_signers)")
    signers = (Path(args.allowed_signers) if args.allowed_signers
               else _default_signers())
    spec = run.plan(None, args.image, command, Path(args.out), cache_dir=cache, gpus=args.gpus,
                    vendor=args.vendor, key_file=key, allowed_signers=signers, code_dir=code, creates=creates)
    if args.dry_run:
        kwargs = spec.create_kwargs()
        kwargs["device_requests"] = [dict(r) for r in kwargs.get("device_requests", [])]
        mounts = spec.mounts()
        if creates:
            pub = f"{default_key_path()}.pub"
            mounts += [{"source": str(default_key_path()), "target": run.KEY_MOUNT, "mode": "ro"},
                       {"source": pub, "target": run.KEY_MOUNT + ".pub", "mode": "ro"}]
            kwargs["environment"]["CAPTURE_KEY"] = run.KEY_MOUNT
        print(json.dumps({**kwargs, "mounts": mounts, "creates": list(spec.creates)}, indent=2, sort_keys=True, default=str))
        return 0
    if creates:
        from capture import signing

        key = signing.ensure_default_key()
        spec = run.plan(None, args.image, command, Path(args.out), cache_dir=cache, gpus=args.gpus,
                        vendor=args.vendor, key_file=key, allowed_signers=signers or _default_signers(), code_dir=code)
    return run.execute(docker_client(), spec)

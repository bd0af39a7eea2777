"""The scaling step's command-line flags, apart from :mod:`capture.trial.scaling` so that building
the CLI's parser (every command does) does not import the launcher."""

from __future__ import annotations

import argparse


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _port(text: str) -> int:
    value = _positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port (1-65535), got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the scaling flags to the ``trial`` subparser."""
    g = parser.add_argument_group(
        "scaling (DDP/FSDP against the single-device baseline, launched with torch.distributed.run)")
    g.add_argument("--nproc", type=_positive_int, metavar="N",
                   help="processes (devices) per node; turns the scaling step on")
    g.add_argument("--strategy", choices=("ddp", "fsdp", "both"), default="both",
                   help="which parallel shape to measure (default: both)")
    g.add_argument("--nnodes", type=_positive_int, default=1, metavar="N",
                   help="nodes taking part (torchrun --nnodes); run the same command on every node")
    g.add_argument("--node-rank", type=int, default=None, metavar="I",
                   help="this node's rank for static rendezvous (torchrun --node-rank)")
    g.add_argument("--rdzv-backend", default=None, metavar="NAME", help="torchrun --rdzv-backend (e.g. c10d)")
    g.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT", help="torchrun --rdzv-endpoint")
    g.add_argument("--rdzv-id", default=None, metavar="ID", help="torchrun --rdzv-id (the same on every node)")
    g.add_argument("--master-addr", default=None, metavar="HOST", help="torchrun --master-addr (static rendezvous)")
    g.add_argument("--master-port", type=_port, default=None, metavar="PORT", help="torchrun --master-port")
    g.add_argument("--dist-dir", default=None, metavar="DIR",
                   help="folder for the ranks' checkpoints and results (default: inside the trial's work "
                        "folder); with several nodes it must be on a filesystem every node shares")

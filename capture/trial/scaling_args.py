"""The scaling step's command-line flags and the validated :class:`ScalingOptions` they become,
apart from :mod:`capture.trial.scaling` so that building the CLI's parser (every command does)
does not import the launcher."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from capture.errors import UsageError

STRATEGIES = ("ddp", "fsdp")


@dataclass(frozen=True)
class ScalingOptions:
    """What the scaling step is asked to do; checked when built (a bad combination is a UsageError)."""

    nproc: int
    strategy: str = "both"
    nnodes: int = 1
    node_rank: int | None = None
    rdzv_backend: str | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    master_addr: str | None = None
    master_port: int | None = None
    dist_dir: Path | None = None
    recovery: bool = True
    """False with --no-recovery: the restore launch is skipped too."""
    fsdp_offload: bool = False
    """FSDP keeps parameters, gradients and optimizer state on the CPU (FSDP2 CPUOffloadPolicy)."""
    rank_memory_limit: int | None = None
    """Bytes each rank (and the single-device baseline) may use, as on a device of that size."""

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise UsageError(f"--nproc: must be >= 1, got {self.nproc}")
        if self.strategy not in (*STRATEGIES, "both"):
            raise UsageError(f"--strategy: must be ddp, fsdp or both, got {self.strategy!r}")
        if self.nnodes < 1:
            raise UsageError(f"--nnodes: must be >= 1, got {self.nnodes}")
        if self.nnodes > 1 and not (self.rdzv_endpoint or self.master_addr):
            raise UsageError(f"--nnodes {self.nnodes}: the nodes need a meeting point",
                             "add --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id ID (or --master-addr/"
                             "--master-port with --node-rank) and run the same command on every node; see docs/scaling.md")
        if self.node_rank is not None and not 0 <= self.node_rank < self.nnodes:
            raise UsageError(f"--node-rank: must be in 0..{self.nnodes - 1} for --nnodes {self.nnodes}, got {self.node_rank}")
        if self.fsdp_offload and "fsdp" not in self.strategies:
            raise UsageError("--fsdp-offload: applies to FSDP, and --strategy ddp measures no FSDP",
                             "use --strategy fsdp or both, or leave --fsdp-offload out")
        if self.rank_memory_limit is not None and self.rank_memory_limit <= 0:
            raise UsageError(f"--rank-memory-limit: must be > 0, got {self.rank_memory_limit}")
        if self.rdzv_endpoint and self.master_addr:
            raise UsageError("--rdzv-endpoint and --master-addr both given",
                             "use --rdzv-endpoint (dynamic rendezvous) or --master-addr/--master-port (static), not both")

    @property
    def strategies(self) -> tuple[str, ...]:
        return STRATEGIES if self.strategy == "both" else (self.strategy,)

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes

    @property
    def explicit_rendezvous(self) -> bool:
        return bool(self.rdzv_endpoint or self.rdzv_backend or self.master_addr or self.master_port)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ScalingOptions | None:
        """From the parsed flags of :func:`add_arguments`; None without ``--nproc`` (no scaling step)."""
        if not args.nproc:
            for flag, given in (("--fsdp-offload", args.fsdp_offload), ("--rank-memory-limit", args.rank_memory_limit)):
                if given:
                    raise UsageError(f"{flag}: belongs to the scaling step, which --nproc N turns on",
                                     f"add --nproc N, or leave {flag} out")
            return None
        limit = None
        if args.rank_memory_limit:
            from capture.commands.trial import parse_bytes  # the one size parser (--memory-limit's)

            limit = parse_bytes(args.rank_memory_limit, "--rank-memory-limit")
        return cls(nproc=args.nproc, strategy=args.strategy, nnodes=args.nnodes, node_rank=args.node_rank,
                   rdzv_backend=args.rdzv_backend, rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id,
                   master_addr=args.master_addr, master_port=args.master_port,
                   dist_dir=Path(args.dist_dir) if args.dist_dir else None,
                   recovery=not getattr(args, "no_recovery", False), fsdp_offload=args.fsdp_offload,
                   rank_memory_limit=limit)


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
    g.add_argument("--fsdp-offload", action="store_true",
                   help="FSDP keeps parameters, gradients and optimizer state in host memory (FSDP2 CPUOffloadPolicy); "
                        "the optimizer steps on the CPU")
    g.add_argument("--rank-memory-limit", default=None, metavar="BYTES",
                   help="memory each rank and the single-device baseline may use, as on a card of that size "
                        "(e.g. 80GiB): CUDA caps the allocator, a CPU run sets RLIMIT_DATA; past it is out of memory, "
                        "recorded as \"does not fit\"")
    g.add_argument("--dist-dir", default=None, metavar="DIR",
                   help="folder for the ranks' checkpoints and results (default: inside the trial's work "
                        "folder); with several nodes it must be on a filesystem every node shares")

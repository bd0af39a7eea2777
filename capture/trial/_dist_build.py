"""What one rank of the scaling step trains: the workload, wrapped for its strategy, reading its shard.

The baseline and DDP build the workload as the single-device trial does
(:func:`capture.trial.workload.build_workload`: every rank holds the whole model). FSDP does not:
:func:`build_sharded` builds the model on the meta device (no memory), shards it with FSDP2
(``fully_shard`` per decoder layer, then the root), allocates only each rank's shard
(``to_empty``), and fills the shards from a full copy that rank 0 builds on its CPU, one tensor at
a time (:func:`materialise`). So FSDP's figures exist when the model fits only sharded, and the
weights are the single-device build's (seeded from ``trial.seed``, or the pretrained files).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
from typing import Any, Iterator

import torch

from capture.trial import workload as wl_mod

META = torch.device("meta")
CPU = torch.device("cpu")
RANK_SEED_STRIDE = 1_000_033  # rank r > 0 draws dropout from seed + r * stride; rank 0 keeps the baseline's stream


# --------------------------------------------------------------------------- data


class ShardedLoader:
    """Each rank's shard of the baseline's stream, with DistributedSampler semantics.

    One global :class:`~capture.trial.workload.PackedLoader` of ``per_rank_micro_batch x world``
    sequences per micro-step, identical on every rank; rank ``r`` keeps rows ``r, r+N, ...``.
    So the ranks together read, step for step, exactly the sequences the baseline reads, and the
    position (the global loader's) is the same on every rank.
    """

    def __init__(self, source: Any, per_rank_micro_batch: int, world: int, rank: int, seed: int, device: Any,
                 longest_first: bool = False) -> None:
        self.inner = wl_mod.PackedLoader(source, per_rank_micro_batch * world, seed, CPU, longest_first)
        self.world, self.rank, self.device = world, rank, device
        self.source = source

    def __iter__(self) -> ShardedLoader:
        return self

    def __next__(self) -> Any:
        rows = next(self.inner)[self.rank::self.world]
        if self.device.type == "cuda":
            return rows.pin_memory().to(self.device, non_blocking=True)
        return rows.to(self.device)

    def state_dict(self) -> dict[str, int]:
        return dict(self.inner.state_dict(), world_size=self.world, rank=self.rank)

    def load_state_dict(self, state: dict[str, int]) -> None:
        if int(state.get("world_size", self.world)) != self.world:
            raise RuntimeError(f"data position is for {state['world_size']} ranks, this launch has {self.world}")
        self.inner.load_state_dict(state)


class Feed:
    """What ``train_step_async`` reads from: counts tokens; under DDP, lets gradients synchronise
    only on the last micro-batch of an optimizer step (what ``DDP.no_sync`` does for the others)."""

    def __init__(self, loader: Iterator[Any], accum: int, ddp_model: Any = None) -> None:
        self.loader, self.accum, self.ddp = loader, accum, ddp_model
        self.calls = 0
        self.tokens = 0

    def __iter__(self) -> Feed:
        return self

    def __next__(self) -> Any:
        if self.ddp is not None:
            # DDP reads this flag in forward() to decide whether backward all-reduces.
            self.ddp.require_backward_grad_sync = self.calls % self.accum == self.accum - 1
        self.calls += 1
        batch = next(self.loader)
        self.tokens += batch.numel()
        return batch


# --------------------------------------------------------------------------- the sharded build (the seam)


@contextlib.contextmanager
def _threads(count: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, count))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _model(config: Any, device: Any) -> tuple[Any, dict[str, Any], Any, Any]:
    """The model (+LoRA) as :func:`~capture.trial.workload.build_model` builds it, seeded the same
    way: ``(model, model_info, tokenizer_dir, lora_info)``. On ``META`` nothing is allocated and no
    weight is read: the model is built from its resolved config (a pretrained folder's
    config.json; transformers refuses ``from_pretrained`` on the meta device) with the same
    attention and checkpointing settings; its weights come from rank 0's CPU copy."""
    if device != META:
        return wl_mod.build_model(config, device)
    from capture.errors import ConfigError
    from capture.trial.build import model as model_mod

    model_mod.check_requirements(config)
    r = model_mod.resolve(config)
    if config.model.quantization != "none" or getattr(r.hf_config, "quantization_config", None) is not None:
        raise ConfigError("trial.model.quantization: the FSDP scaling step cannot shard a quantized base",
                          "use --strategy ddp for QLoRA, or quantization = \"none\"")
    wl_mod.seed_everything(config.seed)
    with torch.device(META):
        model = model_mod.from_config(r.hf_config, dtype=model_mod.weights_dtype(config), **model_mod._attn_kwargs(config))
    model_mod.check_positions(model, config)
    if config.training.gradient_checkpointing:
        model_mod.enable_checkpointing(model)
    model.train()
    info = dict(r.info, tokenizer_dir=str(r.tokenizer_dir) if r.tokenizer_dir else None)
    lora_info = None
    if config.method == "lora":
        with torch.device(META):
            model, lora_info = model_mod.apply_lora(model, config)
    return model, info, r.tokenizer_dir, lora_info


def shard(model: Any, mesh: Any, offload: bool, device: Any) -> dict[str, Any]:
    """FSDP2: one sharding unit per transformer block (the model's ``_no_split_modules``), then the root."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    block_names = set(getattr(base, "_no_split_modules", None) or ())
    units = [m for m in model.modules() if type(m).__name__ in block_names]
    if not units:
        lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
        units = list(lists[0]) if lists else []
    policy = CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else None
    kwargs: dict[str, Any] = {"mesh": mesh} if policy is None else {"mesh": mesh, "offload_policy": policy}
    for m in units:
        fully_shard(m, **kwargs)
    fully_shard(model, **kwargs)
    return {"wrapper": "FSDP2 (torch.distributed.fsdp.fully_shard)",
            "sharding_units": f"{len(units)} x {', '.join(sorted({type(m).__name__ for m in units})) or 'none'} + root",
            "gradient_sync": "reduce-scatter after every micro-batch (sharded gradients, least memory)",
            "offload": (f"parameters, gradients and optimizer state on the CPU (CPUOffloadPolicy(pin_memory="
                        f"{device.type == 'cuda'})); the optimizer steps on the CPU") if offload else "none"}


@torch.no_grad()
def materialise(model: Any, source: Any, mesh: Any) -> None:
    """Fill the allocated shards (and the unsharded buffers) from ``source``, the full model on
    mesh rank 0 (None elsewhere), one tensor at a time: each travels once at full size on the
    mesh's device, then every rank keeps its slice (``distribute_tensor`` from group rank 0).
    Non-persistent buffers (rotary ``inv_freq``) are covered too: ``to_empty`` left them as
    garbage and no state dict holds them."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, distribute_tensor

    comm = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else CPU
    full_source = dict(itertools.chain(source.named_parameters(), source.named_buffers())) if source is not None else {}
    for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
        full = torch.empty(t.shape, dtype=t.dtype, device=comm)
        if source is not None:
            if name not in full_source:
                raise RuntimeError(f"sharded build: rank 0's full model has no tensor {name!r}")
            full.copy_(full_source[name])
        if isinstance(t, DTensor):
            t.to_local().copy_(distribute_tensor(full, t.device_mesh, t.placements, src_data_rank=0).to_local())
        else:
            dist.broadcast(full, group=mesh.get_group(), group_src=0)
            t.copy_(full)
        del full


def build_sharded(config: Any, device: Any, mesh: Any, offload: bool = False) -> tuple[Any, dict[str, Any]]:
    """The FSDP workload on ``mesh``: built on the meta device, only each rank's shard allocated.

    This is the one place the sharded build happens (the seam): the model comes from the
    workload's own build functions (:func:`_model`: every setting of the config applied), on the
    meta device on every rank and in full on mesh rank 0's CPU; the optimizer, schedule, scaler and
    data as :func:`~capture.trial.workload.build_workload` makes them. Returns the workload and
    what to record about the build.
    """
    mesh_rank = mesh.get_local_rank()
    model, info, tokenizer_dir, lora_info = _model(config, META)
    shard_info = shard(model, mesh, offload, device)
    home = CPU if offload else device
    model.to_empty(device=home)
    if offload:  # parameters live on the CPU; the buffers take part in the forward on the device
        for mod in model.modules():
            for key, buf in list(mod._buffers.items()):
                if buf is not None:
                    mod._buffers[key] = torch.empty_like(buf, device=device)
    source = None
    if mesh_rank == 0:
        # torchrun leaves one thread per rank; rank 0's CPU build may use its whole share meanwhile.
        cpus = len(os.sched_getaffinity(0)) if device.type == "cuda" else torch.get_num_threads()
        with _threads(cpus):
            source = _model(config, CPU)[0]
    materialise(model, source, mesh)
    del source
    from capture.trial import state

    state.release_memory(device)
    workload = wl_mod.assemble(config, device, model, info, tokenizer_dir, lora_info, optimizer_device=home)
    weights = ("pretrained: read from the model's files on rank 0's CPU" if config.model.source != "from_config"
               else "from config: random init seeded by trial.seed on rank 0's CPU, as a CPU build of the single-device "
                    "workload draws it")
    shard_info.update(
        materialization=("meta device: every rank built the model on the meta device, sharded it and allocated only its "
                         "shard (to_empty); rank 0 built the full model on its CPU and each tensor was sent to the "
                         "shards (distribute_tensor from group rank 0), so no device held the whole model"),
        weights=weights, optimizer_device=str(home), params_total=workload.params_total,
        param_bytes_total=sum(p.numel() * p.element_size() for p in model.parameters()))
    return workload, shard_info


def warm_imports(config: Any) -> None:
    """Pay the first build's lazy imports (transformers' model modules, peft) without memory."""
    _model(config, META)


# --------------------------------------------------------------------------- per strategy


@dataclasses.dataclass
class Built:
    workload: Any
    feed: Feed
    info: dict[str, Any]


def build(strategy: str, config: Any, plan: Any, device: Any, rank: int, world: int, mesh: Any = None,
          offload: bool = False) -> Built:
    """A fresh workload (seeded as the baseline's), wrapped for ``strategy``, reading its shard.
    ``rank`` and ``world`` are those of the ranks training together (the mesh's, for FSDP)."""
    if strategy == "fsdp":
        wl, info = build_sharded(config, device, mesh, offload)
    else:
        wl = wl_mod.build_workload(config, device)
        info = {}
    if strategy == "baseline":
        return Built(wl, Feed(wl.loader, config.batch.grad_accum), info)
    wl.loader = ShardedLoader(wl.loader.source, plan.per_rank_micro_batch, world, rank, config.seed, device,
                              wl.loader.longest_first)
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        wl.model = DDP(wl.model, device_ids=[device.index] if device.type == "cuda" else None)
        info = {"wrapper": "DistributedDataParallel",
                "gradient_sync": "all-reduce on the last micro-batch of each optimizer step (no_sync before it)"}
        feed = Feed(wl.loader, plan.per_rank_grad_accum, wl.model)
    elif strategy == "fsdp":
        feed = Feed(wl.loader, plan.per_rank_grad_accum)
    else:
        raise ValueError(f"unknown strategy {strategy!r}")
    if rank:
        wl_mod.seed_everything(config.seed + rank * RANK_SEED_STRIDE)
    return Built(wl, feed, info)

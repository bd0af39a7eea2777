"""The optimizer and LR schedule of the user's run, and what their state really holds.

``adamw``/``adam``/``sgd`` (torch, fused kernels on CUDA unless ``fused = false``), ``adamw_8bit``
and ``paged_adamw_8bit`` (bitsandbytes: block-wise 8-bit moments; the paged one in CUDA unified
memory, outside PyTorch's allocator) and ``adafactor`` (torch.optim.Adafactor: factored second
moment, no first moment). :func:`state_facts` reads the state's real size from the optimizer
after a step, by dtype, beside the estimate's ``optimizer_state`` term.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from capture.errors import ConfigError
from capture.trial.build.model import extra_hint
from capture.trial.config import TrialConfig


class Schedule:
    """LR multiplier: linear warm-up, then constant, linear or cosine decay to 0 at ``horizon``.

    A callable object (not a lambda) so LambdaLR.state_dict() carries it into checkpoints.
    """

    def __init__(self, name: str, warmup: int, horizon: int) -> None:
        self.name, self.warmup, self.horizon = name, warmup, max(horizon, warmup + 1)

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / (self.warmup + 1)
        if self.name == "constant":
            return 1.0
        frac = min(1.0, (step - self.warmup) / (self.horizon - self.warmup))
        return 1.0 - frac if self.name == "linear" else 0.5 * (1.0 + math.cos(math.pi * frac))


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(model: torch.nn.Module, config: TrialConfig, device: torch.device) -> tuple[torch.optim.Optimizer, dict[str, Any]]:
    o = config.optimizer
    groups = param_groups(model, o.weight_decay)
    kwargs: dict[str, Any] = {"lr": o.lr}
    fused = False
    if o.name in ("adamw", "adam", "sgd"):
        fused = device.type == "cuda" if o.fused == "auto" else o.fused == "on"
        if fused:
            kwargs["fused"] = True
    if o.name in ("adamw", "adam"):
        kwargs.update(betas=o.betas, eps=o.eps)
        cls: Any = torch.optim.AdamW if o.name == "adamw" else torch.optim.Adam
    elif o.name == "sgd":
        kwargs["momentum"] = o.momentum
        cls = torch.optim.SGD
    elif o.name == "adafactor":
        cls = torch.optim.Adafactor
    else:
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise ConfigError(f"trial.optimizer.name: {o.name} needs bitsandbytes, which is not installed",
                              extra_hint("bitsandbytes")) from None
        kwargs.update(betas=o.betas, eps=o.eps)
        cls = bnb.optim.PagedAdamW8bit if o.name == "paged_adamw_8bit" else bnb.optim.AdamW8bit
    try:
        opt = cls(groups, **kwargs)
    except (RuntimeError, ValueError) as exc:
        key = "trial.optimizer.fused" if fused else "trial.optimizer.name"
        raise ConfigError(f"{key}: {str(exc).splitlines()[0]}", 'set fused = "auto"' if fused else "choose another optimizer") from None
    # What the optimizer holds (its defaults and parameter groups), not the config's values.
    d = opt.defaults
    library = "bitsandbytes" if cls.__module__.startswith("bitsandbytes") else "torch"
    info: dict[str, Any] = {"name": o.name, "class": f"{library}.optim.{cls.__qualname__}", "lr": float(d["lr"]),
                            "weight_decay": float(max(g.get("weight_decay", 0.0) for g in opt.param_groups)),
                            "weight_decay_applies_to": "parameters with 2 or more dimensions (not biases or norms)",
                            "fused": bool(d.get("fused"))}
    if o.name == "sgd":
        info["momentum"] = float(d["momentum"])
    elif o.name != "adafactor":
        info.update(betas=[float(b) for b in d["betas"]], eps=float(d["eps"]))
    if o.name in ("adamw_8bit", "paged_adamw_8bit"):
        info["min_8bit_size"] = int(opt.args.min_8bit_size)
        info["block_size"] = 256
        # Read from the optimizer, not the name: bitsandbytes pages (CUDA unified memory) only on an
        # accelerator and only tensors of 1e5 elements or more; the measured paged bytes are in
        # [trial.memory.terms.optimizer_state] after the steps (state_facts).
        is_paged = bool(getattr(opt, "is_paged", False))
        info["paged"] = is_paged and device.type != "cpu"
        if is_paged and device.type == "cpu":
            info["paged_note"] = "bitsandbytes pages only on an accelerator: on the CPU the state is ordinary memory"
    return opt, info


def build_scheduler(optimizer: torch.optim.Optimizer, config: TrialConfig) -> tuple[Any, dict[str, Any]]:
    horizon = config.warmup_steps + config.measured_steps
    schedule = Schedule(config.scheduler.name, config.scheduler.warmup_steps, horizon)
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    # as the schedule runs: its horizon is at least one step past the warm-up
    return sched, {"name": schedule.name, "warmup_steps": schedule.warmup, "horizon_steps": schedule.horizon}


def state_facts(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer state as it is (after a step): bytes in total, by dtype and in paged (unified)
    memory, tensors counted once."""
    seen: dict[int, tuple[str, int, bool]] = {}
    for per_param in optimizer.state.values():
        for value in per_param.values():
            if isinstance(value, torch.Tensor) and value.numel():
                st = value.untyped_storage()
                paged = getattr(value, "is_paged", False) is True  # bitsandbytes marks its unified-memory buffers
                seen[st.data_ptr() or id(value)] = (str(value.dtype).removeprefix("torch."), st.nbytes(), paged)
    by_dtype: dict[str, int] = {}
    for dtype, nbytes, _ in seen.values():
        by_dtype[dtype] = by_dtype.get(dtype, 0) + nbytes
    return {"state_bytes": sum(by_dtype.values()), "state_bytes_by_dtype": dict(sorted(by_dtype.items())),
            "paged_bytes": sum(nbytes for _, nbytes, paged in seen.values() if paged),
            "params_with_state": len(optimizer.state)}


# --------------------------------------------------------------------------- the optimizer term


def step_counter_bytes(name: str, impl: str, device_type: str) -> int:
    """The fp32 ``step`` tensor torch's Adam/AdamW and Adafactor keep per parameter, where it lives on
    the device being estimated: always on a CPU run; on a GPU only for fused Adam (its step stays on
    the device; the foreach and for-loop paths keep it on the host). bitsandbytes keeps an int."""
    if name in ("adamw", "adam"):
        return 4 if device_type != "cuda" or impl == "fused" else 0
    if name == "adafactor":
        return 4 if device_type != "cuda" else 0
    return 0


def state_bytes(name: str, numel: int, shape: tuple[int, ...], param_bytes: int, momentum: float = 0.0,
                min_8bit_size: int = 4096) -> int:
    """Bytes of one parameter's optimizer state, as each optimizer keeps it (the step counter aside:
    :func:`step_counter_bytes`)."""
    if name in ("adamw", "adam"):
        return 2 * numel * param_bytes
    if name == "sgd":
        return numel * param_bytes if momentum > 0 else 0
    if name in ("adamw_8bit", "paged_adamw_8bit"):
        if numel < min_8bit_size:
            return 2 * numel * 4
        return 2 * numel + 2 * 4 * ((numel + 255) // 256)  # uint8 moments, an fp32 absmax per 256 (qmaps are shared)
    if name == "adafactor":
        if len(shape) >= 2:
            rows = numel // shape[-1]
            cols = numel // shape[-2]
            return (rows + cols) * param_bytes
        return numel * param_bytes
    raise ValueError(name)


PAGED_MIN_NUMEL = 100_000
"""bitsandbytes' paged optimizers put a state buffer in CUDA unified memory only for parameters of
this many elements or more (``Optimizer8bit.get_state_buffer``); smaller ones, and the block-wise
absmax statistics of every tensor, are ordinary device tensors."""


def paged_state_bytes(name: str, numel: int, min_8bit_size: int = 4096) -> int:
    """Bytes of one parameter's state that a paged optimizer keeps in unified memory on CUDA: its
    two moments (1 byte each, or fp32 under ``min_8bit_size``) where the tensor is large enough."""
    if name != "paged_adamw_8bit" or numel < PAGED_MIN_NUMEL:
        return 0
    return 2 * numel * (4 if numel < min_8bit_size else 1)


def implementation(name: str, fused: str, device_type: str) -> str:
    """How torch runs the step: ``fused`` (one kernel, in place), ``foreach`` (grouped kernels
    with list temporaries) or ``for-loop`` (one parameter at a time); bitsandbytes: ``8bit``."""
    if name in ("adamw_8bit", "paged_adamw_8bit"):
        return "8bit"
    if name in ("adamw", "adam", "sgd") and (fused == "on" or (fused == "auto" and device_type == "cuda")):
        return "fused"
    return "foreach" if device_type == "cuda" else "for-loop"


def step_transient_bytes(impl: str, name: str, trainable: list[tuple[int, int]]) -> int:
    """Temporaries of one optimizer step over ``trainable`` (numel, bytes) parameters: foreach
    AdamW keeps the square root of every second moment at once; a for-loop one parameter's."""
    if impl in ("fused", "8bit") or not trainable or name == "sgd":
        return 0
    if impl == "foreach":
        return sum(n * b for n, b in trainable)
    return max(n * b for n, b in trainable) * (2 if name == "adafactor" else 1)

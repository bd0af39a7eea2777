"""Training state: capture, restore, hash, save and load; device sync and memory release.

One place for what the trial stages, the recoverability check and the scaling ranks all need:

- :func:`capture_rng` / :func:`restore_rng`: every RNG stream a step can draw from (python
  ``random``, numpy, torch CPU, the CUDA/ROCm device generators), under the component names of
  :data:`COMPONENTS` (``rng_python``, ``rng_numpy``, ``rng_torch_cpu``, ``rng_cuda``), as tensors
  and plain values so that ``torch.load(weights_only=True)`` reads them back;
- :func:`capture_state` / :func:`restore_state`: the training state of a workload as the user's
  run saves it (model, optimizer, LR scheduler, grad scaler, RNGs, data position) as one dict
  keyed by component. The ``model`` component is what a run writes of its model: for a LoRA
  (peft) model its adapter (``get_peft_model_state_dict``), else the whole ``state_dict``; the
  frozen base of a LoRA run is not saved but verified (capture.trial.base, :func:`base_state`);
- :func:`component_hashes`: one sha256 per component of such a dict, the same function on the
  saved side and on the restored side, so "equal" means equal bytes;
- :func:`to_host`: a deep copy of a state with every tensor on the CPU (made once, reused);
- :func:`sync` and :func:`release_memory`: wait for the device; give cached memory back.

Checkpoint files (formats and timing) are in :mod:`capture.trial.checkpoint_io`.
"""

from __future__ import annotations

import ctypes
import gc
import hashlib
import os
import random
import sys
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

COMPONENTS = (
    "model",
    "optimizer",
    "scheduler",
    "scaler",
    "rng_python",
    "rng_numpy",
    "rng_torch_cpu",
    "rng_cuda",
    "data_position",
)
RNG_COMPONENTS = ("rng_python", "rng_numpy", "rng_torch_cpu", "rng_cuda")
BASE = "base_model"
"""The frozen base of a LoRA run: verified in the fresh process, never written (capture.trial.base)."""
STATE_FORMAT = "capture-recovery-3"
PERTURB_SEED_OFFSET = 1_000_003
"""A withheld RNG is re-seeded from ``seed + PERTURB_SEED_OFFSET``."""
_HASH_THREADS = max(8, min(32, os.cpu_count() or 8))


def device_type(device: Any) -> str:
    return getattr(device, "type", None) or str(device).split(":")[0]


def sync(device: Any) -> None:
    """Wait until the device has finished every queued kernel (nothing to do on a CPU)."""
    if device_type(device) == "cuda":
        import torch

        torch.cuda.synchronize(device if getattr(device, "index", None) is not None else None)


def release_memory(device: Any) -> None:
    """Collect garbage and return cached memory: the allocator's to the device, the heap's to the OS."""
    gc.collect()
    if device_type(device) == "cuda":
        import torch

        torch.cuda.empty_cache()
    else:
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass


# --------------------------------------------------------------------------- RNG


def capture_rng(device: Any, own_device_only: bool = False) -> dict[str, Any]:
    """Every RNG stream of this process. ``rng_cuda`` is a list of per-device states: every
    visible device, or only ``device`` with ``own_device_only`` (a rank of a scaling launch)."""
    import numpy as np
    import torch

    # the legacy tuple of the global MT19937 (numpy's stubs pick the dict overload for the default call)
    np_state = cast("tuple[str, Any, int, int, float]", np.random.get_state())
    state: dict[str, Any] = {
        "rng_python": random.getstate(),
        # numpy's state as a tensor and ints, so that torch.load(weights_only=True) can read it.
        "rng_numpy": {"kind": str(np_state[0]), "keys": torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
                      "pos": int(np_state[2]), "has_gauss": int(np_state[3]),
                      "cached_gaussian": float(np_state[4])},
        "rng_torch_cpu": torch.get_rng_state(),
    }
    if device_type(device) == "cuda":
        state["rng_cuda"] = [torch.cuda.get_rng_state(device)] if own_device_only else torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: Mapping[str, Any], device: Any, withhold: Iterable[str] = (), seed: int = 0,
                own_device_only: bool = False) -> None:
    """Set the streams :func:`capture_rng` captured; a withheld one is re-seeded from
    ``seed + PERTURB_SEED_OFFSET`` instead (perturbed, not left where a fresh build put it); one
    that ``state`` lacks is left as it is."""
    import numpy as np
    import torch

    withhold = set(withhold)
    other = int(seed) + PERTURB_SEED_OFFSET
    if "rng_python" in withhold:
        random.seed(other)
    elif "rng_python" in state:
        py = state["rng_python"]
        random.setstate((py[0], tuple(py[1]), py[2]))
    if "rng_numpy" in withhold:
        np.random.seed(other % 2**32)
    elif "rng_numpy" in state:
        s = state["rng_numpy"]
        np.random.set_state((s["kind"], s["keys"].cpu().numpy().astype(np.uint32), s["pos"], s["has_gauss"],
                             s["cached_gaussian"]))
    if "rng_torch_cpu" in withhold:
        torch.default_generator.manual_seed(other)  # CPU only; torch.manual_seed would reseed CUDA too
    elif "rng_torch_cpu" in state:
        torch.set_rng_state(state["rng_torch_cpu"])
    if device_type(device) == "cuda":
        if "rng_cuda" in withhold:
            if own_device_only:
                torch.cuda.manual_seed(other)
            else:
                torch.cuda.manual_seed_all(other)
        elif "rng_cuda" in state and own_device_only:
            torch.cuda.set_rng_state(state["rng_cuda"][0], device)
        elif "rng_cuda" in state:
            torch.cuda.set_rng_state_all(state["rng_cuda"])


class RngGuard:
    """Leave the caller's global RNG streams as they were: the runner's next stage may rely on them."""

    def __init__(self, device: Any) -> None:
        self.device = device

    def __enter__(self) -> RngGuard:
        self.saved = capture_rng(self.device)
        return self

    def __exit__(self, *exc: Any) -> None:
        restore_rng(self.saved, self.device)


# --------------------------------------------------------------------------- training state


def applicability(workload: Any, device: Any) -> dict[str, str | None]:
    """For each component: None when it applies to this run, else why it does not."""
    out: dict[str, str | None] = {c: None for c in COMPONENTS}
    if getattr(workload, "scheduler", None) is None:
        out["scheduler"] = "not applicable: the workload has no LR scheduler"
    scaler = getattr(workload, "scaler", None)
    if scaler is None or (hasattr(scaler, "is_enabled") and not scaler.is_enabled()):
        out["scaler"] = "not applicable: no grad scaler (only fp16 training uses one)"
    if device_type(device) != "cuda":
        out["rng_cuda"] = f"not applicable: the trial ran on {device_type(device)}, no CUDA/ROCm RNG is used"
    return out


def is_adapter(model: Any) -> bool:
    """True for a peft model (a LoRA run): its checkpoint holds the adapter, not the base."""
    peft = sys.modules.get("peft")  # a model can only be a PeftModel once peft was imported
    return peft is not None and isinstance(model, peft.PeftModel)


def model_state(model: Any, adapter_only: bool = True) -> dict[str, Any]:
    """What the user's run saves of its model: a peft model's adapter (``get_peft_model_state_dict``,
    what ``save_pretrained`` writes), else the whole ``state_dict`` (live tensors, no copy).
    ``adapter_only=False``: the whole state_dict of a peft model too."""
    if adapter_only and is_adapter(model):
        from peft import get_peft_model_state_dict

        # save_embedding_layers=False: "auto" may ask the hub whether the vocabulary was resized
        return get_peft_model_state_dict(model, save_embedding_layers=False)
    return model.state_dict()


def load_model_state(model: Any, saved: Mapping[str, Any], adapter_only: bool = True) -> None:
    """Load what :func:`model_state` returned (``set_peft_model_state_dict`` for an adapter)."""
    if adapter_only and is_adapter(model):
        from peft import set_peft_model_state_dict

        result: Any = set_peft_model_state_dict(model, dict(saved))  # peft annotates it as a bare namedtuple
        if result.unexpected_keys:
            raise RuntimeError(f"the adapter state has keys this model lacks: {', '.join(result.unexpected_keys[:3])}")
        return
    model.load_state_dict(saved)


def base_state(model: Any) -> dict[str, Any] | None:
    """The frozen base of a peft model: every state_dict entry that is not a trainable parameter
    (live tensors); None for a model without an adapter (its whole state is the ``model`` component)."""
    if not is_adapter(model):
        return None
    trainable = {n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    return {k: v for k, v in model.state_dict().items() if k not in trainable}


def model_hash(model: Any, adapter_only: bool = True) -> str:
    """The ``model`` component's hash of a live model (:func:`model_state`)."""
    return digest(model_state(model, adapter_only))


def capture_state(workload: Any, device: Any, step: int, adapter_only: bool = True) -> dict[str, Any]:
    """Everything a continuation may need, as the user's run saves it, in plain tensors and
    containers (no pickled objects). Tensors are the live ones (no copy): hash or save it before
    the next step, or :func:`to_host` it."""
    state: dict[str, Any] = {
        "format": STATE_FORMAT,
        "step": step,
        "model": model_state(workload.model, adapter_only),
        "optimizer": workload.optimizer.state_dict(),
        "data_position": workload.loader.state_dict(),
    }
    if getattr(workload, "scheduler", None) is not None:
        state["scheduler"] = workload.scheduler.state_dict()
    if getattr(workload, "scaler", None) is not None:
        state["scaler"] = workload.scaler.state_dict()
    state.update(capture_rng(device))
    return state


def as_built(workload: Any, components: Iterable[str], adapter_only: bool = True) -> dict[str, Any]:
    """A host copy of ``components`` of a workload as it was built (before any step or restore),
    so that one built workload can stand in for a fresh build at every later restore
    (:func:`restore_state`'s ``as_built``). Only the RNG streams are left out: a withheld stream
    is re-seeded, never taken from a build."""
    wanted = set(components)
    out: dict[str, Any] = {}
    if "model" in wanted:
        out["model"] = model_state(workload.model, adapter_only)
    if "optimizer" in wanted:
        out["optimizer"] = workload.optimizer.state_dict()
    if "scheduler" in wanted and getattr(workload, "scheduler", None) is not None:
        out["scheduler"] = workload.scheduler.state_dict()
    if "scaler" in wanted and getattr(workload, "scaler", None) is not None:
        out["scaler"] = workload.scaler.state_dict()
    if "data_position" in wanted:
        out["data_position"] = workload.loader.state_dict()
    return to_host(out)


def restore_state(workload: Any, state: Mapping[str, Any], withhold: Iterable[str], seed: int,
                  as_built: Mapping[str, Any] | None = None, adapter_only: bool = True) -> list[str]:
    """Load ``state`` into a workload, perturbing every withheld component.

    A withheld model, optimizer, scheduler or scaler is as freshly built (step 0); a withheld
    data position starts at 0; a withheld RNG is re-seeded (:func:`restore_rng`). For a freshly
    built workload ``as_built`` is None and those components are left as they are; a workload
    that already trained passes its :func:`as_built` copy, and they are loaded from it (with any
    gradient left over cleared), so one build serves every restore. Returns the components the
    state does not hold (left as built): a checkpoint missing a part is restored as far as it
    goes, and the state check then names what differs.
    """
    withhold = set(withhold)
    applies = [c for c, why in applicability(workload, workload.device).items() if why is None]
    missing = [c for c in applies if c not in state]
    if as_built is not None:
        workload.optimizer.zero_grad(set_to_none=True)
        workload.model.zero_grad(set_to_none=True)

    def source(c: str) -> Mapping[str, Any] | None:
        if c not in withhold and c in state:
            return state
        return as_built if as_built is not None and c in as_built else None

    if (src := source("model")) is not None:
        load_model_state(workload.model, src["model"], adapter_only)
    if (src := source("optimizer")) is not None:
        workload.optimizer.load_state_dict(src["optimizer"])
        _unalias(workload.optimizer, src["optimizer"])
    if (src := source("scheduler")) is not None and getattr(workload, "scheduler", None) is not None:
        workload.scheduler.load_state_dict(src["scheduler"])
    if (src := source("scaler")) is not None and getattr(workload, "scaler", None) is not None:
        workload.scaler.load_state_dict(src["scaler"])
    if (src := source("data_position")) is not None:
        workload.loader.load_state_dict(src["data_position"])
    # RNG last: loading the rest must not shift a stream after it was set.
    restore_rng(state, workload.device, withhold, seed)
    return missing


def _unalias(optimizer: Any, source: Mapping[str, Any]) -> None:
    """``Optimizer.load_state_dict`` keeps a loaded tensor as is when it already has the right
    device and dtype (moments on a CPU, step counters everywhere); the next step then updates the
    source in place. Clone those, so the source (a host copy reused per restore) stays the checkpoint."""
    import torch

    ptrs = {t.data_ptr() for t in _tensors(source) if t.numel()}
    for per_param in optimizer.state.values():
        for key, value in list(per_param.items()):
            if isinstance(value, torch.Tensor) and value.numel() and value.data_ptr() in ptrs:
                per_param[key] = value.clone()


def _tensors(value: Any) -> Iterable[Any]:
    import torch

    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def to_host(value: Any) -> Any:
    """A deep copy with every tensor copied to the CPU (containers rebuilt; other values shared)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, Mapping):
        return {k: to_host(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_host(v) for v in value]
    if isinstance(value, tuple):
        return tuple(to_host(v) for v in value)
    return value


def pin(value: Any) -> Any:
    """Every CPU tensor of ``value`` in page-locked memory (CUDA hosts only), in place: each
    pageable tensor is replaced (and so freed) as soon as its pinned copy exists, so a 48 GB
    host copy never needs 96 GB. Dicts and lists are updated; tuples rebuilt."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.pin_memory() if value.device.type == "cpu" and value.numel() else value
    if isinstance(value, dict):
        for k in list(value):
            value[k] = pin(value[k])
        return value
    if isinstance(value, list):
        for i, v in enumerate(value):
            value[i] = pin(v)
        return value
    if isinstance(value, tuple):
        return tuple(pin(v) for v in value)
    return value


# --------------------------------------------------------------------------- hashes


def _tensor_bytes(t: Any) -> Any:
    import torch

    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()


def _digest(data: Any) -> bytes:
    return hashlib.sha256(data).digest()


def _tensor_digest(t: Any) -> bytes:
    # copy and hash in the worker: device-to-host copies overlap with other tensors' hashing
    return _digest(_tensor_bytes(t))


def value_hash(value: Any, pool: ThreadPoolExecutor | None = None) -> str:
    """sha256 over a nested value: containers by structure (mapping keys sorted by repr), a
    tensor by dtype, shape and the sha256 of its bytes (computed in threads: hashlib releases the
    GIL), anything else by ``repr``."""
    import torch

    parts: list[Any] = []

    def walk(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            parts.append(f"T{v.dtype}{tuple(v.shape)}\0".encode())
            parts.append(pool.submit(_tensor_digest, v) if pool is not None else _tensor_digest(v))
        elif isinstance(v, Mapping):
            parts.append(b"{")
            for k in sorted(v, key=repr):
                parts.append(repr(k).encode() + b":")
                walk(v[k])
            parts.append(b"}")
        elif isinstance(v, (list, tuple)):
            parts.append(b"[")
            for x in v:
                walk(x)
            parts.append(b"]")
        else:
            parts.append(repr(v).encode() + b";")

    walk(value)
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else p.result())
    return "sha256:" + h.hexdigest()


def digest(value: Any) -> str:
    """:func:`value_hash` with the tensors hashed in threads."""
    with ThreadPoolExecutor(_HASH_THREADS) as pool:
        return value_hash(value, pool)


def component_hashes(state: Mapping[str, Any], components: Iterable[str] = COMPONENTS) -> dict[str, str]:
    """One :func:`value_hash` per component that ``state`` holds."""
    with ThreadPoolExecutor(_HASH_THREADS) as pool:
        return {c: value_hash(state[c], pool) for c in components if c in state}


def param_hash(model: Any) -> str:
    """The ``model`` component's hash of a module (its state_dict: parameters and buffers)."""
    with ThreadPoolExecutor(_HASH_THREADS) as pool:
        return value_hash(model.state_dict(), pool)


def optimizer_hash(optimizer: Any) -> str:
    """The ``optimizer`` component's hash (moments, step counts, param groups incl. the LR)."""
    with ThreadPoolExecutor(_HASH_THREADS) as pool:
        return value_hash(optimizer.state_dict(), pool)

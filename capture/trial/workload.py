"""The workload the trial trains: the user's fine-tune assembled from :mod:`capture.trial.build`.

Contract (docs/architecture.md; the recoverability, scaling and recorder code use only this):
:func:`build_workload` seeds python, numpy and torch (CUDA too) from ``config.seed`` *before*
building anything, so two builds are identical. The returned :class:`Workload` has ``model``,
``optimizer``, ``scheduler``, ``scaler`` (GradScaler or None), ``loader`` (a resumable iterator
of :class:`~capture.trial.build.data.Batch`: ``state_dict()`` / ``load_state_dict()`` hold the
data position), ``train_step()`` (grad_accum micro-batches → one optimizer step; returns the mean
loss; ``last_tokens``/``last_pad_tokens`` count what it trained on), ``evaluate()`` and
``tokens_per_step`` (the real tokens of a full step; padded runs count per step).

The parts live where their effect lives: :mod:`~capture.trial.build.model` (source, attention,
quantization, checkpointing, LoRA), :mod:`~capture.trial.build.optim`,
:mod:`~capture.trial.build.data` (text/chat, packed/padded, longest first),
:mod:`~capture.trial.build.loss` (standard/chunked), each beside the memory term it drives
(:mod:`~capture.trial.build.terms`).
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass, field
from typing import Any, Iterator, cast

import numpy as np
import torch

from capture.errors import ConfigError
from capture.trial.build import data as data_mod
from capture.trial.build import model as model_mod
from capture.trial.build.data import BYTE_EOT, Batch, PackedLoader, PackedTokens, SequenceSource, corpus_text  # noqa: F401
from capture.trial.build.loss import Loss
from capture.trial.build.optim import build_optimizer, build_scheduler
from capture.trial.config import TrialConfig

_DTYPES = model_mod.DTYPES


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # seeds every CUDA device too


def resolve_device(name: str) -> torch.device:
    """``auto`` → CUDA (or ROCm, which torch also calls cuda) when present, else CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: torch sees no CUDA/ROCm device",
                          f"this torch ({torch.__version__}) was built for "
                          f"{'CPU only' if not (torch.version.cuda or torch.version.hip) else 'a GPU, but none is visible'};"
                          " use --device cpu or a GPU machine")
    # An explicit index: set_per_process_memory_fraction and friends refuse a bare "cuda". Not
    # torch.cuda.current_device(): that would initialise CUDA before the context is measured.
    return torch.device("cuda", 0) if name == "cuda" else torch.device(name)


def hf_cache_dir() -> str:
    """The hub cache the user chose (read at call time, so --hf-cache and tests take effect)."""
    from capture.paths import hub_cache_dir

    return str(hub_cache_dir())


def import_model_code(config: TrialConfig) -> None:
    """Import the transformers modules this model's class lives in. transformers imports them
    lazily, on the first ``from_config``/``from_pretrained``: seconds of imports (the modeling
    module pulls in its kernels, sharding and loading helpers) that would otherwise be timed
    as loading a model of a few hundred thousand parameters."""
    from transformers import AutoModelForCausalLM

    try:
        r = model_mod.resolve(config)
        AutoModelForCausalLM._model_mapping[type(r.hf_config)]  # the lazy import happens here
    except Exception:  # a bad config is reported, with its key, by the load
        return


# --------------------------------------------------------------------------- workload


@dataclass
class Workload:
    """A live training setup. Mutable on purpose: it trains."""

    config: TrialConfig
    device: torch.device
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: Any
    loader: PackedLoader
    val_source: SequenceSource | None
    tokens_per_step: int
    params_total: int
    params_trainable: int
    loss: Loss
    info: dict[str, Any] = field(default_factory=dict)
    """The resolved definition: model, method, optimizer, precision, data, training (for ``[trial.run]``)."""
    data: Any = None
    last_tokens: int = 0
    """Real (not pad) tokens of the last step."""
    last_pad_tokens: int = 0
    compiled: bool = False

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        p = self.config.precision
        if p.autocast and p.dtype != "fp32":
            return torch.autocast(self.device.type, dtype=_DTYPES[p.dtype])
        return contextlib.nullcontext()

    def forward_backward(self, batch: Batch, accum: int = 1) -> torch.Tensor:
        """One micro-batch: the loss forward and its backward (gradients accumulate)."""
        with self.autocast():
            loss = self.loss(self.model, batch)
        scaled = loss / accum
        (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        return loss.detach()

    def train_step_async(self, batch_iter: Iterator[Batch] | None = None) -> torch.Tensor:
        """One optimizer step over ``grad_accum`` micro-batches; returns the mean loss as a device
        tensor, so a measured loop never waits for the device (no ``.item()`` here)."""
        source = self.loader if batch_iter is None else batch_iter
        accum = self.config.batch.grad_accum
        total: torch.Tensor | None = None
        tokens = pads = 0
        for _ in range(accum):
            batch = next(source)
            loss = self.forward_backward(batch, accum)
            tokens += batch.tokens
            pads += batch.pad_tokens
            total = loss if total is None else total + loss
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.last_tokens, self.last_pad_tokens = tokens, pads
        assert total is not None
        return total / accum

    def train_step(self, batch_iter: Iterator[Batch] | None = None) -> float:
        """One optimizer step (pulls ``grad_accum`` micro-batches); the mean loss as a float."""
        return float(self.train_step_async(batch_iter).item())

    def compile_now(self) -> dict[str, Any]:
        """Trigger torch.compile's compilation (forward and backward) on the first micro-batch the
        run will take, without moving the data position, the weights or any RNG stream: the
        measured steps then see exactly what an uncompiled run sees, minus the compile time."""
        from capture.trial import state

        rng = state.capture_rng(self.device)
        batch = self.loader.source.rows(self.loader._order()[: self.config.batch.micro_batch_size]).to(self.device)
        before = _dynamo_frames()
        self.forward_backward(batch)
        self.optimizer.zero_grad(set_to_none=True)
        state.sync(self.device)
        state.restore_rng(rng, self.device)
        return {"frames_compiled": _dynamo_frames() - before}

    def val_batches(self, count: int) -> Iterator[Batch]:
        """The first ``count`` validation micro-batches, in order (the same every call)."""
        if self.val_source is None:
            raise ConfigError("trial.data.validation_fraction: is 0, so there is no validation data",
                              "set it above 0 to time validation")
        mb, n = self.config.batch.micro_batch_size, len(self.val_source)
        for b in range(count):
            rows = [(b * mb + i) % n for i in range(mb)]
            yield self.val_source.rows(rows).to(self.device, non_blocking=self.device.type == "cuda")

    def tensor_bytes(self) -> int:
        """Bytes of the model's parameters and buffers and of the token data (storages counted once)."""
        seen: dict[int, int] = {}
        tensors = list(self.model.parameters()) + list(self.model.buffers())
        for src in (self.loader.source, self.val_source):
            if isinstance(src, PackedTokens):
                tensors.append(src.blocks)
                if src.labels is not None:
                    tensors.append(src.labels)
        for t in tensors:
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        return sum(seen.values())

    def evaluate(self, batches: int | None = None) -> float:
        """Mean loss over the validation batches (model in eval mode, no gradients)."""
        count = batches or self.config.validation.batches
        was_training = self.model.training
        self.model.eval()
        losses = []
        try:
            with torch.no_grad():
                for batch in self.val_batches(count):
                    with self.autocast():
                        losses.append(self.loss(self.model, batch).float())
        finally:
            self.model.train(was_training)
        return float(torch.stack(losses).mean().item())

    def facts(self) -> dict[str, Any]:
        """The settings in effect, read from the running objects."""
        return model_mod.facts(self.model, self.config, self.compiled)


def _dynamo_frames() -> int:
    try:
        from torch._dynamo.utils import counters

        return int(sum(counters["stats"].get(k, 0) for k in ("unique_graphs",)))
    except Exception:
        return 0


def count_params(model: torch.nn.Module) -> tuple[int, int]:
    """(total, trainable), counted from the built model (shared weights once). A 4-bit weight
    counts the parameters it stores (two per byte), not its packed bytes."""
    seen: set[int] = set()
    total = trainable = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        n = p.numel()
        if type(p).__name__ == "Params4bit" and (qs := getattr(p, "quant_state", None)) is not None:
            n = int(qs.shape.numel())
        total += n
        trainable += n if p.requires_grad else 0
    return total, trainable


def build_workload(config: TrialConfig, device: torch.device) -> Workload:
    """Seed everything, then build model (+LoRA), optimizer, scheduler, scaler and data."""
    return assemble(config, device, *build_model(config, device))


def build_model(config: TrialConfig, device: torch.device) -> tuple[torch.nn.Module, dict[str, Any], Any, dict[str, Any] | None]:
    """The seeded model with every setting applied and LoRA on top: ``(model, model_info,
    tokenizer_dir, lora_info)``, what :func:`assemble` takes (the sharded build makes its own)."""
    if config.precision.dtype == "fp16" and not config.precision.autocast:
        raise ConfigError("trial.precision.autocast: fp16 weights cannot be trained with a GradScaler",
                          'set autocast = true (fp32 weights, fp16 compute) or use dtype = "bf16"')
    model_mod.check_requirements(config)
    seed_everything(config.seed)
    model, model_info, tokenizer_dir = model_mod.build(config, device)
    model.train()
    lora_info = None
    if config.method == "lora":
        model, lora_info = model_mod.apply_lora(model, config)
    return model, model_info, tokenizer_dir, lora_info


def assemble(config: TrialConfig, device: torch.device, model: torch.nn.Module, model_info: dict[str, Any],
             tokenizer_dir: Any, lora_info: dict[str, Any] | None, optimizer_device: torch.device | None = None) -> Workload:
    """The workload around a built model: optimizer (its state on ``optimizer_device``, default
    ``device``), scheduler, scaler, data, loss and compilation, and the definition it records."""
    params_total, params_trainable = count_params(model)
    optimizer, opt_info = build_optimizer(model, config, optimizer_device or device)
    scheduler, sched_info = build_scheduler(optimizer, config)
    scaler = torch.amp.GradScaler(device.type) if config.precision.dtype == "fp16" else None
    vocab = int(cast(Any, model.config).get_text_config().vocab_size)  # a transformers config, not a module
    data = data_mod.build_data(config, vocab, tokenizer_dir)
    loader = PackedLoader(data.train, config.batch.micro_batch_size, config.seed, device, longest_first=data.longest_first)
    loss = Loss(model, config, device)
    compiled = False
    if config.training.compile:
        (model if loss.kind == "standard" else loss.decoder).compile()
        compiled = True
    wl = Workload(config=config, device=device, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                  loader=loader, val_source=data.val, tokens_per_step=config.tokens_per_step,
                  params_total=params_total, params_trainable=params_trainable, loss=loss, data=data, compiled=compiled)
    facts = wl.facts()
    model_info.update({k: v for k, v in facts.items() if k not in ("gradient_checkpointing", "quantization", "compiled")})
    model_info["transformers_version"] = _transformers_version()
    t = config.training
    wl.info = {
        "model": model_info, "method": config.method, "optimizer": opt_info, "scheduler": sched_info,
        "precision": {"dtype": config.precision.dtype, "autocast": config.precision.autocast,
                      "weights_dtype": facts["weights_dtypes"][0] if len(facts["weights_dtypes"]) == 1 else facts["weights_dtypes"],
                      "grad_scaler": scaler is not None},
        "training": {"gradient_checkpointing": facts["gradient_checkpointing"], "quantization": facts["quantization"],
                     "compile": {"enabled": compiled, "target": ("model" if loss.kind == "standard" else "decoder") if compiled else None,
                                 "requested": t.compile},
                     "loss": loss.info},
        "data": data.info,
    }
    if lora_info is not None:
        wl.info["lora"] = lora_info
    return wl


def _transformers_version() -> str:
    import transformers

    return transformers.__version__

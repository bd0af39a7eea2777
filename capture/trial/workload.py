"""The workload the trial trains: a causal-LM fine-tune built from a :class:`TrialConfig`.

Contract (docs/architecture.md; the recoverability and recorder code use only this):
:func:`build_workload` seeds python, numpy and torch (CUDA too) from ``config.seed`` *before*
building anything, so two builds are identical. The returned :class:`Workload` has ``model``,
``optimizer``, ``scheduler``, ``scaler`` (GradScaler or None), ``loader`` (a resumable iterator
of micro-batches: ``state_dict()`` / ``load_state_dict()`` hold the data position) and
``train_step()`` (grad_accum micro-batches → one optimizer step; returns the mean loss),
``evaluate()`` and ``tokens_per_step``.

Batches are always the *longest* the config allows: text is packed into sequences of exactly
``max_seq_len`` tokens (documents joined by an end-of-text token), so no step is padding.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import random
import warnings
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from capture.errors import ConfigError
from capture.trial.config import TrialConfig

BYTE_EOT = 256  # end-of-text id for the byte-level tokenizer (ids 0-255 are the bytes)
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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


# --------------------------------------------------------------------------- data


class PackedLoader:
    """An endless, resumable stream of micro-batches ``[micro_batch, seq_len]`` of token ids.

    The order is a fresh permutation of the sequences every epoch, drawn from a generator
    seeded by ``(seed, epoch)``; the position is ``(epoch, index)``, so restoring a
    ``state_dict()`` in a new process continues with exactly the same batches.
    """

    def __init__(self, source: "SequenceSource", micro_batch: int, seed: int, device: torch.device) -> None:
        self.source, self.micro_batch, self.seed, self.device = source, micro_batch, seed, device
        self.epoch, self.index = 0, 0
        self._perm: list[int] | None = None
        self._pin = device.type == "cuda"

    def _order(self) -> list[int]:
        if self._perm is None:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            self._perm = torch.randperm(len(self.source), generator=g).tolist()
        return self._perm

    def __iter__(self) -> "PackedLoader":
        return self

    def __next__(self) -> torch.Tensor:
        picks: list[int] = []
        while len(picks) < self.micro_batch:
            order = self._order()
            take = min(self.micro_batch - len(picks), len(order) - self.index)
            picks.extend(order[self.index:self.index + take])
            self.index += take
            if self.index >= len(order):
                self.epoch, self.index, self._perm = self.epoch + 1, 0, None
        batch = self.source.rows(picks)
        if self._pin:
            return batch.pin_memory().to(self.device, non_blocking=True)
        return batch.to(self.device)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "micro_batch": self.micro_batch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.index, self._perm = int(state["epoch"]), int(state["index"]), None
        self.seed = int(state.get("seed", self.seed))


class SequenceSource:
    """Sequences of ``seq_len`` token ids, addressed by index."""

    def __len__(self) -> int:
        raise NotImplementedError

    def rows(self, idx: list[int]) -> torch.Tensor:
        raise NotImplementedError


class PackedTokens(SequenceSource):
    def __init__(self, blocks: torch.Tensor) -> None:
        self.blocks = blocks

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def rows(self, idx: list[int]) -> torch.Tensor:
        return self.blocks[idx]


class SyntheticTokens(SequenceSource):
    """Seeded random tokens; sequence ``i`` is the same whenever and wherever it is drawn."""

    def __init__(self, count: int, offset: int, seq_len: int, vocab: int, seed: int) -> None:
        self.count, self.offset, self.seq_len, self.vocab, self.seed = count, offset, seq_len, vocab, seed

    def __len__(self) -> int:
        return self.count

    def rows(self, idx: list[int]) -> torch.Tensor:
        out = torch.empty((len(idx), self.seq_len), dtype=torch.long)
        for row, i in enumerate(idx):
            g = torch.Generator().manual_seed(self.seed * 7_919 + self.offset + i)
            out[row] = torch.randint(0, self.vocab, (self.seq_len,), generator=g)
        return out


def corpus_text() -> str:
    """The shipped text corpus (project-own prose, Apache-2.0), used by the tiny example."""
    return (resources.files("capture.trial") / "data" / "corpus.txt").read_text(encoding="utf-8")


def _documents_from_files(root: Path, patterns: tuple[str, ...], text_field: str, key: str) -> tuple[list[str], list[dict[str, Any]]]:
    files = [root] if root.is_file() else sorted({p for pat in patterns for p in root.glob(pat) if p.is_file()})
    if not files:
        raise ConfigError(f"{key}: no files matching {', '.join(patterns)} in {root}",
                          "point it at .txt, .jsonl or .json files, or set trial.data.files")
    docs: list[str] = []
    listing: list[dict[str, Any]] = []
    for f in files:
        raw = f.read_bytes()
        listing.append({"path": str(f.relative_to(root)) if f != root else f.name, "size_bytes": len(raw),
                        "sha256": hashlib.sha256(raw).hexdigest()})
        text = raw.decode("utf-8", errors="replace")
        suffix = f.suffix.lower()
        if suffix == ".txt" or suffix == ".md":
            docs.extend(d for d in text.split("\n\n") if d.strip())
        elif suffix in (".jsonl", ".json"):
            try:
                rows = [json.loads(line) for line in text.splitlines() if line.strip()] if suffix == ".jsonl" else json.loads(text)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{key}: {f.name} is not valid JSON (line {exc.lineno})", "fix or remove the file") from None
            if not isinstance(rows, list):
                raise ConfigError(f"{key}: {f.name} must hold a JSON array of objects", "or use .jsonl, one object a line")
            for row in rows:
                value = row.get(text_field) if isinstance(row, dict) else None
                if not isinstance(value, str):
                    raise ConfigError(f"trial.data.text_field: {f.name} has a row without a string field {text_field!r}",
                                      "name the field that holds the text")
                docs.append(value)
        else:
            raise ConfigError(f"trial.data.files: {f.name}: only .txt, .md, .jsonl and .json can be read",
                              "convert the data to .jsonl (one {\"text\": ...} object a line)")
    return docs, listing


def hf_cache_dir() -> str:
    """The hub cache the user chose (read at call time, so --hf-cache and tests take effect)."""
    from capture.paths import hub_cache_dir

    return str(hub_cache_dir())


def resolve_snapshot(repo_id: str, revision: str | None, repo_type: str, key: str) -> Path:
    """A repo revision's snapshot folder in the local hub cache; the trial never downloads.

    Resolved like the fingerprint resolves it (capture.probes.artifacts), so the commit in
    ``[trial.run]`` is the one in ``[[models]]``/``[[datasets]]``.
    """
    rev = revision or "main"
    cmd = f"hf download {repo_id}{' --repo-type dataset' if repo_type == 'dataset' else ''} --revision {rev}"
    from capture.errors import UsageError
    from capture.probes import ProbeOptions
    from capture.probes.artifacts import hub_cache_dir, resolve_commit

    cache = hub_cache_dir(ProbeOptions())
    try:
        folder, commit = resolve_commit(cache, repo_type, repo_id, rev, f"{repo_id}@{rev}")
    except UsageError as exc:
        raise ConfigError(f"{key}: {exc.message}", f"download it first (`{cmd}`), or set --hf-cache; "
                                                   "the trial itself runs offline") from None
    return folder / "snapshots" / commit


@dataclass
class DataSet:
    train: SequenceSource
    val: SequenceSource | None
    info: dict[str, Any] = field(default_factory=dict)


def build_data(config: TrialConfig, vocab_size: int, model_path: Path | None) -> DataSet:
    d, seq = config.data, config.batch.max_seq_len
    info: dict[str, Any] = {"source": d.source, "packing": f"packed into sequences of exactly {seq} tokens"}
    if d.source == "synthetic":
        n_val = math.ceil(d.synthetic_sequences * d.validation_fraction) if d.validation_fraction else 0
        n_train = d.synthetic_sequences - n_val
        if n_train < 1:
            raise ConfigError("trial.data.validation_fraction: leaves no training sequences", "lower it")
        info.update(tokenizer="none (uniform random ids)", vocab_size=vocab_size, train_sequences=n_train,
                    val_sequences=n_val, train_tokens=n_train * seq)
        train = SyntheticTokens(n_train, 0, seq, vocab_size, config.seed)
        val = SyntheticTokens(n_val, n_train, seq, vocab_size, config.seed) if n_val else None
        return DataSet(train, val, info)

    if d.source == "corpus":
        docs = [p for p in corpus_text().split("\n\n") if p.strip()]
        info["name"] = "capture built-in corpus (project-own text)"
    else:
        if d.source == "local":
            root = config.resolve_path(d.path or "")
            if not root.exists():
                raise ConfigError(f"trial.data.path: {root} does not exist", "name a folder or file of .txt/.jsonl/.json")
            info["path"] = str(root)
        else:
            root = resolve_snapshot(d.repo_id or "", d.revision, "dataset", "trial.data.repo_id")
            info.update(repo_id=d.repo_id, revision=d.revision or "main", commit=root.name)
        docs, listing = _documents_from_files(root, d.files, d.text_field, "trial.data.path" if d.source == "local" else "trial.data.repo_id")
        info["files"] = listing

    if d.tokenizer == "bytes":
        if vocab_size < BYTE_EOT + 1:
            raise ConfigError(f"trial.data.tokenizer: byte-level ids need a vocabulary of at least 257, the model has {vocab_size}",
                              'set vocab_size >= 257 in [trial.model.config] or use tokenizer = "model"')
        ids: list[int] = []
        for doc in docs:
            ids.extend(doc.encode("utf-8"))
            ids.append(BYTE_EOT)
        info["tokenizer"] = "bytes (UTF-8 bytes 0-255, end-of-text 256)"
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)
        eot = tok.eos_token_id
        ids = []
        for doc in docs:
            ids.extend(tok(doc, add_special_tokens=False)["input_ids"])
            if eot is not None:
                ids.append(eot)
        if ids and max(ids) >= vocab_size:
            raise ConfigError(f"trial.data.tokenizer: the tokenizer yields id {max(ids)}, beyond the model's vocabulary ({vocab_size})",
                              "use the tokenizer that belongs to the model")
        info["tokenizer"] = f"model ({type(tok).__name__})"
    tokens = torch.tensor(ids, dtype=torch.long)
    n_blocks = tokens.numel() // seq
    if n_blocks < 2:
        raise ConfigError(f"trial.batch.max_seq_len: the data holds {tokens.numel()} tokens, fewer than 2 sequences of {seq}",
                          "lower max_seq_len or give more data")
    blocks = tokens[: n_blocks * seq].view(n_blocks, seq)
    n_val = min(n_blocks - 1, math.ceil(n_blocks * d.validation_fraction)) if d.validation_fraction else 0
    info.update(tokens_total=int(tokens.numel()), tokens_sha256=hashlib.sha256(tokens.numpy().tobytes()).hexdigest(),
                documents=len(docs), train_sequences=n_blocks - n_val, val_sequences=n_val,
                train_tokens=(n_blocks - n_val) * seq, dropped_tail_tokens=int(tokens.numel() - n_blocks * seq))
    train = PackedTokens(blocks[: n_blocks - n_val])
    val = PackedTokens(blocks[n_blocks - n_val:]) if n_val else None
    return DataSet(train, val, info)


# --------------------------------------------------------------------------- model


def import_model_code(config: TrialConfig) -> None:
    """Import the transformers modules this model's class lives in. transformers imports them
    lazily, on the first ``from_config``/``from_pretrained``: seconds of imports (the modeling
    module pulls in its kernels, sharding and loading helpers) that would otherwise be timed
    as loading a model of a few hundred thousand parameters."""
    from transformers import AutoConfig, AutoModelForCausalLM

    m = config.model
    try:
        if m.source == "from_config":
            hf_config = AutoConfig.for_model(m.architecture, **m.config)
        else:
            return  # the folder is resolved (and checked) by the load itself
        AutoModelForCausalLM._model_mapping[type(hf_config)]  # the lazy import happens here
    except Exception:  # a bad config is reported, with its key, by the load
        return


def _build_model(config: TrialConfig, device: torch.device) -> tuple[torch.nn.Module, dict[str, Any], Path | None]:
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    m = config.model
    info: dict[str, Any] = {"source": m.source}
    path: Path | None = None
    if m.source == "from_config":
        try:
            hf_config = AutoConfig.for_model(m.architecture, **m.config)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"trial.model.config: {exc}", "use the keyword names of the transformers config class") from None
        defaults = type(hf_config)()  # a config keeps any keyword as an attribute: compare with a clean one
        unknown = sorted(k for k in m.config if not hasattr(defaults, k))
        if unknown:
            raise ConfigError(f"trial.model.config.{unknown[0]}: not a field of {type(hf_config).__name__}",
                              "use the keyword names of the transformers config class")
        # Built on the target device directly: a 1B model initialised on the CPU first takes ~10 s.
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(hf_config)
        info["architecture"] = m.architecture
        info["weights"] = "none (random init from config, seeded)"
    else:
        if m.source == "hub":
            path = resolve_snapshot(m.repo_id or "", m.revision, "model", "trial.model.repo_id")
            info.update(repo_id=m.repo_id, revision=m.revision or "main", commit=path.name)
        else:
            path = config.resolve_path(m.path or "")
            if not (path / "config.json").is_file():
                raise ConfigError(f"trial.model.path: {path} has no config.json", "name a folder written by save_pretrained")
            info["path"] = str(path)
        try:
            model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as exc:
            key = "trial.model.path" if m.source == "local" else "trial.model.repo_id"
            raise ConfigError(f"{key}: cannot load a causal LM from {path} ({str(exc).splitlines()[0]})",
                              "the folder needs config.json and weights (safetensors or .bin)") from None
        model.to(device)
        info["weights"] = "pretrained"
    dtype = _DTYPES[config.precision.dtype]
    model.to(torch.float32 if config.precision.autocast else dtype)
    info["model_type"] = model.config.model_type
    info["class"] = type(model).__name__
    info["transformers_version"] = transformers.__version__
    info["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
    info["vocab_size"] = int(model.config.vocab_size)
    return model, info, path


def _apply_lora(model: torch.nn.Module, config: TrialConfig) -> tuple[torch.nn.Module, dict[str, Any]]:
    import peft

    lc = config.lora
    kwargs: dict[str, Any] = dict(r=lc.rank, lora_alpha=lc.alpha, lora_dropout=lc.dropout, task_type="CAUSAL_LM")
    if lc.target_modules is not None:
        kwargs["target_modules"] = list(lc.target_modules)
    if model.config.model_type == "gpt2":
        kwargs["fan_in_fan_out"] = True  # GPT-2 stores its projections as Conv1D (transposed)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers deprecations peft still calls
            model = peft.get_peft_model(model, peft.LoraConfig(**kwargs))
    except ValueError as exc:
        raise ConfigError(f"trial.lora.target_modules: {str(exc).splitlines()[0]}",
                          "name modules of this model (e.g. q_proj, v_proj for Llama; c_attn for GPT-2)") from None
    resolved = model.peft_config["default"].target_modules
    return model, {"rank": lc.rank, "alpha": lc.alpha, "dropout": lc.dropout,
                   "target_modules": sorted(resolved) if resolved else [], "peft_version": peft.__version__}


class _Schedule:
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


def _build_optimizer(model: torch.nn.Module, config: TrialConfig, device: torch.device) -> tuple[torch.optim.Optimizer, dict[str, Any]]:
    o = config.optimizer
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    fused = device.type == "cuda" if o.fused == "auto" else o.fused == "on"
    kwargs: dict[str, Any] = {"lr": o.lr}
    if fused:
        kwargs["fused"] = True
    if o.name in ("adamw", "adam"):
        kwargs.update(betas=o.betas, eps=o.eps)
        cls = torch.optim.AdamW if o.name == "adamw" else torch.optim.Adam
    else:
        kwargs["momentum"] = o.momentum
        cls = torch.optim.SGD
    try:
        opt = cls(groups, **kwargs)
    except (RuntimeError, ValueError) as exc:
        raise ConfigError(f"trial.optimizer.fused: {str(exc).splitlines()[0]}", 'set fused = "auto"') from None
    info = {"name": o.name, "class": f"torch.optim.{cls.__name__}", "lr": o.lr, "weight_decay": o.weight_decay,
            "weight_decay_applies_to": "parameters with 2 or more dimensions (not biases or norms)", "fused": fused}
    if o.name != "sgd":
        info.update(betas=list(o.betas), eps=o.eps)
    else:
        info["momentum"] = o.momentum
    return opt, info


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
    info: dict[str, Any] = field(default_factory=dict)
    """The resolved definition: model, method, optimizer, precision, data (for ``[trial.run]``)."""

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        p = self.config.precision
        if p.autocast and p.dtype != "fp32":
            return torch.autocast(self.device.type, dtype=_DTYPES[p.dtype])
        return contextlib.nullcontext()

    def train_step_async(self, batch_iter: Iterator[torch.Tensor] | None = None) -> torch.Tensor:
        """One optimizer step over ``grad_accum`` micro-batches; returns the mean loss as a
        device tensor, so a measured loop never waits for the device (no ``.item()`` here)."""
        source = self.loader if batch_iter is None else batch_iter
        accum = self.config.batch.grad_accum
        total: torch.Tensor | None = None
        for _ in range(accum):
            ids = next(source)
            with self.autocast():
                loss = self.model(input_ids=ids, labels=ids).loss
            scaled = loss / accum
            (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
            total = loss.detach() if total is None else total + loss.detach()
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        assert total is not None
        return total / accum

    def train_step(self, batch_iter: Iterator[torch.Tensor] | None = None) -> float:
        """One optimizer step (pulls ``grad_accum`` micro-batches); the mean loss as a float."""
        return float(self.train_step_async(batch_iter).item())

    def val_batches(self, count: int) -> Iterator[torch.Tensor]:
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
                for ids in self.val_batches(count):
                    with self.autocast():
                        losses.append(self.model(input_ids=ids, labels=ids).loss.float())
        finally:
            self.model.train(was_training)
        return float(torch.stack(losses).mean().item())


def count_params(model: torch.nn.Module) -> tuple[int, int]:
    """(total, trainable), counted from the built model (shared weights once)."""
    seen: set[int] = set()
    total = trainable = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    return total, trainable


def build_workload(config: TrialConfig, device: torch.device) -> Workload:
    """Seed everything, then build model (+LoRA), optimizer, scheduler, scaler and data."""
    if config.precision.dtype == "fp16" and not config.precision.autocast:
        raise ConfigError("trial.precision.autocast: fp16 weights cannot be trained with a GradScaler",
                          'set autocast = true (fp32 weights, fp16 compute) or use dtype = "bf16"')
    seed_everything(config.seed)
    model, model_info, model_path = _build_model(config, device)
    model.train()
    lora_info = None
    if config.method == "lora":
        model, lora_info = _apply_lora(model, config)
    params_total, params_trainable = count_params(model)
    optimizer, opt_info = _build_optimizer(model, config, device)
    horizon = config.warmup_steps + config.measured_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _Schedule(config.scheduler.name, config.scheduler.warmup_steps, horizon))
    scaler = None
    if config.precision.dtype == "fp16":
        scaler = torch.amp.GradScaler(device.type)
    data = build_data(config, model_info["vocab_size"], model_path)
    loader = PackedLoader(data.train, config.batch.micro_batch_size, config.seed, device)
    info: dict[str, Any] = {
        "model": model_info, "method": config.method, "optimizer": opt_info,
        "scheduler": {"name": config.scheduler.name, "warmup_steps": config.scheduler.warmup_steps, "horizon_steps": horizon},
        "precision": {"dtype": config.precision.dtype, "autocast": config.precision.autocast,
                      "weights_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
                      "grad_scaler": scaler is not None},
        "data": data.info,
    }
    if lora_info is not None:
        info["lora"] = lora_info
    return Workload(config=config, device=device, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                    loader=loader, val_source=data.val, tokens_per_step=config.tokens_per_step,
                    params_total=params_total, params_trainable=params_trainable, info=info)

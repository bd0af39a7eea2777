"""The trial config: a TOML file that defines the run before any card is measured.

The file is recorded in the manifest (``trial.config_toml``) beside the resolved definition, so a
reviewer sees both what was asked and what ran: as written, except that comments are removed and
any string value holding a credential is rewritten without it (:func:`capture.redact.toml_without_comments`);
``source_sha256`` is the hash of the exact bytes. Every key lives under
``[trial]``; an error names the exact key to fix (``trial.optimizer.lr: must be > 0, got -1``)
and an unknown key is an error with a did-you-mean, never silently ignored.

Layout (see docs/trial.md for every key)::

    [trial]            name, seed, method, device, warmup_steps, measured_steps
    [trial.model]      source = "hub" | "local" | "from_config"; repo_id, revision, path,
                       config_file, architecture, [trial.model.config], attn_implementation,
                       quantization
    [trial.training]   gradient_checkpointing, compile, loss, loss_chunk_size
    [trial.lora]       rank, alpha, dropout, target_modules
    [trial.optimizer]  name, lr, weight_decay, betas, eps, momentum, fused
    [trial.scheduler]  name, warmup_steps
    [trial.precision]  dtype, autocast
    [trial.batch]      max_seq_len, micro_batch_size, grad_accum
    [trial.data]       source = "corpus" | "synthetic" | "local" | "hub"; tokenizer, path,
                       repo_id, revision, format, text_field, messages_field, assistant_only_loss,
                       packing, files, validation_fraction, synthetic_sequences
    [trial.validation] every_steps, batches
    [trial.checkpoint] enabled, every_steps, format, copy_to
    [trial.recovery]   enabled, save_at_step, total_steps, withhold, sensitivity, deterministic
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from capture._toml import TomlError
from capture._toml import loads as toml_loads
from capture._safe_read import CONFIG_MAX_BYTES, read_regular
from capture.errors import ConfigError
from capture.redact import redact_text, redact_value, toml_without_comments
from capture.trial.config_read import Table, check_choice, check_int, did_you_mean, shown

METHODS = ("full", "lora")
# Upper bounds of the integer settings: far beyond any real run, low enough that a typo or a
# hostile file cannot overflow torch's 64-bit sizes and seeds or keep a trial running for ever.
SEED_MAX = 2**32 - 1  # numpy's range; python, numpy and torch are seeded with it (derived seeds stay in 64 bits)
STEPS_MAX = 1_000_000  # trial steps, validation batches, recovery steps: a trial measures minutes, not the run
SCHEDULE_MAX = 2**31 - 1  # schedules of the long run (scheduler warm-up, validation and checkpoint intervals)
SEQ_MAX = 2**24  # tokens in one sequence (and the chunked loss's chunk)
BATCH_MAX = 65_536  # sequences in a micro-batch; micro-batches in an optimizer step
SEQUENCES_MAX = 2**24  # synthetic sequences (their shuffle is a permutation of this many)
RANK_MAX = 65_536  # LoRA rank (the model's widest layer bounds it further)
DEVICES = ("auto", "cpu", "cuda")
MODEL_SOURCES = ("hub", "local", "from_config")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")
QUANTIZATIONS = ("none", "nf4", "int8")
LOSSES = ("standard", "chunked")
OPTIMIZERS = ("adamw", "adam", "sgd", "adamw_8bit", "paged_adamw_8bit", "adafactor")
BNB_OPTIMIZERS = ("adamw_8bit", "paged_adamw_8bit")
DATA_FORMATS = ("text", "chat")
SCHEDULERS = ("constant", "linear", "cosine")
DTYPES = ("fp32", "bf16", "fp16")
DATA_SOURCES = ("corpus", "synthetic", "local", "hub")
TOKENIZERS = ("bytes", "model")
PRETRAINED_SOURCES = ("hub", "local")
CHECKPOINT_FORMATS = ("torch.save", "safetensors", "dcp", "dcp-async")
RECOVERY_COMPONENTS = (
    "model", "optimizer", "scheduler", "scaler", "rng_python", "rng_numpy",
    "rng_torch_cpu", "rng_cuda", "data_position",
)


@dataclass(frozen=True)
class ModelConfig:
    source: str = "from_config"
    """``hub`` (a repo in the local hub cache), ``local`` (a folder), ``from_config`` (no weights)."""
    repo_id: str | None = None
    """Hub repository id (``source = "hub"``)."""
    revision: str | None = None
    """Branch, tag or commit; resolved to a commit from the local cache. None: ``main``."""
    path: str | None = None
    """A local model folder (``source = "local"``); relative to the config file."""
    config_file: str | None = None
    """A real model's ``config.json`` (or its folder), used as written, no weights
    (``source = "from_config"``); relative to the config file."""
    architecture: str | None = None
    """A transformers model type (``llama``, ``qwen2``, ``gpt2``, ...) for a hand-written shape
    (``source = "from_config"``)."""
    config: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the transformers config: the whole shape with ``architecture``, or
    changes on top of ``config_file``."""
    attn_implementation: str | None = None
    """``sdpa``, ``eager``, ``flash_attention_2``, ...; None: what transformers picks."""
    quantization: str = "none"
    """``none``, ``nf4`` (4-bit NormalFloat, double quantization: QLoRA) or ``int8`` (LLM.int8),
    through bitsandbytes. A folder whose config carries a ``quantization_config`` loads as it is."""

    @property
    def pretrained(self) -> bool:
        return self.source in PRETRAINED_SOURCES


@dataclass(frozen=True)
class TrainingConfig:
    gradient_checkpointing: bool = False
    """Activation checkpointing of every decoder layer (non-reentrant), as transformers applies it."""
    compile: bool = False
    """``torch.compile`` the model (``nn.Module.compile``); compile time is its own phase."""
    loss: str = "standard"
    """``standard`` (the model's own loss over full logits) or ``chunked`` (the logits never
    materialised: liger-kernel's fused linear cross-entropy where it runs, else capture's chunked
    torch implementation)."""
    loss_chunk_size: int = 1024
    """Tokens per chunk of the chunked loss (capture's torch implementation)."""


@dataclass(frozen=True)
class LoraConfig:
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.05
    target_modules: tuple[str, ...] | str | None = None
    """Module names to adapt (each must match a module), ``"all-linear"``, or None: peft's default
    for the architecture."""


@dataclass(frozen=True)
class OptimizerConfig:
    name: str = "adamw"
    lr: float = 3e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    momentum: float = 0.0
    """SGD only."""
    fused: str = "auto"
    """``auto`` (fused kernels on CUDA), ``on`` or ``off``."""


@dataclass(frozen=True)
class SchedulerConfig:
    name: str = "constant"
    warmup_steps: int = 0
    """Linear LR warm-up steps (the schedule's, not the trial's timing warm-up)."""


@dataclass(frozen=True)
class PrecisionConfig:
    dtype: str = "fp32"
    """``fp32``, ``bf16`` or ``fp16``."""
    autocast: bool = True
    """True: fp32 weights, ``dtype`` compute under torch.autocast. False: weights stored in ``dtype``."""


@dataclass(frozen=True)
class BatchConfig:
    max_seq_len: int = 128
    micro_batch_size: int = 8
    grad_accum: int = 1


@dataclass(frozen=True)
class DataConfig:
    source: str = "corpus"
    """``corpus`` (the shipped text), ``synthetic`` (seeded random tokens), ``local`` (text files),
    ``hub`` (a dataset repo in the local hub cache)."""
    tokenizer: str = "bytes"
    """``bytes`` (byte-level, ids 0-255 plus end-of-text 256) or ``model`` (the model's tokenizer).
    Default: ``model`` for a pretrained model, ``bytes`` otherwise."""
    path: str | None = None
    """A folder or a single file (``source = "local"``)."""
    repo_id: str | None = None
    revision: str | None = None
    format: str = "text"
    """``text`` (documents) or ``chat`` (rows of ``messages`` rendered with the chat template)."""
    text_field: str = "text"
    """For .json/.jsonl files: the field holding the text."""
    messages_field: str = "messages"
    """For chat data: the field holding the list of ``{role, content}`` messages."""
    assistant_only_loss: bool = False
    """Chat data: the loss on the assistant turns only (other tokens are labelled -100)."""
    packing: bool = True
    """True: documents joined and cut into sequences of exactly ``max_seq_len`` tokens. False: one
    document a sequence (cut at ``max_seq_len``), batches padded to their longest sequence."""
    files: tuple[str, ...] = ("*.txt", "*.jsonl", "*.json")
    """Glob patterns (relative to the folder or snapshot) of the files to read."""
    validation_fraction: float = 0.1
    synthetic_sequences: int = 256
    """How many sequences the synthetic data set holds (training and validation together)."""


@dataclass(frozen=True)
class ValidationConfig:
    every_steps: int = 100
    """The schedule a real run would follow (used to project cost); the trial times one pass."""
    batches: int = 4


@dataclass(frozen=True)
class CheckpointConfig:
    enabled: bool = True
    every_steps: int = 0
    """The schedule a real run would follow (0: only at the end); used to project cost."""
    format: str = "torch.save"
    """How the user's training writes checkpoints (capture.trial.checkpoint_io.FORMATS); the
    recovery check writes and restores in the same format."""
    copy_to: str | None = None
    """A folder to copy the written checkpoint to, timed (off the machine: a mounted bucket, NFS)."""


@dataclass(frozen=True)
class RecoveryConfig:
    enabled: bool = True
    save_at_step: int = 2
    """k: the step after which the checkpoint is saved."""
    total_steps: int = 4
    """n: steps of the uninterrupted reference run."""
    withhold: tuple[str, ...] = ()
    """Components deliberately left out of the checkpoint (to show what breaks)."""
    sensitivity: bool = True
    """Also restore with each component left out in turn, to show which ones this run needs."""
    deterministic: bool | None = None
    """Run the recovery reference and restores under deterministic kernels. None ("auto"): on
    for a GPU, off on a CPU (whose kernels are deterministic for a fixed thread count)."""


@dataclass(frozen=True)
class TrialConfig:
    name: str
    seed: int = 1234
    method: str = "full"
    device: str = "auto"
    warmup_steps: int = 3
    measured_steps: int = 20
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    data: DataConfig = field(default_factory=DataConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    source_text: str = ""
    """The config as recorded (``trial.config_toml``): the file without its comments, credentials removed."""
    source_sha256: str = ""
    """sha256 of the config file's exact text (UTF-8), comments included."""
    source: str = ""
    """Where it came from: a path, or ``example:NAME``."""
    base_dir: str = "."
    """Folder that relative paths in the config are taken from."""

    @property
    def tokens_per_step(self) -> int:
        return self.batch.micro_batch_size * self.batch.max_seq_len * self.batch.grad_accum

    def with_overrides(self, **changes: Any) -> "TrialConfig":
        """Apply command-line overrides (``method``, ``device``, ``warmup_steps``,
        ``measured_steps``, ``micro_batch_size``, ``recovery_enabled``, ``recovery_deterministic``),
        checked like the file."""
        cfg = self
        for key, value in changes.items():
            if value is None:
                continue
            if key == "micro_batch_size":
                check_int(value, "--micro-batch", 1, BATCH_MAX)
                cfg = dataclasses.replace(cfg, batch=dataclasses.replace(cfg.batch, micro_batch_size=value))
            elif key == "recovery_enabled":
                cfg = dataclasses.replace(cfg, recovery=dataclasses.replace(cfg.recovery, enabled=bool(value)))
            elif key == "recovery_deterministic":
                cfg = dataclasses.replace(cfg, recovery=dataclasses.replace(cfg.recovery, deterministic=bool(value)))
            elif key == "method":
                check_choice(value, "--method", METHODS)
                cfg = dataclasses.replace(cfg, method=value)
            elif key == "device":
                check_choice(value, "--device", DEVICES)
                cfg = dataclasses.replace(cfg, device=value)
            elif key in ("warmup_steps", "measured_steps"):
                flag = "--warmup" if key == "warmup_steps" else "--steps"
                check_int(value, flag, 0 if key == "warmup_steps" else 1, STEPS_MAX)
                cfg = dataclasses.replace(cfg, **{key: value})
            else:
                raise ValueError(f"unknown override {key}")
        return cfg

    def resolve_path(self, value: str) -> Path:
        p = Path(value).expanduser()
        return p if p.is_absolute() else Path(self.base_dir) / p


# --------------------------------------------------------------------------- checking


def recorded_text(text: str) -> str:
    """What ``trial.config_toml`` holds: ``text`` without comments and without credentials."""
    out = toml_without_comments(text)
    try:
        toml_loads(out)
    except TomlError:  # never expected; still, never record the comments
        import tomli_w

        out = tomli_w.dumps(redact_value(toml_loads(text)))
    return out


def parse(text: str, source: str, base_dir: Path, default_name: str) -> TrialConfig:
    """Check and resolve a config text. Raises :class:`ConfigError` naming the key to fix; every
    value an error quotes is shown without credentials (:func:`capture.trial.config_read.shown`)."""
    hint = f"fix it in {source}; docs/trial.md lists every key"
    if any(line.strip() == "[signature]" for line in text.splitlines()):
        raise ConfigError(f"{source}: a line reads [signature]", "that line is reserved for the manifest's signature; remove it")
    try:
        doc = toml_loads(text)
    except TomlError as exc:  # also nested too deeply, or an integer of thousands of digits
        raise ConfigError(f"{source}: not valid TOML ({redact_text(str(exc))})", hint) from None
    extra = [k for k in doc if k != "trial"]
    if extra:
        more = " (did you mean trial?)" if difflib.get_close_matches(extra[0], ["trial"], n=1) else "; every key lives under [trial]"
        raise ConfigError(f"{redact_text(extra[0])}: unknown top-level key{more}", hint)
    if "trial" not in doc:
        raise ConfigError(f"{source}: no [trial] table", hint)
    t = Table(doc["trial"], "trial", hint)

    name = redact_text(t.get("name", str, default_name))  # it names files and reports: never a credential
    seed = t.int("seed", 1234, 0, SEED_MAX)
    method = t.choice("method", METHODS, "full")
    device = t.choice("device", DEVICES, "auto")
    warmup = t.int("warmup_steps", 3, 0, STEPS_MAX)
    measured = t.int("measured_steps", 20, 1, STEPS_MAX)
    model = _model(t.table("model"), method)
    training = _training(t.table("training"))

    lt = t.table("lora")
    targets: tuple[str, ...] | str | None
    if isinstance(lt.data.get("target_modules"), str):
        targets = lt.get("target_modules", str, None)
        if targets != "all-linear":
            raise lt.err("target_modules", f'must be an array of module names or "all-linear", got {shown(targets)}')
    else:
        targets = lt.strings("target_modules", None)
    lora = LoraConfig(rank=lt.int("rank", 8, 1, RANK_MAX), alpha=lt.positive("alpha", 16.0),
                      dropout=lt.fraction("dropout", 0.05), target_modules=targets)
    lt.done()

    optimizer = _optimizer(t.table("optimizer"))

    s = t.table("scheduler")
    scheduler = SchedulerConfig(name=s.choice("name", SCHEDULERS, "constant"), warmup_steps=s.int("warmup_steps", 0, 0, SCHEDULE_MAX))
    s.done()

    p = t.table("precision")
    precision = PrecisionConfig(dtype=p.choice("dtype", DTYPES, "fp32"), autocast=p.get("autocast", bool, True))
    if precision.dtype == "fp16" and not precision.autocast:
        raise p.err("autocast", 'fp16 weights cannot be trained with a GradScaler; set autocast = true '
                                '(fp32 weights, fp16 compute) or use dtype = "bf16"')
    if model.quantization != "none" and precision.dtype == "fp32":
        raise p.err("dtype", f'quantization = "{model.quantization}" computes in bf16 or fp16; set dtype = "bf16"')
    p.done()

    b = t.table("batch")
    batch = BatchConfig(max_seq_len=b.int("max_seq_len", 128, 2, SEQ_MAX),
                        micro_batch_size=b.int("micro_batch_size", 8, 1, BATCH_MAX),
                        grad_accum=b.int("grad_accum", 1, 1, BATCH_MAX))
    b.done()

    data = _data(t.table("data"), model)

    v = t.table("validation")
    validation = ValidationConfig(every_steps=v.int("every_steps", 100, 1, SCHEDULE_MAX),
                                  batches=v.int("batches", 4, 1, STEPS_MAX))
    v.done()

    c = t.table("checkpoint")
    copy_to = c.get("copy_to", str, None)
    if copy_to is not None and not copy_to.strip():
        raise c.err("copy_to", "must name a folder, got an empty string")
    checkpoint = CheckpointConfig(enabled=c.get("enabled", bool, True), every_steps=c.int("every_steps", 0, 0, SCHEDULE_MAX),
                                  format=c.choice("format", CHECKPOINT_FORMATS, "torch.save"), copy_to=copy_to)
    c.done()

    r = t.table("recovery")
    withhold = r.strings("withhold", ()) or ()
    for w in withhold:
        if w not in RECOVERY_COMPONENTS:
            more = did_you_mean(w, RECOVERY_COMPONENTS) or f"; known: {', '.join(RECOVERY_COMPONENTS)}"
            raise r.err("withhold", f"unknown component {shown(w)}{more}")
    deterministic = r.get("deterministic", (bool, str), "auto")
    if isinstance(deterministic, str) and deterministic != "auto":
        raise r.err("deterministic", f'must be "auto", true or false, got {shown(deterministic)}')
    recovery = RecoveryConfig(enabled=r.get("enabled", bool, True), save_at_step=r.int("save_at_step", 2, 1, STEPS_MAX),
                              total_steps=r.int("total_steps", 4, 2, STEPS_MAX), withhold=withhold,
                              sensitivity=r.get("sensitivity", bool, True),
                              deterministic=None if deterministic == "auto" else deterministic)
    if recovery.total_steps <= recovery.save_at_step:
        raise r.err("total_steps", f"must be > save_at_step ({recovery.save_at_step}), got {recovery.total_steps}")
    r.done()
    t.done()

    return TrialConfig(
        name=name, seed=seed, method=method, device=device, warmup_steps=warmup, measured_steps=measured,
        model=model, training=training, lora=lora, optimizer=optimizer, scheduler=scheduler, precision=precision,
        batch=batch, data=data, validation=validation, checkpoint=checkpoint, recovery=recovery,
        source_text=recorded_text(text), source_sha256=hashlib.sha256(text.encode("utf-8")).hexdigest(),
        source=source, base_dir=str(base_dir),
    )


def _model(m: Table, method: str) -> ModelConfig:
    source = m.choice("source", MODEL_SOURCES, "from_config")
    model = ModelConfig(
        source=source, repo_id=m.get("repo_id", str, None), revision=m.get("revision", str, None),
        path=m.get("path", str, None), config_file=m.get("config_file", str, None),
        architecture=m.get("architecture", str, None), config=dict(m.get("config", dict, {})),
        attn_implementation=m.get("attn_implementation", str, None),
        quantization=m.choice("quantization", QUANTIZATIONS, "none"),
    )
    if source == "hub" and not model.repo_id:
        raise m.err("repo_id", 'required when source = "hub" (e.g. "gpt2")')
    if source == "local" and not model.path:
        raise m.err("path", 'required when source = "local" (a folder with config.json and weights)')
    if source == "from_config":
        if model.architecture is None and model.config_file is None:
            raise m.err("architecture", 'required when source = "from_config", or config_file: config_file = '
                                        '"config.json" uses a real model\'s config as written; architecture = "llama" '
                                        'with [trial.model.config] describes a shape by hand')
        if model.architecture is not None and model.config_file is not None:
            raise m.err("architecture", "give config_file or architecture, not both (the config file names its model_type)")
        if model.architecture is not None and not model.architecture.strip():
            raise m.err("architecture", "must name a transformers model type (llama, qwen2, mistral, gemma2, phi3, gpt2, ...)")
    for key, wrong in (("repo_id", "hub"), ("revision", "hub"), ("path", "local"), ("architecture", "from_config"),
                       ("config_file", "from_config")):
        m.only_with(key, getattr(model, key), source == wrong, f'source = "{wrong}" (source is "{source}")')
    if model.config and source != "from_config":
        raise m.err("config", f'only used when source = "from_config" (source is "{source}")')
    for key in model.config:
        if key in ("_attn_implementation", "attn_implementation"):
            raise ConfigError(f"trial.model.config.{key}: set the attention kernel with trial.model.attn_implementation",
                              f'e.g. attn_implementation = "eager"; known: {", ".join(ATTN_IMPLEMENTATIONS)}')
        if key in ("quantization_config",):
            raise ConfigError(f"trial.model.config.{key}: set quantization with trial.model.quantization",
                              f'one of {", ".join(QUANTIZATIONS)}')
    if model.attn_implementation is not None and model.attn_implementation not in ATTN_IMPLEMENTATIONS:
        value = model.attn_implementation
        raise m.err("attn_implementation", f"must be one of {', '.join(ATTN_IMPLEMENTATIONS)}, got {shown(value)}"
                                           f"{did_you_mean(value, ATTN_IMPLEMENTATIONS)}")
    if model.quantization != "none" and method != "lora":
        raise m.err("quantization", f'a {model.quantization} base is frozen: train adapters on it with method = "lora" '
                                    "(QLoRA), or set quantization = \"none\" for a full fine-tune")
    m.done()
    return model


def _training(g: Table) -> TrainingConfig:
    training = TrainingConfig(
        gradient_checkpointing=g.get("gradient_checkpointing", bool, False), compile=g.get("compile", bool, False),
        loss=g.choice("loss", LOSSES, "standard"), loss_chunk_size=g.int("loss_chunk_size", 1024, 16, SEQ_MAX))
    if g.has("loss_chunk_size") and training.loss != "chunked":
        raise g.err("loss_chunk_size", 'only used with loss = "chunked"')
    g.done()
    return training


def _optimizer(o: Table) -> OptimizerConfig:
    opt_name = o.choice("name", OPTIMIZERS, "adamw")
    betas = o.get("betas", list, [0.9, 0.999])
    if len(betas) != 2 or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in betas):
        raise o.err("betas", f"must be two numbers in [0, 1), got {shown(betas)}")
    fused = o.get("fused", (str, bool), "auto")
    if isinstance(fused, bool):
        fused = "on" if fused else "off"
    if fused not in ("auto", "on", "off"):
        raise o.err("fused", f'must be "auto", true or false, got {shown(fused)}')
    if fused == "on" and opt_name not in ("adamw", "adam", "sgd"):
        raise o.err("fused", f'{opt_name} has no fused torch kernel; leave fused = "auto"')
    default_lr = 1e-2 if opt_name == "adafactor" else 3e-4
    optimizer = OptimizerConfig(
        name=opt_name, lr=o.positive("lr", default_lr), weight_decay=o.get("weight_decay", float, 0.0),
        betas=(float(betas[0]), float(betas[1])), eps=o.positive("eps", 1e-8),
        momentum=o.fraction("momentum", 0.0), fused=fused,
    )
    if optimizer.weight_decay < 0:
        raise o.err("weight_decay", f"must be >= 0, got {optimizer.weight_decay:g}")
    if optimizer.momentum and opt_name != "sgd":
        raise o.err("momentum", f'only used with name = "sgd" (name is "{opt_name}")')
    if opt_name == "adafactor" and o.has("betas"):
        raise o.err("betas", "adafactor keeps no first moment and decays its second by step (torch.optim.Adafactor); "
                             "leave betas out")
    o.done()
    return optimizer


def _data(d: Table, model: ModelConfig) -> DataConfig:
    has_tokenizer = model.pretrained or model.config_file is not None
    default_tok = "model" if model.pretrained else "bytes"
    data = DataConfig(
        source=d.choice("source", DATA_SOURCES, "corpus"), tokenizer=d.choice("tokenizer", TOKENIZERS, default_tok),
        path=d.get("path", str, None), repo_id=d.get("repo_id", str, None), revision=d.get("revision", str, None),
        format=d.choice("format", DATA_FORMATS, "text"), text_field=d.get("text_field", str, "text"),
        messages_field=d.get("messages_field", str, "messages"),
        assistant_only_loss=d.get("assistant_only_loss", bool, False), packing=d.get("packing", bool, True),
        files=d.strings("files", DataConfig.files) or DataConfig.files,
        validation_fraction=d.fraction("validation_fraction", 0.1),
        synthetic_sequences=d.int("synthetic_sequences", 256, 2, SEQUENCES_MAX),
    )
    if data.source == "local" and not data.path:
        raise d.err("path", 'required when source = "local" (a folder or file of .txt/.jsonl/.json)')
    if data.source == "hub" and not data.repo_id:
        raise d.err("repo_id", 'required when source = "hub" (a dataset repo in the local hub cache)')
    for key, wrong in (("path", "local"), ("repo_id", "hub"), ("revision", "hub")):
        d.only_with(key, getattr(data, key), data.source == wrong, f'source = "{wrong}" (source is "{data.source}")')
    if data.source == "synthetic":
        if d.has("tokenizer"):
            raise d.err("tokenizer", "synthetic data needs no tokenizer (uniform random ids); leave it out")
        if data.format != "text" or not data.packing:
            raise d.err("format" if data.format != "text" else "packing",
                        "synthetic data is full-length random sequences; format and packing apply to real data")
    elif data.tokenizer == "model" and not has_tokenizer:
        raise d.err("tokenizer", '"model" needs a model with a tokenizer (source = "hub" or "local", or a config_file '
                                 'whose folder holds the tokenizer files); use "bytes"')
    elif data.tokenizer == "bytes" and model.pretrained:
        raise d.err("tokenizer", '"bytes" would feed byte ids to a pretrained model, whose vocabulary means something '
                                 'else; use tokenizer = "model" (the default for a pretrained model)')
    if data.format == "chat":
        if data.tokenizer != "model":
            raise d.err("format", '"chat" renders messages with the model\'s chat template: set tokenizer = "model"')
        if data.source == "corpus":
            raise d.err("format", '"chat" needs rows of messages (source = "local" or "hub", .jsonl/.json files)')
    if d.has("assistant_only_loss") and data.format != "chat":
        raise d.err("assistant_only_loss", 'only used with format = "chat"')
    if d.has("messages_field") and data.format != "chat":
        raise d.err("messages_field", 'only used with format = "chat"')
    d.done()
    return data


def load_config(path: str | Path) -> TrialConfig:
    """Read and check a trial config file."""
    p = Path(path)
    try:
        raw = read_regular(p, CONFIG_MAX_BYTES, ConfigError, "trial config")  # no FIFO, device or huge file
    except FileNotFoundError:
        raise ConfigError(f"{p}: no such file", "name a trial config .toml, or run `capture trial --example tiny`") from None
    except IsADirectoryError:
        raise ConfigError(f"{p}: is a folder, not a config file", "name a trial config .toml file") from None
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read ({exc.strerror})", "check the path and its permissions") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: not UTF-8 (byte {exc.start})", "save the config as UTF-8 text") from None
    return parse(text, str(p), p.resolve().parent, p.stem)


def example_names() -> list[str]:
    folder = resources.files("capture.trial") / "examples"
    return sorted(f.name[:-5] for f in folder.iterdir() if f.name.endswith(".toml"))


def load_example(name: str) -> TrialConfig:
    """One of the shipped examples (``tiny``, ``llama-1b``)."""
    names = example_names()
    if name not in names:
        near = difflib.get_close_matches(name, names, n=1)
        extra = f" (did you mean {near[0]}?)" if near else ""
        raise ConfigError(f"--example: no example named {name!r}{extra}", f"shipped examples: {', '.join(names)}")
    folder = resources.files("capture.trial") / "examples"
    text = (folder / f"{name}.toml").read_text(encoding="utf-8")
    return parse(text, f"example:{name}", Path(str(folder)), name)  # config_file paths are the examples' own


"""The model of the user's run: source, architecture, attention kernel, quantization, activation
checkpointing, torch.compile and LoRA, applied as transformers, peft and bitsandbytes apply them,
then read back from the built objects (:func:`facts`) so the manifest records what ran.

Sources (``[trial.model]``): ``hub`` / ``local`` (pretrained weights, loaded offline), or
``from_config`` with either ``config_file`` (a real model's ``config.json`` used as written, no
weights) or ``architecture`` + ``[trial.model.config]`` (a shape by hand; every key transformers
accepts). Any causal-LM architecture transformers knows is accepted.

Quantization (``nf4``, ``int8``) goes through bitsandbytes: a pretrained folder is loaded with a
``BitsAndBytesConfig`` (or as the quantized model its ``quantization_config`` says it is); a model
from a config is built in the compute dtype and its linear layers are then replaced by
bitsandbytes' ``Linear4bit`` / ``Linear8bitLt`` (the output embedding stays, as transformers keeps
it), which quantize when moved to the device.

The memory terms these settings drive (weights by storage, gradients, autocast copies) are in
:mod:`capture.trial.build.terms`, computed from :func:`param_plan` of a model built on the meta
device (:func:`build_meta`) so that ``capture estimate`` needs neither weights nor a GPU.
"""

from __future__ import annotations

import importlib.util
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from capture.errors import ConfigError
from capture.redact import redact_text
from capture.trial.build.model_config import Resolved, first_line, resolve, transformers_version
from capture.trial.config import TrialConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# keyed by dtype; object: also looked up with whatever getattr finds on a layer
SHORT: dict[object, str] = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_ATTN_PACKAGES = {"flash_attention_2": ("flash_attn", "flash-attn"), "flash_attention_3": ("flash_attn_interface", "flash-attn 3 (hopper build)")}
def extra_hint(module: str) -> str:
    """``pip install 'capture-stack[qlora]'``: the extra that provides ``module`` (capture._extras)."""
    from capture._extras import DISTRIBUTION, EXTRA_OF

    return f"pip install '{DISTRIBUTION}[{EXTRA_OF[module][0]}]'"


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def preflight(config: TrialConfig) -> Resolved:
    """Before anything is measured: the packages the settings need, and the model's config
    (architecture, config file, folder) resolved. One-line errors, exit 2."""
    check_requirements(config)
    r = resolve(config)
    folder_quant = getattr(r.hf_config, "quantization_config", None)
    if folder_quant is not None and config.method != "lora":
        kind = "nf4" if _qc(folder_quant, "bnb_4bit_quant_type") == "nf4" else (
            "int8" if _qc(folder_quant, "load_in_8bit") else "quantized")
        raise _frozen_folder(kind)
    return r


def _qc(qc: Any, key: str) -> Any:
    return qc.get(key) if isinstance(qc, dict) else getattr(qc, key, None)


def _frozen_folder(kind: str) -> ConfigError:
    return ConfigError(f"trial.model: the folder holds a {kind} model (its config.json has a quantization_config); "
                       "its weights are frozen", 'train adapters on it: method = "lora"')


def check_requirements(config: TrialConfig) -> None:
    """Packages the settings need (one-line error naming the extra, exit 2)."""
    m = config.model
    if m.quantization != "none" or config.optimizer.name in ("adamw_8bit", "paged_adamw_8bit"):
        key = "trial.model.quantization" if m.quantization != "none" else "trial.optimizer.name"
        what = m.quantization if m.quantization != "none" else config.optimizer.name
        if not _has("bitsandbytes"):
            raise ConfigError(f"{key}: {what} needs bitsandbytes, which is not installed", extra_hint("bitsandbytes"))
    need = _ATTN_PACKAGES.get(m.attn_implementation or "")
    if need and not _has(need[0]):
        raise ConfigError(f"trial.model.attn_implementation: {m.attn_implementation} needs the {need[1]} package, "
                          "which is not installed", 'install it for this CUDA build, or use attn_implementation = "sdpa"')


def from_config(hf_config: Any, **kwargs: Any) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_config`` under the default device: what transformers refuses in
    the config is a config error (exit 2); running out of memory, or a device error, stays what it is."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_config(hf_config, **kwargs)
    except Exception as exc:
        if isinstance(exc, (MemoryError, torch.OutOfMemoryError)) or (
                isinstance(exc, RuntimeError) and torch.get_default_device().type != "meta"):
            raise
        text = str(exc).lower()
        if kwargs.get("attn_implementation") and any(w in text for w in ("attn", "attention", "flash")):
            raise _attn_error(exc) from None
        raise ConfigError(f"trial.model: transformers cannot build {hf_config.model_type} from this config "
                          f"({type(exc).__name__}: {first_line(exc)})",
                          "check the sizes in [trial.model.config] or the config file (heads must divide the hidden size)") from None


# --------------------------------------------------------------------------- building


def weights_dtype(config: TrialConfig) -> torch.dtype:
    """The dtype of the stored (unquantized) weights: fp32 under autocast, else the compute dtype."""
    p = config.precision
    return torch.float32 if p.autocast else DTYPES[p.dtype]


def _attn_kwargs(config: TrialConfig) -> dict[str, Any]:
    impl = config.model.attn_implementation
    return {"attn_implementation": impl} if impl else {}


def _attn_error(exc: BaseException) -> ConfigError:
    return ConfigError(f"trial.model.attn_implementation: {redact_text(str(exc).splitlines()[0])[:300]}",
                       'use attn_implementation = "sdpa" (or "eager")')


def bnb_config(quantization: str, compute: torch.dtype) -> Any:
    from transformers import BitsAndBytesConfig

    if quantization == "nf4":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=compute)
    return BitsAndBytesConfig(load_in_8bit=True)


def build(config: TrialConfig, device: torch.device) -> tuple[torch.nn.Module, dict[str, Any], Path | None]:
    """The model on ``device``, seeded by the caller, with every setting applied; LoRA not yet."""
    from transformers import AutoModelForCausalLM

    r = resolve(config)
    m = config.model
    info = dict(r.info)
    dtype = weights_dtype(config)
    compute = DTYPES[config.precision.dtype]
    kwargs = _attn_kwargs(config)
    folder_quant = getattr(r.hf_config, "quantization_config", None)
    try:
        if m.source == "from_config":
            with torch.device(device):  # built on the device directly: a 1B model on the CPU first takes ~10 s
                model = from_config(r.hf_config, dtype=dtype if m.quantization == "none" else compute, **kwargs)
            if m.quantization != "none":
                quantize_linears(model, m.quantization, compute, device)
                _cast_unquantized(model, dtype)
                if device.type == "cuda":  # the full-precision staging is capture's, not the run's: give it back
                    torch.cuda.empty_cache()
        else:
            # Loaded onto the device directly (one device: no dispatch hooks), not into host memory
            # first and then moved: an 8B model's bf16 copy is 16 GB of the host's memory otherwise.
            load: dict[str, Any] = dict(local_files_only=True, dtype=dtype, device_map={"": device}, **kwargs)
            if m.quantization != "none" and folder_quant is None:
                load["quantization_config"] = bnb_config(m.quantization, compute)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = AutoModelForCausalLM.from_pretrained(str(r.weights_dir), **load)
    except (ImportError, ValueError) as exc:
        text = str(exc)
        if "attn" in text.lower() or "flash" in text.lower() or "attention" in text.lower():
            raise _attn_error(exc) from None
        if m.source != "from_config" and isinstance(exc, ValueError):
            key = "trial.model.path" if m.source == "local" else "trial.model.repo_id"
            raise ConfigError(f"{key}: cannot load a causal LM from {r.weights_dir} ({redact_text(text.splitlines()[0])})",
                              "the folder needs config.json and weights (safetensors or .bin)") from None
        raise
    except OSError as exc:
        key = "trial.model.path" if m.source == "local" else "trial.model.repo_id"
        raise ConfigError(f"{key}: cannot load a causal LM from {r.weights_dir} ({redact_text(str(exc).splitlines()[0])})",
                          "the folder needs config.json and weights (safetensors or .bin)") from None
    if folder_quant is not None:
        kind = quantization_of(model)
        if config.method != "lora":
            raise _frozen_folder(kind or "quantized")
        if m.quantization != "none" and kind and kind != m.quantization:
            raise ConfigError(f"trial.model.quantization: {m.quantization!r}, but the folder holds a {kind} model",
                              f'set quantization = "{kind}" (or leave it out: the folder decides)')
        info["quantization_source"] = "the folder's quantization_config"
    elif m.quantization != "none":
        info["quantization_source"] = ("trial.model.quantization (bitsandbytes, at load)" if m.source != "from_config"
                                       else "trial.model.quantization (bitsandbytes: linear layers replaced, quantized on the device)")
    check_positions(model, config)
    if config.training.gradient_checkpointing:
        enable_checkpointing(model)
    info["tokenizer_dir"] = str(r.tokenizer_dir) if r.tokenizer_dir else None
    return model, info, r.tokenizer_dir


_POSITION_TABLES = ("wpe", "embed_positions", "position_embeddings")
"""The names transformers gives learned absolute position embeddings (GPT-2 and its kin, OPT, ...)."""


def check_positions(model: Any, config: TrialConfig) -> None:
    """A learned position table has a fixed number of rows: a longer sequence would index past it
    (an IndexError deep in the first forward). Rotary and ALiBi models have no table."""
    seq = config.batch.max_seq_len
    for name, mod in model.named_modules():
        if name.rsplit(".", 1)[-1] in _POSITION_TABLES and isinstance(mod, torch.nn.Embedding):
            rows = mod.num_embeddings - int(getattr(mod, "offset", 0) or 0)  # OPT keeps 2 rows before position 0
            if seq > rows:
                raise ConfigError(f"trial.batch.max_seq_len: {seq} is longer than the {rows} positions the model embeds "
                                  f"({name})", f"set max_seq_len <= {rows}, or give the model more positions "
                                  "(n_positions / max_position_embeddings)")


def enable_checkpointing(model: Any) -> None:
    """Activation checkpointing as transformers applies it, non-reentrant (torch's recommended mode)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ConfigError(f"trial.training.gradient_checkpointing: {type(model).__name__} does not support it in "
                          f"transformers {transformers_version()}", "set gradient_checkpointing = false")
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # the name transformers 5 moves to
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def quantize_linears(model: Any, quantization: str, compute: torch.dtype, device: torch.device) -> int:
    """Replace every ``nn.Linear`` but the output embedding by bitsandbytes' quantized layer, one at
    a time (the full-precision weight is freed as its layer is quantized). Returns how many."""
    import bitsandbytes as bnb

    skip = {id(model.get_output_embeddings())}
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not torch.nn.Linear or id(child) in skip:
                continue
            w = child.weight.data
            if quantization == "nf4":
                q: torch.nn.Module
                q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                      compute_dtype=compute, quant_type="nf4", compress_statistics=True, device="meta")
                q.weight = bnb.nn.Params4bit(w.to(compute), requires_grad=False, quant_type="nf4", compress_statistics=True)
            else:
                q = bnb.nn.Linear8bitLt(child.in_features, child.out_features, bias=child.bias is not None,
                                        has_fp16_weights=False, threshold=6.0, device="meta")
                q.weight = bnb.nn.Int8Params(w.to(torch.float16), requires_grad=False, has_fp16_weights=False)
            if child.bias is not None:
                q.bias = torch.nn.Parameter(child.bias.data, requires_grad=child.bias.requires_grad)
            setattr(parent, name, q.to(device))
            del child, w
            count += 1
    model.is_loaded_in_4bit = quantization == "nf4"
    model.is_loaded_in_8bit = quantization == "int8"
    return count


def _cast_unquantized(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Floating parameters and buffers that are not quantized storage, in ``dtype``."""
    for mod in model.modules():
        if type(mod).__module__.startswith("bitsandbytes"):
            if getattr(mod, "bias", None) is not None:
                mod.bias.data = mod.bias.data.to(dtype)
            continue
        for p in mod.parameters(recurse=False):
            if p.is_floating_point():
                p.data = p.data.to(dtype)


def build_meta(config: TrialConfig) -> tuple[torch.nn.Module, Resolved]:
    """The model on the meta device (no memory, no weights) with LoRA applied, for the estimate.
    Quantization is not applied here: :func:`param_plan` accounts for it by the same rule
    :func:`quantize_linears` and transformers follow."""
    r = resolve(config)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = from_config(r.hf_config, dtype=weights_dtype(config))
        check_positions(model, config)
        if config.method == "lora":  # adapters on meta too: peft's initialisation then costs nothing
            model, _ = apply_lora(model, config)
    return model, r


# --------------------------------------------------------------------------- LoRA


def apply_lora(model: torch.nn.Module, config: TrialConfig) -> tuple[torch.nn.Module, dict[str, Any]]:
    """peft LoRA on ``target_modules``; each named target must adapt at least one module."""
    import peft

    lc = config.lora
    kwargs: dict[str, Any] = dict(r=lc.rank, lora_alpha=lc.alpha, lora_dropout=lc.dropout, task_type="CAUSAL_LM")
    if lc.target_modules is not None:
        kwargs["target_modules"] = lc.target_modules if isinstance(lc.target_modules, str) else list(lc.target_modules)
    if cast(Any, model.config).model_type == "gpt2":  # a transformers config, not a module
        kwargs["fan_in_fan_out"] = True  # GPT-2 stores its projections as Conv1D (transposed)
    linear_names = sorted({n.rsplit(".", 1)[-1] for n, mod in model.named_modules() if _is_linear(mod)})
    widest = max((max(int(d) for d in cast(Any, mod).weight.shape) for mod in model.modules() if _is_linear(mod)),
                 default=0)
    if widest and lc.rank > widest:  # also keeps a hostile rank (2**63) from reaching torch's allocator
        raise ConfigError(f"trial.lora.rank = {lc.rank} is larger than every linear layer of this model (widest: {widest})",
                          "a LoRA update of rank r has rank at most min(in, out) of its layer; usual ranks are 8 to 256")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = peft.get_peft_model(model, peft.LoraConfig(**kwargs))
    except ValueError as exc:
        raise ConfigError(f"trial.lora.target_modules: {redact_text(str(exc).splitlines()[0])[:300]}",
                          f"this model's linear layers: {', '.join(linear_names)}") from None
    adapted = list(getattr(model, "targeted_module_names", []))
    if isinstance(lc.target_modules, tuple):
        unmatched = [t for t in lc.target_modules if not any(n == t or n.endswith("." + t) for n in adapted)]
        if unmatched:
            raise ConfigError(f"trial.lora.target_modules: {', '.join(unmatched)} match no module of "
                              f"{type(cast(Any, model).get_base_model()).__name__}",
                              f"this model's linear layers: {', '.join(linear_names)} (or \"all-linear\")")
    return model, lora_facts(model, config)


def _is_linear(mod: Any) -> bool:
    return isinstance(mod, torch.nn.Linear) or type(mod).__name__ in ("Conv1D", "Linear4bit", "Linear8bitLt")


def lora_facts(model: Any, config: TrialConfig) -> dict[str, Any]:
    """What peft adapted, read from the model: every adapted module counted by its name."""
    import peft

    lc = config.lora
    adapted = list(getattr(model, "targeted_module_names", []))
    by_name: dict[str, int] = {}
    for n in adapted:
        short = n.rsplit(".", 1)[-1]
        by_name[short] = by_name.get(short, 0) + 1
    adapter_params = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    requested: Any = lc.target_modules if lc.target_modules is not None else "peft default for the architecture"
    held = getattr(model, "peft_config", {}).get("default")  # what peft holds, not the config's values
    if held is None:
        raise RuntimeError("peft holds no 'default' adapter on the model it returned")
    resolved = getattr(held, "target_modules", None)
    return {"rank": int(held.r), "alpha": held.lora_alpha, "dropout": float(held.lora_dropout),
            "target_modules": sorted(resolved) if isinstance(resolved, (set, list, tuple)) else
            (resolved if isinstance(resolved, str) else None) or sorted(by_name),
            "target_modules_requested": list(requested) if isinstance(requested, tuple) else requested,
            "adapted_modules": dict(sorted(by_name.items())), "adapted_module_count": len(adapted),
            "adapter_params": adapter_params, "peft_version": peft.__version__}


# --------------------------------------------------------------------------- read back


def quantization_of(model: Any) -> str | None:
    """``nf4``/``fp4``/``int8`` from the quantized layers the model holds, or None."""
    for mod in _bnb_layers(model):
        if type(mod).__name__ == "Linear4bit":
            return str(getattr(mod.weight, "quant_type", "4bit"))
        return "int8"
    return None


def _bnb_layers(model: Any) -> list[Any]:
    """bitsandbytes' own quantized linear layers (not peft's LoRA wrappers of the same names)."""
    return [mod for mod in model.modules() if type(mod).__module__.startswith("bitsandbytes")
            and type(mod).__name__ in ("Linear4bit", "Linear8bitLt")]


def facts(model: Any, config: TrialConfig, compiled: bool) -> dict[str, Any]:
    """The settings in effect, read from the running model (not copied from the config)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    cfg = base.config
    out: dict[str, Any] = {"model_type": cfg.model_type, "class": type(base).__name__,
                           "attn_implementation": getattr(cfg, "_attn_implementation", None),
                           "vocab_size": int(getattr(cfg.get_text_config(), "vocab_size", 0) or 0)}
    layers = [mod for mod in base.modules() if type(mod).__name__ == "GradientCheckpointingLayer"
              or any(c.__name__ == "GradientCheckpointingLayer" for c in type(mod).__mro__[1:])]
    on = [mod for mod in layers if getattr(mod, "gradient_checkpointing", False)]
    func = getattr(base, "_gradient_checkpointing_func", None) or next(
        (getattr(mod, "_gradient_checkpointing_func", None) for mod in base.modules()
         if getattr(mod, "_gradient_checkpointing_func", None) is not None), None)
    prop = "is_activation_checkpointing" if hasattr(type(base), "is_activation_checkpointing") else "is_gradient_checkpointing"
    gc: dict[str, Any] = {"enabled": bool(getattr(base, prop, False)),
                          "layers_checkpointed": len(on), "layers": len(layers)}
    if func is not None and getattr(func, "keywords", None) is not None:
        gc["use_reentrant"] = bool(func.keywords.get("use_reentrant", True))
    out["gradient_checkpointing"] = gc
    quant: dict[str, Any] = {"method": quantization_of(base) or "none"}
    q_layers = _bnb_layers(base)
    if q_layers:
        first = q_layers[0]
        quant.update(layers=len(q_layers), library="bitsandbytes", library_version=_version("bitsandbytes"))
        if type(first).__name__ == "Linear4bit":
            quant["compute_dtype"] = SHORT.get(getattr(first, "compute_dtype", None), str(getattr(first, "compute_dtype", "")))
            qs = getattr(first.weight, "quant_state", None)
            quant["double_quant"] = bool(getattr(qs, "nested", False))
            quant["blocksize"] = int(getattr(qs, "blocksize", 0) or 0) or None
    out["quantization"] = quant
    out["compiled"] = compiled
    dtypes = sorted({SHORT.get(p.dtype, str(p.dtype).removeprefix("torch.")) for p in model.parameters() if p.is_floating_point()})
    out["weights_dtypes"] = dtypes
    return out


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


# --------------------------------------------------------------------------- the weights term


@dataclass(frozen=True)
class Param:
    name: str
    numel: int
    bytes_per: float
    """Bytes per parameter as stored (0.5 + statistics for nf4, 1 + scales for int8)."""
    storage: str
    """fp32 | bf16 | fp16 | nf4 | int8"""
    trainable: bool
    kind: str
    """embedding | output | linear | lora | other"""

    @property
    def nbytes(self) -> int:
        return int(self.numel * self.bytes_per)


NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)
"""nf4 with double quantization (QLoRA): 4 bits a weight, an 8-bit absmax per 64, an fp32 absmax per 256 of those."""
INT8_BYTES = 1.0


def param_plan(model: Any, quantization: str, weight_bytes: int) -> list[Param]:
    """Every parameter of ``model`` (a meta model: shapes only) as it will be stored, in build
    order. Linear layers of a quantized model store ``quantization`` (all but the output
    embedding, the rule of :func:`quantize_linears` and of transformers' bitsandbytes loader)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    out_emb = base.get_output_embeddings()
    in_emb = base.get_input_embeddings()
    quant_ids: set[int] = set()
    if quantization != "none":
        for mod in base.modules():
            if type(mod) is torch.nn.Linear and mod is not out_emb:
                quant_ids.add(id(mod.weight))
    seen: set[int] = set()
    plan: list[Param] = []
    out_w = getattr(out_emb, "weight", None)
    in_w = getattr(in_emb, "weight", None)
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if "lora_" in name:
            plan.append(Param(name, p.numel(), p.element_size(), SHORT.get(p.dtype, "fp32"), p.requires_grad, "lora"))
            continue
        kind = "embedding" if p is in_w else "output" if p is out_w else "linear" if p.ndim == 2 else "other"
        if id(p) in quant_ids:
            per = NF4_BYTES if quantization == "nf4" else INT8_BYTES + 4 / max(1, p.shape[1])
            plan.append(Param(name, p.numel(), per, quantization, False, kind))
        else:
            plan.append(Param(name, p.numel(), weight_bytes, {4: "fp32", 2: "bf16"}.get(weight_bytes, "bf16"),
                              p.requires_grad, kind))
    return plan

"""The model's config, resolved before anything is built: where it comes from (a hand-written
shape, a real ``config.json``, a pretrained folder, a hub snapshot), what transformers makes of
it, and the checks every source passes (a causal LM, sizes a build and the estimate can use).
Configs are input: whatever transformers refuses in one is a one-line error (exit 2).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from capture import _json
from capture._escape import printable
from capture._safe_read import CONFIG_MAX_BYTES, read_regular
from capture.errors import ConfigError
from capture.redact import redact_text
from capture.trial.config import TrialConfig


@dataclass(frozen=True)
class Resolved:
    """Where the model's config, weights and tokenizer come from."""

    hf_config: Any
    info: dict[str, Any]
    weights_dir: Path | None
    tokenizer_dir: Path | None


def _tokenizer_files(folder: Path) -> bool:
    return any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json"))


def _known_config_keys(hf_config: Any) -> set[str]:
    import inspect

    from transformers import PretrainedConfig

    keys: set[str] = set()
    for cls in type(hf_config).__mro__:
        if isinstance(cls, type) and issubclass(cls, PretrainedConfig):
            keys |= set(inspect.signature(cls.__init__).parameters) - {"self", "kwargs"}  # type: ignore[misc]
    keys |= set(vars(type(hf_config)()))
    return keys


def _from_hand(config: TrialConfig, base: Any | None) -> Any:
    """The transformers config of ``architecture`` + ``[trial.model.config]``, or ``base`` (a
    config file's) with ``[trial.model.config]`` on top. A key transformers does not know is an
    error; a key it consumes (``rope_theta`` becomes ``rope_parameters``) is accepted."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    m = config.model
    values = dict(m.config)
    if base is None:
        arch = m.architecture or ""
        if arch not in CONFIG_MAPPING_NAMES:
            from capture.trial.config_read import did_you_mean

            raise ConfigError(f"trial.model.architecture: {arch!r} is not a model type transformers "
                              f"{transformers_version()} knows{did_you_mean(arch, sorted(CONFIG_MAPPING_NAMES))}",
                              "name a model_type (llama, qwen2, mistral, gemma2, phi3, gpt2, ...), or use config_file "
                              "with the model's own config.json (a local folder with weights: source = \"local\")")
        try:
            hf = AutoConfig.for_model(arch, **values)
        except Exception as exc:  # the values are the user's: whatever transformers refuses is theirs to fix
            raise ConfigError(f"trial.model.config: {first_line(exc)}",
                              "use the keyword names and value types of the transformers config class") from None
    else:
        hf = base
        try:
            for k, v in values.items():
                setattr(hf, k, v)
        except Exception as exc:
            raise ConfigError(f"trial.model.config: {first_line(exc)}",
                              "use the keyword names of the transformers config class") from None
    known = _known_config_keys(hf)
    for key in values:
        if key not in known and not _consumed(type(hf), key, values[key]):
            raise ConfigError(f"trial.model.config.{key}: not a field of {type(hf).__name__}",
                              "use the keyword names of the transformers config class")
    return hf


def _consumed(cls: Any, key: str, value: Any) -> bool:
    """transformers standardises some keys into others (``rope_theta`` → ``rope_parameters``)."""
    try:
        return not hasattr(cls(**{key: value}), key)
    except Exception:
        return False


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def resolve(config: TrialConfig) -> Resolved:
    """The model's transformers config and where its weights and tokenizer are (no weights read)."""
    from transformers import AutoConfig

    from capture.trial.build.data import resolve_snapshot

    m = config.model
    info: dict[str, Any] = {"source": m.source}
    weights: Path | None = None
    tokenizer: Path | None = None
    if m.source == "from_config" and m.config_file is not None:
        path = config.resolve_path(m.config_file)
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            what = ("is not a regular file" if file.exists() else
                    "is a link that leads nowhere" if file.is_symlink() else "does not exist")
            raise ConfigError(f"trial.model.config_file: {printable(file)[:300]} {what}",
                              "name a model's config.json (or its folder)")
        try:
            raw = read_regular(file, CONFIG_MAX_BYTES, ConfigError, "model config file")
            data = _json.loads(raw)
            hf = _config_from_dict(data, file)
        except ConfigError:
            raise
        except Exception as exc:  # a hostile or broken file: whatever transformers refuses in it
            raise ConfigError(f"trial.model.config_file: {file.name}: {first_line(exc)}",
                              "a config.json written by transformers (save_pretrained) or taken from a model repository") from None
        if "quantization_config" in data:
            raise ConfigError(f"trial.model.config_file: {file.name} carries a quantization_config, which needs the "
                              "quantized weights", 'use trial.model.quantization with the unquantized config, or source = "local"')
        hf = _from_hand(config, hf) if m.config else hf
        info.update(config_file=str(file), config_file_sha256=hashlib.sha256(raw).hexdigest())  # the bytes read
        tokenizer = file.parent if _tokenizer_files(file.parent) else None
        info["weights"] = "none (random init from the config file, seeded)"
    elif m.source == "from_config":
        hf = _from_hand(config, None)
        info["weights"] = "none (random init from config, seeded)"
    else:
        if m.source == "hub":
            weights = resolve_snapshot(m.repo_id or "", m.revision, "model", "trial.model.repo_id")
            info.update(repo_id=m.repo_id, revision=m.revision or "main", commit=weights.name)
        else:
            weights = config.resolve_path(m.path or "")
            if not (weights / "config.json").is_file():
                raise ConfigError(f"trial.model.path: {weights} has no config.json", "name a folder written by save_pretrained")
            info["path"] = str(weights)
        try:
            hf = AutoConfig.from_pretrained(str(weights), local_files_only=True)
        except Exception as exc:  # the folder's config.json is input like any other
            key = "trial.model.path" if m.source == "local" else "trial.model.repo_id"
            raise ConfigError(f"{key}: cannot read the model's config ({first_line(exc)})",
                              "the folder needs a config.json written by transformers") from None
        tokenizer = weights if _tokenizer_files(weights) else None
        info["weights"] = "pretrained"
    _check_causal_lm(hf)
    _check_shape(hf)
    info["architecture"] = hf.model_type  # the name trial.model.architecture takes, whatever the source
    return Resolved(hf, info, weights, tokenizer)


def _config_from_dict(data: Any, file: Path) -> Any:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise ConfigError(f"trial.model.config_file: {file.name} names no model_type", "a transformers config.json has one")
    if data["model_type"] not in CONFIG_MAPPING:
        raise ConfigError(f"trial.model.config_file: {file.name}: model_type {data['model_type']!r} is unknown to "
                          f"transformers {transformers_version()}", "upgrade transformers, or check the file")
    return CONFIG_MAPPING[data["model_type"]].from_dict(data)


def _check_causal_lm(hf: Any) -> None:
    from transformers import AutoModelForCausalLM

    if type(hf) not in AutoModelForCausalLM._model_mapping:
        raise ConfigError(f"trial.model: {hf.model_type} has no causal-LM class in transformers {transformers_version()}",
                          "the trial fine-tunes causal language models (AutoModelForCausalLM)")


MAX_LAYERS = 1024
"""More decoder layers than any model people fine-tune (Llama-3.1-405B has 126): a larger
figure is a typo or a hostile config, and building it, even on the meta device, would take hours."""
_SHAPE_KEYS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
               "vocab_size", "head_dim")


def _check_shape(hf: Any) -> None:
    """The sizes every estimate and build reads: whole numbers of at least 1, a bounded layer count."""
    text = hf.get_text_config()
    for key in _SHAPE_KEYS:
        value = getattr(text, key, None)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"trial.model: {key} = {value!r} is not a whole number of at least 1",
                              "check [trial.model.config] or the config file")
    heads, kv = getattr(text, "num_attention_heads", None), getattr(text, "num_key_value_heads", None)
    if isinstance(heads, int) and isinstance(kv, int) and heads % kv:
        raise ConfigError(f"trial.model: num_attention_heads = {heads} is not a multiple of num_key_value_heads = {kv}",
                          "grouped-query attention shares each key/value head among a whole number of query heads")
    layers = getattr(text, "num_hidden_layers", None)
    if layers is not None and layers > MAX_LAYERS:
        raise ConfigError(f"trial.model: num_hidden_layers = {layers} is more than {MAX_LAYERS}",
                          "check [trial.model.config] or the config file (Llama-3.1-405B has 126 layers)")


def first_line(exc: BaseException) -> str:
    """The exception's message on one line: its first line, with the next one where the first only
    introduces it (transformers' validators: "Class validation error for validator 'x':")."""
    lines = [x.strip() for x in str(exc).splitlines() if x.strip()]
    if not lines:
        return type(exc).__name__
    text = f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]
    return redact_text(text)[:300]

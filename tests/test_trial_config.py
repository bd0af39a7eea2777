"""Trial config: one broken config per error case, each error naming the key to fix."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import pytest

from capture.errors import ConfigError, EXIT_USAGE
from capture.trial.config import example_names, load_config, load_example, parse

BASE = """
[trial]
name = "t"
[trial.model]
source = "from_config"
architecture = "gpt2"
[trial.model.config]
n_layer = 1
"""


def _cfg(text: str):
    return parse(text, "t.toml", Path("."), "t")


def test_minimal_config_gets_documented_defaults():
    c = _cfg(BASE)
    assert c.name == "t" and c.method == "full" and c.optimizer.name == "adamw"
    assert c.batch.max_seq_len == 128 and c.batch.micro_batch_size == 8 and c.batch.grad_accum == 1
    assert c.recovery.save_at_step == 2 and c.recovery.total_steps == 4 and c.recovery.withhold == ()
    assert c.recovery.deterministic is None  # "auto"
    assert c.checkpoint.format == "torch.save" and c.checkpoint.copy_to is None
    assert c.source_text == BASE
    assert c.tokens_per_step == 128 * 8


def test_shipped_examples_load_and_say_what_they_run():
    assert {"tiny", "llama-1b"} <= set(example_names())
    tiny = load_example("tiny")
    assert tiny.model.config["n_layer"] == 2 and tiny.model.config["resid_pdrop"] > 0  # dropout: RNG matters
    assert tiny.data.source == "corpus" and tiny.data.tokenizer == "bytes"
    big = load_example("llama-1b")
    mc = big.model.config
    assert (mc["hidden_size"], mc["intermediate_size"], mc["num_hidden_layers"], mc["num_attention_heads"],
            mc["num_key_value_heads"], mc["vocab_size"]) == (2048, 5632, 16, 16, 4, 32000)
    assert big.batch.max_seq_len == 2048 and big.batch.micro_batch_size == 8
    assert big.precision.dtype == "bf16" and big.precision.autocast and big.optimizer.fused == "auto"
    assert big.source_text.startswith("[trial]") and "A Llama-style model" not in big.source_text  # comments go


def test_unknown_example_suggests_the_near_name():
    with pytest.raises(ConfigError, match=r"--example: no example named 'tiney' \(did you mean tiny\?\)"):
        load_example("tiney")


BROKEN = [
    # (what to append / replace, expected message fragment naming the key)
    ("[trial.optimizer]\nlr = -1\n", r"trial\.optimizer\.lr: must be > 0, got -1"),
    ("[trial.optimizer]\nlearning_rate = 1e-3\n", r"trial\.optimizer\.learning_rate: unknown key \(did you mean lr\?\)"),
    ("[trial.optimizer]\nname = \"adamx\"\n", r"trial\.optimizer\.name: must be one of adamw, adam, sgd, adamw_8bit, paged_adamw_8bit, adafactor, got 'adamx' \(did you mean 'adamw?'\?\)"),
    ("[trial.optimizer]\nbetas = [0.9]\n", r"trial\.optimizer\.betas: must be two numbers"),
    ("[trial.optimizer]\nmomentum = 0.9\n", r"trial\.optimizer\.momentum: only used with name = \"sgd\""),
    ("[trial.optimizer]\nfused = \"yes\"\n", r"trial\.optimizer\.fused"),
    ("[trial.optimizer]\nweight_decay = -0.1\n", r"trial\.optimizer\.weight_decay: must be >= 0"),
    # TOML writes inf and nan; a learning rate of inf passed "> 0" and trained to a NaN loss
    ("[trial.optimizer]\nlr = inf\n", r"trial\.optimizer\.lr: must be a finite number, got inf"),
    ("[trial.optimizer]\nweight_decay = nan\n", r"trial\.optimizer\.weight_decay: must be a finite number, got nan"),
    ("[trial.optimizer]\neps = +inf\n", r"trial\.optimizer\.eps: must be a finite number, got inf"),
    ("[trial.lora]\nalpha = inf\n", r"trial\.lora\.alpha: must be a finite number, got inf"),
    ("[trial.lora]\ndropout = nan\n", r"trial\.lora\.dropout: must be a finite number, got nan"),
    ("[trial.data]\nvalidation_fraction = -inf\n", r"trial\.data\.validation_fraction: must be a finite number, got -inf"),
    ("[trial.batch]\nmicro_batch_size = 0\n", r"trial\.batch\.micro_batch_size: must be >= 1, got 0"),
    ("[trial.batch]\nmicro_batch_size = \"8\"\n", r"trial\.batch\.micro_batch_size: must be an integer, got a string"),
    ("[trial.batch]\nmax_seq_len = 1.5\n", r"trial\.batch\.max_seq_len: must be an integer, got a number"),
    ("[trial.batch]\ngrad_acum = 2\n", r"trial\.batch\.grad_acum: unknown key \(did you mean grad_accum\?\)"),
    ("[trial.precision]\ndtype = \"bf32\"\n", r"trial\.precision\.dtype: must be one of fp32, bf16, fp16"),
    ("[trial.precision]\ndtype = \"fp16\"\nautocast = false\n", r"trial\.precision\.autocast: fp16 weights"),
    ("[trial.lora]\nrank = 0\n", r"trial\.lora\.rank: must be >= 1, got 0"),
    ("[trial.lora]\ndropout = 1.0\n", r"trial\.lora\.dropout: must be in \[0, 1\), got 1"),
    ("[trial.lora]\ntarget_modules = \"q_proj\"\n", r"trial\.lora\.target_modules: must be an array"),
    ("[trial.data]\nsource = \"local\"\n", r"trial\.data\.path: required when source = \"local\""),
    ("[trial.data]\nsource = \"hub\"\n", r"trial\.data\.repo_id: required when source = \"hub\""),
    ("[trial.data]\npath = \"x\"\n", r"trial\.data\.path: only used when source = \"local\""),
    ("[trial.data]\nvalidation_fraction = 1\n", r"trial\.data\.validation_fraction: must be in \[0, 1\)"),
    ("[trial.data]\ntokenizer = \"model\"\n", r"trial\.data\.tokenizer: \"model\" needs a model with a tokenizer"),
    ("[trial.validation]\nevery_steps = 0\n", r"trial\.validation\.every_steps: must be >= 1, got 0"),
    ("[trial.checkpoint]\nenabled = \"yes\"\n", r"trial\.checkpoint\.enabled: must be a boolean, got a string"),
    ("[trial.recovery]\nsave_at_step = 4\ntotal_steps = 4\n", r"trial\.recovery\.total_steps: must be > save_at_step \(4\), got 4"),
    ("[trial.checkpoint]\nformat = \"safetensor\"\n", r"trial\.checkpoint\.format: must be one of torch\.save, safetensors, dcp, dcp-async, got 'safetensor' \(did you mean 'safetensors'\?\)"),
    ("[trial.checkpoint]\ncopy_to = \"\"\n", r"trial\.checkpoint\.copy_to: must name a folder"),
    ("[trial.recovery]\ndeterministic = \"yes\"\n", r"trial\.recovery\.deterministic: must be \"auto\", true or false, got 'yes'"),
    ("[trial.recovery]\ndeterministic = 1\n", r"trial\.recovery\.deterministic: must be a boolean or a string, got an integer"),
    ("[trial.recovery]\nwithhold = [\"rng_cud\"]\n", r"trial\.recovery\.withhold: unknown component 'rng_cud' \(did you mean 'rng_cuda'\?\)"),
    ("[trial.scheduler]\nname = \"cosin\"\n", r"trial\.scheduler\.name: must be one of constant, linear, cosine, got 'cosin' \(did you mean 'cosine'\?\)"),
    ("[trial.scheduler]\nwarmup_steps = -1\n", r"trial\.scheduler\.warmup_steps: must be >= 0, got -1"),
    ("[trial.modle]\nsource = \"hub\"\n", r"trial\.modle: unknown key \(did you mean model\?\)"),
    ("[trail]\nseed = 1\n", r"trail: unknown top-level key \(did you mean trial\?\)"),
]


@pytest.mark.parametrize("extra, message", BROKEN, ids=[m.split(":")[0].replace("\\", "") for _, m in BROKEN])
def test_broken_config_names_the_key(extra, message):
    with pytest.raises(ConfigError, match=message) as info:
        _cfg(BASE + extra)
    assert info.value.exit_code == EXIT_USAGE
    assert info.value.hint and "t.toml" in info.value.hint


@pytest.mark.parametrize("text, message", [
    ("[trial]\nseed = -1\n", r"trial\.seed: must be >= 0, got -1"),
    ("[trial]\nmethod = \"qlora\"\n", r"trial\.method: must be one of full, lora, got 'qlora'"),
    ("[trial]\nmeasured_steps = 0\n", r"trial\.measured_steps: must be >= 1, got 0"),
    ("[trial]\nwarmup_steps = -2\n", r"trial\.warmup_steps: must be >= 0, got -2"),
    ("[trial.model]\nsource = \"hub\"\n", r"trial\.model\.repo_id: required when source = \"hub\""),
    ("[trial.model]\nsource = \"local\"\n", r"trial\.model\.path: required when source = \"local\""),
    ("[trial.model]\nsource = \"from_config\"\n", r"trial\.model\.architecture: required when source = \"from_config\""),
    ("[trial.model]\narchitecture = \"llama\"\nconfig_file = \"config.json\"\n", r"trial\.model\.architecture: give config_file or architecture, not both"),
    ("[trial.model]\nsource = \"hub\"\nrepo_id = \"gpt2\"\npath = \"x\"\n", r"trial\.model\.path: only used when source = \"local\""),
    ("[trial.model]\nsource = \"hub\"\nrepo_id = \"gpt2\"\n[trial.model.config]\nn_layer = 1\n", r"trial\.model\.config: only used when source = \"from_config\""),
    ("[trial]\nmodel = 3\n", r"trial\.model: must be a table, got an integer"),
    ("name = \"x\"\n", r"name: unknown top-level key; every key lives under \[trial\]"),
    ("[trial\n", r"t\.toml: not valid TOML"),
    ("", r"t\.toml: no \[trial\] table"),
    ('[trial]\nname = """\n[signature]\n"""\n', r"t\.toml: a line reads \[signature\]"),
])
def test_broken_top_level_and_model(text, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(text)


def test_file_errors_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="is a folder"):
        load_config(tmp_path)
    bad = tmp_path / "latin1.toml"
    bad.write_bytes(b"[trial]\nname = \"caf\xe9\"\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(bad)


def test_load_config_records_the_text_without_comments_and_resolves_paths(tmp_path):
    text = BASE + "# a comment the manifest must not keep\n[trial.data]\nsource = \"local\"\npath = \"data\"\n"
    f = tmp_path / "mine.toml"
    f.write_text(text)
    c = load_config(f)
    assert c.source_text == text.replace("# a comment the manifest must not keep\n", "")
    assert c.source_sha256 == hashlib.sha256(text.encode()).hexdigest()
    assert c.source == str(f) and c.name == "t"
    assert c.resolve_path("data") == tmp_path / "data"


def test_overrides_are_checked_like_the_file():
    c = _cfg(BASE)
    o = c.with_overrides(method="lora", measured_steps=3, warmup_steps=0, micro_batch_size=2, device="cpu")
    assert (o.method, o.measured_steps, o.warmup_steps, o.batch.micro_batch_size, o.device) == ("lora", 3, 0, 2, "cpu")
    assert c.method == "full"  # frozen: the original is untouched
    with pytest.raises(ConfigError, match=r"--steps: must be >= 1, got 0"):
        c.with_overrides(measured_steps=0)
    with pytest.raises(ConfigError, match=r"--micro-batch: must be >= 1"):
        c.with_overrides(micro_batch_size=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.seed = 3  # type: ignore[misc]


def test_recovery_determinism_and_checkpoint_format_keys():
    c = _cfg(BASE + '[trial.recovery]\ndeterministic = false\n[trial.checkpoint]\nformat = "dcp-async"\ncopy_to = "out"\n')
    assert c.recovery.deterministic is False
    assert (c.checkpoint.format, c.checkpoint.copy_to) == ("dcp-async", "out")
    assert _cfg(BASE + '[trial.recovery]\ndeterministic = "auto"\n').recovery.deterministic is None
    assert c.with_overrides(recovery_deterministic=True).recovery.deterministic is True


def test_hostile_config_files_are_refused_with_one_line(tmp_path):
    # a FIFO would block, /dev/zero would fill memory, deep nesting would overflow the parser's stack
    import os

    from capture.errors import ConfigError
    from capture.trial.config import load_config

    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    zero = tmp_path / "zero.toml"
    zero.symlink_to("/dev/zero")
    deep = tmp_path / "deep.toml"
    deep.write_text("[trial]\nx = " + "[" * 3000 + "]" * 3000 + "\n")
    digits = tmp_path / "digits.toml"
    digits.write_text("[trial]\nseed = " + "9" * 5000 + "\n")
    for path, match in ((fifo, "not a regular file"), (zero, "not a regular file"), (deep, "nested too deeply"),
                        (digits, "an integer of more than 4,300 digits")):
        with pytest.raises(ConfigError, match=match):
            load_config(path)


@pytest.mark.parametrize("text, reason", [
    ('{"vocab_size": ' + "9" * 5000 + "}", "an integer of more than 4,300 digits"),
    ("[" * 100_000 + "]" * 100_000, "arrays or objects nested too deeply to read"),
    ('{"model_type": "llama",', "Expecting property name enclosed in double quotes at line 1, column 24"),
])
def test_a_hostile_model_config_file_is_one_config_error(tmp_path, text, reason):
    (tmp_path / "config.json").write_text(text)
    (tmp_path / "c.toml").write_text('[trial]\nname = "c"\n[trial.model]\nsource = "from_config"\nconfig_file = "config.json"\n')
    with pytest.raises(ConfigError) as info:
        from capture.trial.build.model_config import resolve

        resolve(load_config(tmp_path / "c.toml"))
    assert info.value.message == f"trial.model.config_file: config.json: {reason}"


def test_a_model_config_file_that_is_not_a_file_says_what_it_is(tmp_path):
    import os

    from capture.trial.build.model_config import resolve

    os.mkfifo(tmp_path / "fifo.json")  # read, it would block the trial forever
    (tmp_path / "loop1").symlink_to("loop2")
    (tmp_path / "loop2").symlink_to("loop1")
    (tmp_path / "dangling").symlink_to("gone.json")
    for name, what in (("fifo.json", "is not a regular file"), ("loop1", "is a link that leads nowhere"),
                       ("dangling", "is a link that leads nowhere"), ("missing.json", "does not exist")):
        (tmp_path / "c.toml").write_text(f'[trial]\nname = "c"\n[trial.model]\nsource = "from_config"\nconfig_file = "{name}"\n')
        with pytest.raises(ConfigError) as info:
            resolve(load_config(tmp_path / "c.toml"))
        assert info.value.message == f"trial.model.config_file: {tmp_path / name} {what}"


@pytest.mark.parametrize("text, match", [
    ('{"text": "a"}\n{"text": ', r"is not valid JSON \(line 2: Expecting value at line 1, column 10\)$"),
    ('{"text": "a", "n": ' + "9" * 5000 + "}\n",  # int()'s 4,300-digit limit
     r"is not valid JSON \(line 1: an integer of more than 4,300 digits\)$"),
    ("[" * 100_000 + "]" * 100_000 + "\n", r"is not valid JSON \(line 1: arrays or objects nested too deeply to read\)$"),
])
def test_a_hostile_data_file_is_one_config_error(text, match):
    """What the user's data files may hold, read where every .jsonl/.json record is parsed."""
    from capture.errors import ConfigError
    from capture.trial.build.data import _rows

    with pytest.raises(ConfigError, match=match):
        _rows(Path("train.jsonl"), text, ".jsonl")


BOUNDS = {  # (table, key, largest accepted): docs/trial.md's config reference
    ("trial", "seed", 2**32 - 1), ("trial", "warmup_steps", 1_000_000), ("trial", "measured_steps", 1_000_000),
    ("trial.batch", "max_seq_len", 2**24), ("trial.batch", "micro_batch_size", 65_536),
    ("trial.batch", "grad_accum", 65_536), ("trial.validation", "every_steps", 2**31 - 1),
    ("trial.validation", "batches", 1_000_000), ("trial.checkpoint", "every_steps", 2**31 - 1),
    ("trial.scheduler", "warmup_steps", 2**31 - 1), ("trial.data", "synthetic_sequences", 2**24),
    ("trial.lora", "rank", 65_536), ("trial.recovery", "total_steps", 1_000_000),
}


@pytest.mark.parametrize("table, key, largest", sorted(BOUNDS))
def test_integer_settings_have_an_upper_bound_named_in_one_line(table, key, largest):
    """A typo or a hostile file (2**64 as the seed ended in torch's "Overflow when unpacking long
    long"; 2**63 validation batches ran for ever) is one config error; the bound itself is accepted."""
    from capture.errors import ConfigError

    def text(value: int) -> str:
        body = BASE.replace("[trial]\n", f"[trial]\n{key} = {value}\n", 1) if table == "trial" else BASE + f"[{table}]\n{key} = {value}\n"
        return body + ('[trial.data]\nsource = "synthetic"\n' if table != "trial.data" else "source = \"synthetic\"\n")

    _cfg(text(largest))
    for value in (largest + 1, 2**64, 10**40):
        with pytest.raises(ConfigError, match=f"^{table}.{key}: must be <= {largest:,}, got "):
            _cfg(text(value))


@pytest.mark.parametrize("flag, key", [("--steps", "measured_steps"), ("--warmup", "warmup_steps"),
                                       ("--micro-batch", "micro_batch_size")])
def test_command_line_overrides_have_the_same_bounds(flag, key):
    from capture.errors import ConfigError

    c = _cfg(BASE)
    c.with_overrides(**{key: 65_536})
    with pytest.raises(ConfigError, match=f"^{flag}: must be <= ") as info:
        c.with_overrides(**{key: 2**63})
    assert info.value.hint

"""The workload, for real on the CPU: transformers models, peft LoRA, the packed resumable loader,
a real hub-cache layout on disk and real local files."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from tiny_configs import gpt2_model

from capture.errors import ConfigError
from capture.trial.config import parse
from capture.trial.workload import BYTE_EOT, build_workload, corpus_text
from tiny_tokenizer import save_tiny_tokenizer

CPU = torch.device("cpu")

SMALL_GPT2 = """
[trial]
name = "small"
seed = 7
warmup_steps = 0
measured_steps = 2
""" + gpt2_model(dropout=0.1) + """[trial.batch]
max_seq_len = 32
micro_batch_size = 3
grad_accum = 2
[trial.lora]
rank = 4
alpha = 8
target_modules = ["c_attn"]
"""


def cfg(text: str = SMALL_GPT2, base: Path = Path("."), **over):
    c = parse(text, "small.toml", base, "small")
    return c.with_overrides(**over) if over else c


def test_two_builds_from_one_seed_are_identical_and_train_the_same():
    a = build_workload(cfg(), CPU)
    start = {n: p.detach().clone() for n, p in a.model.named_parameters()}
    la = [a.train_step() for _ in range(3)]
    b = build_workload(cfg(), CPU)  # reseeds the process's generators, as a fresh process would start
    assert all(torch.equal(start[n], p) for n, p in b.model.named_parameters())
    lb = [b.train_step() for _ in range(3)]
    assert la == lb  # dropout masks too: the global torch RNG was seeded before the build
    assert la[0] == pytest.approx(5.55, abs=0.1)  # ~ln(257): an untrained byte model
    c = build_workload(cfg(SMALL_GPT2.replace("seed = 7", "seed = 8")), CPU)
    assert c.train_step() != la[0]


def test_train_step_pulls_grad_accum_micro_batches_and_counts_tokens():
    w = build_workload(cfg(), CPU)
    assert w.tokens_per_step == 32 * 3 * 2
    w.train_step()
    assert w.loader.state_dict()["index"] == 6  # 2 micro-batches of 3 sequences
    assert w.params_total == w.params_trainable == sum(p.numel() for p in w.model.parameters())
    info = w.info
    assert info["model"]["model_type"] == "gpt2" and info["optimizer"]["class"] == "torch.optim.AdamW"
    assert info["optimizer"]["fused"] is False  # fused only by default on CUDA
    assert info["data"]["tokenizer"].startswith("bytes") and info["data"]["train_sequences"] > 0
    assert info["precision"]["weights_dtype"] == "fp32"


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")  # no training step here
def test_the_scheduler_row_is_the_schedule_that_runs():
    """A warm-up of 5 steps in a 2-step trial: the schedule runs to one step past its warm-up (6),
    and the row says 6, as the learning rates the scheduler hands out show."""
    w = build_workload(cfg(SMALL_GPT2 + '[trial.scheduler]\nname = "linear"\nwarmup_steps = 5\n'), CPU)
    assert w.info["scheduler"] == {"name": "linear", "warmup_steps": 5, "horizon_steps": 6}
    peak = w.optimizer.defaults["lr"]
    lrs = []
    for _ in range(7):
        lrs.append(w.optimizer.param_groups[0]["lr"] / peak)
        w.scheduler.step()
    assert lrs[:6] == pytest.approx([1 / 6, 2 / 6, 3 / 6, 4 / 6, 5 / 6, 1.0]) and lrs[6] == 0.0


def test_packed_batches_are_full_length_real_text():
    w = build_workload(cfg(), CPU)
    batch = next(w.loader)
    assert batch.shape == (3, 32) and batch.input_ids.dtype == torch.long
    assert batch.tokens == 96 and batch.pad_tokens == 0 and batch.attention_mask is None
    assert torch.equal(batch.labels, batch.input_ids)  # packed text: every token carries the loss
    text = bytes(int(t) for t in batch.input_ids[0] if t != BYTE_EOT).decode("utf-8")
    assert text.replace("\n", " ").strip() and text in corpus_text().replace("\n\n", "\n")
    d = w.info["data"]
    assert d["tokens_total"] == d["train_tokens"] + d["val_sequences"] * 32 + d["dropped_tail_tokens"]


def test_loader_resumes_in_a_new_loader_across_epochs():
    w = build_workload(cfg(micro_batch_size=5), CPU)
    n = len(w.loader.source)
    steps_per_epoch = n // 5 + 1
    for _ in range(steps_per_epoch - 1):
        next(w.loader)
    state = w.loader.state_dict()
    expected = [next(w.loader) for _ in range(3)]  # crosses into the next epoch
    fresh = build_workload(cfg(micro_batch_size=5), CPU)
    fresh.loader.load_state_dict(json.loads(json.dumps(state)))  # survives a trip through JSON
    got = [next(fresh.loader) for _ in range(3)]
    assert all(torch.equal(x.input_ids, y.input_ids) for x, y in zip(expected, got))
    assert fresh.loader.epoch >= 1


def test_evaluate_is_repeatable_and_leaves_training_mode():
    w = build_workload(cfg(), CPU)
    assert w.evaluate(2) == w.evaluate(2)
    assert w.model.training


def test_lora_trainable_is_measured_and_only_adapters_move():
    w = build_workload(cfg(method="lora"), CPU)
    assert w.params_trainable < w.params_total
    lora = {n: p.detach().clone() for n, p in w.model.named_parameters() if p.requires_grad}
    assert lora and all("lora_" in n for n in lora)
    assert w.params_trainable == sum(p.numel() for p in lora.values())
    assert w.info["lora"]["target_modules"] == ["c_attn"] and w.info["lora"]["rank"] == 4
    base = {n: p.detach().clone() for n, p in w.model.named_parameters() if not p.requires_grad}
    for _ in range(2):
        w.train_step()
    after = dict(w.model.named_parameters())
    assert all(torch.equal(after[n], p) for n, p in base.items())
    assert any(not torch.equal(after[n], p) for n, p in lora.items())


def test_lora_bad_target_names_the_key():
    with pytest.raises(ConfigError, match=r"trial\.lora\.target_modules"):
        build_workload(cfg(SMALL_GPT2.replace('["c_attn"]', '["q_proj"]'), method="lora"), CPU)


def test_byte_tokenizer_needs_a_large_enough_vocabulary():
    with pytest.raises(ConfigError, match=r"trial\.data\.tokenizer: byte-level ids need a vocabulary of at least 257, the model has 100"):
        build_workload(cfg(SMALL_GPT2.replace("vocab_size = 257", "vocab_size = 100")), CPU)


def test_unknown_model_config_field_is_named():
    with pytest.raises(ConfigError, match=r"trial\.model\.config\.n_layers: not a field of GPT2Config"):
        build_workload(cfg(SMALL_GPT2.replace("n_layer = 1", "n_layer = 1\nn_layers = 2")), CPU)


def test_a_sequence_longer_than_the_position_table_is_a_config_error(tmp_path, capsys):
    """GPT-2 learns 32 positions here: 64 tokens would index past the table in the first forward
    (an IndexError from torch.embedding); the build and the estimate refuse it first."""
    text = SMALL_GPT2.replace("max_seq_len = 32", "max_seq_len = 64")
    with pytest.raises(ConfigError, match=r"max_seq_len: 64 is longer than the 32 positions .*transformer\.wpe"):
        build_workload(cfg(text), CPU)
    from capture._cli import main

    (tmp_path / "long.toml").write_text(text)
    assert main(["estimate", str(tmp_path / "long.toml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: trial.batch.max_seq_len: 64") and "\nhint: set max_seq_len <= 32" in err


def test_synthetic_llama_with_sgd_and_bf16_autocast():
    text = """
[trial]
seed = 3
[trial.model]
source = "from_config"
architecture = "llama"
[trial.model.config]
hidden_size = 32
intermediate_size = 64
num_hidden_layers = 1
num_attention_heads = 4
num_key_value_heads = 2
vocab_size = 500
[trial.optimizer]
name = "sgd"
lr = 0.1
momentum = 0.9
[trial.precision]
dtype = "bf16"
autocast = true
[trial.batch]
max_seq_len = 16
micro_batch_size = 2
[trial.data]
source = "synthetic"
synthetic_sequences = 10
validation_fraction = 0.2
"""
    w = build_workload(cfg(text), CPU)
    assert w.info["data"]["train_sequences"] == 8 and w.info["data"]["val_sequences"] == 2
    batch = next(w.loader)
    assert int(batch.input_ids.max()) < 500
    assert torch.equal(batch.input_ids, next(build_workload(cfg(text), CPU).loader).input_ids)
    assert isinstance(w.optimizer, torch.optim.SGD) and w.scaler is None
    assert w.train_step() > 0 and w.evaluate(1) > 0


# --------------------------------------------------------------------------- hub cache and local files


def _save_tiny_model(folder: Path, with_tokenizer: bool = False) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=300, n_positions=32, n_embd=16, n_layer=1, n_head=2)).save_pretrained(folder)
    if with_tokenizer:
        save_tiny_tokenizer(folder, [corpus_text()])


def _as_hub_cache(cache: Path, kind: str, repo_id: str, files_from: Path, commit: str) -> None:
    """The layout huggingface_hub writes: blobs by hash, snapshot symlinks, a ref for main."""
    repo = cache / f"{kind}s--{repo_id.replace('/', '--')}"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in sorted(files_from.iterdir()):
        data = f.read_bytes()
        blob = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        (snap / f.name).symlink_to(Path("../../blobs") / blob)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


def test_model_and_dataset_from_a_real_hub_cache_layout(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    src = tmp_path / "src"
    _save_tiny_model(src, with_tokenizer=True)  # a pretrained model is fed its own tokenizer's ids
    commit = "a" * 40
    _as_hub_cache(cache, "model", "someorg/tiny-gpt2", src, commit)
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("\n".join(json.dumps({"body": p}) for p in corpus_text().split("\n\n")[:40]))
    _as_hub_cache(cache, "dataset", "someorg/notes", data, "b" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    text = f"""
[trial]
[trial.model]
source = "hub"
repo_id = "someorg/tiny-gpt2"
[trial.data]
source = "hub"
repo_id = "someorg/notes"
text_field = "body"
[trial.batch]
max_seq_len = 32
micro_batch_size = 2
"""
    w = build_workload(cfg(text), CPU)
    m = w.info["model"]
    assert (m["repo_id"], m["revision"], m["commit"], m["weights"]) == ("someorg/tiny-gpt2", "main", commit, "pretrained")
    d = w.info["data"]
    assert d["commit"] == "b" * 40 and d["files"][0]["path"] == "train.jsonl" and d["documents"] == 40
    assert d["files"][0]["sha256"] == hashlib.sha256((data / "train.jsonl").read_bytes()).hexdigest()
    from transformers import GPT2LMHeadModel

    saved = GPT2LMHeadModel.from_pretrained(src)
    assert torch.equal(saved.transformer.wte.weight, w.model.transformer.wte.weight)
    assert w.train_step() > 0

    with pytest.raises(ConfigError, match=r"trial\.model\.repo_id: .*someorg/absent") as info:
        build_workload(cfg(text.replace("someorg/tiny-gpt2", "someorg/absent")), CPU)
    assert "download" in info.value.hint


def test_local_model_with_its_own_tokenizer_and_local_files(tmp_path):
    model_dir = tmp_path / "model"
    _save_tiny_model(model_dir, with_tokenizer=True)
    data = tmp_path / "texts"
    data.mkdir()
    paragraphs = corpus_text().split("\n\n")
    (data / "a.txt").write_text("\n\n".join(paragraphs[:30]))
    (data / "b.json").write_text(json.dumps([{"text": p} for p in paragraphs[30:60]]))
    (data / "ignored.csv").write_text("x,y\n")
    text = """
[trial]
[trial.model]
source = "local"
path = "model"
[trial.data]
source = "local"
path = "texts"
tokenizer = "model"
[trial.batch]
max_seq_len = 32
micro_batch_size = 2
"""
    w = build_workload(cfg(text, base=tmp_path), CPU)
    d = w.info["data"]
    assert [f["path"] for f in d["files"]] == ["a.txt", "b.json"]
    assert d["tokenizer"].startswith("model (")  # the class name differs between transformers 4 and 5
    assert w.info["model"]["path"] == str(model_dir)
    assert w.train_step() > 0

    (data / "c.parquet").write_bytes(b"PAR1")
    with pytest.raises(ConfigError, match=r"trial\.data\.files: c\.parquet: only \.txt, \.md, \.jsonl and \.json"):
        build_workload(cfg(text.replace('path = "texts"', 'path = "texts"\nfiles = ["*.parquet"]'), base=tmp_path), CPU)
    shutil.rmtree(data)
    with pytest.raises(ConfigError, match=r"trial\.data\.path: .*texts does not exist"):
        build_workload(cfg(text, base=tmp_path), CPU)
    os.remove(model_dir / "config.json")
    with pytest.raises(ConfigError, match=r"trial\.model\.path: .*has no config\.json"):
        build_workload(cfg(text, base=tmp_path), CPU)


def test_too_little_data_for_two_sequences(tmp_path):
    (tmp_path / "one.txt").write_text("short")
    text = SMALL_GPT2 + '[trial.data]\nsource = "local"\npath = "one.txt"\n'
    with pytest.raises(ConfigError, match=r"trial\.batch\.max_seq_len: the data holds 6 tokens, fewer than 2 sequences of 32"):
        build_workload(cfg(text, base=tmp_path), CPU)

"""The settings that make a 7-8B fine-tune fit, for real on the CPU (transformers, peft, torch,
bitsandbytes' CPU backend): each is applied, read back from the running objects into the
manifest, and checked against what ran. Model families come from a real ``config.json`` written
by transformers; chat data from a real tokenizer built here with its chat template."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from capture._cli import main
from capture.errors import ConfigError
from capture.trial.build.data import IGNORE
from capture.trial.config import load_example, parse
from capture.trial.workload import build_workload
from tiny_tokenizer import save_tiny_tokenizer

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[1]
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=320)
FAMILIES = {  # model_type: (extra config, this family's linear layer names)
    "qwen2": ({}, {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}),
    "mistral": ({}, {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}),
    "gemma2": ({"head_dim": 16}, {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}),
    "phi3": ({"pad_token_id": 0}, {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}),
}


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    monkeypatch.delenv("CAPTURE_KEY", raising=False)
    monkeypatch.chdir(tmp_path)


def _config_json(folder: Path, model_type: str, **extra) -> Path:
    from transformers import AutoConfig

    folder.mkdir(parents=True, exist_ok=True)
    AutoConfig.for_model(model_type, **dict(TINY, **extra)).to_json_file(folder / "config.json")
    return folder / "config.json"


def _cfg(body: str, base: Path) -> object:
    text = "[trial]\nname = \"t\"\nwarmup_steps = 1\nmeasured_steps = 2\n" + body
    if "[trial.batch]" not in body:
        text += "[trial.batch]\nmax_seq_len = 32\nmicro_batch_size = 2\n"
    if "[trial.data]" not in body:
        text += "[trial.data]\nsource = \"synthetic\"\nsynthetic_sequences = 16\n"
    return parse(text, str(base / "t.toml"), base, "t")


# --------------------------------------------------------------------------- model families


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_from_its_config_file_with_lora_on_every_linear_layer(tmp_path, family):
    extra, linears = FAMILIES[family]
    _config_json(tmp_path / "m", family, **extra)
    c = _cfg('method = "lora"\n[trial.model]\nconfig_file = "m/config.json"\n[trial.lora]\ntarget_modules = "all-linear"\n',
             tmp_path)
    wl = build_workload(c, CPU)
    m, lora = wl.info["model"], wl.info["lora"]
    assert m["model_type"] == family and m["config_file_sha256"] and m["weights"].startswith("none")
    assert set(lora["adapted_modules"]) == linears  # read from peft's targeted modules, not the config
    assert lora["adapted_module_count"] == sum(lora["adapted_modules"].values()) == len(linears) * 2
    assert lora["adapter_params"] == wl.params_trainable
    assert wl.train_step() > 0


def test_lora_targets_that_match_no_module_are_named(tmp_path):
    _config_json(tmp_path / "m", "phi3", pad_token_id=0)
    c = _cfg('method = "lora"\n[trial.model]\nconfig_file = "m/config.json"\n[trial.lora]\n'
             'target_modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]\n', tmp_path)
    with pytest.raises(ConfigError, match=r"trial\.lora\.target_modules: q_proj, k_proj, v_proj, gate_proj, up_proj "
                                          r"match no module of Phi3ForCausalLM") as info:
        build_workload(c, CPU)
    assert "qkv_proj" in info.value.hint and "gate_up_proj" in info.value.hint


def test_real_llama_config_is_used_as_written_and_keys_transformers_consumes_are_accepted(tmp_path):
    from capture.trial import memory

    shipped = ROOT / "capture" / "trial" / "examples" / "llama-3.1-8b" / "config.json"
    c = _cfg(f'[trial.model]\nconfig_file = "{shipped}"\n', tmp_path)
    plan = memory.plan_for(c, "cuda")  # on the meta device: 8 B parameters, no memory
    assert sum(p.numel for p in plan.params) == 8_030_261_248 and plan.vocab == 128256
    c2 = _cfg('[trial.model]\narchitecture = "llama"\n[trial.model.config]\nhidden_size = 64\nintermediate_size = 128\n'
              'num_hidden_layers = 1\nnum_attention_heads = 4\nvocab_size = 320\nrope_theta = 500000.0\n', tmp_path)
    wl = build_workload(c2, CPU)
    assert wl.model.config.rope_parameters["rope_theta"] == 500000.0
    c3 = _cfg('[trial.model]\narchitecture = "llama"\n[trial.model.config]\nhidden_sizes = 64\n', tmp_path)
    with pytest.raises(ConfigError, match=r"trial\.model\.config\.hidden_sizes: not a field of LlamaConfig"):
        build_workload(c3, CPU)
    with pytest.raises(ConfigError, match=r"trial\.model\.architecture: 'lama' is not a model type .* \(did you mean 'llama'\?\)"):
        build_workload(_cfg('[trial.model]\narchitecture = "lama"\n', tmp_path), CPU)
    with pytest.raises(ConfigError, match=r"trial\.model\.config\._attn_implementation: set the attention kernel with "
                                          r"trial\.model\.attn_implementation"):
        _cfg('[trial.model]\narchitecture = "llama"\n[trial.model.config]\n_attn_implementation = "eager"\n', tmp_path)


def test_config_errors_keep_the_known_keys_readable(tmp_path):
    with pytest.raises(ConfigError) as info:
        _cfg('[trial.model]\narchitecture = "llama"\nbogus = 1\n', tmp_path)
    assert "known keys: architecture, attn_implementation, config" in info.value.message
    assert "<redacted>" not in info.value.message


# --------------------------------------------------------------------------- training settings


LLAMA = ('[trial.model]\narchitecture = "llama"\n{extra}[trial.model.config]\nhidden_size = 64\nintermediate_size = 128\n'
         'num_hidden_layers = 2\nnum_attention_heads = 4\nnum_key_value_heads = 2\nvocab_size = 320\n')


def _llama(tmp_path: Path, extra: str = "", training: str = "", rest: str = "") -> object:
    return _cfg(LLAMA.format(extra=extra) + (f"[trial.training]\n{training}" if training else "") + rest, tmp_path)


def test_gradient_checkpointing_is_read_back_from_the_model_and_changes_no_numbers(tmp_path):
    off = build_workload(_llama(tmp_path), CPU)
    on = build_workload(_llama(tmp_path, training="gradient_checkpointing = true\n"), CPU)
    g_off, g_on = off.info["training"]["gradient_checkpointing"], on.info["training"]["gradient_checkpointing"]
    assert g_off["enabled"] is False and g_off["layers_checkpointed"] == 0
    assert g_on == {"enabled": True, "layers_checkpointed": 2, "layers": 2, "use_reentrant": False}
    b = next(off.loader)
    assert torch.equal(b.input_ids, next(on.loader).input_ids)
    assert off.forward_backward(b).item() == on.forward_backward(b).item()
    for (n, p), q in zip(off.model.named_parameters(), on.model.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6), n


@pytest.mark.parametrize("arch, extra", [("llama", {}), ("gemma2", {"head_dim": 16})])
def test_chunked_loss_equals_the_standard_loss_without_the_full_logits(tmp_path, arch, extra):
    _config_json(tmp_path / arch, arch, **extra)
    base = f'[trial.model]\nconfig_file = "{arch}/config.json"\n'
    std = build_workload(_cfg(base, tmp_path), CPU)
    chk = build_workload(_cfg(base + '[trial.training]\nloss = "chunked"\nloss_chunk_size = 24\n', tmp_path), CPU)
    info = chk.info["training"]["loss"]
    assert info["name"] == "chunked" and info["chunk_tokens"] == 24 and "torch" in info["implementation"]
    if arch == "gemma2":
        assert info["final_logit_softcapping"] == 30.0  # applied as the model applies it
    b = next(std.loader)
    assert chk.forward_backward(b).item() == pytest.approx(std.forward_backward(b).item(), rel=1e-5)
    for (n, p), q in zip(std.model.named_parameters(), chk.model.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6), n


def test_attention_implementation_is_applied_and_a_missing_kernel_is_one_line(tmp_path, capsys):
    wl = build_workload(_llama(tmp_path, extra='attn_implementation = "eager"\n'), CPU)
    assert wl.info["model"]["attn_implementation"] == "eager" == wl.model.config._attn_implementation
    cfg = tmp_path / "fa.toml"
    cfg.write_text("[trial]\n" + LLAMA.format(extra='attn_implementation = "flash_attention_2"\n')
                   + '[trial.data]\nsource = "synthetic"\n')
    assert main(["trial", str(cfg), "--no-preflight", "-o", str(tmp_path / "o.toml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("error: trial.model.attn_implementation: flash_attention_2 needs the flash-attn package")
    assert len(err) == 2 and err[1].startswith("hint:") and not (tmp_path / "o.toml").exists()


@pytest.mark.parametrize("name, cls, state_dtypes", [
    ("adamw_8bit", "bitsandbytes.optim.AdamW8bit", {"uint8", "float32"}),
    pytest.param("paged_adamw_8bit", "bitsandbytes.optim.PagedAdamW8bit", {"uint8", "float32"},
                 marks=pytest.mark.filterwarnings("ignore:Paged optimizers are not supported on CPU")),
    ("adafactor", "torch.optim.Adafactor", None),
])
def test_optimizers_with_their_real_state_size(tmp_path, name, cls, state_dtypes):
    from capture.trial import memory
    from capture.trial.build.optim import state_facts

    c = _llama(tmp_path, rest=f'[trial.optimizer]\nname = "{name}"\n')
    wl = build_workload(c, CPU)
    assert wl.info["optimizer"]["class"] == cls
    wl.train_step()
    facts = state_facts(wl.optimizer)
    if state_dtypes:
        assert set(facts["state_bytes_by_dtype"]) == state_dtypes  # 1-byte moments (small tensors in fp32)
    # what ran, read from the optimizer: bitsandbytes falls back to ordinary memory on the CPU
    assert facts["paged_bytes"] == 0 and wl.info["optimizer"].get("paged") in (None, False)
    assert ("paged_note" in wl.info["optimizer"]) == (name == "paged_adamw_8bit")
    plan = memory.plan_for(c, "cpu")
    est = memory.estimate_plan(plan, 2)
    want = est.term("optimizer_state").bytes + (est.term("optimizer_state_paged").bytes if est.term("optimizer_state_paged") else 0)
    assert abs(want - facts["state_bytes"]) <= 0.05 * facts["state_bytes"] + 512 * facts["params_with_state"]


def test_the_optimizer_row_is_what_the_optimizer_holds(tmp_path):
    """Fused AdamW on the CPU (torch has a fused CPU kernel), betas and weight decay as configured:
    the manifest's row is read from the optimizer's defaults and groups, and a model whose every
    trainable tensor is 1-D (only norms train) records that no weight decay applies."""
    c = _llama(tmp_path, rest='[trial.optimizer]\nname = "adamw"\nfused = "on"\nweight_decay = 0.05\n'
                              'betas = [0.8, 0.9]\neps = 1e-6\n')
    wl = build_workload(c, CPU)
    row = wl.info["optimizer"]
    assert row["fused"] is True and wl.optimizer.defaults["fused"] is True
    assert (row["betas"], row["eps"], row["weight_decay"]) == ([0.8, 0.9], 1e-6, 0.05)
    assert [g["weight_decay"] for g in wl.optimizer.param_groups] == [0.05, 0.0]
    from capture.trial.build.optim import build_optimizer

    for p in wl.model.parameters():
        p.requires_grad_(p.ndim == 1)
    opt, row = build_optimizer(wl.model, c, CPU)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.0] and row["weight_decay"] == 0.0


def test_paged_state_is_counted_from_the_mark_bitsandbytes_puts_on_its_buffers():
    """On CUDA, bitsandbytes allocates paged state with ``F.get_paged``, which sets ``is_paged =
    True`` on the tensor; there is no CUDA here, so the mark is put on a real optimizer's state."""
    from capture.trial.build.optim import state_facts

    model = torch.nn.Linear(64, 32)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 64)).sum().backward()
    opt.step()
    before = state_facts(opt)
    assert before["paged_bytes"] == 0
    moment = opt.state[model.weight]["exp_avg"]
    moment.is_paged = True
    after = state_facts(opt)
    assert after["paged_bytes"] == moment.untyped_storage().nbytes() == 64 * 32 * 4
    assert after["state_bytes"] == before["state_bytes"]


def test_qlora_nf4_base_built_from_a_config(tmp_path):
    c = _cfg('method = "lora"\n' + LLAMA.format(extra='quantization = "nf4"\n')
             + '[trial.training]\ngradient_checkpointing = true\n[trial.precision]\ndtype = "bf16"\nautocast = false\n', tmp_path)
    wl = build_workload(c, CPU)
    q = wl.info["training"]["quantization"]
    assert q["method"] == "nf4" and q["double_quant"] is True and q["compute_dtype"] == "bf16"
    assert q["layers"] == 14 and q["library"] == "bitsandbytes"  # 7 linear layers x 2 decoder layers, not lm_head
    assert wl.params_trainable < wl.params_total and wl.train_step() > 0


def _quantized_folder(folder: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

    plain = folder.parent / "plain"
    AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **TINY)).save_pretrained(plain)
    q = AutoModelForCausalLM.from_pretrained(plain, quantization_config=BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16), device_map="cpu")
    q.save_pretrained(folder)
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["some words to learn from"] * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>").save_pretrained(folder)


def test_a_quantized_folder_loads_as_it_is_and_refuses_a_full_fine_tune(tmp_path, capsys):
    folder = tmp_path / "q4"
    _quantized_folder(folder)
    assert "quantization_config" in json.loads((folder / "config.json").read_text())
    body = (f'[trial.model]\nsource = "local"\npath = "{folder}"\n[trial.precision]\ndtype = "bf16"\nautocast = false\n'
            '[trial.data]\nsource = "synthetic"\nsynthetic_sequences = 16\n[trial.batch]\nmax_seq_len = 32\nmicro_batch_size = 2\n')
    cfg = tmp_path / "full.toml"
    cfg.write_text('[trial]\nmethod = "full"\n' + body)
    assert main(["trial", str(cfg), "--no-preflight", "-o", str(tmp_path / "o.toml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "holds a nf4 model" in err[0] and 'method = "lora"' in err[1]
    wl = build_workload(parse('[trial]\nmethod = "lora"\n' + body, str(cfg), tmp_path, "t"), CPU)
    assert wl.info["training"]["quantization"]["method"] == "nf4"
    assert wl.info["model"]["quantization_source"] == "the folder's quantization_config"


def test_missing_optional_package_names_its_extra(tmp_path):
    cfg = tmp_path / "q.toml"
    cfg.write_text('[trial]\nmethod = "lora"\n' + LLAMA.format(extra='quantization = "nf4"\n')
                   + '[trial.precision]\ndtype = "bf16"\n[trial.data]\nsource = "synthetic"\n')
    hide = ("import importlib.abc, sys\n"
            "class H(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] == 'bitsandbytes': raise ModuleNotFoundError(name, name=name)\n"
            "sys.meta_path.insert(0, H())\n"
            "from capture._cli import main\n"
            f"raise SystemExit(main(['trial', {str(cfg)!r}, '--no-preflight', '-o', {str(tmp_path / 'o.toml')!r}]))\n")
    r = subprocess.run([sys.executable, "-c", hide], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith(("error:", "hint:"))]
    assert lines == ["error: trial.model.quantization: nf4 needs bitsandbytes, which is not installed",
                     "hint: pip install 'capture-stack[qlora]'"]
    assert "Traceback" not in r.stderr and not (tmp_path / "o.toml").exists()


# --------------------------------------------------------------------------- data


def _model_with_chat_tokenizer(folder: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **TINY)).save_pretrained(folder)
    save_tiny_tokenizer(folder, ["how do I pack a batch? pad it to the longest sequence."] * 40, vocab_size=310, chat=True)


def test_text_is_tokenized_a_batch_a_call_with_the_ids_of_one_call_a_record(tmp_path, monkeypatch):
    """The batches' edges cost nothing: 7 documents in batches of 3 give each document the ids
    the tokenizer gives it alone (an empty one included), and the labels are the ids' array."""
    from transformers import AutoTokenizer

    from capture.trial.build import data

    folder = tmp_path / "tok"
    docs = ["how do I pack a batch?", "", "pad it to the longest sequence.", "é ünïcode ✓", "a " * 50, "x", "pad"]
    save_tiny_tokenizer(folder, docs * 5, vocab_size=300)
    tok = AutoTokenizer.from_pretrained(str(folder))
    monkeypatch.setattr(data, "TEXT_BATCH", 3)
    example = load_example("tiny")
    cfg = dataclasses.replace(example, data=dataclasses.replace(example.data, tokenizer="model", format="text"))
    out, _, eot = data.tokenize(cfg, docs, len(tok), folder, {})
    assert [list(ids) for ids in out.ids] == [tok(d, add_special_tokens=False)["input_ids"] for d in docs]
    assert all(lab is ids for lab, ids in zip(out.labels, out.ids)) and eot == tok.eos_token_id


def test_chat_is_tokenized_a_batch_a_call_with_the_ids_of_one_call_a_conversation(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from capture.trial.build import data

    folder = tmp_path / "tok"
    save_tiny_tokenizer(folder, ["how do I pack a batch? pad it to the longest sequence."] * 40, vocab_size=310, chat=True)
    tok = AutoTokenizer.from_pretrained(str(folder))
    convs = [[{"role": "user", "content": "how do I pack " * (1 + i % 3)}, {"role": "assistant", "content": "pad" * i}]
             for i in range(7)]
    monkeypatch.setattr(data, "TEXT_BATCH", 3)
    example = load_example("tiny")
    cfg = dataclasses.replace(example, data=dataclasses.replace(example.data, tokenizer="model", format="chat"))
    out, pad, eot = data.tokenize(cfg, convs, len(tok), folder, {})
    alone = [list(tok.apply_chat_template(c, tokenize=True, return_dict=True)["input_ids"]) for c in convs]
    assert [list(ids) for ids in out.ids] == alone and len({len(a) for a in alone}) > 1
    assert all(lab is ids for lab, ids in zip(out.labels, out.ids)) and eot is None and pad == tok.pad_token_id


def test_chat_data_padded_with_loss_on_assistant_turns_longest_first(tmp_path):
    model = tmp_path / "model"
    _model_with_chat_tokenizer(model)
    rows = [{"messages": [{"role": "user", "content": "how do I pack a batch?" * (1 + i % 3)},
                          {"role": "assistant", "content": "pad it" + " to the longest sequence" * (i % 4)}]} for i in range(12)]
    data = tmp_path / "chat.jsonl"  # a single file as trial.data.path
    data.write_text("\n".join(json.dumps(r) for r in rows))
    c = _cfg(f'[trial.model]\nsource = "local"\npath = "{model}"\n[trial.data]\nsource = "local"\npath = "chat.jsonl"\n'
             'format = "chat"\nassistant_only_loss = true\npacking = false\nvalidation_fraction = 0.2\n'
             '[trial.batch]\nmax_seq_len = 128\nmicro_batch_size = 3\n', tmp_path)
    wl = build_workload(c, CPU)
    d = wl.info["data"]
    assert d["format"] == "chat" and d["conversations"] == 12 and d["files"][0]["path"] == "chat.jsonl"
    assert "longest sequences of the data first" in d["measured_on"] and 0 < d["loss_tokens_share"] < 1
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    b = next(wl.loader)
    lengths = b.attention_mask.sum(1).tolist()
    assert lengths == sorted(lengths, reverse=True) and lengths[0] == d["longest_sequence"]
    assert b.pad_tokens == b.input_ids.numel() - sum(lengths) and b.tokens == sum(lengths)
    for row in range(b.input_ids.shape[0]):
        kept = [t for t in b.labels[row].tolist() if t != IGNORE]
        text = tok.decode(kept)
        assert text.startswith("pad it") and "how do I" not in text  # assistant turns only
        assert all(t == IGNORE for t, m in zip(b.labels[row].tolist(), b.attention_mask[row].tolist()) if not m)
    assert wl.train_step() > 0 and wl.last_pad_tokens > 0


def test_byte_tokenizer_on_a_pretrained_model_is_exit_2(tmp_path, capsys):
    model = tmp_path / "model"
    _model_with_chat_tokenizer(model)
    capsys.readouterr()  # save_pretrained's progress bar, when no trial of this process has turned it off yet
    cfg = tmp_path / "b.toml"
    cfg.write_text(f'[trial]\n[trial.model]\nsource = "local"\npath = "{model}"\n[trial.data]\ntokenizer = "bytes"\n')
    assert main(["trial", str(cfg), "-o", str(tmp_path / "o.toml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith('error: trial.data.tokenizer: "bytes" would feed byte ids to a pretrained model') and len(err) == 2
    c = parse(f'[trial]\n[trial.model]\nsource = "local"\npath = "{model}"\n', str(cfg), tmp_path, "t")
    assert c.data.tokenizer == "model"  # the default for a pretrained model


# --------------------------------------------------------------------------- the whole trial


def _read(path: Path) -> dict:
    from capture.manifest import load_unverified

    return load_unverified(path).data


def test_trial_records_settings_mfu_both_ways_and_pad_tokens(tmp_path):
    cat = tmp_path / "cat.toml"
    cat.write_text('[[accelerator]]\nname = "this CPU"\nmatch = "^CPU"\nmemory_bytes = 8589934592\npeak_bf16_dense_flops = 1e12\n')
    cfg = tmp_path / "t.toml"
    cfg.write_text("[trial]\nwarmup_steps = 1\nmeasured_steps = 2\n" + LLAMA.format(extra="")
                   + '[trial.training]\ngradient_checkpointing = true\nloss = "chunked"\n'
                   '[trial.precision]\ndtype = "bf16"\nautocast = true\n[trial.batch]\nmax_seq_len = 64\nmicro_batch_size = 2\n'
                   '[trial.data]\nsource = "synthetic"\nsynthetic_sequences = 16\n')
    out = tmp_path / "o.toml"
    assert main(["trial", str(cfg), "--catalog", str(cat), "--no-recovery", "--no-report", "--no-preflight", "-o", str(out)]) == 0
    from test_docs import undocumented

    assert undocumented(_read(out)) == []  # every field the settings add is in docs/manifest.md
    t = _read(out)["trial"]
    tr = t["run"]["training"]
    assert tr["gradient_checkpointing"]["enabled"] and tr["loss"]["name"] == "chunked"
    s = t["stats"]
    assert s["mfu_6n"] == s["mfu"] and s["mfu_with_attention"] > s["mfu"]
    assert s["attention_flops_per_token"] == 6 * 2 * 64 * 64  # 6 x layers x attention width x seq
    assert s["pad_tokens_total"] == 0 and s["pad_share"] == 0.0
    mem = t["memory"]
    assert mem["estimate"]["activations"]["inputs"]["gradient_checkpointing"] is True
    assert mem["terms"]["weights"]["measured_bytes"] > 0 and "error" in mem["terms"]["optimizer_state"]
    assert mem["allocator_settings"]["expandable_segments"] is False


def test_decide_puts_runs_that_differ_in_a_setting_in_different_groups(tmp_path):
    from capture.decide import runs as decide_runs

    outs = []
    for gc in ("false", "true"):
        cfg = tmp_path / f"gc-{gc}.toml"
        cfg.write_text("[trial]\nwarmup_steps = 0\nmeasured_steps = 1\n" + LLAMA.format(extra="")
                       + f"[trial.training]\ngradient_checkpointing = {gc}\n[trial.data]\nsource = \"synthetic\"\n"
                       "[trial.batch]\nmax_seq_len = 32\nmicro_batch_size = 2\n")
        out = tmp_path / f"gc-{gc}.out.toml"
        assert main(["trial", str(cfg), "--no-recovery", "--no-report", "--no-preflight", "-o", str(out)]) == 0
        outs.append(_read(out))
    defs = [decide_runs.run_definition(m) for m in outs]
    assert defs[0] != defs[1]
    differ = {k for k, v in defs[0].settings} ^ {k for k, v in defs[1].settings} | {
        k for (k, v), (k2, v2) in zip(defs[0].settings, defs[1].settings) if k == k2 and v != v2}
    assert any(k.startswith("training.gradient_checkpointing") for k in differ)


@pytest.mark.slow
def test_compile_is_its_own_phase_and_never_inside_the_step_statistics(tmp_path):
    """torch.compile (inductor, the CPU's C++ backend) on a tiny Llama: the compilation happens in
    its own timed phase before the first step, the manifest says what was compiled, and the
    measured steps run the compiled graph, so no step is as slow as the compilation."""
    cfg = tmp_path / "t.toml"
    cfg.write_text("[trial]\nwarmup_steps = 1\nmeasured_steps = 3\n" + LLAMA.format(extra="")
                   + "[trial.training]\ncompile = true\n[trial.data]\nsource = \"synthetic\"\nsynthetic_sequences = 16\n"
                   "[trial.batch]\nmax_seq_len = 32\nmicro_batch_size = 2\n")
    out = tmp_path / "o.toml"
    assert main(["trial", str(cfg), "--no-recovery", "--no-report", "--no-preflight", "-o", str(out)]) == 0
    t = _read(out)["trial"]
    comp = t["run"]["training"]["compile"]
    assert comp == {"enabled": True, "target": "model", "requested": True}
    assert t["compile"]["frames_compiled"] >= 1
    compile_s = t["compile"]["duration_s"]
    assert compile_s == t["cost"]["phases"]["compile_s"] > 0
    steps = t["steps"]["step_time_s"] + t["steps"]["warmup_step_time_s"]
    assert len(steps) == 4 and max(steps) < compile_s
    assert t["stats"]["step_time_max_s"] < compile_s

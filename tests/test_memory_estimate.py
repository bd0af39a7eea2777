"""The memory estimate (issue 23): `capture estimate` on the shipped examples and on tiny shapes of
every setting, the allocator model's rules, the activation model against torch's own saved-tensor
hooks per model family, the committed H200 grid as a regression, and the CPU estimate against the
measured peak RSS of the same trial.

Nothing here reads the machine: every expectation is derived from the config, the model built
from it, or the committed H200 measurement.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest
import torch

from capture._cli import main
from capture.trial import memory
from capture.trial.allocator import (LARGE_BUFFER, ROUND_LARGE, SMALL_BUFFER, CachingAllocator, ExpandableAllocator,
                                     allocation_size, replay, round_size)
from capture.trial.config import example_names, load_example, parse
from capture.trial.estimate import Curve, largest_fitting

ROOT = Path(__file__).resolve().parents[1]
GRID = ROOT / "docs" / "measurements" / "h200-memory-grid-2026-12-04.groups.jsonl"
MIB, GIB = 2**20, 2**30
CPU_TOLERANCE = 0.25  # this shape measured -14 %; docs/trial.md documents 50 % (activation-heavy shapes)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=320)


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    monkeypatch.delenv("CAPTURE_KEY", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.chdir(tmp_path)


def _cfg(body: str, base: Path, seq: int = 32, mb: int = 2) -> object:
    text = "[trial]\nname = \"t\"\nwarmup_steps = 1\nmeasured_steps = 2\n" + body
    if "[trial.batch]" not in body:
        text += f"[trial.batch]\nmax_seq_len = {seq}\nmicro_batch_size = {mb}\n"
    if "[trial.data]" not in body:
        text += "[trial.data]\nsource = \"synthetic\"\nsynthetic_sequences = 16\n"
    (base / "t.toml").write_text(text)
    return parse(text, str(base / "t.toml"), base, "t")


def _llama_body(extra_model: str = "", extra: str = "", method: str = "full", **cfg: int) -> str:
    shape = dict(TINY, **cfg)
    return (f'method = "{method}"\n[trial.model]\nsource = "from_config"\narchitecture = "llama"\n{extra_model}'
            "[trial.model.config]\n" + "".join(f"{k} = {v}\n" for k, v in shape.items()) + extra)


# --------------------------------------------------------------------------- capture estimate


@pytest.mark.parametrize("example", example_names())
def test_estimate_on_every_shipped_example(example, capsys):
    """Exit 0, JSON with every term's formula and inputs, and a card table whose verdicts follow
    from the totals printed beside them."""
    assert main(["estimate", "--example", example, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    est, cards = out["estimate"], out["cards"]
    terms = {k: v for k, v in est.items() if isinstance(v, dict) and "bytes" in v}
    assert est["total_bytes"] == sum(t["bytes"] for t in terms.values())
    assert all(t["formula"] for t in terms.values())
    assert terms["weights"]["bytes"] > 0 and terms["cuda_context"]["bytes"] == memory.CONTEXT_REFERENCE_BYTES
    assert est["reserved_bytes"] == est["allocator_bytes"] + terms["allocator_reserve"]["bytes"]
    assert est["expandable_segments_total_bytes"] > est["allocator_bytes"]
    assert cards and out["micro_batch"] == load_example(example).batch.micro_batch_size
    for c in cards:
        assert c["usable_bytes"] == int(c["memory_bytes"] * (1 - out["headroom"]))
        assert c["fits"] == (est["total_bytes"] <= c["usable_bytes"])
        assert c["basis"].startswith("estimate")
        if c["fits"]:
            assert c["max_micro_batch"] >= out["micro_batch"]


def test_estimate_text_fits_100_columns_and_shows_what_the_json_says(tmp_path, capsys):
    """The terminal view at a long config path: every line within 100 characters, each non-zero
    term, the totals and every card's verdict as the JSON gives them."""
    deep = tmp_path / ("runs-of-the-long-named-project-" * 3) / "llama-3.1-8b-lora-gradient-checkpointing.toml"
    deep.parent.mkdir(parents=True)
    shipped = Path(str(resources.files("capture.trial") / "examples"))
    shutil.copytree(shipped / "llama-3.1-8b", deep.parent / "llama-3.1-8b")
    shutil.copyfile(shipped / "llama-3.1-8b-lora.toml", deep)
    assert main(["estimate", str(deep), "--json"]) == 0
    js = json.loads(capsys.readouterr().out)
    assert main(["estimate", str(deep)]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert lines[0] == f"memory estimate for {deep}:"  # a path is never cut; past 100 columns it stands alone
    assert lines[1].startswith(f"  micro-batch {js['micro_batch']} x {js['seq_len']} tokens")
    assert all(len(x) <= 100 for x in lines[1:]), max(lines[1:], key=len)
    named = {x.split()[0] for x in lines if x.startswith("  ") and len(x.split()) > 2}
    terms = [k for k, v in js["estimate"].items() if isinstance(v, dict) and v.get("bytes")]
    assert set(terms) <= named
    for c in js["cards"]:
        row = next(x for x in lines if x.startswith(f"  {c['name']} "))
        assert row.split()[-2:][0] == ("yes" if c["fits"] else "no")


def test_largest_micro_batch_is_the_boundary_of_the_estimate(capsys):
    """The card's largest micro-batch fits and one more does not, each checked by its own estimate."""
    assert main(["estimate", "--example", "llama-3.1-8b-lora", "--card", "h100", "--json"]) == 0
    card = json.loads(capsys.readouterr().out)["cards"][0]
    assert card["name"] == "H100 80GB SXM"
    best = card["max_micro_batch"]
    totals = {}
    for mb in (best, best + 1):
        assert main(["estimate", "--example", "llama-3.1-8b-lora", "--card", "H100 80GB SXM", "--micro-batch", str(mb),
                     "--json"]) == 0
        totals[mb] = json.loads(capsys.readouterr().out)["estimate"]["total_bytes"]
    assert totals[best] <= card["usable_bytes"] < totals[best + 1]


CURVES = {
    "straight": lambda mb: 10 * GIB + mb * 700 * MIB,
    "reserve steps": lambda mb: 10 * GIB + mb * 700 * MIB + (mb // 3) * 2 * GIB,  # the allocator's reserve jumps
    "convex": lambda mb: 4 * GIB + mb * mb * 64 * MIB,
    "flat, then a cliff": lambda mb: 20 * GIB + (0 if mb < 37 else 200 * GIB),
}


@pytest.mark.parametrize("shape", CURVES)
def test_largest_fitting_is_exact_on_any_growing_curve_and_shares_its_points(shape):
    """Against a scan of every micro-batch: the exact boundary for many card sizes and ceilings;
    one curve serves every card, so later cards cost few new points."""
    f = CURVES[shape]
    curve = Curve(f)
    for usable in [f(1) - 1] + [int(g * GIB) for g in (12, 18.5, 40, 80, 141, 192, 400)]:
        for ceiling in (8, 64, 1024):
            want = max((mb for mb in range(1, ceiling + 1) if f(mb) <= usable), default=None)
            got, capped = largest_fitting(curve, usable, ceiling)
            assert got == want, (shape, usable / GIB, ceiling)
            assert capped == (want == ceiling)
    assert len(curve.seen) <= 40  # a scan would replay hundreds of points
    straight = Curve(CURVES["straight"])
    for usable in (40 * GIB, 80 * GIB, 141 * GIB, 192 * GIB):
        before = len(straight.seen)
        largest_fitting(straight, usable, 1024)
        assert len(straight.seen) - before <= (4 if before == 0 else 2)


def test_the_8b_settings_order_as_the_h200_measured_them(capsys):
    """Llama-3.1-8B at the same micro-batch: QLoRA < LoRA < full fine-tune, and checkpointing
    takes the full fine-tune's activations down (issue 22's H200 figures: 77.7 → 64.8 GiB)."""
    totals = {}
    for name in ("full", "lora", "qlora"):
        assert main(["estimate", "--example", f"llama-3.1-8b-{name}", "--micro-batch", "2", "--card", "H200", "--json"]) == 0
        totals[name] = json.loads(capsys.readouterr().out)["estimate"]
    assert totals["qlora"]["total_bytes"] < totals["lora"]["total_bytes"] < totals["full"]["total_bytes"]
    assert totals["qlora"]["weights"]["inputs"]["quantization"] == "nf4"
    assert set(totals["qlora"]["weights"]["inputs"]["by_storage"]) >= {"nf4", "bf16"}


def test_config_error_and_bad_flags_are_exit_2_one_line(tmp_path, capsys):
    (tmp_path / "bad.toml").write_text('[trial]\nname = "x"\n[trial.training]\ngradient_checkpointing = "yes"\n')
    for argv in (["estimate", str(tmp_path / "bad.toml")], ["estimate", "--example", "tiny", "--card", "nonesuch"],
                 ["estimate", "--example", "tiny", "--card", "80GB"], ["estimate", "--example", "tiny", "--headroom", "1"],
                 ["estimate", "--example", "tiny", "--micro-batch", "0"], ["estimate", str(tmp_path / "missing.toml")]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "Traceback" not in err and err.startswith("error: ") and "\nhint: " in err, (argv, err)


@pytest.mark.parametrize("rank", [65_536, 321])
def test_a_lora_rank_beyond_every_layer_is_exit_2_one_line(rank, tmp_path, capsys):
    """A rank no layer can hold (the tiny Llama's widest linear is its 320-wide head) is refused
    before peft builds it (2**63, before the config's bound of 65,536, ended in torch's "Storage
    size calculation overflowed")."""
    (tmp_path / "t.toml").write_text('[trial]\nname = "t"\n' + _llama_body(method="lora", extra=f"[trial.lora]\nrank = {rank}\n"))
    assert main(["estimate", str(tmp_path / "t.toml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: trial.lora.rank = {rank} is larger than every linear layer") and "(widest: 320)" in err
    assert len(err.strip().splitlines()) == 2 and "\nhint: " in err, err
    (tmp_path / "t.toml").write_text('[trial]\nname = "t"\n' + _llama_body(method="lora", extra="[trial.lora]\nrank = 320\n"))
    assert main(["estimate", str(tmp_path / "t.toml"), "--json"]) == 0


HOSTILE_SHAPES = {  # [trial.model.config] on the tiny Llama: what the error must name
    "zero hidden size": ({"hidden_size": 0}, "hidden_size = 0"),
    "negative layers": ({"num_hidden_layers": -3}, "num_hidden_layers = -3"),
    "heads that do not divide the hidden size": ({"hidden_size": 65}, "not a multiple"),
    "key/value heads that do not divide the heads": ({"num_key_value_heads": 3}, "num_key_value_heads = 3"),
    "a size written as a string": ({"vocab_size": '"320"'}, "vocab_size"),
    "a fractional size": ({"intermediate_size": 12.5}, "intermediate_size"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_SHAPES))
def test_a_shape_transformers_or_the_estimate_cannot_use_is_exit_2_one_line(case, tmp_path, capsys):
    """Sizes that would end in a traceback deep in transformers or in the estimate are refused
    before anything is built, naming the key."""
    values, named = HOSTILE_SHAPES[case]
    (tmp_path / "t.toml").write_text('[trial]\nname = "t"\n' + _llama_body(**values))
    assert main(["estimate", str(tmp_path / "t.toml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: trial.model") and named in err and "\nhint: " in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 2, err


def test_a_million_layers_is_refused_at_once_not_built(tmp_path):
    """A hostile layer count would take hours to build even on the meta device: refused by the
    resolved config, from a hand-written shape and from a config.json alike."""
    (tmp_path / "hand.toml").write_text('[trial]\nname = "t"\n' + _llama_body(num_hidden_layers=10**6))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **TINY, "num_hidden_layers": 10**6}))
    (tmp_path / "file.toml").write_text('[trial]\nname = "t"\n[trial.model]\nsource = "from_config"\n'
                                        'config_file = "config.json"\n')
    (tmp_path / "inf.json").write_text('{"model_type": "llama", "num_hidden_layers": 1e400}')
    (tmp_path / "inf.toml").write_text('[trial]\nname = "t"\n[trial.model]\nsource = "from_config"\n'
                                       'config_file = "inf.json"\n')
    for name, named in (("hand", "more than 1024"), ("file", "more than 1024"), ("inf", "num_hidden_layers")):
        done = subprocess.run([sys.executable, "-m", "capture", "estimate", str(tmp_path / f"{name}.toml")],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert done.returncode == 2 and named in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


BF16 = "[trial.precision]\ndtype = \"bf16\"\nautocast = false\n"
SETTINGS = {  # name: (model keys, [trial.*] tables, method)
    "full-fp32": ("", "[trial.precision]\ndtype = \"fp32\"\nautocast = false\n", "full"),
    "full-bf16-autocast": ("", "[trial.precision]\ndtype = \"bf16\"\nautocast = true\n", "full"),
    "checkpointing": ("", "[trial.training]\ngradient_checkpointing = true\n", "full"),
    "eager": ('attn_implementation = "eager"\n', "", "full"),
    "chunked-loss": ("", "[trial.training]\nloss = \"chunked\"\nloss_chunk_size = 16\n", "full"),
    "lora": ("", "[trial.lora]\nrank = 4\ntarget_modules = \"all-linear\"\n", "lora"),
    "qlora-nf4": ('quantization = "nf4"\n', "[trial.precision]\ndtype = \"bf16\"\nautocast = false\n", "lora"),
    "int8": ('quantization = "int8"\n', "[trial.precision]\ndtype = \"bf16\"\nautocast = false\n", "lora"),
    "adamw_8bit": ("", "[trial.optimizer]\nname = \"adamw_8bit\"\n", "full"),
    "paged_adamw_8bit": ("", "[trial.optimizer]\nname = \"paged_adamw_8bit\"\n", "full"),
    "adafactor": ("", "[trial.optimizer]\nname = \"adafactor\"\n", "full"),
    "sgd": ("", "[trial.optimizer]\nname = \"sgd\"\nmomentum = 0.9\n", "full"),
}


@pytest.fixture(scope="module")
def plain_estimate(tmp_path_factory):
    base = tmp_path_factory.mktemp("plain")
    return memory.estimate_plan(memory.plan_for(_cfg(_llama_body(extra=BF16), base), "cuda"), 2)


def _paged_split(tmp_path):
    """A vocabulary of 2048 makes the embedding and the untied head 131,072 elements each: their
    1-byte moments go to unified memory (outside the allocator), their absmax statistics and every
    other tensor's state stay device tensors; the two terms add up to the non-paged optimizer's."""
    def estimate(name: str):
        body = _llama_body(extra=f'[trial.optimizer]\nname = "{name}"\n' + BF16, vocab_size=2048)
        return memory.estimate_plan(memory.plan_for(_cfg(body, tmp_path), "cuda"), 2)

    paged, plain = estimate("paged_adamw_8bit"), estimate("adamw_8bit")
    big = 2 * 2048 * TINY["hidden_size"]
    assert paged.term("optimizer_state_paged").inputs["params_paged"] == big
    assert paged.term_bytes("optimizer_state_paged") == 2 * big  # two 1-byte moments
    assert paged.term_bytes("optimizer_state") > 0  # the absmax statistics and the small tensors' state
    assert paged.term_bytes("optimizer_state") + paged.term_bytes("optimizer_state_paged") == pytest.approx(
        plain.term_bytes("optimizer_state"), abs=512 * 64)  # the allocator rounds each tensor to 512 bytes


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_each_setting_moves_its_own_term(tmp_path, setting, plain_estimate):
    """Every setting of issue 22 changes the term its effect lives in, in the direction it must."""
    model_keys, tables, method = SETTINGS[setting]
    if "[trial.precision]" not in tables:
        tables += BF16
    est = memory.estimate_plan(memory.plan_for(_cfg(_llama_body(model_keys, tables, method), tmp_path), "cuda"), 2)
    base = plain_estimate
    b = base.term_bytes
    e = est.term_bytes
    assert est.total_bytes > 0 and est.allocator_bytes <= est.reserved_bytes
    if setting == "full-fp32":  # the base is bf16 weights without autocast
        # (tiny tensors round up to the allocator's 512 bytes either way)
        assert e("weights") == pytest.approx(2 * b("weights"), rel=0.02)
        # (and fused Adam's fp32 step counter per parameter, on the device, the same in both)
        assert e("optimizer_state") == pytest.approx(2 * b("optimizer_state"), rel=0.03)
    elif setting == "full-bf16-autocast":
        assert e("weights") == pytest.approx(2 * b("weights"), rel=0.02)
        assert e("autocast_weight_copies") > 0 == b("autocast_weight_copies")
    elif setting == "checkpointing":
        assert e("activations") < b("activations")
        assert est.term("activations").inputs["gradient_checkpointing"] is True
    elif setting == "eager":
        assert est.term("activations").inputs["attn_implementation"] == "eager"
        assert est.term("activations").inputs["saved_bytes_per_layer"] > base.term("activations").inputs["saved_bytes_per_layer"]
    elif setting == "chunked-loss":
        assert e("logits") < b("logits") and est.term("logits").inputs["loss"] == "chunked"
    elif setting in ("lora", "qlora-nf4", "int8"):
        assert e("lora_adapters") > 0 and e("optimizer_state") < b("optimizer_state") / 5
        if setting != "lora":
            storage = est.term("weights").inputs["by_storage"]
            assert ("nf4" if setting == "qlora-nf4" else "int8") in storage
            assert e("weights") < b("weights")
    elif setting == "adamw_8bit":  # tiny tensors (< 4096 elements) keep fp32 moments, as bitsandbytes does
        assert 0 < e("optimizer_state") < b("optimizer_state")
    elif setting == "paged_adamw_8bit":
        # bitsandbytes pages only tensors of 1e5 elements or more; TINY's are all smaller
        assert est.term("optimizer_state_paged") is None and e("optimizer_state") > 0
        _paged_split(tmp_path)
    elif setting == "adafactor":
        assert 0 < e("optimizer_state") < b("optimizer_state") / 4
    elif setting == "sgd":
        assert e("optimizer_state") * 2 == pytest.approx(b("optimizer_state"), rel=0.03)  # Adam's step counters aside


def test_estimate_reads_the_longest_sequence_it_was_told(tmp_path):
    c = _cfg(_llama_body(), tmp_path, seq=64)
    short, long = (memory.estimate_plan(memory.plan_for(c, "cuda", seq=s, seq_source="test"), 1) for s in (16, 64))
    assert long.term_bytes("activations") > 3 * short.term_bytes("activations")
    assert long.term("activations").inputs["seq_source"] == "test"


# --------------------------------------------------------------------------- the allocator model


def test_allocator_rounding_and_segment_sizes_follow_pytorch():
    assert round_size(1) == 512 and round_size(512) == 512 and round_size(513) == 1024
    assert allocation_size(1) == SMALL_BUFFER and allocation_size(1 << 20) == SMALL_BUFFER
    assert allocation_size((1 << 20) + 1) == LARGE_BUFFER and allocation_size((10 << 20) - 1) == LARGE_BUFFER
    assert allocation_size(10 << 20) == 10 << 20 and allocation_size((10 << 20) + 1) == (10 << 20) + ROUND_LARGE


def test_allocator_reuses_splits_and_merges_blocks():
    a = CachingAllocator()
    h1 = a.malloc(4 << 20)  # a 20 MiB large segment, split
    h2 = a.malloc(4 << 20)  # from the remainder: same segment
    assert a.reserved == LARGE_BUFFER and h1[0] == h2[0] and a.allocated == 8 << 20
    a.free(h1)
    a.free(h2)  # both merge back into one free 20 MiB block
    h3 = a.malloc(16 << 20)
    assert a.reserved == LARGE_BUFFER and h3 == (h1[0], 0)
    small = a.malloc(1000)  # small pool: its own 2 MiB segment
    assert a.reserved == LARGE_BUFFER + SMALL_BUFFER
    a.free(h3)
    a.free(small)
    a.empty_cache()
    assert a.reserved == 0 and a.peak_reserved == LARGE_BUFFER + SMALL_BUFFER


def test_segments_that_cannot_merge_cost_memory_that_expandable_segments_saves():
    """Two 12 MiB tensors freed, then one of 24 MiB: by default each 12 MiB block is a segment of
    its own (requests of 10 MiB and more), so the freed ones cannot merge and a third segment is
    mapped (48 MiB reserved); with expandable segments they sit side by side in one segment, merge,
    and take the request (24 MiB)."""
    events = [("alloc", 1, 12 << 20, "t"), ("alloc", 2, 12 << 20, "t"), ("free", 1), ("free", 2),
              ("alloc", 3, 24 << 20, "t")]
    r = replay(events)
    assert r.peak_allocated == 24 << 20
    assert r.peak_reserved == 48 << 20
    assert r.peak_reserved_expandable == 24 << 20
    e = ExpandableAllocator()
    for h in [e.malloc(12 << 20), e.malloc(12 << 20)]:
        e.free(h)
    e.malloc(24 << 20)
    assert e.peak_reserved == 24 << 20
    holes = [("alloc", i, 12 << 20, "t") for i in range(1, 7)] + [("free", 1), ("free", 3), ("free", 5),
                                                                     ("alloc", 9, 24 << 20, "t")]
    r = replay(holes)  # holes between live blocks cost memory either way
    assert r.peak_reserved == r.peak_reserved_expandable == 96 << 20


def test_replay_of_a_real_estimate_is_deterministic_and_tagged(tmp_path):
    plan = memory.plan_for(_cfg(_llama_body(), tmp_path), "cuda")
    a, b = memory.simulate(plan, 2), memory.simulate(plan, 2)
    assert (a.peak_allocated, a.peak_reserved) == (b.peak_allocated, b.peak_reserved)
    assert sum(a.peak_tags.values()) == a.peak_allocated
    assert a.peak_reserved >= a.peak_allocated


# --------------------------------------------------------------------------- gradient accumulation


def _gradient_bytes_at_step(plan: memory.Plan, micro_batch: int) -> int:
    """Bytes tagged ``gradients`` still live when the replay reaches its first optimizer step."""
    tr = memory.Trace()
    memory._step_events(tr, plan, micro_batch, True, [])
    live: dict[int, int] = {}
    for e in tr.events:
        if e[0] == "alloc" and e[3] == "gradients":
            live[e[1]] = e[2]
        elif e[0] == "free":
            live.pop(e[1], None)
        elif e[0] == "phase" and e[1] == "optimizer step":
            break
    return sum(live.values())


@pytest.mark.parametrize("method", ["full", "full-tied", "full-fp32", "lora"])
def test_gradient_accumulation_adds_into_one_set_of_gradients_as_torch_does(tmp_path, method):
    """Micro-batches after the first add into the gradients the first made: the estimate holds one
    set at the optimizer step whatever grad_accum is, the bytes torch holds in ``.grad`` after the
    same number of backward passes (real model on the CPU; bf16 weights, a head tied to the input
    embedding, fp32 weights)."""
    from capture.trial.workload import build_model

    lora = '[trial.lora]\nrank = 8\ntarget_modules = "all-linear"\n' if method == "lora" else ""
    dtype = "fp32" if method == "full-fp32" else "bf16"
    body = _llama_body(method=method.split("-")[0], extra=f'[trial.precision]\ndtype = "{dtype}"\nautocast = false\n' + lora,
                       **({"tie_word_embeddings": "true"} if method == "full-tied" else {}))
    batch, seq = 2, 32
    model = None
    for accum in (1, 2, 4):
        c = _cfg(body + f"[trial.batch]\nmax_seq_len = {seq}\nmicro_batch_size = {batch}\ngrad_accum = {accum}\n",
                 tmp_path)
        plan = memory.plan_for(c, "cpu")
        if model is None:
            model = build_model(c, torch.device("cpu"))[0]
            model.train()
        model.zero_grad(set_to_none=True)
        for k in range(accum):
            ids = torch.randint(0, plan.vocab, (batch, seq), generator=torch.Generator().manual_seed(k))
            model(input_ids=ids, labels=ids).loss.backward()
        held = sum(p.grad.untyped_storage().nbytes() for p in model.parameters() if p.grad is not None)
        assert held > 0 and _gradient_bytes_at_step(plan, batch) == held, (method, accum)


def test_the_largest_grad_accum_costs_what_three_do(tmp_path):
    """Every micro-batch after the second repeats the second's events from the same state: the
    replay stops at three (memory.MAX_MICRO_REPLAYED), and replaying all of them gives the same."""
    base = _llama_body(method="lora", extra='[trial.lora]\nrank = 8\n')
    plans = {ga: memory.plan_for(_cfg(base + f"[trial.batch]\nmax_seq_len = 32\nmicro_batch_size = 2\n"
                                             f"grad_accum = {ga}\n", tmp_path), "cuda")
             for ga in (3, 7, 65_536)}  # 65,536: the config's bound (2**63 hung before the replay stopped at three)
    three = memory.estimate_plan(plans[3], 2).to_manifest()
    assert memory.estimate_plan(plans[65_536], 2).to_manifest() | {"inputs": None} == three | {"inputs": None}
    seven = memory.estimate_plan(plans[7], 2)
    old = memory.MAX_MICRO_REPLAYED
    try:
        memory.MAX_MICRO_REPLAYED = 7
        assert memory.estimate_plan(plans[7], 2).terms == seven.terms
    finally:
        memory.MAX_MICRO_REPLAYED = old


# --------------------------------------------------------------------------- activations vs torch's saved tensors


FAMILY_CONFIGS = {
    "llama": {}, "qwen2": {}, "mistral": {}, "gemma2": {"head_dim": 16}, "phi3": {"pad_token_id": 0},
    "gpt2": None,
}


def _family_config(tmp_path: Path, family: str) -> Path:
    from transformers import AutoConfig

    folder = tmp_path / family
    folder.mkdir()
    if family == "gpt2":
        hf = AutoConfig.for_model("gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=320, n_positions=256)
    else:
        shape = dict(TINY, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                     num_hidden_layers=3)
        hf = AutoConfig.for_model(family, **dict(shape, **FAMILY_CONFIGS[family]))
    hf.to_json_file(folder / "config.json")
    return folder / "config.json"


def _measured_saved_bytes(model: torch.nn.Module, batch: int, seq: int, vocab: int) -> int:
    """Bytes autograd saves while one middle decoder layer runs forward, each storage once,
    parameters (and their casts' storages of weights) excluded: torch's own account."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = next(m for m in base.modules() if isinstance(m, torch.nn.ModuleList))
    layer = layers[len(layers) // 2]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    inside = [False]
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if inside[0]:
            st = t.untyped_storage()
            if st.data_ptr() not in params and st.data_ptr() != 0:
                saved[st.data_ptr()] = st.nbytes()
        return t

    h1 = layer.register_forward_pre_hook(lambda *a: inside.__setitem__(0, True))
    h2 = layer.register_forward_hook(lambda *a: inside.__setitem__(0, False))
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(input_ids=ids, labels=ids).loss
    finally:
        h1.remove()
        h2.remove()
    loss.backward()
    return sum(saved.values())


@pytest.mark.parametrize("method", ["full", "lora"])
@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_activation_model_matches_torch_saved_tensors(tmp_path, family, method):
    """The bytes one decoder layer leaves saved for backward, as the estimate models them, against
    what torch's saved-tensor hooks see in the real model on the CPU (bf16 weights, SDPA)."""
    from capture.trial.workload import build_model

    _family_config(tmp_path, family)
    lora = '[trial.lora]\nrank = 8\ndropout = 0.05\ntarget_modules = "all-linear"\n' if method == "lora" else ""
    body = (f'method = "{method}"\n[trial.model]\nconfig_file = "{family}/config.json"\n'
            '[trial.precision]\ndtype = "bf16"\nautocast = false\n' + lora)
    batch, seq = 2, 96
    c = _cfg(body, tmp_path, seq=seq, mb=batch)
    plan = memory.plan_for(c, "cpu")
    want = memory._layer_saved_bytes(plan, batch)
    model = build_model(c, torch.device("cpu"))[0]
    model.train()
    got = _measured_saved_bytes(model, batch, seq, plan.vocab)
    assert got > 0
    assert abs(want - got) / got <= 0.06, f"{family} {method}: estimate {want} vs torch {got} bytes saved per layer"


# --------------------------------------------------------------------------- the H200 grid, replayed


def test_committed_h200_grid_stays_within_its_measured_accuracy(tmp_path):
    """The estimate replayed against the committed H200 measurement of 56 shapes: the peak of
    allocated tensors within 2 % everywhere; the device figure within 5 % at no fewer shapes than
    the committed report (48) and nowhere beyond 11 % (the one shape at the card's limit)."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "memory_estimate.py"), "--out", str(tmp_path),
                           "--report", str(GRID)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads((tmp_path / "memory-grid.json").read_text())["rows"]
    assert len(rows) == 56
    assert all(abs(r["ratio"]["allocated"] - 1) <= 0.02 for r in rows), [
        (r["size"], r["method"], r["seq"], r["micro_batch"], r["ratio"]["allocated"]) for r in rows
        if abs(r["ratio"]["allocated"] - 1) > 0.02]
    within = [r for r in rows if abs(r["ratio"]["device"] - 1) <= 0.05]
    assert len(within) >= 48
    assert max(abs(r["ratio"]["device"] - 1) for r in rows) <= 0.11
    assert {(r["size"], r["method"]) for r in rows} >= {(s, m) for s in ("1b", "8b") for m in ("full", "lora", "qlora")}


# --------------------------------------------------------------------------- the CPU trial: estimate vs peak RSS


def test_cpu_estimate_matches_the_measured_peak_rss_of_the_same_trial(tmp_path):
    """A trial whose model, optimizer and activations are most of its memory: the estimate it
    records before its first step against the peak RSS it measured, within the documented CPU
    tolerance; the weights and optimizer state, measured as tensors, match exactly."""
    from capture.manifest import load_unverified

    body = _llama_body(hidden_size=384, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=6,
                       num_key_value_heads=2, vocab_size=8000)
    _cfg(body + '[trial.precision]\ndtype = "fp32"\nautocast = false\n', tmp_path, seq=256, mb=4)
    key = tmp_path / "key"
    assert main(["keygen", "-o", str(key), "-C", "ci@capture"]) == 0
    out = tmp_path / "trial.toml"
    assert main(["trial", str(tmp_path / "t.toml"), "--device", "cpu", "--no-report", "--no-recovery", "--key", str(key),
                 "-o", str(out), "--workdir", str(tmp_path / "work")]) == 0
    mem = load_unverified(out).data["trial"]["memory"]
    est, measured = mem["estimate"], mem["measured"]
    assert mem["estimate_error"] == pytest.approx((est["total_bytes"] - measured["device_used_bytes"])
                                                 / measured["device_used_bytes"])
    print(f"CPU estimate error {mem['estimate_error']:+.1%}, model share {1 - mem['framework_overhead_bytes'] / est['total_bytes']:.0%}")
    assert abs(mem["estimate_error"]) <= CPU_TOLERANCE, mem["estimate_error"]
    model_share = (est["total_bytes"] - mem["framework_overhead_bytes"]) / est["total_bytes"]
    assert model_share > 0.3  # the test measures the model's memory, not the interpreter's
    assert abs(mem["terms"]["weights"]["error"]) < 0.01
    assert abs(mem["terms"]["optimizer_state"]["error"]) < 0.01

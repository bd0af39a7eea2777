"""Trial arithmetic and readings: statistics, the memory estimate against real H200 figures,
cost, the catalog, out-of-memory recognition, and device memory through a fake pynvml served
from the values read on the real H200 (tests/fixtures/h200/probe.json)."""

from __future__ import annotations

import json
import os
import statistics
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from capture.commands.trial import parse_bytes
from capture.costs import default_currency
from capture.errors import ConfigError, UsageError
from capture.trial.cost import PhaseTimer, Price, cost_table, project, resolve_price
from capture.trial.devmem import DeviceMemory, NvmlReader, peak_rss_bytes, reset_peak_rss, rss_bytes
from capture.trial.fit import Card, cards_fit, is_oom, load_catalog, oom_text
from capture.trial.measure import StepClock, flops_per_token, mfu, percentile, summarize
from capture.trial.memory import relative_error
from capture.trial.workload import count_params
from fakes import H200, fake_pynvml_h200

PROBE = json.loads((H200 / "probe.json").read_text())


@pytest.fixture(autouse=True)
def _no_user_catalog(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))  # the user's own catalog stays out


# --------------------------------------------------------------------------- statistics


def test_percentiles_match_numpy_linear_on_known_arrays():
    xs = [float(i) for i in range(1, 101)]
    assert percentile(xs, 50) == pytest.approx(50.5)
    assert percentile(xs, 90) == pytest.approx(90.1)
    assert percentile(xs, 99) == pytest.approx(99.01)
    rng = np.random.default_rng(0)
    ys = list(rng.exponential(size=37))
    for q in (0, 10, 50, 90, 99, 100):
        assert percentile(ys, q) == pytest.approx(float(np.percentile(ys, q)))


def test_summarize_known_steps():
    times = [1.0, 1.0, 1.0, 1.0, 2.0]  # one slow step
    waits = [0.0, 0.0, 0.5, 0.0, 0.5]
    s = summarize(times, waits, [100] * 5)
    assert s.steps == 5 and s.step_time_median_s == 1.0
    assert s.step_time_mean_s == pytest.approx(1.2)
    assert s.step_time_cv == pytest.approx(statistics.pstdev(times) / 1.2)  # population std / mean = 0.4/1.2
    assert s.step_time_cv == pytest.approx(1 / 3)
    assert s.step_time_p90_s == pytest.approx(1.6) and s.step_time_p99_s == pytest.approx(1.96)
    assert s.stall_share == pytest.approx(1.0 / 6.0)
    assert s.tokens_per_step == 100 and s.tokens_per_s == pytest.approx(500 / 6.0)
    steady = summarize([0.25] * 8, [0.0] * 8)
    assert steady.step_time_cv == 0.0 and steady.stall_share == 0.0 and steady.tokens_per_s is None
    with pytest.raises(ValueError):
        summarize([], [])
    with pytest.raises(ValueError):
        summarize([1.0], [0.0, 0.0])


def test_mfu_reproduces_the_h200_llama_figure():
    ll = PROBE["llama_1b"]
    fpt, formula = flops_per_token(ll["params"], ll["params"])
    assert fpt == 6 * ll["params"] and "6N" in formula
    # probe.json computed 6 * N * tokens / step / 989e12 with tokens/s = tokens / median step
    assert mfu(ll["tok_s"], ll["params"], ll["params"], 989e12) == pytest.approx(ll["mfu"], rel=1e-9)
    lora_fpt, _ = flops_per_token(ll["params"], 1_000_000)
    assert 4 * ll["params"] < lora_fpt < 6 * ll["params"]


def test_step_clock_measures_intervals_between_marks():
    c = StepClock()
    for _ in range(4):
        c.mark()
    d = c.durations_s()
    assert len(d) == 3 and all(x >= 0 for x in d) and c.marks == 4


# --------------------------------------------------------------------------- memory estimate


def _plan(model_toml: str, mb: int, seq: int, dtype: str = "bf16", autocast: bool = True, method: str = "full",
          optimizer: str = "adamw", device: str = "cuda"):
    from pathlib import Path

    from capture.trial import memory
    from capture.trial.config import parse

    text = (f'[trial]\nmethod = "{method}"\n[trial.model]\n{model_toml}\n[trial.optimizer]\nname = "{optimizer}"\n'
            f'[trial.precision]\ndtype = "{dtype}"\nautocast = {str(autocast).lower()}\n'
            f'[trial.batch]\nmax_seq_len = {seq}\nmicro_batch_size = {mb}\n[trial.data]\nsource = "synthetic"\n')
    return memory.plan_for(parse(text, "t.toml", Path("."), "t"), device)


LLAMA_1B = ('architecture = "llama"\n[trial.model.config]\nhidden_size = 2048\nintermediate_size = 5632\n'
            'num_hidden_layers = 16\nnum_attention_heads = 16\nnum_key_value_heads = 4\nvocab_size = 32000\n'
            'max_position_embeddings = 2048')


@pytest.mark.parametrize("name, model, mb, seq, alloc_tol, device_tol", [
    ("llama_1b", LLAMA_1B, 8, 2048, 0.02, 0.05),
    # GPT-2's Conv1D attention (views of one c_attn output) and its Python GELU are modelled less
    # closely than the Llama family the grid targets (docs/trial.md, "Memory estimate")
    ("gpt2_124m", 'architecture = "gpt2"', 16, 1024, 0.15, 0.20),
])
def test_estimate_against_real_h200_measurements(name, model, mb, seq, alloc_tol, device_tol):
    """The shapes probe.json trained on the H200 (bf16 autocast, fused AdamW): the replayed peak of
    allocated tensors against max_memory_allocated there, the device total against NVML."""
    from capture.trial import memory

    real = PROBE[name]
    plan = _plan(model, mb, seq)
    assert sum(p.numel for p in plan.params) == real["params"]  # counted from the model built on meta
    est = memory.estimate_plan(plan, mb, PROBE["ctx_overhead_bytes"], "CUDA context measured on the H200")
    names = [t.name for t in est.terms]
    assert names[:3] == ["weights", "optimizer_state", "gradients"] and "allocator_reserve" in names
    assert est.term("weights").inputs["by_storage"]["fp32"]["bytes"] == real["params"] * 4
    assert real["params"] * 8 <= est.term("optimizer_state").bytes < real["params"] * 8 + 2**20
    assert est.term("cuda_context").bytes == 650969088
    assert est.total_bytes == sum(t.bytes for t in est.terms)
    assert abs(relative_error(est.allocator_bytes, real["max_alloc"])) < alloc_tol
    assert abs(relative_error(est.total_bytes, real["nvml_used"])) < device_tol
    table = est.to_manifest()
    assert table["activations"]["inputs"]["tokens"] == mb * seq and "formula" in table["logits"]
    assert table["activations"]["inputs"]["saved_bytes_per_layer"] > 0


def test_estimate_lora_and_pure_bf16_and_sgd_terms():
    from capture.trial import memory

    tiny = ('architecture = "llama"\n[trial.model.config]\nhidden_size = 64\nintermediate_size = 128\n'
            'num_hidden_layers = 2\nnum_attention_heads = 4\nnum_key_value_heads = 2\nvocab_size = 300')
    lora = _plan(tiny, 2, 16, dtype="fp32", autocast=False, method="lora", device="cpu")
    shape = lora.shape
    assert shape.gated and shape.kv_heads == 2 and lora.vocab == 300
    adapters = [p for p in lora.params if p.kind == "lora"]
    trainable = sum(p.numel for p in lora.params if p.trainable)
    assert adapters and trainable == sum(p.numel for p in adapters)
    est = memory.estimate_plan(lora, 2)
    assert est.term("optimizer_state").bytes == trainable * 8 + 64 * len(adapters)  # fp32 moments; a 4-byte step each, 64-aligned
    assert est.term("autocast_weight_copies").bytes == 0 and est.term("framework_overhead") is None
    assert est.term("allocator_reserve") is None  # no caching allocator on a CPU
    pure = _plan(tiny, 2, 16, dtype="bf16", autocast=False, optimizer="sgd", device="cpu")
    weights = memory.estimate_plan(pure, 2).term("weights")
    exact = sum(p.numel for p in pure.params) * 2
    assert weights.inputs["by_storage"]["bf16"]["bytes"] == exact
    assert exact <= weights.bytes < exact + 512 * len(pure.params)  # the allocator rounds each tensor to 512 B
    assert memory.estimate_plan(pure, 2).term("optimizer_state").bytes == 0  # SGD without momentum
    assert relative_error(110, 100) == pytest.approx(0.1) and relative_error(1, None) is None


# --------------------------------------------------------------------------- cost


def test_cost_of_the_whole_trial_per_trained_token():
    timer = PhaseTimer(t0=0.0)
    timer.phases.update({"load": 600.0, "steps": 2400.0, "recovery": 300.0})
    out = cost_table(timer=timer, wall_total_s=3600.0, price=Price(4.0, "--price-per-hour"), trained_tokens=2_000_000,
                     completed_steps=100, projection=None, device_name="NVIDIA H200")
    assert out["trial_cost"] == pytest.approx(4.0)
    assert out["cost_per_million_trained_tokens"] == pytest.approx(2.0)
    assert out["wall_unaccounted_s"] == pytest.approx(300.0)
    assert out["phases"] == {"load_s": 600.0, "steps_s": 2400.0, "recovery_s": 300.0}
    none = cost_table(timer=timer, wall_total_s=10.0, price=None, trained_tokens=0, completed_steps=0,
                      projection=None, device_name="cpu")
    assert "trial_cost" not in none and "price_note" in none


def test_projection_adds_validation_and_checkpoints_at_the_schedule():
    # 16384 tokens a step, 0.2555 s a step (the H200 llama_1b shape), 1e9 target tokens
    p = project(1_000_000_000, "--target-tokens", 16384, 0.2555, validation_s=30.0, validation_every_steps=500,
                checkpoint_s=26.6, checkpoint_every_steps=1000, fixed_s=60.0)
    assert p.steps == 61036  # ceil(1e9 / 16384)
    assert p.train_s == pytest.approx(61036 * 0.2555)
    assert p.validation_s == pytest.approx(122 * 30.0)
    assert p.checkpoint_s == pytest.approx((61 + 1) * 26.6)
    assert p.total_s == pytest.approx(p.train_s + p.validation_s + p.checkpoint_s + 60.0)
    assert p.to_manifest(Price(3.6, "x"))["cost"] == pytest.approx(p.total_s / 3600 * 3.6)
    assert "cost" not in p.to_manifest(None)


def test_price_comes_from_the_flag_before_the_catalog():
    card = Card("H200 141GB", "nvidia", "H200", 1, 1.0, price_per_hour=3.0, source="mine.toml")
    assert resolve_price(5.0, card) == Price(5.0, "--price-per-hour", default_currency())
    assert resolve_price(None, card).per_hour == 3.0 and "mine.toml" in resolve_price(None, card).source
    assert resolve_price(None, None) is None


def test_parse_bytes_units():
    assert parse_bytes("85899345920") == 85899345920
    assert parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("141 GB") == 141 * 10**9 and parse_bytes("1.5GiB") == 3 * 2**29
    for bad in ("lots", "-1", "12 parsecs", "0"):
        with pytest.raises(UsageError, match="--memory-limit"):
            parse_bytes(bad)


# --------------------------------------------------------------------------- catalog and fit


def test_shipped_catalog_matches_the_names_the_tools_print():
    cat = load_catalog()
    assert {c.name for c in cat.cards} >= {"A100 80GB SXM", "H100 80GB SXM", "H200 141GB", "MI300X 192GB"}
    assert cat.match(PROBE["nvml"]["name"]).name == "H200 141GB"
    assert cat.match(PROBE["nvml"]["name"]).memory_bytes == PROBE["nvml"]["mem_total"]
    assert cat.match("NVIDIA A100-SXM4-80GB").peak_bf16_dense_flops == 312e12
    assert cat.match("NVIDIA H100 80GB HBM3").peak_bf16_dense_flops == 989e12
    assert cat.match("AMD Instinct MI300X").peak_bf16_dense_flops == 1307e12
    for other in ("NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200 NVL", "NVIDIA A100-PCIE-40GB", "CPU: AMD EPYC"):
        assert cat.match(other) is None, other


def test_catalog_override_replaces_by_name_and_adds(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    f = tmp_path / "mine.toml"
    f.write_text('[[accelerator]]\nname = "H200 141GB"\nmatch = "H200"\nmemory_bytes = 150754820096\n'
                 'peak_bf16_dense_flops = 989e12\nprice_per_hour = 3.5\n\n'
                 '[[accelerator]]\nname = "L40S"\nmatch = "L40S"\nmemory_bytes = 48305799168\n')
    cat = load_catalog(f)
    assert cat.get("H200 141GB").price_per_hour == 3.5 and cat.get("H200 141GB").source == str(f)
    assert cat.get("L40S").peak_bf16_dense_flops is None and cat.get("A100 80GB SXM") is not None
    assert cat.sources[-1] == str(f)
    user = tmp_path / "cfg" / "capture" / "accelerators.toml"
    user.parent.mkdir(parents=True)
    user.write_text('[[accelerator]]\nname = "A100 80GB SXM"\nmatch = "A100"\nmemory_bytes = 1\n')
    assert load_catalog().get("A100 80GB SXM").memory_bytes == 1


@pytest.mark.parametrize("text, message", [
    ('[[accelerator]]\nname = "X"\nmemory_bytes = 0\n', r"accelerator\[0\]\.memory_bytes: must be a positive integer"),
    ('[[accelerator]]\nmemory_bytes = 5\n', r"accelerator\[0\]\.name: required"),
    ('[[accelerator]]\nname = "X"\nmemory_bytes = 5\nmatch = "("\n', r"accelerator\[0\]\.match: not a regular expression"),
    ('[[accelerator]]\nname = "X"\nmemory_bytes = 5\nprice = 3\n', r"accelerator\[0\]\.price: unknown key"),
    ('[[accelerator]]\nname = "X"\nmemory_bytes = 5\nprice_per_hour = -3\n', r"accelerator\[0\]\.price_per_hour: must be a positive number"),
    ('[[accelerators]]\nname = "X"\n', r"accelerators: unknown key"),
    ('[[accelerator]\n', r"not valid TOML"),
])
def test_broken_catalog_names_the_entry(tmp_path, text, message):
    f = tmp_path / "cat.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_catalog(f)


def test_missing_catalog_file_is_a_usage_error(tmp_path):
    with pytest.raises(ConfigError, match="--catalog"):
        load_catalog(tmp_path / "nope.toml")


@pytest.mark.parametrize("loader", ["accelerators", "preflight"])
def test_a_catalog_file_is_read_as_hostile_input(tmp_path, monkeypatch, loader):
    """Both catalogs (the trial's accelerators.toml, preflight's SKUs) read their overlays the same
    way: a file over the config limit, a FIFO, bytes that are not UTF-8 are one ConfigError each,
    never a hang or a whole huge file in memory; the user's own file takes the same road."""
    from capture._safe_read import CONFIG_MAX_BYTES
    from capture.preflight import catalog as preflight_catalog

    load = load_catalog if loader == "accelerators" else preflight_catalog.load_catalog
    huge = tmp_path / "huge.toml"
    with open(huge, "wb") as f:
        f.truncate(CONFIG_MAX_BYTES + 1)  # sparse: nothing of it is on the disk
    with pytest.raises(ConfigError, match="over the"):
        load(huge)
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="is not a file"):
        load(fifo)  # opened for reading, a FIFO without a writer would block forever
    latin = tmp_path / "latin.toml"
    latin.write_bytes(b"# caf\xe9\n")
    with pytest.raises(ConfigError, match="cannot read"):
        load(latin)
    user = tmp_path / "cfg" / "capture" / f"{loader}.toml"
    user.parent.mkdir(parents=True)
    os.link(huge, user)
    with pytest.raises(ConfigError, match="over the"):
        load()


def test_cards_fit_with_headroom_on_the_h200_llama_measurement():
    used = PROBE["llama_1b"]["nvml_used"]  # 51.8 GB on the H200, device total
    cards = {c["name"]: c for c in cards_fit(used, 0.10, load_catalog(), load_catalog().get("H200 141GB"), "nvml")}
    assert all(c["fits"] for c in cards.values())
    assert cards["H200 141GB"]["tested"] and not cards["A100 80GB SXM"]["tested"]
    assert cards["A100 80GB SXM"]["usable_bytes"] == int(85899345920 * 0.9)
    assert cards["A100 80GB SXM"]["headroom_bytes"] == 85899345920 - used
    assert not any("step" in k or "flops" in k or "tokens" in k for c in cards.values() for k in c)  # no speed claims
    tight = {c["name"]: c["fits"] for c in cards_fit(80 * 10**9, 0.10, load_catalog(), None, "x")}
    assert tight == {"A100 80GB SXM": False, "H100 80GB SXM": False, "H200 141GB": True, "MI300X 192GB": True}


def test_oom_recognition_real_errors():
    with pytest.raises(RuntimeError) as info:  # the real CPU allocator's refusal
        torch.empty(1 << 62, dtype=torch.uint8)
    assert is_oom(info.value) and "can't allocate memory" in oom_text(info.value)
    assert is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. If reserved but unallocated ..."))
    assert oom_text(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. If reserved but unallocated")) \
        == "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB."
    assert is_oom(MemoryError())
    assert not is_oom(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) and not is_oom(ValueError("x"))


# --------------------------------------------------------------------------- device memory


def _nvml_with_usage(used: list[int], procs: list[tuple[int, int]]):
    """The H200's fake pynvml, with the used-memory readings and process list of a run."""
    fake = fake_pynvml_h200()
    real_info = fake.nvmlDeviceGetMemoryInfo
    readings = iter(used)

    def info(handle, version=None):
        mem = real_info(handle)
        mem.used = next(readings)
        mem.free = mem.total - mem.used
        return mem

    fake.nvmlDeviceGetMemoryInfo = info
    fake.nvmlDeviceGetComputeRunningProcesses = lambda h: [SimpleNamespace(pid=p, usedGpuMemory=u) for p, u in procs]
    return fake


def test_context_measured_as_device_used_minus_before_when_the_driver_hides_the_pid():
    nv = PROBE["nvml"]
    before, after = nv["mem_used_before_torch"], nv["mem_used_before_torch"] + PROBE["ctx_overhead_bytes"]
    fake = _nvml_with_usage([before, after, after + 10**9], procs=[(1, 5 * 10**9)])  # a container: foreign PID
    uuid = nv["uuid"].removeprefix("GPU-")
    dm = DeviceMemory(torch.device("cuda"), reader=NvmlReader(fake), device_key=uuid)
    dm.before_context()
    assert dm.context_bytes() == PROBE["ctx_overhead_bytes"] == 650969088
    used, source = dm.device_used()
    assert used == PROBE["ctx_overhead_bytes"] + 10**9 and "minus used before" in source


def test_process_usage_preferred_when_the_driver_lists_this_pid():
    nv = PROBE["nvml"]
    mine = PROBE["llama_1b"]["nvml_used"] - nv["mem_used_before_torch"]
    fake = _nvml_with_usage([nv["mem_used_before_torch"]] * 5, procs=[(os.getpid(), mine), (1, 123)])
    dm = DeviceMemory(torch.device("cuda"), reader=NvmlReader(fake), device_key=nv["uuid"].removeprefix("GPU-").upper().lower())
    dm.before_context()
    used, source = dm.device_used()
    assert used == mine and "this process" in source
    assert dm.total_bytes() == (nv["mem_total"], "nvml")


def test_another_process_device_memory_is_read_only_where_the_driver_lists_this_one():
    """The early reference process: where NVML lists processes, what it holds during the measured
    steps is read (0 when it holds nothing); where the driver hides PIDs (a container), there is
    no per-process figure, and the trial then starts it only after the steps."""
    from capture.trial import recover

    nv = PROBE["nvml"]
    uuid = nv["uuid"].removeprefix("GPU-")
    mine = PROBE["llama_1b"]["nvml_used"] - nv["mem_used_before_torch"]
    other = os.getpid() + 1
    listed = DeviceMemory(torch.device("cuda"), reader=NvmlReader(
        _nvml_with_usage([0] * 9, procs=[(os.getpid(), mine)])), device_key=uuid)
    assert listed.process_bytes(other) == 0 and listed.process_bytes(os.getpid()) == mine
    holding = DeviceMemory(torch.device("cuda"), reader=NvmlReader(
        _nvml_with_usage([0] * 9, procs=[(os.getpid(), mine), (other, 536870912)])), device_key=uuid)
    assert holding.process_bytes(other) == 536870912
    hidden = DeviceMemory(torch.device("cuda"), reader=NvmlReader(
        _nvml_with_usage([0] * 9, procs=[(1, 5 * 10**9)])), device_key=uuid)
    assert hidden.process_bytes(other) is None and hidden.process_bytes(os.getpid()) is None
    assert DeviceMemory(torch.device("cpu")).process_bytes(other) is None
    cuda = torch.device("cuda")
    assert recover.early_start(cuda, cores=16, process_figures=True) == recover.WITH_STEPS
    assert recover.early_start(cuda, cores=16, process_figures=False) == recover.AFTER_STEPS


def test_cpu_peak_rss_resets_per_phase():
    if not reset_peak_rss():
        pytest.skip("/proc/self/clear_refs not writable here")
    base = rss_bytes()
    block = bytearray(300 << 20)
    block[::4096] = b"x" * len(block[::4096])  # touch every page
    peak_with = peak_rss_bytes()
    del block
    assert peak_with >= base + (250 << 20)
    assert reset_peak_rss()
    assert peak_rss_bytes() < peak_with - (200 << 20)
    dm = DeviceMemory(torch.device("cpu"))
    r = dm.read()
    assert r.device_type == "cpu" and r.peak_allocated_bytes is None and "VmHWM" in r.device_used_source
    assert r.allocator_gap_bytes is None

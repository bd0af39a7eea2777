"""The trial report: terminal summary and self-contained HTML, from manifests complete or not.

The manifest is synthetic but built from the H200 readings in tests/fixtures/h200/probe.json
(llama_1b: allocator peaks, NVML device use, step median/CV, checkpoint write/size/load).
"""

from __future__ import annotations

import copy
import json
import re
import statistics
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

from capture import manifest as mf
from capture.trial import report

FIXTURES = Path(__file__).parent / "fixtures" / "h200"
EVIL = "<script>alert('x')</script>"


def _probe() -> dict:
    return json.loads((FIXTURES / "probe.json").read_text())


def _manifest() -> dict:
    p = _probe()
    llama, nvml, torch_ = p["llama_1b"], p["nvml"], p["torch"]
    median, cv = llama["step_med_s"], llama["step_cv"]
    # 20 measured steps spread around the measured median with the measured CV.
    rng = np.random.default_rng(0)
    steps = [float(median * (1 + cv * z)) for z in rng.standard_normal(20)]
    weights = llama["params"] * 4
    m = mf.new_manifest("trial")
    m["accelerator"] = {"vendor": "nvidia", "model": nvml["name"], "count": 1, "driver_version": nvml["driver"],
                        "runtime": "CUDA", "runtime_version": "13.0", "memory_per_device_bytes": nvml["mem_total"]}
    m["nvidia"] = {"driver_version": nvml["driver"], "cuda_driver_version": "13.0"}
    m["framework"] = {"name": "torch", "version": torch_["version"], "cuda_version": torch_["cuda"]}
    m["trial"] = {
        "config_source": "example:llama-1b",
        "run": {"name": "llama-1b", "device": "cuda", "device_name": nvml["name"], "method": "full",
                "params_total": llama["params"], "params_trainable": llama["params"], "trainable_share": 1.0,
                "max_seq_len": llama["seq"], "micro_batch_size": llama["mb"], "grad_accum": 1,
                "tokens_per_step": llama["seq"] * llama["mb"], "warmup_steps": 3, "measured_steps": 20, "seed": 1234,
                "model": {"source": "from_config", "architecture": "llama", "class": "LlamaForCausalLM"},
                "optimizer": {"name": "adamw", "lr": 1e-4, "weight_decay": 0.1, "fused": True},
                "precision": {"dtype": "bf16", "autocast": True, "weights_dtype": "float32"}},
        "memory": {
            "estimate": {"total_bytes": 45_000_000_000, "allocator_bytes": 44_349_030_912, "note": "estimate",
                         "weights": {"bytes": weights, "formula": "params_total x bytes_per_weight"},
                         "gradients": {"bytes": weights, "formula": "params_trainable x bytes_per_weight"},
                         "optimizer_state": {"bytes": 2 * weights, "formula": "params x 2 x 4"},
                         "activations": {"bytes": 44_349_030_912 - 4 * weights, "formula": "per token per layer"},
                         "framework_overhead": {"bytes": p["ctx_overhead_bytes"], "formula": "measured"}},
            "measured": {"device_type": "cuda", "peak_allocated_bytes": llama["max_alloc"],
                         "peak_reserved_bytes": llama["max_reserved"], "device_used_bytes": llama["nvml_used"],
                         "device_used_source": "NVML memory used"},
            "estimate_error": (45_000_000_000 - llama["nvml_used"]) / llama["nvml_used"],
        },
        "steps": {"step_time_s": steps, "warmup_step_time_s": [2.9, 0.6, 0.3], "data_wait_s": [0.0004] * 20,
                  "loss": [10.95 - 0.01 * i for i in range(20)]},
        "stats": {"step_time_median_s": statistics.median(steps), "step_time_p90_s": report.percentile(steps, 90),
                  "step_time_cv": cv, "tokens_per_s": llama["tok_s"], "mfu": llama["mfu"], "stall_share": 0.0016},
        "validation": {"duration_s": 1.02, "batches": 4, "loss": 10.71},
        "checkpoint": {"duration_s": llama["ckpt_write_s"], "size_bytes": llama["ckpt_bytes"],
                       "bytes_per_s": llama["ckpt_bytes"] / llama["ckpt_write_s"]},
        "fit": {"fits": True, "verdict": "fits: full steps completed with at least 10% of NVML total free", "headroom": 0.1,
                "cards": [{"name": "A100 80GB SXM", "memory_bytes": 85_899_345_920, "fits": True, "tested": False,
                           "headroom_bytes": 85_899_345_920 - llama["nvml_used"], "headroom_fraction": 0.397, "basis": "NVML"},
                          {"name": "H200 141GB", "memory_bytes": nvml["mem_total"], "fits": True, "tested": True,
                           "headroom_bytes": nvml["mem_total"] - llama["nvml_used"], "headroom_fraction": 0.656, "basis": "NVML"}]},
        "recovery": {"verdict": "bit-exact", "save_at_step": 2, "total_steps": 4, "fresh_process": True, "withheld": [],
                     "loss_diff": 0.0, "losses_uninterrupted": p["resume_losses"]["full"][:4],
                     "losses_resumed": p["resume_losses"]["full"][2:4],
                     "param_hash_uninterrupted": "sha256:" + "ab" * 32, "param_hash_resumed": "sha256:" + "ab" * 32,
                     "checkpoint_size_bytes": llama["ckpt_bytes"], "checkpoint_write_s": llama["ckpt_write_s"],
                     "restore_load_s": llama["ckpt_load_s"], "sensitivity_control": "bit-exact",
                     "sensitivity": [
                         {"component": "model", "applicable": True, "depends": True, "diverged_at_step": 3, "loss_diff": 0.66},
                         {"component": "rng_python", "applicable": True, "depends": False, "loss_diff": 0.0},
                         {"component": "rng_cuda", "applicable": True, "depends": True, "diverged_at_step": 3,
                          "loss_diff": -0.0074},
                         {"component": "scaler", "applicable": False,
                          "note": "not applicable: no grad scaler (only fp16 training uses one)"}]},
        "cost": {"wall_total_s": 95.0, "price_per_hour": 3.5, "trial_cost": 95.0 / 3600 * 3.5,
                 "cost_per_million_trained_tokens": 0.02, "phases": {"steps_s": 6.0, "recovery_s": 40.0}},
    }
    return m


SECTIONS = ("run", "memory", "steps", "stats", "validation", "checkpoint", "fit", "recovery", "cost")


def test_terminal_summary_shows_every_stage():
    text = report.render_terminal(_manifest(), colour=False)
    p = _probe()
    assert "NVIDIA H200 · driver 580.159.04 · CUDA 13.0 · torch 2.11.0+cu130 (CUDA 13.0)" in text
    assert "852,559,872 trainable of 852,559,872" in text
    assert "seq 2,048 · micro-batch 8" in text
    # estimate vs NVML device use, with the relative error the runner recorded
    assert "estimate 41.91 GiB vs measured 48.24 GiB device used (error -13.1 %)" in text
    assert re.search(r"measured peak allocated +43\.90 GiB", text)
    assert re.search(r"Steps +median 25\d\.\d ms, p90 2\d\d\.\d ms, CV 0\.73 %", text)
    assert "20 measured after 3 warm-up" in text
    assert "64,113 tok/s" in text and re.search(r"MFU \(6N\) +33\.16 %", text)
    assert f"{p['llama_1b']['ckpt_write_s']:.2f} s" in text
    assert re.search(r"H200 141GB +140\.40 GiB +92\.16 GiB \(65\.6 %\) .* yes +yes", text)
    assert "Recovery    bit-exact (checkpoint after step 2 of 4, restored in a fresh process)" in text
    assert re.search(r"rng_cuda +yes +3 +-0\.0074", text)
    assert re.search(r"rng_python +no\b", text)
    assert re.search(r"scaler +not applicable", text)
    assert re.search(r"0\.09236 \S+ for the whole trial", text)  # in the catalog's currency
    assert re.search(r"recovery +40\.00 s +42\.1 %", text)
    assert "\x1b" not in text
    assert max(len(line) for line in text.splitlines()) <= 120


def test_withheld_component_and_divergence_are_flagged():
    m = _manifest()
    m["trial"]["recovery"].update(verdict="diverged at step 3", diverged_at_step=3, loss_diff=-0.0074,
                                  withheld=["rng_cuda"], max_abs_param_diff=2.4e-4, param_hash_resumed="sha256:" + "cd" * 32)
    text = report.render_terminal(m, colour=False)
    assert "Recovery    diverged at step 3 (checkpoint after step 2 of 4" in text
    assert re.search(r"WITHHELD on purpose +rng_cuda → diverged at step 3", text)
    assert re.search(r"loss diff at divergence +-0\.0074 \(resumed − uninterrupted\)", text)
    assert re.search(r"parameter hash +differs", text)
    html_text = report.render_html(m)
    assert 'class="status bad"' in html_text and "rng_cuda → diverged at step 3" in html_text


def test_a_nondeterministic_step_is_told_apart_from_missing_state():
    """As on the H200 with llama-1b: a full restore diverged, and a second restore differed too."""
    m = _manifest()
    m["trial"]["recovery"].update(verdict="diverged at step 4", diverged_at_step=4, loss_diff=-0.000104,
                                  restore_repeat="differs from the first restore at step 4",
                                  deterministic_algorithms=False)
    text = report.render_terminal(m, colour=False, width=200)
    whole = ("differs from the first restore at step 4: the training step is not deterministic on this stack "
             "(torch deterministic algorithms were off)")
    assert re.search(r"second restore +" + re.escape(whole), text)
    assert whole in report.render_html(m)
    narrow = report.render_terminal(m, colour=False, width=80)  # wrapped to the width, never cut
    assert max(len(line) for line in narrow.splitlines()) <= 80
    assert whole in " ".join(narrow.split())
    m["trial"]["recovery"]["restore_repeat"] = "identical"
    assert "identical to the first: the checkpoint lacks state" in report.render_terminal(m, colour=False)


def test_colour_only_when_asked_or_tty(capsys):
    m = _manifest()
    assert "\x1b[32m" in report.render_terminal(m, colour=True)  # bit-exact in green
    assert "\x1b" not in report.render_terminal(m)  # pytest's stdout is not a TTY


def test_html_is_self_contained_and_plots_the_measured_steps(tmp_path):
    m = _manifest()
    path = report.write_html(m, tmp_path / "run.html")
    assert path == tmp_path / "run.html"
    assert [p.name for p in tmp_path.iterdir()] == ["run.html"]  # atomic: no temp file left
    text = path.read_text()
    assert text.startswith("<!DOCTYPE html>")
    assert "<script" not in text.lower() and "<link" not in text.lower() and " src=" not in text
    assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", text)  # only the SVG namespace URI
    svgs = re.findall(r"<svg.*?</svg>", text, re.S)
    assert len(svgs) == 2
    for svg in svgs:
        ET.fromstring(svg)  # well-formed: every string escaped
    steps_svg = next(s for s in svgs if 'aria-label="step time per step"' in s)
    mem_svg = next(s for s in svgs if 'aria-label="memory: estimate and measured"' in s)
    # 20 measured points + the 0.3 s warm-up step; the 2.9 s and 0.6 s warm-up steps are off the
    # scale (set by the measured steps) and drawn as triangles at the top edge
    assert steps_svg.count("<circle") == 21 and steps_svg.count("<path") == 2
    median = statistics.median(m["trial"]["steps"]["step_time_s"])
    assert f"median {report.fmt_seconds(median)}" in steps_svg and "p90 " in steps_svg
    assert "warm-up (excluded)" in steps_svg
    for label in ("estimate", "peak allocated", "peak reserved", "device used", "weights", "activations",
                  "framework overhead", "A100 80GB SXM 80.00 GiB", "H200 141GB = this device 140.40 GiB"):
        assert label in mem_svg
    assert mem_svg.count("<rect") == 5 + 3 + 5  # stacked terms, three measured bars, legend swatches


def test_every_string_is_escaped(tmp_path):
    m = _manifest()
    m["trial"]["run"]["name"] = EVIL
    m["trial"]["fit"]["cards"][0]["name"] = EVIL
    m["trial"]["recovery"]["sensitivity"][3]["note"] = EVIL
    m["trial"]["memory"]["estimate"][EVIL] = {"bytes": 1000, "formula": EVIL}
    m["trial"]["cost"][EVIL] = EVIL
    text = report.write_html(m, tmp_path / "r.html").read_text()
    assert "<script" not in text
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in text
    for svg in re.findall(r"<svg.*?</svg>", text, re.S):
        ET.fromstring(svg)


def test_terminal_neutralises_control_characters():
    m = _manifest()
    m["trial"]["run"]["name"] = "x\x1b[2J\x1b]0;pwned\x07y"
    text = report.render_terminal(m, colour=False)
    assert "\x1b" not in text and "\x07" not in text
    assert "x\\x1b[2J\\x1b]0;pwned\\x07y" in text


@pytest.mark.parametrize("section", SECTIONS)
def test_a_missing_stage_reads_not_measured(section, tmp_path):
    m = _manifest()
    del m["trial"][section]
    text = report.render_terminal(m, colour=False)
    report.write_html(m, tmp_path / "r.html")
    title = {"stats": None, "run": "Run", "memory": "Memory", "steps": None, "validation": "Validation",
             "checkpoint": "Checkpoint", "fit": "Fit", "recovery": "Recovery", "cost": "Cost"}[section]
    if title:
        assert re.search(rf"^{title} +not measured$", text, re.M), text


def test_steps_and_stats_both_missing():
    m = _manifest()
    del m["trial"]["steps"], m["trial"]["stats"]
    assert re.search(r"^Steps +not measured$", report.render_terminal(m, colour=False), re.M)
    assert report.step_time_svg(m) == ""


def test_skipped_stages_say_why():
    m = _manifest()
    m["trial"]["recovery"] = {"skipped": "--no-recovery"}
    m["trial"]["validation"] = {"skipped": "trial.data.validation_fraction = 0: no held-out data"}
    text = report.render_terminal(m, colour=False)
    assert "Recovery    skipped: --no-recovery" in text
    assert "Validation  skipped: trial.data.validation_fraction = 0" in text


@pytest.mark.parametrize("manifest", [
    {},
    {"schema_version": 1, "kind": "trial"},
    {"schema_version": 1, "trial": "not a table"},
    {"trial": {"steps": {"step_time_s": "oops", "loss": [None, "x"]}, "fit": "x", "memory": {"estimate": [1, 2]},
               "recovery": {"sensitivity": [1, "a", {"component": "model"}], "withheld": "rng_python"},
               "cost": {"phases": {"steps_s": "fast"}}, "stats": {"step_time_median_s": "n/a"}}},
    {"accelerator": "H200", "framework": [], "trial": {"run": {"params_trainable": "many", "model": 3}}},
], ids=["empty", "header-only", "trial-not-table", "wrong-types", "wrong-stack-types"])
def test_broken_or_foreign_manifests_never_crash(manifest, tmp_path):
    text = report.render_terminal(manifest, colour=False)
    assert text.startswith("capture trial report")
    html_text = report.write_html(manifest, tmp_path / "r.html").read_text()
    assert html_text.rstrip().endswith("</html>")


def test_empty_manifest_is_all_not_measured():
    text = report.render_terminal({"schema_version": 1, "kind": "trial"}, colour=False)
    for title in ("Run", "Memory", "Steps", "Validation", "Checkpoint", "Fit", "Recovery", "Cost"):
        assert re.search(rf"^{title} +not measured$", text, re.M)
    assert "no accelerator recorded" in text


def test_report_of_a_written_manifest_round_trips(tmp_path):
    """What the runner hands over is what a reader later parses back from TOML: same report."""
    m = _manifest()
    path = tmp_path / "trial.toml"
    mf.write(path, m)
    parsed = mf.parse_body(path.read_bytes())
    # TOML puts a table's plain keys before its sub-tables, so only the order of rows may differ.
    assert sorted(report.render_terminal(parsed, colour=False).splitlines()) == \
        sorted(report.render_terminal(copy.deepcopy(m), colour=False).splitlines())


def test_units_follow_the_key_names():
    assert report.fmt_value("size_bytes", 10_230_911_945) == "9.53 GiB"
    assert report.fmt_value("duration_s", 26.59) == "26.59 s"
    assert report.fmt_value("step_time_median_s", 0.2555) == "255.5 ms"
    assert report.fmt_value("bytes_per_s", 67_615_115) == "64.48 MiB/s"
    assert report.fmt_value("tokens_per_s", 64113.2) == "64,113 tok/s"
    assert report.fmt_value("stall_share", 0.0016) == "0.16 %"
    assert report.fmt_value("estimate_error", -0.131) == "-13.1 %"
    assert report.fmt_value("headroom", 0.1) == "10.00 %"
    assert report.fmt_value("fits", True) == "yes"
    assert report.fmt_value("wall_total_s", 7300) == "2.03 h"
    assert report.fmt_value("step_time_s", [0.1] * 20) == "20 values (100.0 ms .. 100.0 ms)"
    assert report.fmt_value("mfu_6n", 0.184216) == "18.42 %" and report.fmt_value("mfu_with_attention", 0.193382) == "19.34 %"
    names = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert report.fmt_value("target_modules", names) == ", ".join(names)  # names are shown, not "7 values"
    assert report.fmt_value("target_modules", [f"m{i}" for i in range(30)]).endswith("m19 and 10 more")


@pytest.mark.parametrize("q", [0, 10, 50, 90, 99, 100])
def test_percentile_matches_numpy(q):
    values = [0.31, 0.25, 0.27, 0.26, 0.9, 0.255, 0.2601]
    assert report.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_html_path_sits_next_to_the_manifest():
    assert report.html_path_for(Path("results/trial-tiny.toml")) == Path("results/trial-tiny.html")


PREFLIGHT = {"mode": "quick", "verdict": "warn", "duration_s": 12.3, "device_kind": "cuda", "checks": [
    {"name": "gemm_bf16", "device": 0, "verdict": "pass", "reason": "within the datasheet range", "value": 790.1,
     "unit": "TFLOP/s", "expected": "700-989 TFLOP/s (H200 SXM, datasheet dense bf16 989)"},
    {"name": "pcie_link", "verdict": "warn", "reason": "Gen4 x16, expected Gen5 x16", "value": "Gen4 x16"}]}
SCALING = {"world_size": 2, "device_type": "cuda", "collective": {"library": "nccl", "version": "2.28.9"},
           "batch": {"tokens_per_optimizer_step": 16384, "per_rank_micro_batch": 4, "per_rank_grad_accum": 1,
                     "method": "micro_batch divided by world_size"},
           "baseline": {"throughput_tokens_per_s": 64000.0, "step_time_median_s": 0.256},
           "ddp": {"throughput_tokens_per_s": 120000.0, "efficiency": 0.9375, "step_time_median_s": 0.137,
                   "step_time_p90_s": 0.139, "step_time_cv": 0.004, "peak_memory_per_rank_bytes": 48 * 2**30,
                   "comm_share": 0.12, "recovery": {"verdict": "bit-exact"}},
           "fsdp": {"throughput_tokens_per_s": 100000.0, "efficiency": 0.78125, "step_time_median_s": 0.164,
                    "peak_memory_per_rank_bytes": 30 * 2**30, "comm_share_note": "not attributable",
                    "recovery": {"verdict": "diverged at step 3"}},
           "reading": "choose DDP for throughput (120000 vs 100000 tokens/s), FSDP for memory"}


def test_sections_run_in_trial_order_with_preflight_and_scaling():
    m = _manifest()
    m["preflight"], m["scaling"] = PREFLIGHT, SCALING
    titles = [s.title for s in report.sections(m)]
    assert titles == ["Stack", "Preflight", "Run", "Memory", "Steps", "Validation", "Checkpoint", "Fit", "Recovery",
                      "Scaling", "Cost"]
    text = report.render_terminal(m, colour=False, width=160)
    assert "Preflight   warn (quick mode, cuda, 12.30 s)" in text
    assert re.search(r"gemm_bf16 +0 +pass +790 TFLOP/s +700-989 TFLOP/s", text)
    assert re.search(r"pcie_link +warn +Gen4 x16", text)
    assert re.search(r"1 device +DDP x2 +FSDP x2", text)  # side by side
    assert re.search(r"useful throughput +64,000 tok/s +120,000 tok/s +100,000 tok/s", text)
    assert re.search(r"scaling efficiency +1 \(by definition\) +0\.938 +0\.781", text)
    assert re.search(r"restore in fresh processes +- +bit-exact +diverged at step 3", text)
    assert "Scaling     choose DDP for throughput" in text
    html_text = report.render_html(m)
    assert "<h2>Scaling</h2>" in html_text and "<h2>Preflight</h2>" in html_text and "FSDP x2" in html_text


def test_verdict_panel_comes_first():
    m = _manifest()
    m["preflight"], m["scaling"] = PREFLIGHT, SCALING
    panel = {v.label: v for v in report.verdict_panel(m, "signature valid, signer trusted by alice@lab")}
    assert list(panel) == ["signature", "stack", "preflight", "fits", "recovery", "tokens/s", "MFU", "trial cost",
                           "cost per million tokens at steady state", "projected cost and time to the target",
                           "scaling"]
    assert panel["signature"].state == "ok" and panel["recovery"].state == "ok" and panel["preflight"].state == "warn"
    assert panel["fits"].value == "fits on H200 141GB, 65.6 % headroom"
    assert panel["tokens/s"].value == "64,113 tok/s (step CV 0.73 %)"
    assert panel["MFU"].value == "33.2 %"
    assert panel["scaling"].value == "DDP x2 efficiency 0.938, FSDP x2 efficiency 0.781"
    text = report.render_terminal(m, colour=False, signature="signature valid, signer trusted by alice@lab")
    assert text.index("signature valid") < text.index("\nStack ")
    html_text = report.render_html(m, "NOT signed")
    assert html_text.index('aria-label="verdict"') < html_text.index("<h2>Stack</h2>")
    assert '<div class="bad">NOT signed</div>' in html_text


def test_a_high_cv_is_called_out_and_no_python_none_anywhere(tmp_path):
    m = _manifest()
    m["trial"]["stats"]["step_time_cv"] = 0.12
    del m["trial"]["cost"]["price_per_hour"]
    panel = {v.label: v for v in report.verdict_panel(m)}
    assert panel["tokens/s"].value.endswith("(step CV 12.00 %, HIGH)") and panel["tokens/s"].state == "warn"
    for broken in ({}, {"trial": {"recovery": {"verdict": None}, "stats": {"tokens_per_s": None}}}, m):
        assert "None" not in report.render_terminal(broken, colour=False)
        assert "None" not in report.render_html(broken)


def test_recovery_fields_a_newer_stage_adds_are_shown():
    """Helper stages add tables to [trial.recovery]: arrays of tables become tables, verdicts stand out."""
    m = _manifest()
    m["trial"]["recovery"]["component_verdict"] = "all restored state matches"
    m["trial"]["recovery"]["restored"] = [{"component": "model", "hash_saved": "sha256:aa", "hash_restored": "sha256:aa",
                                           "equal": True},
                                          {"component": "rng_cuda", "hash_saved": "sha256:bb", "equal": False}]
    text = report.render_terminal(m, colour=False, width=160)
    assert re.search(r"COMPONENT VERDICT +all restored state matches", text)
    assert re.search(r"restored: component +hash saved +hash restored +equal", text)
    assert re.search(r"rng_cuda +sha256:bb +no", text)


QLORA_TRAINING = {  # trial.run.training of the QLoRA run pinned at manifests/nvidia-h100-80gb-hbm3-x1/2026-12-06/13704c81bf7e.toml
    "compile": {"enabled": False, "requested": False},
    "gradient_checkpointing": {"enabled": True, "layers": 32, "layers_checkpointed": 32, "use_reentrant": False},
    "loss": {"implementation": "LlamaForCausalLM.forward(labels=...): cross-entropy over the full logits", "name": "standard"},
    "quantization": {"blocksize": 64, "compute_dtype": "bf16", "double_quant": True, "layers": 224,
                     "library": "bitsandbytes", "library_version": "0.50.2", "method": "nf4"},
}


def _run_rows(m: dict) -> dict[str, str]:
    from capture.trial.report.sections import _run_section

    return dict(_run_section(m).rows)


def test_the_settings_that_make_a_run_fit_read_one_row_each_in_terminal_and_html(tmp_path):
    """Issue 22: the attention kernel, checkpointing, quantization, compile and the loss as they
    ran, each a row of its own (they were one run-on ``gradient_checkpointing=enabled=no, ...``
    line, and the attention implementation was not shown at all)."""
    m = _manifest()
    m["trial"]["run"]["model"] = {**(m["trial"]["run"].get("model") or {}), "attn_implementation": "sdpa"}
    m["trial"]["run"]["training"] = copy.deepcopy(QLORA_TRAINING)
    rows = _run_rows(m)
    assert rows["attention"] == "sdpa"
    assert rows["checkpointing"] == "on: 32 of 32 decoder layers, non-reentrant"
    assert rows["quantization"] == "nf4 (bitsandbytes 0.50.2): 224 layers, compute bf16, double quant, block 64"
    assert rows["compile"] == "off"
    assert rows["loss"] == "standard: LlamaForCausalLM.forward(labels=...): cross-entropy over the full logits"
    assert "training" not in rows and not any("=" in v for k, v in rows.items() if k in ("checkpointing", "quantization"))
    text = report.render_terminal(m, colour=False, width=100)
    assert re.search(r"\n +checkpointing +on: 32 of 32 decoder layers, non-reentrant\n", text)
    html_path = report.write_html(m, tmp_path / "r.html")
    html = html_path.read_text()
    assert "on: 32 of 32 decoder layers, non-reentrant" in html and "attention" in html

    # What differs from what was asked says both; a key a newer trial adds is still shown.
    training = m["trial"]["run"]["training"]
    training["compile"] = {"enabled": False, "requested": True}
    training["gradient_checkpointing"] = {"enabled": False, "layers": 32, "layers_checkpointed": 0}
    training["quantization"] = {"method": "none"}
    training["loss"] = {"name": "chunked", "implementation": "capture's chunked linear cross-entropy in torch",
                        "chunk_tokens": 4096, "liger_unavailable": "ImportError: no module named liger_kernel"}
    training["offload"] = {"enabled": True}
    rows = _run_rows(m)
    assert rows["compile"] == "asked for, not applied" and rows["checkpointing"] == "off" and rows["quantization"] == "none"
    assert rows["loss"] == ("chunked: capture's chunked linear cross-entropy in torch; 4,096-token chunks "
                            "(liger-kernel not used: ImportError: no module named liger_kernel)")
    assert rows["offload"] == "enabled yes"
    compiled = {**training, "compile": {"enabled": True, "requested": True, "target": "decoder"}}
    m["trial"]["run"]["training"] = compiled
    assert _run_rows(m)["compile"] == "on (decoder)"


def test_terms_measured_alone_are_a_table_beside_their_estimates():
    """trial.memory.terms (a QLoRA run on an H100, as pinned) was one run-on
    ``weights=measured_bytes=..., estimate_bytes=...`` line; now a row a term with its error."""
    m = _manifest()
    m["trial"]["memory"]["terms"] = {
        "allocator_reserve": {"basis": "peak reserved - peak allocated (the caching allocator's blocks beyond tensors)",
                              "estimate_bytes": 5721741312, "measured_bytes": 4645220352, "miss_bytes": 1076520960},
        "optimizer_state": {"basis": "the optimizer's state tensors after the steps, each storage once",
                            "error": 0.0006782495515847312, "estimate_bytes": 335773696, "params_with_state": 448,
                            "state_bytes": 335546112, "state_bytes_by_dtype": {"float32": 335546112}},
        "weights": {"error": -7.849378451328098e-05, "estimate_bytes": 5870067712, "measured_bytes": 5870528512},
    }
    from capture.trial.report.sections import _memory_section

    sec = _memory_section(m)
    assert not any(label == "terms" for label, _ in sec.rows)
    grid = next(g for g in sec.grids if g.headers[0] == "term measured alone")
    by_term = {r[0]: r for r in grid.rows}
    assert by_term["allocator reserve"][1:4] == ["4.33 GiB", "5.33 GiB", "+23.2 %"]
    assert by_term["optimizer state"][1:4] == ["320.00 MiB", "320.22 MiB", "+0.1 %"]
    assert by_term["optimizer state"][4].endswith("params with state 448; state bytes by dtype float32=320.00 MiB")
    assert by_term["weights"][1:] == ["5.47 GiB", "5.47 GiB", "-0.0 %", ""]
    text = report.render_terminal(m, colour=False, width=100)
    assert re.search(r"allocator reserve +4\.33 GiB +5\.33 GiB +\+23\.2 %", text)


def test_a_sub_table_reads_one_row_per_entry_not_a_run_on_line():
    """``plan = {checkpoint=full, restore=..., ...}`` was one ``k=v, k=v`` line wrapped over four;
    more than two entries are now rows of their own under the table's row, deeper tables indented
    again, two or fewer stay on the line as ``label value``."""
    from capture.trial.report.sections import _generic_rows, recovery_extras

    rec = {"plan": {"checkpoint": "full", "early_build": True, "memory": {"limit_bytes": 2**30, "peak_bytes": 2**29,
                                                                          "overlap": False}},
           "deterministic": {"enabled": False, "requested": "auto"},
           "second_resume": {"verdict": "bit-exact", "step": 3, "components": 7, "note": "from the second checkpoint"}}
    rows, _ = recovery_extras(rec, set())
    assert rows == [("plan", ""), ("  checkpoint", "full"), ("  early build", "yes"), ("  memory", ""),
                    ("    limit", "1.00 GiB"), ("    peak", "512.00 MiB"), ("    overlap", "no"),
                    ("deterministic", "enabled no · requested auto"),
                    ("second resume", "BIT-EXACT"), ("  step", "3"), ("  components", "7"),
                    ("  note", "from the second checkpoint")]
    assert _generic_rows({"allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "expandable_segments": False}}) == [
        ("allocator settings", "PYTORCH_CUDA_ALLOC_CONF (empty) · expandable segments no")]  # a variable's name as written
    assert _generic_rows({"schedule": {"every_steps": 50, "batches": 4}, "timings": {"a_s": 1.0, "b_s": 0.5, "c_s": 2}}) == [
        ("schedule", "every steps 50 · batches 4"), ("timings", ""), ("  a", "1.00 s"), ("  b", "500.0 ms"), ("  c", "2.00 s")]


def test_the_page_shows_the_nesting_the_terminal_shows(tmp_path):
    """Indented rows (a term under the estimate, an entry under its sub-table) were flush left on
    the page, so an entry read as a row of its own; now they carry their level."""
    m = _manifest()
    m["trial"]["recovery"]["plan"] = {"checkpoint": "full", "restore": "one build", "memory": {"a_bytes": 1, "b_bytes": 2, "c": 3}}
    html = report.write_html(m, tmp_path / "r.html").read_text()
    assert '<td class="k">plan</td>' in html and '<td class="k i1">checkpoint</td>' in html
    assert '<td class="k i2">a</td>' in html and "td.i1{padding-left" in html
    assert re.search(r'<td class="fig">\+?-?\d[\d.]* %</td>', html)  # a short figure in a grid never wraps


def test_mfu_both_ways_reads_three_rows_with_their_flops_and_formulas():
    """Issue 22 item 4, as pinned for the QLoRA run on an H100: the 6N figure and the one with
    attention FLOPs, each named with its FLOPs a token and formula, and the peak (these were
    thirteen generic rows: 'peak flops 9.89e+14', 'mfu 6n 0.184216', ...)."""
    from capture.trial.report.sections import _steps_section

    m = _manifest()
    six = "4 x params_total + 2 x params_trainable (6N for a full fine-tune; attention scores not counted)"
    m["trial"]["stats"].update({
        "mfu": 0.184216, "mfu_6n": 0.184216, "mfu_with_attention": 0.193382,
        "flops_formula": six, "flops_formula_6n": six, "flops_per_token": 3.237e10,
        "flops_per_token_with_attention": 3.398e10, "attention_flops_per_token": 1.611e9,
        "attention_flops_formula": "6 x layers x attention_width x seq_len (causal: half the score matrix)",
        "attention_flops_inputs": {"attention_width": 4096, "layers": 32, "seq_len": 2048},
        "peak_flops": 9.89e14, "peak_flops_source": "catalog: H100 80GB SXM, dense bf16 peak"})
    rows = dict(_steps_section(m).rows)
    assert rows["MFU (6N)"] == f"18.42 % · 32.37 GFLOP a token = {six}"
    assert rows["MFU with attention"] == ("19.34 % · 33.98 GFLOP a token, of which attention 1.611 GFLOP = 6 x layers "
                                          "x attention_width x seq_len (causal: half the score matrix) "
                                          "(attention width 4,096, layers 32, seq len 2,048)")
    assert rows["peak"] == "989 TFLOP/s (catalog: H100 80GB SXM, dense bf16 peak)"
    assert not {"mfu", "mfu 6n", "peak flops", "flops per token", "attention flops inputs"} & set(rows)
    del m["trial"]["stats"]["mfu"], m["trial"]["stats"]["mfu_6n"], m["trial"]["stats"]["mfu_with_attention"]
    m["trial"]["stats"]["mfu_note"] = "not computed: no peak FLOP/s for 'CPU: AMD EPYC' in the accelerator catalog"
    rows = dict(_steps_section(m).rows)
    assert "MFU (6N)" not in rows and rows["mfu note"].startswith("not computed")

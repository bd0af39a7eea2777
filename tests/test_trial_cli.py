"""`capture trial` end to end, in-process through capture._cli.main, on the real CPU: real
transformers models, real peft, a real signing key, real out-of-memory under RLIMIT_AS."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from capture import manifest as mf
from capture import signing
from capture._cli import main
from capture.errors import EXIT_USAGE
from capture.trial.config import example_names, load_example
from capture.trial.recover_steps import MAPPED_READ

SMALL = """
[trial]
name = "small"
seed = 5
warmup_steps = 1
measured_steps = 3
[trial.model]
source = "from_config"
architecture = "gpt2"
[trial.model.config]
vocab_size = 257
n_positions = 64
n_embd = 64
n_layer = 2
n_head = 2
resid_pdrop = 0.1
bos_token_id = 256
eos_token_id = 256
[trial.batch]
max_seq_len = 64
micro_batch_size = 4
[trial.validation]
every_steps = 10
batches = 2
[trial.checkpoint]
every_steps = 20
"""


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch):
    """A fresh config folder: the default signing key is created there on first use."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    monkeypatch.delenv("CAPTURE_KEY", raising=False)
    monkeypatch.chdir(tmp_path)


def _verified(path: Path, tmp_path: Path) -> dict:
    """Signature first (by the key capture created and trusted), then parse."""
    raw = path.read_bytes()
    allowed = signing.AllowedSigners.load(tmp_path / "cfg" / "capture" / "allowed_signers")
    _info, body = signing.verify_signed_bytes(raw, allowed, str(path))
    return mf.parse_body(body, str(path))


def _small(tmp_path: Path, text: str = SMALL, name: str = "small.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_tiny_example_end_to_end_holds_every_result(tmp_path, capsys):
    out = tmp_path / "tiny.toml"
    assert main(["trial", "--example", "tiny", "-o", str(out)]) == 0
    stdout, stderr = capsys.readouterr()
    assert stdout.rstrip().endswith(str(out)) and "memory estimate before running" in stderr
    m = _verified(out, tmp_path)
    said = stderr.split("capture: memory estimate before running: ", 1)[1].split("\ncapture: ", 1)[0]
    assert all(len(x) <= 100 for x in ("capture: memory estimate before running: " + said).splitlines())
    from capture.fmt import bytes_str

    for term, v in m["trial"]["memory"]["estimate"].items():  # every non-zero term, name and figure together
        if isinstance(v, dict) and v.get("bytes"):
            assert f"{term} {bytes_str(v['bytes'])}" in said
    assert m["kind"] == "trial"
    keys = list(m)
    assert keys.index("host") < keys.index("trial")  # the stack first, results after it
    t = m["trial"]
    assert t["config_source"] == "example:tiny" and t["config_toml"] == load_example("tiny").source_text

    run = t["run"]
    assert run["method"] == "full" and run["device"] == "cpu" and run["params_total"] == run["params_trainable"] > 100_000
    assert run["model"]["architecture"] == "gpt2" and run["optimizer"]["name"] == "adamw"
    assert (run["max_seq_len"], run["micro_batch_size"], run["grad_accum"]) == (128, 8, 1)
    assert run["precision"]["dtype"] == "fp32" and run["data"]["tokenizer"].startswith("bytes")
    assert run["validation_schedule"] == {"every_steps": 50, "batches": 4}

    mem = t["memory"]
    est = mem["estimate"]
    for term in ("weights", "gradients", "optimizer_state", "activations", "logits", "framework_overhead"):
        assert est[term]["bytes"] >= 0 and "formula" in est[term] and "inputs" in est[term]
    assert est["weights"]["bytes"] == run["params_total"] * 4
    assert est["total_bytes"] == sum(v["bytes"] for v in est.values() if isinstance(v, dict))
    meas = mem["measured"]
    assert meas["device_used_bytes"] > est["weights"]["bytes"] and "VmHWM" in meas["device_used_source"]
    assert -0.9 < mem["estimate_error"] < 2.0

    n = run["measured_steps"]
    steps = t["steps"]
    assert len(steps["step_time_s"]) == len(steps["data_wait_s"]) == len(steps["loss"]) == n
    assert len(steps["warmup_step_time_s"]) == run["warmup_steps"] and steps["clock"] == "perf_counter"
    assert all(w <= s for w, s in zip(steps["data_wait_s"], steps["step_time_s"]))
    assert steps["loss"][-1] < 5.6  # below ln(257): the model learned something from the corpus
    s = t["stats"]
    assert s["step_time_median_s"] > 0 and s["step_time_p90_s"] <= s["step_time_p99_s"] <= s["step_time_max_s"]
    assert 0 <= s["stall_share"] < 1 and s["tokens_per_s"] > 0 and "mfu" not in s and "mfu_note" in s

    v = t["validation"]
    assert v["duration_s"] > 0 and v["batches"] == 4 and v["loss"] > 0
    c = t["checkpoint"]
    assert c["fsync"] is True and c["size_bytes"] > run["params_total"] * 4 and c["bytes_per_s"] > 0
    assert not list(tmp_path.glob(".capture-trial-*"))  # scratch removed

    f = t["fit"]
    assert f["fits"] is True and f["headroom"] == 0.1 and {c["name"] for c in f["cards"]} >= {"H200 141GB", "MI300X 192GB"}
    assert "recovery" in t and isinstance(t["recovery"], dict)

    cost = t["cost"]
    assert cost["trained_tokens"] == (run["warmup_steps"] + n) * run["tokens_per_step"]
    for phase in ("import_framework_s", "fingerprint_s", "load_s", "estimate_s", "steps_s", "validation_s",
                  "checkpoint_s"):
        assert cost["phases"][phase] >= 0
    assert cost["wall_total_s"] >= sum(cost["phases"].values()) - 1e-6
    assert "price_note" in cost

    rep = t["report"]
    html = out.with_suffix(".html")
    assert rep["html"] == html.name and rep["html_sha256"] == hashlib.sha256(html.read_bytes()).hexdigest()

    # the fresh-process restore is bit-exact on CPU, and every field written is documented
    rec = t["recovery"]
    assert rec["verdict"] == "bit-exact" and rec["fresh_process"] is True
    # per-component restored-state equality, checked in the fresh process before any step
    assert [r["component"] for r in rec["restored_state"]] == rec["components_saved"]
    assert all(r["equal"] for r in rec["restored_state"])
    assert rec["restored_state_verdict"] == f"all {len(rec['components_saved'])} components equal to what was saved"
    assert rec["deterministic"]["enabled"] is False  # auto: off on a CPU
    assert c["format"] == "torch.save" and c["blocked_s"] == c["durable_s"] == c["duration_s"]
    assert {x["component"] for x in rec["sensitivity"] if x.get("depends")} >= {"model", "optimizer", "rng_torch_cpu",
                                                                                "data_position"}
    # the early build is decided from what the trial measured (here: the CPU's memory)
    from capture.trial.recover import budget_from_trial

    budget = budget_from_trial(t)
    assert budget is not None and budget.peak_bytes > f["measured_bytes"] // 2 and budget.fits_early_build()
    assert rec["memory_budget"]["overlap"] is rec["memory_budget"]["early_build"] is True
    assert rec["plan"] == {"checkpoint": "full", "restore": "one build, reloaded per restore", "early_build": True,
                           "fresh_processes": "started while another trains",
                           "host_memory": "default (a CPU trial)", "second_read": MAPPED_READ}
    assert rec["data_order"]["equal"] is True and rec["resume_again"]["verdict"] == "bit-exact"
    from test_docs import undocumented

    assert undocumented(m) == []


def test_lora_switch_records_measured_trainable_parameters(tmp_path):
    out = tmp_path / "lora.toml"
    assert main(["trial", str(_small(tmp_path)), "--method", "lora", "--steps", "2", "--warmup", "1",
                 "--no-recovery", "--no-preflight", "--no-report", "-o", str(out)]) == 0
    t = _verified(out, tmp_path)["trial"]
    run = t["run"]
    assert run["method"] == "lora" and 0 < run["params_trainable"] < run["params_total"]
    assert run["lora"]["target_modules"] == ["c_attn"]  # peft's default for GPT-2, resolved
    # rank, alpha and dropout as peft holds them (the defaults: 8, 16, 0.05); the rank is the one
    # the adapter's matrices have: c_attn maps 64 to 192 in each of the 2 layers
    lora = run["lora"]
    assert (lora["rank"], lora["alpha"], lora["dropout"]) == (8, 16.0, 0.05)
    assert lora["adapter_params"] == run["params_trainable"] == lora["rank"] * (64 + 192) * 2
    assert t["overrides"] == {"method": "lora", "measured_steps": 2, "warmup_steps": 1}
    assert t["config_toml"] == SMALL and t["config_source"] == str(tmp_path / "small.toml")
    est = t["memory"]["estimate"]  # only the adapter trains: its fp32 moments, its gradients at most
    assert est["optimizer_state"]["bytes"] == pytest.approx(2 * run["params_trainable"] * 4, rel=0.05)
    assert est["gradients"]["bytes"] <= run["params_trainable"] * 4 * 1.05
    assert t["memory"]["terms"]["optimizer_state"]["state_bytes_by_dtype"]["float32"] >= 2 * run["params_trainable"] * 4
    assert len(t["steps"]["step_time_s"]) == 2
    # the checkpoint stage writes what a LoRA run writes: the adapter and its optimizer, not the base
    c = t["checkpoint"]
    assert c["model_state"] == "adapter" and c["size_bytes"] < run["params_total"] * 4
    assert t["recovery"] == {"skipped": "--no-recovery"} and t["report"] == {"skipped": "--no-report"}
    assert not out.with_suffix(".html").exists()


def test_catalog_override_gives_mfu_and_price_on_the_tested_device_only(tmp_path):
    cat = tmp_path / "cat.toml"
    cat.write_text('[[accelerator]]\nname = "this CPU"\nmatch = "^CPU"\nmemory_bytes = 8589934592\n'
                   'peak_bf16_dense_flops = 1e12\nprice_per_hour = 2.0\n')
    cfg = _small(tmp_path, SMALL + '[trial.precision]\ndtype = "bf16"\nautocast = true\n')
    out = tmp_path / "bf16.toml"
    assert main(["trial", str(cfg), "--catalog", str(cat), "--no-recovery", "--no-preflight", "--no-report",
                 "--target-tokens", "1000000", "-o", str(out)]) == 0
    t = _verified(out, tmp_path)["trial"]
    s = t["stats"]
    assert s["peak_flops"] == 1e12 and str(cat) in s["peak_flops_source"] and "bf16" in s["peak_flops_source"]
    assert s["mfu"] == pytest.approx(s["tokens_per_s"] * 6 * t["run"]["params_total"] / 1e12)
    est = t["memory"]["estimate"]
    # bf16 copies of the weights every matmul reads (the tied embedding/head once), saved for
    # backward; position embedding, norms and biases are not matmul weights that autocast keeps
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.pytorch_utils import Conv1D

    with torch.device("meta"):
        gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=257, n_positions=64, n_embd=64, n_layer=2, n_head=2))
    matmul = gpt2.transformer.wte.weight.numel() + sum(m.weight.numel() for m in gpt2.modules() if isinstance(m, Conv1D))
    assert est["autocast_weight_copies"]["bytes"] == pytest.approx(2 * matmul, rel=0.01)
    cost = t["cost"]
    assert cost["price_per_hour"] == 2.0 and "this CPU" in cost["price_source"]
    assert cost["trial_cost"] == pytest.approx(cost["wall_total_s"] / 3600 * 2.0)
    assert cost["cost_per_million_trained_tokens"] == pytest.approx(cost["trial_cost"] / (cost["trained_tokens"] / 1e6))
    proj = cost["projection"]
    assert proj["optimizer_steps"] == -(-1_000_000 // 256) and proj["cost"] == pytest.approx(proj["total_s"] / 3600 * 2.0)
    cards = {c["name"]: c for c in t["fit"]["cards"]}
    assert cards["this CPU"]["tested"] and not cards["H200 141GB"]["tested"]
    assert all(set(c) <= {"name", "memory_bytes", "usable_bytes", "fits", "margin_bytes", "headroom_bytes",
                          "headroom_fraction", "tested", "basis"} for c in cards.values())


def test_find_max_batch_against_a_memory_limit_on_cpu(tmp_path):
    import torch  # noqa: F401 - the trial imports these in this process: the budget sits above them
    import transformers  # noqa: F401
    from transformers import GPT2LMHeadModel  # noqa: F401

    from capture.trial.devmem import rss_bytes

    cfg = _small(tmp_path, SMALL.replace("n_layer = 2", "n_layer = 1"))
    limit = int(((rss_bytes() or 0) + (120 << 20)) / 0.9)  # ~120 MiB above this process's resident set
    out = tmp_path / "max.toml"
    assert main(["trial", str(cfg), "--find-max-batch", "--memory-limit", str(limit), "--max-batch", "512",
                 "--steps", "1", "--warmup", "0", "--no-recovery", "--no-preflight", "--no-report",
                 "-o", str(out)]) == 0
    f = _verified(out, tmp_path)["trial"]["fit"]
    search = f["search"]
    assert search["limit_bytes"] == limit and search["limit_source"] == "--memory-limit" and search["headroom"] == 0.1
    cands = {c["micro_batch"]: c for c in search["candidates"]}
    best = search["max_micro_batch"]
    assert cands[best]["fits"] and cands[best]["device_used_bytes"] <= search["usable_bytes"]
    assert best < 512, "a 120 MiB budget cannot hold 512 sequences of 64 tokens"
    assert not cands[best + 1]["fits"] and "usable" in cands[best + 1]["reason"]  # bisection closed the gap
    assert search["candidates"][0]["micro_batch"] == 1 and search["start_micro_batch"] > 1  # from the estimate, not 1, 2, 4
    assert all(c["fits"] == (c["micro_batch"] <= best) for c in search["candidates"] if c["fits"])


OOM_SCRIPT = textwrap.dedent("""
    import re, resource, sys
    import torch, transformers, peft  # the big libraries map their code before the limit
    from transformers import GPT2LMHeadModel  # noqa: F401
    from capture._cli import main
    status = open("/proc/self/status").read()
    vm = int(re.search(r"VmSize:\\s+(\\d+)", status).group(1)) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + (1200 << 20), resource.RLIM_INFINITY))
    sys.exit(main(sys.argv[1:]))
""")


def test_out_of_memory_is_reported_as_does_not_fit(tmp_path):
    """A real allocation failure: the address space capped ~1.2 GiB above the start, a micro-batch
    of 2048 sequences; the trial must finish, signed, and say "does not fit", not crash."""
    out = tmp_path / "oom.toml"
    env = dict(os.environ, XDG_CONFIG_HOME=str(tmp_path / "cfg"), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "-c", OOM_SCRIPT, "trial", str(_small(tmp_path)), "--micro-batch", "2048",
                           "--steps", "1", "--warmup", "0", "--no-preflight", "--no-report", "-o", str(out)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "does not fit" in proc.stderr
    t = _verified(out, tmp_path)["trial"]
    f = t["fit"]
    assert f["fits"] is False and f["verdict"].startswith("does not fit: out of memory at training step 1")
    assert re.search(r"can't allocate memory|MemoryError|out of memory", f["oom"])
    assert t["stats"] == {"skipped": "the run did not fit (training step 1 of 1)"}
    assert t["recovery"] == {"skipped": "the training step did not fit"}
    assert t["validation"] == {"skipped": "the training step did not fit"}
    assert t["memory"]["estimate"]["activations"]["inputs"]["micro_batch"] == 2048
    assert t["cost"]["trained_tokens"] == 0 and t["cost"]["completed_optimizer_steps"] == 0


@pytest.mark.parametrize("args, message", [
    ([], "give a config file or --example NAME"),
    (["x.toml", "--example", "tiny"], "give a config file or --example NAME"),
    (["--example", "tiny", "--headroom", "1.5"], r"--headroom: must be in \[0, 1\), got 1.5"),
    (["--example", "tiny", "--memory-limit", "lots"], "--memory-limit: 'lots' is not a size"),
    (["--example", "tiny", "--price-per-hour", "-1"], "--price-per-hour: '-1': expected a number above 0"),
    (["--example", "tiny", "--price-per-hour", "inf"], "--price-per-hour: 'inf': expected a number above 0"),
    (["--example", "tiny", "--steps", "0"], "--steps: must be >= 1, got 0"),
    (["--example", "huge"], "--example: no example named 'huge'"),
    (["missing.toml"], "missing.toml: no such file"),
    (["--example", "tiny", "-o", "no/such/folder/m.toml"], "-o: folder no/such/folder does not exist"),
])
def test_usage_errors_exit_2_with_one_line(tmp_path, capsys, args, message):
    try:
        code = main(["trial", *args])
    except SystemExit as exc:  # a flag's own type check ends in argparse, with the same one line
        code = exc.code
    assert code == EXIT_USAGE
    err = capsys.readouterr().err
    assert re.search(message, err) and "Traceback" not in err and err.startswith("error: ")


def test_broken_config_file_names_the_key_and_writes_nothing(tmp_path, capsys):
    cfg = _small(tmp_path, SMALL + "[trial.optimizer]\nlr = -1\n")
    assert main(["trial", str(cfg), "-o", str(tmp_path / "m.toml")]) == EXIT_USAGE
    assert "error: trial.optimizer.lr: must be > 0, got -1" in capsys.readouterr().err
    assert not (tmp_path / "m.toml").exists() and not list(tmp_path.glob(".capture-trial-*"))


def test_a_loss_that_goes_nan_is_a_result_said_everywhere(tmp_path, capsys):
    """lr = 1e30 is a finite number and trains to a NaN loss: the trial still runs (tokens/s are
    real), and the stderr line, [trial.stats] and the report's verdict panel all say from which
    measured step the loss was not finite."""
    cfg = _small(tmp_path, SMALL + "[trial.optimizer]\nlr = 1e30\n")
    out = tmp_path / "nan.toml"
    assert main(["trial", str(cfg), "-o", str(out), "--steps", "3", "--no-recovery", "--no-preflight",
                 "--no-report"]) == 0
    err = capsys.readouterr().err
    stats = _verified(out, tmp_path)["trial"]["stats"]
    assert stats["loss_finite"] is False and stats["loss_first_nonfinite_step"] >= 1
    assert f"the loss is not finite from measured step {stats['loss_first_nonfinite_step']}" in err
    assert main(["show", str(out), "--allowed-signers", str(tmp_path / "cfg" / "capture" / "allowed_signers")]) == 0
    shown = capsys.readouterr().out
    assert f"NOT FINITE from measured step {stats['loss_first_nonfinite_step']}" in shown


def test_list_examples_and_default_output_name(tmp_path, capsys):
    assert main(["trial", "--list-examples"]) == 0
    assert capsys.readouterr().out.split() == example_names() == ["llama-1b", "llama-3.1-8b-full", "llama-3.1-8b-lora",
                                                                  "llama-3.1-8b-qlora", "tiny"]
    cfg = _small(tmp_path, name="exp-7.toml")
    assert main(["trial", str(cfg), "--steps", "1", "--warmup", "0", "--no-recovery", "--no-preflight",
                 "--no-report"]) == 0
    printed = Path(capsys.readouterr().out.strip().splitlines()[-1])
    # the config file's stem names it (exp-7.toml), not trial.name
    assert re.fullmatch(r"trial-exp-7-\d{8}T\d{6}Z\.toml", printed.name) and printed.parent == tmp_path
    assert _verified(printed, tmp_path)["trial"]["run"]["name"] == "small"


def test_the_reference_process_starts_while_validation_and_checkpoint_run(tmp_path):
    """A deterministic check runs its reference in a fresh process; that process is started when
    the measured steps end, so its imports overlap validation, checkpoint and fit instead of
    adding to the recovery stage (on an 8B LoRA run, ~16 s of the stage's 75)."""
    out = tmp_path / "det.toml"
    assert main(["trial", str(_small(tmp_path)), "--steps", "2", "--warmup", "1", "--recovery-deterministic",
                 "--no-preflight", "--no-report", "-o", str(out)]) == 0
    t = _verified(out, tmp_path)["trial"]
    rec, phases = t["recovery"], t["recovery"]["phases"]
    assert rec["deterministic"]["enabled"] is True and rec["verdict"] == "bit-exact"
    assert phases["reference_started_early"] is True
    assert phases["reference_started"] == "when the measured steps ended"  # a CPU: the steps keep their cores
    assert phases["restore_started"] == "when the measured steps ended" and phases["restore_start_wait_s"] >= 0
    # it was waiting before the stage began: at least validation and checkpoint ran in between
    between = t["cost"]["phases"]["validation_s"] + t["cost"]["phases"]["checkpoint_s"]
    assert phases["reference_head_start_s"] >= between > 0
    assert 0 <= phases["reference_start_wait_s"] <= phases["reference_wall_s"]
    from test_docs import undocumented

    assert undocumented(_verified(out, tmp_path)) == []


def test_on_an_accelerator_the_reference_process_starts_with_the_measured_steps(tmp_path, monkeypatch):
    """Where the steps wait on an accelerator and cores are spare, the reference process starts
    with the measured steps (its imports were longer than validation, checkpoint and fit at 8B).
    The rule is forced here, on the CPU, to check the wiring: the process it started is the one
    the stage used, and it had the steps' time as well."""
    from capture.trial import recover

    assert recover.early_start(torch.device("cpu"), cores=64) == recover.AFTER_STEPS
    assert recover.early_start(torch.device("cuda"), cores=2) == recover.AFTER_STEPS
    assert recover.early_start(torch.device("cuda"), cores=16) == recover.WITH_STEPS
    monkeypatch.setattr(recover, "early_start", lambda device, cores=None, process_figures=True: recover.WITH_STEPS)
    out = tmp_path / "det.toml"
    assert main(["trial", str(_small(tmp_path)), "--steps", "2", "--warmup", "1", "--recovery-deterministic",
                 "--no-preflight", "--no-report", "-o", str(out)]) == 0
    t = _verified(out, tmp_path)["trial"]
    phases = t["recovery"]["phases"]
    assert t["recovery"]["verdict"] == "bit-exact"
    assert phases["reference_started_early"] is True and phases["reference_started"] == "with the measured steps"
    cost = t["cost"]["phases"]
    assert phases["reference_head_start_s"] >= cost["steps_s"] + cost["validation_s"] + cost["checkpoint_s"] > 0
    # the first restoring process too: its start is counted from the go-ahead the stage gave it
    # (what its imports still took after that, then its early build)
    assert phases["restore_started"] == "with the measured steps"
    assert phases["restore_head_start_s"] >= cost["steps_s"] + cost["validation_s"] + cost["checkpoint_s"]
    assert 0 <= phases["restore_start_wait_s"] <= phases["worker_start_s"]


def test_a_run_that_does_not_fit_stops_the_reference_process_it_started(tmp_path, monkeypatch):
    """The steps ran out of memory: no recovery stage follows, and the process started with them
    is stopped at once (not left waiting on its stdin until the trial ends)."""
    from capture.trial import recover, runner, worker_proc

    monkeypatch.setattr(recover, "early_start", lambda device, cores=None, process_figures=True: recover.WITH_STEPS)
    started: list[worker_proc.Worker] = []
    real = recover.start_early

    def spy(*args, **kwargs):
        early = real(*args, **kwargs)
        started.extend(early.workers().values())
        return early

    monkeypatch.setattr(recover, "start_early", spy)
    monkeypatch.setattr(runner, "is_oom", lambda exc: True)
    stopped_before_fit: list[bool] = []
    real_fit = runner._fit_table

    def fit_table(*args, **kwargs):
        stopped_before_fit.append(all(w.proc.poll() is not None for w in started))
        return real_fit(*args, **kwargs)

    monkeypatch.setattr(runner, "_fit_table", fit_table)

    def fail(self, batches):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    from capture.trial import workload

    monkeypatch.setattr(workload.Workload, "train_step_async", fail)
    out = tmp_path / "oom.toml"
    assert main(["trial", str(_small(tmp_path)), "--steps", "2", "--warmup", "1", "--recovery-deterministic",
                 "--no-preflight", "--no-report", "-o", str(out)]) == 0
    assert len(started) == 2 and stopped_before_fit == [True]  # the reference and the first restoring process
    t = _verified(out, tmp_path)["trial"]
    assert t["recovery"] == {"skipped": "the training step did not fit"}

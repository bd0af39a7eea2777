"""The scaling step when one device is not enough (issue 24 item 5).

Real torchrun launches on the CPU (gloo): FSDP's meta-device build checked tensor by tensor against
the single-device build; a per-rank memory limit (RLIMIT_DATA) that the single-device baseline and
DDP exceed while FSDP over 2 ranks fits; the smaller FSDP shapes measured on a sub-mesh when one
device does not fit, and the efficiency taken against the smallest that fits.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from capture.errors import UsageError
from capture.trial import scaling, scaling_args
from capture.trial.config import load_config, load_example
from capture.trial.scaling import BatchPlan, derive_batch
from capture.trial.scaling_table import results_tables
from capture.trial.workload import corpus_text
from tiny_tokenizer import save_tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20


def _args(*argv: str) -> scaling_args.ScalingOptions:
    p = argparse.ArgumentParser()
    scaling_args.add_arguments(p)
    p.add_argument("--no-recovery", action="store_true")
    opts = scaling_args.ScalingOptions.from_args(p.parse_args(list(argv)))
    assert opts is not None
    return opts


def _tiny_text(**subs: str) -> str:
    text = load_example("tiny").source_text
    for key, value in subs.items():
        text, n = re.subn(rf"(?m)^{key}\s*=.*$", f"{key} = {value}", text)
        assert n == 1, key
    return text


def _with_model(text: str, model_toml: str) -> str:
    """The tiny example with its [trial.model] tables replaced."""
    start, end = text.index("[trial.model]"), text.index("[trial.lora]")
    return text[:start] + model_toml + "\n" + text[end:]


LLAMA = """[trial.model]
source = "from_config"
architecture = "llama"

[trial.model.config]
vocab_size = 300
hidden_size = 64
intermediate_size = 128
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
max_position_embeddings = 128
"""


# --------------------------------------------------------------------------- flags


def test_offload_and_memory_limit_flags():
    opts = _args("--nproc", "2", "--fsdp-offload", "--rank-memory-limit", "80GiB")
    assert opts.fsdp_offload is True and opts.rank_memory_limit == 80 * 2**30
    assert _args("--nproc", "2").fsdp_offload is False and _args("--nproc", "2").rank_memory_limit is None
    with pytest.raises(UsageError, match=r"^--fsdp-offload: applies to FSDP, and --strategy ddp measures no FSDP"):
        _args("--nproc", "2", "--strategy", "ddp", "--fsdp-offload")
    with pytest.raises(UsageError, match=r"^--rank-memory-limit: 'lots' is not a size"):
        _args("--nproc", "2", "--rank-memory-limit", "lots")
    for flag in (["--fsdp-offload"], ["--rank-memory-limit", "1GiB"]):
        with pytest.raises(UsageError, match=rf"^{flag[0]}: belongs to the scaling step, which --nproc N turns on"):
            _args(*flag)


def test_cli_flags_are_one_line_errors(tmp_path: Path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "capture", "trial", "--example", "tiny", "--device", "cpu",
                           "--nproc", "2", "--strategy", "ddp", "--fsdp-offload", "-o", str(tmp_path / "m.toml")],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: --fsdp-offload: applies to FSDP") and "Traceback" not in proc.stderr
    assert not (tmp_path / "m.toml").exists()


# --------------------------------------------------------------------------- the smallest N that fits


def test_ladder_doubles_below_the_world_and_skips_what_cannot_split():
    config = load_example("tiny").with_overrides(micro_batch_size=4)  # grad_accum 1
    assert [p.world_size for p in scaling.ladder(config, 8)] == [2, 4]
    assert [p.world_size for p in scaling.ladder(config, 2)] == []
    odd = load_example("tiny").with_overrides(micro_batch_size=2)
    assert [p.world_size for p in scaling.ladder(odd, 8)] == [2]  # 2 sequences cannot split over 4
    for p in scaling.ladder(config, 8):
        assert p.tokens_per_optimizer_step == p.baseline_tokens_per_optimizer_step


def _shape(tps: float, world: int, mem: int = 100 * MIB) -> dict:
    rank = {"rank": 0, "tokens_measured": 640, "step_time_median_s": 1.0, "step_time_p90_s": 1.1, "step_time_cv": 0.01,
            "step_time_total_s": 640 / tps, "peak_memory_bytes": mem, "comm_share": 0.3}
    return {"fits": True, "world_size": world, "ranks": [rank], "measured_steps": 10, "warmup_steps": 1,
            "tokens_measured": 640, "losses": [1.0], "final_loss": 1.0, "profiled_steps": 2, "memory_basis": "m"}


OOM = {"fits": False, "verdict": "does not fit: out of memory on rank 0", "oom": "OutOfMemoryError: x", "oom_rank": 0}


def test_efficiency_against_the_smallest_n_that_fits():
    plan, smaller = derive_batch(8, 1, 8, 16), [derive_batch(8, 1, 2, 16), derive_batch(8, 1, 4, 16)]
    items = {"baseline": {"fits": False, "verdict": "does not fit on one device: out of memory in warm-up step 1"},
             "fsdp@2": dict(OOM), "fsdp@4": _shape(400.0, 4), "ddp": dict(OOM), "fsdp": _shape(600.0, 8)}
    t = results_tables(items, plan, smaller, ("ddp", "fsdp"), {}, None, 2, 4)
    assert t["efficiency_reference"]["world_size"] == 4 and t["efficiency_reference"]["shape"] == "FSDP x4"
    assert [s["fits"] for s in t["smaller_shapes"]] == [False, True]
    # Per device: 600/8 against 400/4 -> 0.75; twice the devices gave 1.5x.
    assert t["fsdp"]["efficiency"] == pytest.approx(0.75) and t["fsdp"]["speedup"] == pytest.approx(1.5)
    assert t["ddp"] == dict(OOM, world_size=8)  # a verdict, no figures, no efficiency
    table = dict(t, world_size=8)
    line = scaling.reading(table)
    assert line.startswith("one device does not fit; choose FSDP, the only shape that fits on 8 ranks")
    assert "DDP does not fit" in line and line.endswith("efficiency is against FSDP x4, the smallest N that fits")
    text = scaling.render_scaling(dict(table, reading=line))
    header = next(ln for ln in text.splitlines() if "1 device" in ln)
    assert header.index("1 device") < header.index("FSDP x2") < header.index("FSDP x4") < header.index("DDP x8")
    eff_row = next(ln for ln in text.splitlines() if ln.strip().startswith("scaling efficiency"))
    assert eff_row.split()[-3:] == ["(def.)", "-", "0.75"]
    assert "DDP x8: does not fit: out of memory on rank 0 (OutOfMemoryError: x)" in text


def test_report_section_shows_what_did_not_fit():
    from capture.trial.report import scaling_section

    plan = derive_batch(8, 1, 2, 16)
    t = results_tables({"baseline": {"fits": False, "verdict": "does not fit on one device: out of memory in warm-up step 1",
                                     "oom": "OutOfMemoryError: y"}, "ddp": dict(OOM), "fsdp": _shape(128.0, 2)},
                       plan, [], ("ddp", "fsdp"), {}, None, 2, 4)
    t = dict(t, world_size=2, reading=scaling.reading(dict(t, world_size=2)))
    sec = scaling_section({"scaling": t})
    rows = {r[0]: r[1:] for r in sec.grids[0].rows}
    assert rows["fits"] == ["no (out of memory)", "no (out of memory)", "yes"]
    assert rows["scaling efficiency"][0] == "-"  # one device is no reference when it does not fit
    assert dict(sec.rows)["efficiency against"].startswith("FSDP x2: one device does not fit")
    assert dict(sec.rows)["1 device"] == "does not fit on one device: out of memory in warm-up step 1 (OutOfMemoryError: y)"


def test_efficiency_against_one_device_when_it_fits_and_the_full_world_when_nothing_smaller_does():
    plan = derive_batch(8, 1, 2, 16)
    base = {"fits": True, "step_times_s": [1.0, 1.0], "tokens_measured": 256, "measured_steps": 2, "peak_memory_bytes": 1}
    t = results_tables({"baseline": base, "ddp": _shape(192.0, 2), "fsdp": _shape(128.0, 2)}, plan, [], ("ddp", "fsdp"),
                       {}, None, 2, 4)
    assert t["efficiency_reference"]["world_size"] == 1 and t["baseline"]["verdict"] == "fits on one device"
    assert t["ddp"]["efficiency"] == pytest.approx(192 / (2 * 128)) and t["fsdp"]["efficiency"] == pytest.approx(0.5)
    assert "smallest N" not in scaling.reading(dict(t, world_size=2))
    t = results_tables({"baseline": {"fits": False, "verdict": "does not fit on one device"}, "fsdp": _shape(128.0, 2)},
                       plan, [], ("fsdp",), {}, None, 2, 4)
    assert t["efficiency_reference"]["shape"] == "FSDP x2" and t["fsdp"]["efficiency"] == pytest.approx(1.0)
    assert scaling.reading(dict(t, world_size=2)).endswith(
        "efficiency is against FSDP x2, the smallest N that fits (1 by definition: no smaller shape fits)")
    t = results_tables({"baseline": {"fits": False}, "ddp": dict(OOM), "fsdp": dict(OOM)}, plan, [], ("ddp", "fsdp"),
                       {}, None, 2, 4)
    assert "efficiency_reference" not in t
    assert scaling.reading(dict(t, world_size=2)) == ("one device does not fit; DDP nor FSDP does not fit on 2 ranks "
                                                      "either; try --fsdp-offload, or more devices")


def test_out_of_memory_marker_becomes_a_result_not_a_failure(tmp_path: Path):
    out = tmp_path / "result.json"
    script = (f"import json; open({str(out)!r} + '.rank1.oom', 'w').write(json.dumps({{'item': 'ddp', 'rank': 1, "
              "'reason': 'RuntimeError: can not allocate'}));"
              f"open({str(out)!r} + '.rank0.error', 'w').write('rank 0: RuntimeError: Connection closed by peer\\n');"
              "import sys; sys.exit(1)")
    with pytest.raises(scaling.RankOutOfMemory) as info:
        scaling.run_launch([sys.executable, "-c", script], os.environ, tmp_path / "l.log", out, 60)
    assert (info.value.item, info.value.rank, info.value.reason) == ("ddp", 1, "RuntimeError: can not allocate")
    # A marker cut short by a rank stopped meanwhile is not read as one: the error line is the answer.
    (tmp_path / "result.json.rank1.oom").write_text('{"item": "dd')
    with pytest.raises(scaling.LaunchFailed, match=r"Connection closed by peer$") as info:
        scaling.run_launch([sys.executable, "-c", "import sys; sys.exit(1)"], os.environ, tmp_path / "l.log", out, 60)
    assert not isinstance(info.value, scaling.RankOutOfMemory)


# --------------------------------------------------------------------------- real launches


def test_sharded_build_equals_the_single_device_build(tmp_path: Path):
    """Meta device, FSDP2 shards, rank 0's CPU copy sent tensor by tensor: every parameter and
    buffer (Llama's non-persistent rotary inv_freq included) equals the single-device build, for a
    model from config, with LoRA, from pretrained files, and with CPU offload; each rank holds half."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import torch

    torch.manual_seed(7)
    hf = AutoConfig.for_model("llama", vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    AutoModelForCausalLM.from_config(hf).save_pretrained(tmp_path / "llama-files")
    save_tiny_tokenizer(tmp_path / "llama-files", [corpus_text()])
    cases = {
        "gpt2": _tiny_text(),
        "gpt2-offload": _tiny_text(),
        "llama-lora": _with_model(_tiny_text(method='"lora"', target_modules='["q_proj", "v_proj"]'), LLAMA),
        "llama-pretrained": _with_model(_tiny_text(tokenizer='"model"'), f'[trial.model]\nsource = "local"\npath = "{tmp_path / "llama-files"}"\n'),
    }
    specs = []
    for name, text in cases.items():
        (tmp_path / f"{name}.toml").write_text(text)
        specs.append(f"{name}={tmp_path / f'{name}.toml'}" + (":offload" if name.endswith("offload") else ""))
    out = tmp_path / "out.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(ROOT / "tests" / "scripts" / "sharded_build.py"), str(out), *specs],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert sorted(results) == sorted(cases)
    for name, r in results.items():
        assert r["equal"], (name, r["mismatched"])
        assert sum(r["local_numel"]) == r["total_numel"] == r["params_total"], name  # shards, nothing twice
        assert max(r["local_numel"]) < 0.6 * r["total_numel"], name
        assert r["losses"][1] == r["losses"][1] and r["losses"][0] != r["losses"][1], name  # finite, it trains
        assert r["info"]["materialization"].startswith("meta device"), name
    assert "model.rotary_emb.inv_freq" in results["llama-pretrained"]["buffers"]
    assert results["llama-pretrained"]["info"]["weights"].startswith("pretrained")
    assert results["gpt2"]["info"]["weights"].startswith("from config") and results["gpt2"]["info"]["offload"] == "none"
    assert results["gpt2-offload"]["info"]["offload"].startswith("parameters, gradients and optimizer state on the CPU")


def _big_config(tmp_path: Path):
    """A 25M-parameter GPT-2 (8 layers of 512): fp32 AdamW state ~400 MiB on one device, half per
    rank under FSDP over 2, so a limit between the two separates them with ~70 MiB either side."""
    text = _tiny_text(n_embd="512", n_layer="8", n_head="8", n_positions="32", max_seq_len="32",
                      micro_batch_size="2", grad_accum="1")
    (tmp_path / "big.toml").write_text(text)
    return load_config(tmp_path / "big.toml").with_overrides(device="cpu", warmup_steps=1, measured_steps=2)


def test_fsdp_fits_under_a_per_rank_limit_the_baseline_and_ddp_exceed(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # thread stacks count in RLIMIT_DATA: the same on every machine
    config = _big_config(tmp_path)
    t = scaling.run_scaling(config, _args("--nproc", "2", "--rank-memory-limit", "340MiB", "--no-recovery",
                                          "--dist-dir", str(tmp_path / "dist")), tmp_path)
    base = t["baseline"]
    assert base["fits"] is False and base["verdict"].startswith("does not fit on one device: out of memory in ")
    assert "can't allocate memory" in base["oom"] or "MemoryError" in base["oom"]
    assert t["ddp"]["fits"] is False and t["ddp"]["verdict"].startswith("does not fit: out of memory on rank")
    assert [r["after_item"] for r in t["relaunches"]] == ["ddp"]  # the launch ended; FSDP ran in the next
    f = t["fsdp"]
    assert f["fits"] is True and f["throughput_tokens_per_s"] > 0 and [r["rank"] for r in f["ranks"]] == [0, 1]
    assert f["tokens_measured"] == config.tokens_per_step * 2 and f["tokens_per_optimizer_step"] == config.tokens_per_step
    assert f["materialization"].startswith("meta device") and f["weights"].startswith("from config")
    # Building: rank 1 allocated its shard only, rank 0 also the full copy it sends from (its CPU is its device here).
    grew = [r["build_peak_memory_bytes"] - r["memory_before_build_bytes"] for r in f["ranks"]]
    assert grew[1] < 0.75 * f["param_bytes_total"] and grew[0] >= f["param_bytes_total"]  # measured: 54 and 156 of 97 MiB
    assert t["efficiency_reference"]["shape"] == "FSDP x2" and f["efficiency"] == pytest.approx(1.0)
    assert t["reading"].startswith("one device does not fit; choose FSDP, the only shape that fits on 2 ranks")
    assert "efficiency is against FSDP x2, the smallest N that fits" in t["reading"]
    limit = t["rank_memory_limit"]
    assert limit["bytes"] == 340 * MIB and "RLIMIT_DATA" in limit["how"]
    for r in limit["per_rank"]:
        assert r["rlimit_data_bytes"] == r["data_segment_before_bytes"] + 340 * MIB
    assert t["env_set_by_capture"]["MALLOC_MMAP_THRESHOLD_"] == str(2**20)
    assert "does not fit" in scaling.render_scaling(t)


def test_smaller_shapes_on_a_sub_mesh_when_one_device_does_not_fit(tmp_path: Path, monkeypatch):
    """4 ranks: with the baseline recorded as not fitting (carried, as a relaunch carries it), FSDP
    is measured on ranks 0-1 (the other two wait), fits, and FSDP x4 is taken against it. With
    --fsdp-offload, which reaches the ranks and is recorded."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    config = load_example("tiny").with_overrides(device="cpu", warmup_steps=1, measured_steps=2, micro_batch_size=4)
    args = _args("--nproc", "4", "--strategy", "fsdp", "--no-recovery", "--fsdp-offload")
    plan = scaling.plan_scaling(config, args)
    base = tmp_path / "dist"
    base.mkdir()
    job = scaling.measure_job(config, args, plan, base, 600)
    assert [e["world_size"] for e in job["ladder"]] == [2]
    env, _ = scaling.child_environment("cpu", 4)
    carried = {"baseline": {"fits": False, "verdict": "does not fit on one device: planted"}}
    measure, _, relaunches, _ = scaling.launch_measure(job, args, base, env, 600, done=carried)
    assert relaunches == []
    smaller = [BatchPlan.from_manifest(e["plan"]) for e in job["ladder"]]
    t = results_tables(measure["items"], plan, smaller, ("fsdp",), {}, None, 2, 4)
    two = t["smaller_shapes"][0]
    assert two["fits"] is True and two["world_size"] == 2 and [r["rank"] for r in two["ranks"]] == [0, 1]
    assert two["tokens_measured"] == config.tokens_per_step * 2  # the same global batch on 2 ranks
    assert measure["items"]["fsdp@2"]["batch"]["per_rank_micro_batch"] == 2
    assert t["efficiency_reference"]["shape"] == "FSDP x2"
    four = t["fsdp"]
    assert [r["rank"] for r in four["ranks"]] == [0, 1, 2, 3] and four["tokens_measured"] == config.tokens_per_step * 2
    assert four["efficiency"] == pytest.approx(four["throughput_tokens_per_s"] / (2 * two["throughput_tokens_per_s"]))
    assert t["baseline"]["verdict"] == "does not fit on one device: planted"
    assert four["offload"].startswith("parameters, gradients and optimizer state on the CPU")
    assert four["optimizer_device"] == "cpu" and two["offload"] == four["offload"]


def test_a_rank_killed_by_the_kernel_is_named_with_the_way_out(tmp_path: Path):
    """Real torchrun, a rank that gets SIGKILL (as the OOM killer sends it to a CPU rank past the
    host's memory): no traceback, no error file, so the launcher's own words are read for it."""
    die = tmp_path / "die.py"
    die.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           "--max-restarts", "0", str(die)]
    with pytest.raises(scaling.LaunchFailed, match=r"^scaling: rank process \d+ was killed by SIGKILL: most likely "
                                                   r"the kernel's OOM killer \(the host's or the memory cgroup's "
                                                   r"memory ran out\)$") as info:
        scaling.run_launch(cmd, os.environ, tmp_path / "l.log", tmp_path / "r.json", 120)
    assert info.value.hint.startswith("--rank-memory-limit BYTES caps each rank") and str(tmp_path / "l.log") in info.value.hint
    assert "\n" not in info.value.message


def test_a_rank_the_kernel_kills_in_an_item_is_a_result_and_the_launch_goes_on(tmp_path: Path, monkeypatch):
    """A real rank process gets SIGKILL inside the DDP item (as the OOM killer sends it to a CPU
    rank past the host's memory): before, the launch failed (exit 2) and the trial's other
    results were lost; now, as an out-of-memory marker would, DDP is recorded as not fitting on
    the rank that was killed, and the next launch measures FSDP."""
    import signal
    import threading
    import time

    from capture.trial.scratch import PAUSE_ENV

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    paused = tmp_path / "paused.txt"
    monkeypatch.setenv(PAUSE_ENV, f"scaling.item.ddp={paused}")  # each rank waits there until it is killed
    killed: list[int] = []

    def kill_first() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not killed:
            lines = paused.read_text().splitlines() if paused.exists() else []
            if lines:
                killed.append(int(lines[0].split()[1]))
                os.kill(killed[0], signal.SIGKILL)
            time.sleep(0.05)

    watcher = threading.Thread(target=kill_first, daemon=True)
    watcher.start()
    config = load_example("tiny").with_overrides(device="cpu", warmup_steps=1, measured_steps=2, micro_batch_size=4)
    t = scaling.run_scaling(config, _args("--nproc", "2", "--no-recovery", "--dist-dir", str(tmp_path / "dist")),
                            tmp_path)
    watcher.join(5)
    assert killed, "no rank reached the DDP item"
    ddp = t["ddp"]
    assert ddp["fits"] is False and re.fullmatch(r"does not fit: out of memory on rank [01]", ddp["verdict"])
    assert ddp["oom"] == (f"its process (PID {killed[0]}) was killed by SIGKILL: most likely the kernel's OOM "
                          "killer (the host's or the memory cgroup's memory ran out)")
    assert [r["after_item"] for r in t["relaunches"]] == ["ddp"]
    assert t["baseline"]["fits"] is True and t["fsdp"]["fits"] is True and t["fsdp"]["throughput_tokens_per_s"] > 0


def test_the_killed_ranks_marker_is_read_only_when_it_is_this_hosts_and_whole(tmp_path: Path):
    import socket

    out = tmp_path / "result-measure.json"
    here = socket.gethostname()
    (tmp_path / "result-measure.json.rank0.at").write_text(json.dumps({"item": "ddp", "rank": 0, "pid": 42,
                                                                       "host": here + "-other"}))  # another node
    (tmp_path / "result-measure.json.rank1.at").write_text('{"item": "fs')  # cut short
    (tmp_path / "result-measure.json.rank2.at").write_text(json.dumps({"item": "ddp", "rank": "2", "pid": 42,
                                                                       "host": here}))  # rank not an int
    assert scaling._rank_at(out, "42") is None
    (tmp_path / "result-measure.json.rank3.at").write_text(json.dumps({"item": "fsdp", "rank": 3, "pid": 42,
                                                                       "host": here}))
    assert scaling._rank_at(out, "42") == ("fsdp", 3) and scaling._rank_at(out, "43") is None

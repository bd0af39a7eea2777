"""Recoverability: a checkpoint restored in a fresh interpreter must continue bit-exactly.

Everything here is real: a small GPT-2 (dropout on) built by capture.trial.workload, trained on
the CPU with torch, checkpointed with torch.save and restored by `python -m
capture.trial.recover_worker` in a new process. The H200 reading this guards against is
tests/fixtures/h200/probe.json `resume_losses`: without the CUDA RNG state the run diverged at
the first step after the restore.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from capture.errors import ConfigError
from capture.trial import recover, report
from capture.trial.config import TrialConfig, load_example, parse
from capture.trial.workload import build_workload

FIXTURES = Path(__file__).parent / "fixtures" / "h200"
CPU = torch.device("cpu")

# Small enough for seconds on two cores, with what makes a restore hard: dropout (torch CPU RNG),
# an LR that changes every step (warm-up then cosine), AdamW moments, a shuffled loader.
CONFIG = """
[trial]
name = "recover-test"
seed = 77
device = "cpu"
warmup_steps = 1
measured_steps = 5

[trial.model]
source = "from_config"
architecture = "gpt2"

[trial.model.config]
vocab_size = 257
n_positions = 32
n_embd = 32
n_layer = 1
n_head = 2
resid_pdrop = 0.1
embd_pdrop = 0.1
attn_pdrop = 0.1

[trial.optimizer]
name = "adamw"
lr = 3e-3
weight_decay = 0.01

[trial.scheduler]
name = "cosine"
warmup_steps = 2

[trial.batch]
max_seq_len = 32
micro_batch_size = 4

[trial.data]
source = "synthetic"
synthetic_sequences = 64

[trial.recovery]
save_at_step = 2
total_steps = 4
"""


def _config(tmp_path: Path, **recovery) -> TrialConfig:
    cfg = parse(CONFIG, "recover-test.toml", tmp_path, "recover-test")
    return dataclasses.replace(cfg, recovery=dataclasses.replace(cfg.recovery, **recovery)) if recovery else cfg


@pytest.fixture(autouse=True)
def _keep_global_torch_settings():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


# --------------------------------------------------------------------------- the stage, end to end


def test_full_restore_in_a_fresh_process_is_bit_exact_and_sensitivity_finds_what_it_needs(tmp_path):
    before = (random.getstate(), torch.get_rng_state())
    table = recover.run_recoverability(_config(tmp_path), CPU, tmp_path)

    assert table["verdict"] == "bit-exact"
    assert table["fresh_process"] is True
    assert (table["save_at_step"], table["total_steps"]) == (2, 4)
    assert len(table["losses_uninterrupted"]) == 4
    assert table["losses_resumed"] == table["losses_uninterrupted"][2:]  # exact float equality
    assert table["param_hash_resumed"] == table["param_hash_uninterrupted"]
    assert table["optimizer_hash_resumed"] == table["optimizer_hash_uninterrupted"]
    assert table["max_abs_param_diff"] == 0.0 and table["loss_diff"] == 0.0
    assert "diverged_at_step" not in table and table["withheld"] == []
    assert table["checkpoint_size_bytes"] > 100_000 and table["checkpoint_write_s"] > 0 and table["restore_load_s"] > 0
    assert table["components_saved"] == ["model", "optimizer", "scheduler", "rng_python", "rng_numpy",
                                         "rng_torch_cpu", "data_position"]
    assert table["sensitivity_control"] == "bit-exact"

    sens = {s["component"]: s for s in table["sensitivity"]}
    assert list(sens) == list(recover.COMPONENTS)
    for needed in ("model", "optimizer", "rng_torch_cpu", "data_position"):
        assert sens[needed]["depends"] is True, needed
        assert sens[needed]["diverged_at_step"] in (3, 4), needed
    # dropout masks come from the torch CPU generator and the batches from the loader position:
    # both change the very first step after the restore
    assert sens["rng_torch_cpu"]["diverged_at_step"] == 3 and sens["rng_torch_cpu"]["loss_diff"] != 0
    assert sens["data_position"]["diverged_at_step"] == 3 and sens["data_position"]["loss_diff"] != 0
    # the schedule sets the LR of step 4 onwards, so it shows in the final state
    assert sens["scheduler"]["depends"] is True
    # nothing in this workload draws from python's or numpy's global generators
    assert sens["rng_python"]["depends"] is False and sens["rng_numpy"]["depends"] is False
    for absent in ("scaler", "rng_cuda"):
        assert sens[absent]["applicable"] is False and "depends" not in sens[absent]
        assert sens[absent]["note"].startswith("not applicable")

    assert not (tmp_path / "recovery").exists()  # checkpoint and scratch files removed
    assert (random.getstate(), torch.get_rng_state().tolist()) == (before[0], before[1].tolist())
    assert torch.get_num_threads() >= table["cpu_threads"]


def test_withheld_rng_diverges_and_the_report_flags_it(tmp_path):
    table = recover.run_recoverability(_config(tmp_path, withhold=("rng_torch_cpu",)), CPU, tmp_path, sensitivity=False)

    assert table["withheld"] == ["rng_torch_cpu"]
    assert table["verdict"] == "diverged at step 3"
    assert table["diverged_at_step"] == 3
    assert table["loss_diff"] == table["losses_resumed"][0] - table["losses_uninterrupted"][2] != 0
    assert table["param_hash_resumed"] != table["param_hash_uninterrupted"]
    assert table["max_abs_param_diff"] > 0
    # the worker restored the checkpoint a second time: same perturbation, same result, so the
    # divergence is the withheld state, not a nondeterministic step
    assert table["restore_repeat"] == "identical"
    assert "sensitivity" not in table

    m = {"schema_version": 1, "kind": "trial", "trial": {"recovery": table}}
    text = report.render_terminal(m, colour=False)
    assert "Recovery    diverged at step 3 (checkpoint after step 2 of 4, restored in a fresh process)" in text
    assert "WITHHELD on purpose      rng_torch_cpu → diverged at step 3" in text


def test_a_failing_worker_is_a_recorded_result_not_a_crash(tmp_path):
    """A checkpoint that cannot be read in the fresh process: the worker says why, one line."""
    # A local model keeps the worker from pre-importing transformers: the failure comes sooner.
    cfg = parse(CONFIG.replace('source = "from_config"\narchitecture = "gpt2"', 'source = "local"\npath = "no-model"')
                .split("[trial.model.config]")[0] + "[trial.optimizer]" + CONFIG.split("[trial.optimizer]")[1],
                "local.toml", tmp_path, "local")
    setup = {"config": recover.config_to_dict(cfg), "device": "cpu", "seed": cfg.seed,
             "settings": dataclasses.asdict(recover.GlobalSettings.current())}
    worker = recover.Worker("restore", setup, tmp_path)
    try:
        worker.start_job({"checkpoint": str(tmp_path / "missing.pt"), "save_at_step": 2, "total_steps": 4,
                          "variants": [{"withhold": [], "full": True}]})
        with pytest.raises(recover.WorkerFailed, match=r"^FileNotFoundError: .*missing\.pt"):
            worker.result(timeout_s=300)
    finally:
        worker.stop()
    assert json.loads((tmp_path / "restore.result.json").read_text())["error"].startswith("FileNotFoundError")
    assert worker.proc.returncode == 1


# --------------------------------------------------------------------------- the pieces, in process


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A workload after 2 steps and its checkpoint on disk."""
    tmp = tmp_path_factory.mktemp("ckpt")
    cfg = _config(tmp)
    wl = build_workload(cfg, CPU)
    for _ in range(2):
        wl.train_step()
    state = recover.capture_state(wl, CPU, 2)
    size, seconds = recover.save_checkpoint(state, tmp / "ckpt.pt")
    return cfg, wl, tmp / "ckpt.pt", size, seconds


def test_checkpoint_holds_every_component_and_loads_with_weights_only(trained):
    _, wl, path, size, seconds = trained
    assert size == path.stat().st_size and seconds > 0
    assert [p.name for p in path.parent.iterdir()] == ["ckpt.pt"]  # no temp file left behind
    state = recover.load_checkpoint(path, CPU)  # weights_only=True: no pickled objects inside
    assert state["step"] == 2
    assert {"model", "optimizer", "scheduler", "rng_python", "rng_numpy", "rng_torch_cpu", "data_position"} <= set(state)
    assert "rng_cuda" not in state and "scaler" not in state
    assert state["data_position"] == wl.loader.state_dict()
    assert state["scheduler"]["last_epoch"] == 2


def test_save_is_atomic_when_serialisation_fails(tmp_path):
    target = tmp_path / "ckpt.pt"
    target.write_bytes(b"previous checkpoint")
    with pytest.raises(Exception):
        recover.save_checkpoint({"bad": lambda: None}, target)  # a lambda cannot be pickled
    assert target.read_bytes() == b"previous checkpoint"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


@pytest.mark.parametrize("component", ["rng_python", "rng_numpy", "rng_torch_cpu", "data_position",
                                       "model", "optimizer", "scheduler"])
def test_a_withheld_component_is_really_absent(trained, component):
    """Withheld means perturbed: neither the checkpoint's state nor what a fresh build left."""
    cfg, _, path, _, _ = trained
    state = recover.load_checkpoint(path, CPU)

    def snapshot(wl):
        return {
            "rng_python": random.getstate(),
            "rng_numpy": np.random.get_state()[1].tolist(),
            "rng_torch_cpu": torch.get_rng_state().tolist(),
            "data_position": wl.loader.state_dict(),
            "model": recover.param_hash(wl.model),
            "optimizer": recover.optimizer_hash(wl.optimizer),
            "scheduler": wl.scheduler.state_dict()["last_epoch"],
        }

    fresh_wl = build_workload(cfg, CPU)
    fresh = snapshot(fresh_wl)
    full_wl = build_workload(cfg, CPU)
    recover.restore_state(full_wl, recover.load_checkpoint(path, CPU), [], cfg.seed)
    restored = snapshot(full_wl)
    wl = build_workload(cfg, CPU)
    recover.restore_state(wl, state, [component], cfg.seed)
    got = snapshot(wl)

    assert got[component] != restored[component]
    if component.startswith("rng_"):
        assert got[component] != fresh[component]  # re-seeded, not left where the build put it
    else:
        assert got[component] == fresh[component]  # left as freshly built (step 0)
    for other in set(got) - {component} - {"rng_python", "rng_numpy", "rng_torch_cpu"}:
        assert got[other] == restored[other], other


def test_hashes_see_one_flipped_bit(trained):
    _, wl, _, _, _ = trained
    before = recover.param_hash(wl.model)
    p = next(wl.model.parameters())
    with torch.no_grad():
        bits = p.view(torch.int32)
        bits.view(-1)[0] ^= 1
        assert recover.param_hash(wl.model) != before
        bits.view(-1)[0] ^= 1
    assert recover.param_hash(wl.model) == before
    opt_before = recover.optimizer_hash(wl.optimizer)
    wl.optimizer.param_groups[0]["lr"] *= 1.0000001
    assert recover.optimizer_hash(wl.optimizer) != opt_before


def test_applicability_names_scaler_and_cuda_rng(tmp_path):
    cfg = _config(tmp_path)
    fp16 = dataclasses.replace(cfg, precision=dataclasses.replace(cfg.precision, dtype="fp16", autocast=True))
    wl = build_workload(fp16, CPU)
    assert wl.scaler is not None
    app = recover.applicability(wl, CPU)
    assert app["scaler"] is None  # applies: fp16 training carries a grad scaler
    assert app["rng_cuda"].startswith("not applicable") and "cpu" in app["rng_cuda"]
    assert recover.applicability(wl, torch.device("cuda", 0))["rng_cuda"] is None
    assert recover.applicability(build_workload(cfg, CPU), CPU)["scaler"].startswith("not applicable")


# --------------------------------------------------------------------------- comparing, config


def test_divergence_is_the_first_differing_step():
    ref_losses, ref_hashes = [2.0, 1.5], ("p", "o")
    assert recover.compare_run(ref_losses, ref_hashes, [2.0, 1.5], ("p", "o"), 4) == (None, 0.0, True)
    assert recover.compare_run(ref_losses, ref_hashes, [2.0, 1.25], ("q", "o"), 4) == (6, -0.25, False)
    # losses equal but the final state differs: diverged at the last step
    assert recover.compare_run(ref_losses, ref_hashes, [2.0, 1.5], ("p", "x"), 4) == (6, 0.0, True)
    # a run stopped at its first differing loss
    assert recover.compare_run(ref_losses, ref_hashes, [2.5], ("p", "o"), 4) == (5, 0.5, False)
    nan = float("nan")
    assert recover.first_divergence([nan, 1.0], [nan, 1.0], 1) == (None, 0.0)
    assert recover.verdict_text(None, True) == "bit-exact"
    assert recover.verdict_text(5, False) == "diverged at step 5"
    assert recover.verdict_text(6, True).startswith("diverged at step 6 (final state differs")


def test_the_h200_resume_reading_is_a_divergence_at_step_5():
    """probe.json: 8 steps uninterrupted vs 4 + restore without the CUDA RNG + 4."""
    losses = json.loads((FIXTURES / "probe.json").read_text())["resume_losses"]
    step, diff, _ = recover.compare_run(losses["full"][4:], ("h", "o"), losses["resumed"][4:], ("x", "o"), 4)
    assert step == 5
    assert diff == pytest.approx(10.955985069274902 - 10.963438034057617)


@pytest.mark.parametrize("name", ["tiny", "llama-1b"])
def test_config_survives_the_trip_to_the_worker(name):
    cfg = load_example(name).with_overrides(device="cpu", micro_batch_size=3, method="lora")
    again = recover.config_from_dict(TrialConfig, json.loads(json.dumps(recover.config_to_dict(cfg))))
    assert again == cfg


@pytest.mark.parametrize("recovery, match", [
    ({"save_at_step": 4, "total_steps": 4}, r"recovery\.save_at_step = 4 must be at least 1 and below"),
    ({"save_at_step": 0}, r"recovery\.save_at_step = 0"),
    ({"withhold": ("rng_gpu",)}, r"recovery\.withhold names unknown component\(s\): rng_gpu"),
])
def test_bad_recovery_settings_name_the_key(tmp_path, recovery, match):
    with pytest.raises(ConfigError, match=match):
        recover.run_recoverability(_config(tmp_path, **recovery), CPU, tmp_path)
    assert not (tmp_path / "recovery").exists()

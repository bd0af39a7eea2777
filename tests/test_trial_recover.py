"""Recoverability: a checkpoint restored in a fresh interpreter must hold what was saved and
continue bit-exactly (or within the run-to-run band when the step itself is not deterministic).

Everything here is real: a small GPT-2 (dropout on) built by capture.trial.workload, trained on
the CPU with torch, checkpointed with torch.save and restored by `python -m
capture.trial._recover_worker` in a new process. The nondeterministic step is planted for real
too: a sitecustomize module, on the workers' PYTHONPATH, adds noise from an OS-seeded generator
after every optimizer step, in the parent and in the fresh processes alike. The H200 reading this guards against is
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

from tiny_configs import gpt2_model

from capture.errors import ConfigError
from capture.trial import checkpoint_io, recover, report, state
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

""" + gpt2_model(dropout=0.1, specials=False, blank_lines=True) + """
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
    assert table["loss_diff"] == 0.0 and table["loss_diff_max"] == 0.0
    assert "diverged_at_step" not in table and table["withheld"] == []
    assert table["checkpoint_size_bytes"] > 100_000 and table["checkpoint_write_s"] > 0 and table["restore_load_s"] > 0
    assert table["components_saved"] == ["model", "optimizer", "scheduler", "rng_python", "rng_numpy",
                                         "rng_torch_cpu", "data_position"]
    # the headline: every restored component hashed in the fresh process before any step
    rows = {r["component"]: r for r in table["restored_state"]}
    assert list(rows) == table["components_saved"]
    assert all(r["equal"] and r["saved_sha256"] == r["restored_sha256"] != "" for r in rows.values())
    assert table["restored_state_verdict"] == "all 7 components equal to what was saved"
    assert table["verdict_kind"] == "bit-exact" and table["run_to_run_band"] == 0.0
    assert table["restore_repeat"] == "identical" and table["run_to_run_runs"] == 2
    assert table["deterministic"]["enabled"] is False and table["deterministic"]["requested"] == "auto"
    assert table["sensitivity_rule"].startswith("depends: withholding it changes any loss or the final state")

    sens = {s["component"]: s for s in table["sensitivity"]}
    assert list(sens) == list(state.COMPONENTS)
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
    assert "max_abs_param_diff" not in table  # the per-component hashes say what differs
    # the worker restored the checkpoint a second time: same perturbation, same result, so the
    # divergence is the withheld state, not a nondeterministic step
    assert table["restore_repeat"] == "identical"
    assert "sensitivity" not in table

    m = {"schema_version": 1, "kind": "trial", "trial": {"recovery": table}}
    rows = {r["component"]: r for r in table["restored_state"]}
    assert rows["rng_torch_cpu"]["equal"] is False and rows["rng_torch_cpu"]["note"] == "withheld on purpose"
    assert all(r["equal"] for c, r in rows.items() if c != "rng_torch_cpu")
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
        worker.start_job({"kind": "restore", "checkpoint": str(tmp_path / "missing.pt"), "save_at_step": 2,
                          "total_steps": 4})
        with pytest.raises(recover.WorkerFailed, match=r"^FileNotFoundError: .*missing\.pt"):
            worker.result(timeout_s=300)
    finally:
        worker.stop()
    assert json.loads((tmp_path / "restore.result.json").read_text())["error"].startswith("FileNotFoundError")
    assert worker.proc.returncode == 1


def test_a_worker_killed_from_outside_is_named_by_its_signal(tmp_path):
    """SIGKILL, as the kernel's OOM killer sends it: the reason is the signal, not the last line the
    worker happened to print (an import warning, say)."""
    import signal

    setup = {"config": recover.config_to_dict(parse(CONFIG, "c.toml", tmp_path, "c")), "device": "cpu", "seed": 1,
             "settings": dataclasses.asdict(recover.GlobalSettings.current())}
    for signum, reason in ((signal.SIGKILL, "the restore process was killed by SIGKILL: most likely the kernel's "
                                            "OOM killer (the host's or the memory cgroup's memory ran out)"),
                           (signal.SIGTERM, "the restore process was killed by SIGTERM")):
        worker = recover.Worker("restore", setup, tmp_path)
        try:
            worker.proc.send_signal(signum)
            with pytest.raises(recover.WorkerFailed) as info:
                worker.result(timeout_s=60)
            assert info.value.reason == reason
        finally:
            worker.stop()


# --------------------------------------------------------------------------- the pieces, in process


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A workload after 2 steps and its checkpoint on disk."""
    tmp = tmp_path_factory.mktemp("ckpt")
    cfg = _config(tmp)
    wl = build_workload(cfg, CPU)
    for _ in range(2):
        wl.train_step()
    timing = checkpoint_io.save(state.capture_state(wl, CPU, 2), tmp / "ckpt.pt")
    return cfg, wl, tmp / "ckpt.pt", timing.size_bytes, timing.durable_s


def test_checkpoint_holds_every_component_and_loads_with_weights_only(trained):
    _, wl, path, size, seconds = trained
    assert size == path.stat().st_size and seconds > 0
    assert [p.name for p in path.parent.iterdir()] == ["ckpt.pt"]  # no temp file left behind
    saved = checkpoint_io.load(path)  # weights_only=True: no pickled objects inside
    assert saved["step"] == 2
    assert {"model", "optimizer", "scheduler", "rng_python", "rng_numpy", "rng_torch_cpu", "data_position"} <= set(saved)
    assert "rng_cuda" not in saved and "scaler" not in saved
    assert saved["data_position"] == wl.loader.state_dict()
    assert saved["scheduler"]["last_epoch"] == 2


def test_save_is_atomic_when_serialisation_fails(tmp_path):
    target = tmp_path / "ckpt.pt"
    target.write_bytes(b"previous checkpoint")
    with pytest.raises(Exception):
        checkpoint_io.save({"bad": lambda: None}, target)  # a lambda cannot be pickled
    assert target.read_bytes() == b"previous checkpoint"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


@pytest.fixture
def small_disk(tmp_path):
    """A real 4 MiB filesystem (tmpfs), as a full disk is met: the 8B full checkpoint (45 GB)
    that did not fit beside another on a 64 GB disk failed in torch as "unexpected pos"."""
    from memory_cgroups import mounted_tmpfs

    with mounted_tmpfs(tmp_path / "disk", "4m") as disk:
        yield disk


@pytest.mark.parametrize("fmt", checkpoint_io.FORMATS)
def test_a_checkpoint_larger_than_the_free_space_is_refused_before_a_byte_is_written(small_disk, fmt):
    big = {"model": {"w": torch.zeros(2 * 1024 * 1024)}, "step": 2}  # 8 MiB of fp32
    with pytest.raises(checkpoint_io.NoSpace, match=r"needs 8\.00 MiB and .*disk has 4\.00 MiB free .*--workdir"):
        checkpoint_io.save(big, small_disk / checkpoint_io.file_name(fmt), fmt)
    assert list(small_disk.iterdir()) == []
    view = torch.zeros(256 * 1024)  # 1 MiB, held twice through one storage: counted once
    small = {"model": {"w": view, "tied": view}, "step": 2}
    assert checkpoint_io.tensor_bytes(small) == view.nbytes
    timing = checkpoint_io.save(small, small_disk / checkpoint_io.file_name(fmt), fmt)
    assert timing.size_bytes > view.nbytes
    assert torch.equal(checkpoint_io.load(timing.path, fmt)["model"]["w"], view)


@pytest.mark.parametrize("component", ["rng_python", "rng_numpy", "rng_torch_cpu", "data_position",
                                       "model", "optimizer", "scheduler"])
def test_a_withheld_component_is_really_absent(trained, component):
    """Withheld means perturbed: neither the checkpoint's state nor what a fresh build left."""
    cfg, _, path, _, _ = trained
    saved = checkpoint_io.load(path)

    def snapshot(wl):
        return {
            "rng_python": random.getstate(),
            "rng_numpy": np.random.get_state()[1].tolist(),
            "rng_torch_cpu": torch.get_rng_state().tolist(),
            "data_position": wl.loader.state_dict(),
            "model": state.param_hash(wl.model),
            "optimizer": state.optimizer_hash(wl.optimizer),
            "scheduler": wl.scheduler.state_dict()["last_epoch"],
        }

    fresh_wl = build_workload(cfg, CPU)
    fresh = snapshot(fresh_wl)
    full_wl = build_workload(cfg, CPU)
    state.restore_state(full_wl, checkpoint_io.load(path), [], cfg.seed)
    restored = snapshot(full_wl)
    wl = build_workload(cfg, CPU)
    state.restore_state(wl, saved, [component], cfg.seed)
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
    before = state.param_hash(wl.model)
    p = next(wl.model.parameters())
    with torch.no_grad():
        bits = p.view(torch.int32)
        bits.view(-1)[0] ^= 1
        assert state.param_hash(wl.model) != before
        bits.view(-1)[0] ^= 1
    assert state.param_hash(wl.model) == before
    opt_before = state.optimizer_hash(wl.optimizer)
    wl.optimizer.param_groups[0]["lr"] *= 1.0000001
    assert state.optimizer_hash(wl.optimizer) != opt_before


def test_applicability_names_scaler_and_cuda_rng(tmp_path):
    cfg = _config(tmp_path)
    fp16 = dataclasses.replace(cfg, precision=dataclasses.replace(cfg.precision, dtype="fp16", autocast=True))
    wl = build_workload(fp16, CPU)
    assert wl.scaler is not None
    app = state.applicability(wl, CPU)
    assert app["scaler"] is None  # applies: fp16 training carries a grad scaler
    assert app["rng_cuda"].startswith("not applicable") and "cpu" in app["rng_cuda"]
    assert state.applicability(wl, torch.device("cuda", 0))["rng_cuda"] is None
    assert state.applicability(build_workload(cfg, CPU), CPU)["scaler"].startswith("not applicable")


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


# --------------------------------------------------------------------------- issue 11: state check, band, formats

NOISY_STEP = '''
import torch
from capture.trial import workload as _workload

_noise = torch.Generator()
_noise.seed()  # from OS entropy: every process, every run draws different noise
_step = _workload.Workload.train_step_async


def _noisy_step(self, batch_iter=None):
    loss = _step(self, batch_iter)
    with torch.no_grad():
        for p in self.model.parameters():
            p.add_(torch.randn(p.shape, generator=_noise) * 1e-4)
    return loss


_workload.Workload.train_step_async = _noisy_step
'''


@pytest.fixture
def noisy_step(tmp_path, monkeypatch):
    """A nondeterministic optimizer step here and in every fresh worker process."""
    import os

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(NOISY_STEP)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    namespace: dict = {}
    from capture.trial import workload

    original = workload.Workload.train_step_async
    exec(compile(NOISY_STEP, "sitecustomize.py", "exec"), namespace)
    yield
    workload.Workload.train_step_async = original


def test_an_incomplete_checkpoint_is_caught_before_any_step(tmp_path):
    """The optimizer state left out of the save: the fresh process names it and runs no step."""
    table = recover.run_recoverability(_config(tmp_path), CPU, tmp_path, sensitivity=False, leave_out=("optimizer",))

    assert table["verdict_kind"] == "state_differs"
    assert table["verdict"] == "restored state differs from the saved state: optimizer (caught before any step ran)"
    rows = {r["component"]: r for r in table["restored_state"]}
    assert rows["optimizer"]["equal"] is False
    assert rows["optimizer"]["note"] == "not in the checkpoint: left as freshly built"
    assert all(r["equal"] for c, r in rows.items() if c != "optimizer")
    assert "losses_resumed" not in table and "sensitivity" not in table
    assert table["left_out_of_checkpoint"] == ["optimizer"]
    assert table["restored_state_verdict"] == "6 of 7 equal; differs: optimizer"


def test_a_nondeterministic_step_is_judged_by_its_band(tmp_path, noisy_step):
    table = recover.run_recoverability(_config(tmp_path), CPU, tmp_path)

    # the restored state is still exactly what was saved: that does not depend on the step
    assert all(r["equal"] for r in table["restored_state"])
    band = table["run_to_run_band"]
    assert band > 0 and table["run_to_run_runs"] == 3  # the two continuations differed: a third was run
    assert table["restore_repeat"].startswith("differs from the first restore")
    assert table["verdict_kind"] == "within_band", table["verdict"]
    assert table["verdict"].startswith("equal within the run-to-run band (max |Δloss| ")
    assert table["loss_diff_max"] <= recover.BAND_MARGIN * band
    assert f"more than {recover.BAND_MARGIN:g} × the run-to-run band" in table["sensitivity_rule"]

    sens = {s["component"]: s for s in table["sensitivity"]}
    # a withheld data position feeds other batches: far beyond the noise
    assert sens["data_position"]["depends"] is True
    assert sens["data_position"]["loss_diff_max"] > 100 * band
    # nothing draws from python's or numpy's generators: no restore is spent on them
    for unused in ("rng_python", "rng_numpy"):
        assert sens[unused]["depends"] is False, sens[unused]
        assert sens[unused]["note"].startswith("not drawn from during the continuation")


def test_judging_against_a_band():
    ref, hashes = [2.0, 1.5], ("p", "o")
    run = {"losses": [2.0, 1.5 + 1e-6], "param_hash": "q", "optimizer_hash": "o"}
    assert recover.judge(ref, hashes, run, 1e-6, 4)["kind"] == "within_band"
    far = recover.judge(ref, hashes, dict(run, losses=[2.1, 1.6]), 1e-6, 4)
    assert far["kind"] == "beyond_band" and far["diverged_at_step"] == 5
    assert far["text"].startswith("diverged beyond the run-to-run band at step 5 (max |Δloss| 0.1")
    assert recover.judge(ref, hashes, dict(run, param_hash="p", losses=ref), 0.0, 4)["kind"] == "bit-exact"
    assert recover.judge(ref, hashes, run, 0.0, 4)["kind"] == "beyond_band"  # a band of 0: any difference
    assert recover.run_to_run_band([{"losses": [1.0, 2.0]}, {"losses": [1.0, 2.5]}, {"losses": [1.0, 1.75]}]) == 0.75


def test_determinism_is_on_for_a_gpu_and_off_on_a_cpu_unless_asked():
    outer = recover.GlobalSettings.current()
    gpu, cpu = torch.device("cuda", 0), CPU
    auto_gpu = recover.resolve_determinism(None, gpu, outer, {})
    assert auto_gpu.enabled and auto_gpu.env == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    assert "CUBLAS_WORKSPACE_CONFIG" in auto_gpu.to_manifest()["environment"]
    assert not recover.resolve_determinism(None, cpu, outer, {}).enabled
    assert recover.resolve_determinism(True, cpu, outer, {}).enabled
    assert not recover.resolve_determinism(False, gpu, outer, {}).enabled
    # a deterministic value the user set is kept
    assert recover.resolve_determinism(True, gpu, outer, {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}).env == {}
    op = recover.no_deterministic_op("RuntimeError: scatter_add_cuda_kernel does not have a deterministic "
                                     "implementation, but you set 'torch.use_deterministic_algorithms(True)'")
    assert op == "scatter_add_cuda_kernel"
    assert recover.no_deterministic_op("RuntimeError: CUDA out of memory") is None


def test_deterministic_mode_runs_the_reference_in_a_fresh_process_too(tmp_path):
    table = recover.run_recoverability(_config(tmp_path, deterministic=True), CPU, tmp_path, sensitivity=False)

    assert table["verdict"] == "bit-exact"
    assert table["reference_fresh_process"] is True and table["deterministic_algorithms"] is True
    assert table["deterministic"]["enabled"] is True and table["deterministic"]["reason"] == "on as configured"
    assert len(table["step_time_s"]) == 4 and table["step_time_median_s"] > 0
    assert not torch.are_deterministic_algorithms_enabled()  # this process keeps its own settings


def test_early_processes_do_not_outlive_a_failed_start(tmp_path, monkeypatch):
    """The reference is started first; when starting the restoring process fails, the reference
    (held by no one yet) is stopped before the error leaves start_early."""
    started: list[recover.Worker] = []
    real_init = recover.Worker.__init__

    def spawn(self, name, *args, **kwargs):
        if name == "restore":
            raise OSError("no more processes")
        real_init(self, name, *args, **kwargs)
        started.append(self)

    monkeypatch.setattr(recover.Worker, "__init__", spawn)
    with pytest.raises(OSError, match="no more processes"):
        recover.start_early(_config(tmp_path, deterministic=True), CPU, tmp_path)
    try:
        assert [w.name for w in started] == ["reference"]
        assert started[0].proc.poll() is not None  # stopped, not left waiting on its stdin
    finally:
        for worker in started:
            worker.stop()


@pytest.mark.parametrize("fmt", ["safetensors", "dcp", "dcp-async"])
def test_every_checkpoint_format_restores_every_component(trained, tmp_path, fmt):
    cfg, wl, _, _, _ = trained
    saved = state.capture_state(wl, CPU, 2)
    path = tmp_path / checkpoint_io.file_name(fmt)
    timing = checkpoint_io.save(saved, path, fmt)
    assert timing.size_bytes > 100_000 and 0 < timing.blocked_s <= timing.durable_s
    back = checkpoint_io.load(path, fmt)
    assert state.component_hashes(back) == state.component_hashes(saved)
    fresh = build_workload(cfg, CPU)
    assert state.restore_state(fresh, back, [], cfg.seed) == []
    assert state.component_hashes(state.capture_state(fresh, CPU, 2)) == state.component_hashes(saved)
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temp file or folder left


def test_the_stage_restores_the_format_the_config_names(tmp_path):
    cfg = _config(tmp_path)
    cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, format="safetensors"))
    table = recover.run_recoverability(cfg, CPU, tmp_path, sensitivity=False)
    assert table["checkpoint_format"] == "safetensors" and table["verdict"] == "bit-exact"
    assert all(r["equal"] for r in table["restored_state"])

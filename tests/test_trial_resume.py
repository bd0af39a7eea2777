"""Resume as training resumes (issue 24): a LoRA run's checkpoint holds its adapter and the base
is verified, not written; the fresh process builds once and reloads per restore; the run resumes
twice, across an epoch boundary of the loader, and the batches each step consumed are compared
with the uninterrupted run's.

Everything is real: GPT-2 shapes built by transformers, LoRA by peft, a pretrained base written by
``save_pretrained`` into a folder made here, checkpoints on disk, restores in fresh interpreters.
Planted faults reach the fresh processes the way the noisy step of test_trial_recover does: a
sitecustomize module on their PYTHONPATH (and, where the parent must share the fault, the same
patch applied here).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

from tiny_configs import gpt2_model

from capture.trial import checkpoint_io, hostmem, recover, state
from capture.trial.config import TrialConfig, parse
from capture.trial.workload import build_workload

CPU = torch.device("cpu")

CONFIG = """
[trial]
name = "resume-test"
seed = 11
device = "cpu"
warmup_steps = 1
measured_steps = 5

{model}

[trial.lora]
rank = 4
alpha = 8
dropout = 0.1
target_modules = ["c_attn", "c_fc"]

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
synthetic_sequences = 40

[trial.recovery]
save_at_step = 2
total_steps = 4
"""

FROM_CONFIG = gpt2_model(dropout=0.1, blank_lines=True)


def _config(tmp_path: Path, method: str = "lora", model: str = FROM_CONFIG, **recovery) -> TrialConfig:
    cfg = parse(CONFIG.format(model=model), "resume-test.toml", tmp_path, "resume-test").with_overrides(method=method)
    return dataclasses.replace(cfg, recovery=dataclasses.replace(cfg.recovery, **recovery)) if recovery else cfg


@pytest.fixture(autouse=True)
def _keep_global_torch_settings():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _plant(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: str) -> None:
    """``code`` runs at the start of every fresh process this test starts."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(code)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))


# --------------------------------------------------------------------------- the LoRA checkpoint


def test_a_lora_checkpoint_holds_the_adapter_and_restores_bit_exactly(tmp_path):
    cfg = _config(tmp_path)
    trained = build_workload(cfg, CPU)
    for _ in range(2):
        trained.train_step()
    saved = state.capture_state(trained, CPU, 2)
    adapter = set(saved["model"])
    assert adapter and all(".lora_A." in k or ".lora_B." in k for k in adapter)
    base = state.base_state(trained.model)
    assert base and not adapter & set(base) and "base_model.model.transformer.wte.weight" in base
    def nbytes(sd):
        return sum(t.numel() * t.element_size() for t in sd.values())

    assert nbytes(saved["model"]) * 10 < nbytes(trained.model.state_dict())  # the base is most of the model
    path = checkpoint_io.save(saved, tmp_path / "adapter.pt").path
    full = checkpoint_io.save(state.capture_state(trained, CPU, 2, adapter_only=False), tmp_path / "full.pt")
    assert path.stat().st_size * 3 < full.size_bytes  # RNG states and file overhead are the same in both

    fresh = build_workload(cfg, CPU)
    assert state.restore_state(fresh, checkpoint_io.load(path), [], cfg.seed) == []
    # equal state, bit for bit: the whole model (the rebuilt base and the restored adapter), optimizer, the rest
    want, got = trained.model.state_dict(), fresh.model.state_dict()
    assert list(want) == list(got) and all(torch.equal(want[k], got[k]) for k in want)
    assert state.component_hashes(state.capture_state(fresh, CPU, 2)) == state.component_hashes(saved)
    losses = []
    for wl in (trained, fresh):  # the same RNG streams for both (dropout), as at the save
        state.restore_rng(saved, CPU)
        losses.append([wl.train_step() for _ in range(2)])
    assert losses[0] == losses[1]
    assert state.model_hash(fresh.model) == state.model_hash(trained.model)


def test_the_lora_stage_checkpoints_the_adapter_and_matches_the_rebuilt_base(tmp_path, capsys):
    lines: list[str] = []
    table = recover.run_recoverability(_config(tmp_path), CPU, tmp_path, progress=lines.append)

    assert table["verdict"] == "bit-exact", table["verdict"]
    assert table["plan"]["checkpoint"] == "adapter" and "base is verified, not written" in table["checkpoint_contents"]
    rows = table["restored_state"]
    assert rows[0]["component"] == "base_model" and rows[0]["equal"] is True
    assert rows[0]["note"] == "verified, not in the checkpoint: rebuilt from config and seed"
    assert all(r["equal"] for r in rows) and table["restored_state_verdict"] == "all 8 components equal to what was saved"
    b = table["base_model"]
    assert b["kind"] == "rebuilt from config and seed" and b["equal"] is True and b["in_checkpoint"] is False
    assert b["expected_sha256"] == b["found_sha256"] == rows[0]["saved_sha256"] == rows[0]["restored_sha256"]
    built = build_workload(_config(tmp_path), CPU)
    assert b["expected_sha256"] == state.digest(state.base_state(built.model))  # the seeded base, as built here
    adapter_bytes = sum(v.numel() * v.element_size() for v in state.model_state(built.model).values())
    assert table["checkpoint_size_bytes"] < 3 * adapter_bytes + 40_000  # adapter, 2 Adam moments, RNG states
    # the adapter depends on its own state and dropout's RNG like any model
    sens = {s["component"]: s for s in table["sensitivity"]}
    assert sens["model"]["depends"] and sens["optimizer"]["depends"] and sens["rng_torch_cpu"]["depends"]
    # the phase table: recorded and printed
    phases = table["phases"]
    for name in ("reference", "save", "worker_start", "restore_build", "base_verify", "restore", "continuations",
                 "second_resume", "sensitivity", "total"):
        assert phases[f"{name}_s"] >= 0, name
    assert phases["total_s"] == table["elapsed_s"]
    assert lines[0] == "recovery phases (seconds):" and lines[-1].startswith("  total ")
    assert any(line.startswith("  sensitivity ") for line in lines)
    assert not (tmp_path / "recovery").exists()


def test_a_base_rebuilt_differently_in_the_fresh_process_is_caught(tmp_path, monkeypatch):
    """The fresh process's build gives a base that differs in one weight (a different init, a
    different seed): the base_model row says so and no step runs."""
    _plant(tmp_path, monkeypatch, '''
import torch
from capture.trial import workload as _w

_build = _w.build_workload


def _other_base(config, device):
    wl = _build(config, device)
    frozen = next(p for p in wl.model.parameters() if not p.requires_grad)
    with torch.no_grad():
        frozen.view(-1)[0] += 1e-3
    return wl


_w.build_workload = _other_base
''')
    table = recover.run_recoverability(_config(tmp_path), CPU, tmp_path, sensitivity=False)

    assert table["verdict_kind"] == "state_differs"
    assert table["verdict"] == "restored state differs from the saved state: base_model (caught before any step ran)"
    rows = {r["component"]: r for r in table["restored_state"]}
    assert rows["base_model"]["equal"] is False and all(r["equal"] for c, r in rows.items() if c != "base_model")
    assert table["base_model"]["expected_sha256"] != table["base_model"]["found_sha256"]
    assert "losses_resumed" not in table and "data_order" not in table


@pytest.fixture
def pretrained(tmp_path):
    """A tiny GPT-2 written by save_pretrained into a local folder, and the fingerprint's record of it."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from capture.probes import ProbeOptions
    from capture.probes.artifacts import probe_artifact

    torch.manual_seed(3)
    folder = tmp_path / "base-model"
    GPT2LMHeadModel(GPT2Config(vocab_size=257, n_positions=32, n_embd=32, n_layer=1, n_head=2,
                               bos_token_id=256, eos_token_id=256)).save_pretrained(folder)
    record = probe_artifact(str(folder), "model", ProbeOptions(progress=False)).to_manifest()
    model = f'[trial.model]\nsource = "local"\npath = "{folder.name}"'
    return folder, record, _config(tmp_path, model=model)


def test_a_pretrained_base_is_verified_by_its_files_and_a_corrupted_file_is_caught(tmp_path, pretrained):
    folder, record, cfg = pretrained
    table = recover.run_recoverability(cfg, CPU, tmp_path / "a", sensitivity=False, models=[record])
    assert table["verdict"] == "bit-exact", table["verdict"]
    b = table["base_model"]
    assert b["kind"] == "pretrained files" and b["equal"] is True and b["spec"] == str(folder)
    assert b["expected_sha256"] == b["found_sha256"] == record["content_hash"]
    assert b["files"] == len(record["files"]) and "model.safetensors" in {f["path"] for f in record["files"]}

    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # one bit of the last tensor's data: the file still loads
    weights.write_bytes(bytes(data))
    table = recover.run_recoverability(cfg, CPU, tmp_path / "b", sensitivity=False, models=[record])

    assert table["verdict"] == "restored state differs from the saved state: base_model (caught before any step ran)"
    b = table["base_model"]
    assert b["equal"] is False and b["mismatched_files"] == ["model.safetensors"] and b["found_sha256"] != record["content_hash"]
    row = table["restored_state"][0]
    assert row["component"] == "base_model" and row["note"] == "pretrained files: model.safetensors differs from the record"
    assert "losses_resumed" not in table


# --------------------------------------------------------------------------- two resumes, an epoch boundary


# In every fresh process: before each checkpoint is written, which checkpoints the scratch holds.
SEES_SCRATCH = '''
import os
from capture.trial import checkpoint_io as _io

_save, _load = _io.save, _io.load


def _seeing(saved, path, *args, **kwargs):
    held = sorted(p for p in os.listdir(os.path.dirname(path)) if p.endswith(".pt"))
    with open(os.environ["SCRATCH_LOG"], "a") as f:
        f.write(f"{os.path.basename(path)} {' '.join(held)}\\n")
    return _save(saved, path, *args, **kwargs)


def _reading(path, *args, **kwargs):
    host = _load(path, *args, **kwargs)
    with open("/proc/self/maps") as f:  # the kernel's word on whether the file's pages are the host copy
        mapped = any(line.rstrip().endswith(str(path)) for line in f)
    with open(os.environ["SCRATCH_LOG"] + ".reads", "a") as f:
        f.write(f"{os.path.basename(path)} mapped={mapped} thp={os.environ.get('THP_MEM_ALLOC_ENABLE')}\\n")
    return host


_io.save, _io.load = _seeing, _reading
'''


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """The full fine-tune of the shape above (dropout on), the stage as it runs; with what the
    scratch held at each checkpoint write and the order in which the parent drove its workers."""
    tmp = tmp_path_factory.mktemp("full")
    cfg = _config(tmp, method="full")
    events: list[str] = []
    workers: list = []
    init, start_job = recover.Worker.__init__, recover.Worker.start_job

    def registered(self, *args, **kwargs):
        init(self, *args, **kwargs)
        workers.append(self)

    def logged_start(self, job):
        running = sorted(w.name for w in workers if w is not self and w.proc.poll() is None)
        events.append(f"{self.name} job, running: {', '.join(running) or 'none'}")
        return start_job(self, job)

    with pytest.MonkeyPatch.context() as mp:
        _plant(tmp, mp, SEES_SCRATCH)
        mp.setenv("SCRATCH_LOG", str(tmp / "scratch.log"))
        mp.setattr(recover.Worker, "start_job", logged_start)
        mp.setattr(recover.Worker, "__init__", registered)
        here: dict = {}  # the same watch in this process, where the reference runs without deterministic mode
        exec(SEES_SCRATCH.replace("_io.save, _io.load = _seeing, _reading", ""), here)
        mp.setattr(checkpoint_io, "save", here["_seeing"])
        table = recover.run_recoverability(cfg, CPU, tmp)
    table["_scratch"] = (tmp / "scratch.log").read_text().splitlines()
    table["_reads"] = (tmp / "scratch.log.reads").read_text().splitlines()
    table["_events"] = events
    return cfg, table


def test_the_scratch_never_holds_two_checkpoints_and_one_restore_runs_at_a_time(full_run):
    """At 8B a full checkpoint with AdamW is 45 GB: the resumed run's checkpoint is written only
    after the first one went (the first restore holds it in memory), and the first restore's
    process has ended before the second resume is given its job (two full workloads do not fit
    one 80 GB card). Both were missing on the first H100 run (no space left at 20 GB)."""
    _, table = full_run
    assert table["resume_again"]["verdict"] == "bit-exact"
    writes = [line.split() for line in table["_scratch"]]
    assert [w[0] for w in writes] == ["checkpoint.pt", "again-checkpoint.pt"]
    assert writes[0][1:] == [] and writes[1][1:] == [], writes  # nothing else on disk at either write
    assert table["_events"][-1] == "resume-again job, running: none", table["_events"]


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the kernel's map of the process (Linux)")
def test_the_second_resume_maps_its_checkpoint_and_the_first_copies_it(full_run):
    """The second resume writes no checkpoint after its read, so it maps the file (a read and
    copy to the device 4x faster at 16.8 GB on an H100 host); the first restoring process copies
    it, as it writes the resumed run's checkpoint while it holds the host copy and a mapped
    file's pages would stay taken until then. A CPU trial leaves the allocator as it is."""
    _, table = full_run
    assert table["_reads"] == ["checkpoint.pt mapped=False thp=None", "again-checkpoint.pt mapped=True thp=None"]
    assert table["plan"]["host_memory"] == "default (a CPU trial)"
    assert table["plan"]["second_read"] == recover.MAPPED_READ
    assert table["resume_again"]["verdict"] == "bit-exact"


def test_on_an_accelerator_the_readers_get_huge_pages_unless_the_environment_says_otherwise():
    from capture.trial import recover_steps

    cuda, det = torch.device("cuda"), {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    assert recover_steps.reader_env(det, cuda, environ={}) == dict(det, THP_MEM_ALLOC_ENABLE="1")
    assert recover_steps.reader_env(det, cuda, environ={"THP_MEM_ALLOC_ENABLE": "0"}) == det  # the user's 0 stays
    assert recover_steps.reader_env(det, CPU, environ={}) == det
    assert recover_steps.host_memory(cuda, {"THP_MEM_ALLOC_ENABLE": "1"}) == "huge pages (THP_MEM_ALLOC_ENABLE=1)"
    assert recover_steps.host_memory(cuda, {}) == "default"
    assert recover_steps.host_memory(cuda, {"THP_MEM_ALLOC_ENABLE": "0"}) == "default (THP_MEM_ALLOC_ENABLE='0' as set)"
    assert recover_steps.host_memory(CPU, {"THP_MEM_ALLOC_ENABLE": "1"}) == "default (a CPU trial)"


def test_a_mapped_read_gives_the_saved_state_and_outlives_its_file(tmp_path):
    saved = {"step": 3, "model": {"w": torch.randn(64, 8), "b": torch.arange(5)}, "rng": (1, torch.ones(3))}
    timing = checkpoint_io.save(saved, tmp_path / "checkpoint.pt")
    host = checkpoint_io.load(timing.path, mmap=True)
    checkpoint_io.remove(timing.path)
    assert not timing.path.exists()
    assert host["step"] == 3 and torch.equal(host["model"]["w"], saved["model"]["w"])
    assert torch.equal(host["model"]["b"], saved["model"]["b"]) and torch.equal(host["rng"][1], saved["rng"][1])
    host["model"]["w"].add_(1)  # a private mapping: writable, and nothing goes back to a file
    assert torch.equal(host["model"]["w"], saved["model"]["w"] + 1)


def test_two_resumes_across_an_epoch_boundary_consume_the_uninterrupted_batches(full_run):
    cfg, table = full_run
    assert table["verdict"] == "bit-exact" and table["plan"]["checkpoint"] == "full"
    order = table["data_order"]
    boundary = order["epoch_boundary"]
    # 36 training sequences (40 less the validation tenth), 4 per step: the run starts 2 x 4 + 2 before the end
    assert boundary["arranged"] is True and boundary["items_per_epoch"] == 36 and boundary["start_index"] == 26
    assert boundary["wraps_in_step"] == 3
    assert order["positions"]["at_save"]["epoch"] == 0 and order["positions"]["at_second_save"]["epoch"] == 1
    ref = order["batch_sha256_uninterrupted"]
    assert len(ref) == 4 and all(len(s) == 1 and s[0].startswith("sha256:") for s in ref)
    assert len({s[0] for s in ref}) == 4
    assert order["batch_sha256_resumed"] == ref[2:] and order["batch_sha256_resumed_again"] == ref[3:]
    assert order["equal"] is True and "first_differing_step" not in order
    assert order["verdict"] == ("both resumes consumed the uninterrupted run's batches, step for step and across "
                                "the epoch boundary")
    again = table["resume_again"]
    assert again["save_at_step"] == 3 and again["verdict"] == "bit-exact"
    assert again["restored_state_verdict"] == "all 7 components equal to what was saved"
    assert again["losses_resumed"] == table["losses_uninterrupted"][3:]
    assert again["param_hash_resumed"] == table["param_hash_uninterrupted"]
    # the batch hash is the sha256 of the ids the loader hands out (dtype, shape, bytes), reproducible outside capture
    import hashlib

    wl = build_workload(cfg, CPU)
    wl.loader.load_state_dict(dict(wl.loader.state_dict(), epoch=0, index=26))
    ids = next(wl.loader).input_ids
    assert "sha256:" + hashlib.sha256(f"{ids.dtype}{tuple(ids.shape)}".encode() + ids.numpy().tobytes()).hexdigest() \
        == ref[0][0]


def test_reloading_one_build_gives_what_a_fresh_build_per_restore_gives(full_run, tmp_path):
    cfg, reloaded = full_run
    rebuilt = recover.run_recoverability(cfg, CPU, tmp_path, plan=dataclasses.replace(recover.PLAN, reload=False,
                                                                                      early_build=False))
    assert rebuilt["plan"]["restore"] == "a fresh build per restore"
    assert reloaded["plan"]["restore"] == "one build, reloaded per restore"
    for key in ("verdict", "losses_uninterrupted", "losses_resumed", "param_hash_resumed", "optimizer_hash_resumed",
                "restored_state", "run_to_run_band"):
        assert reloaded[key] == rebuilt[key], key
    for a, b in zip(reloaded["sensitivity"], rebuilt["sensitivity"]):
        assert {k: a.get(k) for k in ("component", "depends", "loss_diff", "loss_diff_max", "diverged_at_step")} == \
               {k: b.get(k) for k in ("component", "depends", "loss_diff", "loss_diff_max", "diverged_at_step")}
    assert reloaded["data_order"]["batch_sha256_resumed"] == rebuilt["data_order"]["batch_sha256_resumed"]
    # one build for every restore against one per restore (first, band, 9 - 2 not applicable variants)
    assert reloaded["restore_timings"]["build_s"] < rebuilt["restore_timings"]["build_s"]


FORGETS_EPOCH = '''
def _state_dict(self):
    return {"index": self.index, "seed": self.seed, "micro_batch": self.micro_batch}  # the epoch is lost


def _load_state_dict(self, state):
    self.epoch, self.index, self._perm = int(state.get("epoch", 0)), int(state["index"]), None
    self.seed = int(state.get("seed", self.seed))
'''
PATCH_LOADER = '''
from capture.trial.build import data as _w

_w.PackedLoader.state_dict = _state_dict
_w.PackedLoader.load_state_dict = _load_state_dict
'''


def test_a_loader_that_forgets_its_epoch_is_caught_by_the_batch_hashes(tmp_path, monkeypatch):
    """Its state_dict restores to an equal state_dict, every hash of the restored state is equal,
    the first resume is bit-exact (the save was in epoch 0): only the second resume, after the
    epoch wrapped, trains on other batches. The batch hashes name the step."""
    from capture.trial.build import data as workload

    _plant(tmp_path, monkeypatch, FORGETS_EPOCH + PATCH_LOADER)
    namespace: dict = {}
    exec(compile(FORGETS_EPOCH, "forgets_epoch.py", "exec"), namespace)  # the parent's loader too (undone after)
    monkeypatch.setattr(workload.PackedLoader, "state_dict", namespace["_state_dict"])
    monkeypatch.setattr(workload.PackedLoader, "load_state_dict", namespace["_load_state_dict"])

    table = recover.run_recoverability(_config(tmp_path, method="full"), CPU, tmp_path, sensitivity=False)

    assert all(r["equal"] for r in table["restored_state"])
    assert table["losses_resumed"] == table["losses_uninterrupted"][2:]  # the first resume is right
    again = table["resume_again"]
    assert all(r["equal"] for r in again["restored_state"])  # the state check cannot see it
    order = table["data_order"]
    assert order["equal"] is False and order["first_differing_step"] == 4
    assert order["differs_in"] == "second resume (from step 3)"
    assert order["batch_sha256_resumed"] == order["batch_sha256_uninterrupted"][2:]
    assert order["batch_sha256_resumed_again"] != order["batch_sha256_uninterrupted"][3:]
    assert table["verdict_kind"] == "data_order_differs"
    assert table["verdict"] == ("data order differs: the second resume (from step 3) consumed other batches than "
                                "the uninterrupted run from step 4")


# --------------------------------------------------------------------------- early builds


def test_early_builds_follow_the_measured_memory():
    budget = recover.MemoryBudget(limit_bytes=100, peak_bytes=60, build_bytes=20)
    assert budget.fits_early_build()
    assert dataclasses.replace(budget, peak_bytes=75).fits_early_build()  # 95 of 100: 5 % kept free
    assert not dataclasses.replace(budget, peak_bytes=76).fits_early_build()
    assert not dataclasses.replace(budget, build_bytes=0).fits_early_build()
    trial = {"fit": {"limit_bytes": 100, "usable_bytes": 90, "measured_bytes": 60},
             "memory": {"estimate": {"weights": {"bytes": 15}}, "framework_overhead_bytes": 5}}
    blind = hostmem.HostMemory(None, "", None, "")  # the host's side: tests/test_trial_recover_memory.py
    assert recover.budget_from_trial(trial, blind) == budget
    roomy = recover.budget_from_trial(trial, hostmem.HostMemory(2**40, "t", 2**39, "a"), held=2**30, shared=2**29)
    assert dataclasses.replace(roomy, host_need_bytes=None, host_limit_bytes=None) == budget
    assert recover.budget_from_trial({"fit": {"fits": False}}) is None
    # the 8B LoRA on one H200: 111 GiB measured, 16 GB of bf16 weights, a 651 MB context
    h200 = recover.MemoryBudget(150_754_820_096, 111 * 2**30, 16_060_000_000 + 651_000_000)
    assert h200.fits_early_build()
    text = recover.phase_text({"reference_s": 1.5, "worker_start_s": 3.0, "total_s": 9.0, "overlapped": ["worker_start"]})
    assert text.splitlines() == ["recovery phases (seconds):", "  reference            1.50",
                                 "  worker start         3.00  (overlapped with the reference)",
                                 "  total                9.00"]


def test_sensitivity_rows_inside_the_band_and_for_an_undrawn_stream():
    import types

    from capture.trial import recover_judge

    ref = types.SimpleNamespace(applicability={c: None for c in state.COMPONENTS}, losses=[1.0, 2.0, 1.5, 1.25],
                                hashes=("p", "o"))
    variants = {"rng_python": {"losses": [1.5, 1.25 + 1e-7], "param_hash": "q", "optimizer_hash": "o"},
                "rng_numpy": {"undrawn": True},
                "data_position": {"losses": [1.75, 1.5], "param_hash": "x", "optimizer_hash": "y"}}
    rows = {r["component"]: r for r in recover_judge.sensitivity_rows(ref, variants, 1e-7, 2)}
    assert rows["rng_python"]["depends"] is False and rows["rng_python"]["note"].endswith("inside the run-to-run band")
    assert rows["rng_numpy"] == {"component": "rng_numpy", "applicable": True, "depends": False, "loss_diff": 0.0,
                                 "loss_diff_max": 0.0, "note": "not drawn from during the continuation: withholding "
                                                               "it cannot change the run (no restore needed)"}
    assert rows["data_position"]["depends"] is True and rows["data_position"]["diverged_at_step"] == 3
    assert rows["model"]["note"] == "not run"


def test_a_lora_run_resumes_twice_from_an_async_dcp_checkpoint(tmp_path):
    cfg = _config(tmp_path)
    cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, format="dcp-async"))
    table = recover.run_recoverability(cfg, CPU, tmp_path, sensitivity=False)
    assert table["checkpoint_format"] == "dcp-async" and table["verdict"] == "bit-exact", table["verdict"]
    assert table["resume_again"]["verdict"] == "bit-exact" and table["data_order"]["equal"] is True
    assert all(r["equal"] for r in table["restored_state"] + table["resume_again"]["restored_state"])


# In the first restoring process: whether pinning the host copy had started when the resumed run
# wrote its checkpoint at k2 (inside the first continuation), and in which thread it ran.
PIN_BESIDE = '''
import os
import threading
from capture.trial import checkpoint_io as _io, recover_steps as _rs

_started = threading.Event()
_pinned, _save = _rs._pinned, _io.save


def _log(line):
    with open(os.environ["PIN_LOG"], "a") as f:
        f.write(line + "\\n")


def _pinning(host, device):
    _started.set()
    _log("pin " + threading.current_thread().name)
    return _pinned(host, device)


def _saving(saved, path, *args, **kwargs):
    if os.path.basename(path).startswith("again-"):
        _log("save_again, pinning started: %s" % _started.wait(10))
    return _save(saved, path, *args, **kwargs)


_rs._pinned, _io.save = _pinning, _saving
'''


def test_the_host_copy_is_pinned_beside_the_first_continuation(tmp_path, monkeypatch):
    """Pinning a 48 GB host copy took 27 s on the H100 after the first continuation (which itself
    writes a 48 GB checkpoint): the copy is not read again before the band's restores, so it is
    pinned in a thread while that continuation runs, and the stage waits only for what is left."""
    _plant(tmp_path, monkeypatch, PIN_BESIDE)
    monkeypatch.setenv("PIN_LOG", str(tmp_path / "pin.log"))
    table = recover.run_recoverability(_config(tmp_path, method="full"), CPU, tmp_path, sensitivity=False)

    log = (tmp_path / "pin.log").read_text().splitlines()
    assert [line.split()[0] for line in log] == ["pin", "save_again,"], log
    assert log[0].startswith("pin pin_") and log[1].endswith("pinning started: True"), log
    assert table["verdict"] == "bit-exact" and table["resume_again"]["verdict"] == "bit-exact"
    timings = table["restore_timings"]
    assert timings["pin_s"] >= 0 and 0 <= timings["pin_wait_s"] <= timings["continuations_s"]

"""`capture preflight` and the trial's preflight stage end to end on the real CPU: real torch GEMM
and copies, real gloo all-reduce across two worker processes, a real signing key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tiny_configs import gpt2_model

from capture import manifest as mf
from capture import signing
from capture._cli import main
from capture.errors import EXIT_PREFLIGHT, EXIT_USAGE
from capture.preflight import preflight_rows, render
from capture.preflight.allreduce import bus_bandwidth, run_allreduce
from capture.preflight.catalog import load_catalog

SMALL = """
[trial]
name = "small"
seed = 5
warmup_steps = 1
measured_steps = 2
""" + gpt2_model(n_positions=64) + """[trial.batch]
max_seq_len = 32
micro_batch_size = 2
[trial.validation]
every_steps = 10
batches = 1
[trial.checkpoint]
enabled = false
"""


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    monkeypatch.delenv("CAPTURE_KEY", raising=False)
    monkeypatch.chdir(tmp_path)


def _verified(path: Path, tmp_path: Path) -> dict:
    allowed = signing.AllowedSigners.load(tmp_path / "cfg" / "capture" / "allowed_signers")
    _info, body = signing.verify_signed_bytes(path.read_bytes(), allowed, str(path))
    return mf.parse_body(body, str(path))


def _break_allreduce(monkeypatch) -> None:
    """A real failure: the gloo workers get 10 ms to finish, are killed, and the check fails."""
    from capture.preflight import stage

    monkeypatch.setattr(stage, "TIMEOUT_S", {"quick": 0.01, "full": 0.01})


def test_cpu_preflight_json_and_signed_manifest(tmp_path, capsys):
    out = tmp_path / "preflight.toml"
    assert main(["preflight", "--device", "cpu", "--json", "-o", str(out)]) == 0
    stdout, stderr = capsys.readouterr()
    table = json.loads(stdout)
    assert table["device_kind"] == "cpu" and table["mode"] == "quick" and table["verdict"] == "pass"
    checks = {c["name"]: c for c in table["checks"]}
    assert checks["gemm_fp32"]["unit"] == "TFLOP/s" and checks["gemm_fp32"]["value"] > 0
    assert checks["memory_copy"]["value"] > 0
    ar = checks["allreduce"]
    assert ar["verdict"] == "pass" and ar["value"] > 0 and "2 ranks, gloo" in ar["reason"]
    assert checks["health"]["verdict"] == "skipped"
    assert "capture: preflight: gloo all-reduce across 2 processes" in stderr
    data = _verified(out, tmp_path)
    assert data["kind"] == "fingerprint" and "host" in data
    assert data["preflight"]["checks"] == table["checks"]
    assert set(data["preflight"]) == {"mode", "verdict", "duration_s", "device_kind", "checks"}


def test_cpu_preflight_table_on_stdout(capsys):
    assert main(["preflight", "--device", "cpu"]) == 0
    stdout, stderr = capsys.readouterr()
    assert stdout.splitlines()[0].split() == ["check", "dev", "result", "value", "expected", "/", "reason"]
    assert "allreduce" in stdout and "preflight pass (quick, cpu" in stdout
    assert "capture: preflight:" not in stdout and "capture: preflight:" in stderr


def test_failed_check_exits_5_after_printing_and_writing(tmp_path, capsys, monkeypatch):
    _break_allreduce(monkeypatch)
    out = tmp_path / "p.toml"
    assert main(["preflight", "--device", "cpu", "-o", str(out)]) == EXIT_PREFLIGHT
    stdout, stderr = capsys.readouterr()
    assert "FAIL" in stdout
    last = [ln for ln in stderr.splitlines() if ln.startswith(("error:", "hint:"))]
    assert last[0].startswith("error: preflight failed: allreduce: the 2 worker processes did not finish")
    assert last[1].startswith("hint: ")
    assert "Traceback" not in stderr
    assert _verified(out, tmp_path)["preflight"]["verdict"] == "fail"


def test_gloo_allreduce_busbw_definition():
    r = run_allreduce(2, "gloo", 4 * 2**20, 3, 120.0)
    assert r.correct and r.error is None
    algbw, busbw = bus_bandwidth(r.nbytes, r.seconds_per_iter, 2)
    assert busbw == pytest.approx(algbw * 2 * (2 - 1) / 2) == pytest.approx(r.busbw_bytes_per_s)
    assert bus_bandwidth(8, 1.0, 8) == (8.0, 14.0)  # nccl-tests: 2(n-1)/n = 1.75 for n = 8


@pytest.mark.parametrize("args,message", [
    (["--principal", "me"], "error: --principal needs -o FILE"),
    (["-o", "missing/dir/p.toml"], "error: -o: missing/dir/p.toml is a folder or its folder does not exist"),
    (["--device", "cuda"], "error: --device cuda: no cuda device is visible to torch"),
    (["--quick", "--full"], "error: argument --full: not allowed with argument --quick"),
    (["--catalog", "nope.toml"], "error: --catalog: nope.toml is not a file"),
])
def test_usage_errors_exit_2_with_one_line(args, message, capsys):
    try:
        rc = main(["preflight", "--device", "cpu", *args] if "--device" not in args else ["preflight", *args])
    except SystemExit as exc:  # argparse's own usage errors
        rc = exc.code
    assert rc == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith(message), err
    assert "hint:" in err and "Traceback" not in err


def test_bad_catalog_names_the_key(tmp_path, capsys):
    cat = tmp_path / "cat.toml"
    cat.write_text('[[sku]]\nname = "X"\npeak_bf16_dense_flops = -1\n')
    assert main(["preflight", "--device", "cpu", "--catalog", str(cat)]) == EXIT_USAGE
    assert "sku[0].peak_bf16_dense_flops: must be a positive number" in capsys.readouterr().err


def test_trial_runs_preflight_first_and_records_it(tmp_path, capsys):
    cfg = tmp_path / "small.toml"
    cfg.write_text(SMALL)
    out = tmp_path / "t.toml"
    assert main(["trial", str(cfg), "--no-recovery", "--no-report", "-o", str(out)]) == 0
    data = _verified(out, tmp_path)
    assert data["kind"] == "trial" and data["preflight"]["device_kind"] == "cpu"
    assert data["preflight"]["verdict"] == "pass" and "stats" in data["trial"]
    assert data["trial"]["cost"]["phases"]["preflight_s"] > 0
    assert "capture: preflight: quick checks on cpu" in capsys.readouterr().err


def test_trial_stops_on_a_failed_preflight_unless_told(tmp_path, capsys, monkeypatch):
    _break_allreduce(monkeypatch)
    cfg = tmp_path / "small.toml"
    cfg.write_text(SMALL)
    out = tmp_path / "t.toml"
    assert main(["trial", str(cfg), "--no-recovery", "--no-report", "-o", str(out)]) == EXIT_PREFLIGHT
    err = capsys.readouterr().err
    assert "error: preflight failed: allreduce" in err and "Traceback" not in err
    data = _verified(out, tmp_path)
    assert data["kind"] == "fingerprint" and data["preflight"]["verdict"] == "fail" and "trial" not in data
    assert main(["trial", str(cfg), "--no-recovery", "--no-report", "--ignore-preflight-failure", "-o", str(out)]) == 0
    data = _verified(out, tmp_path)
    assert data["kind"] == "trial" and data["preflight"]["verdict"] == "fail" and "stats" in data["trial"]
    assert "going on as --ignore-preflight-failure asks" in capsys.readouterr().err


def test_trial_no_preflight(tmp_path):
    cfg = tmp_path / "small.toml"
    cfg.write_text(SMALL)
    out = tmp_path / "t.toml"
    assert main(["trial", str(cfg), "--no-preflight", "--no-recovery", "--no-report", "-o", str(out)]) == 0
    assert "preflight" not in _verified(out, tmp_path)


# --------------------------------------------------------------------------- rendering, compare, catalog


A = {"preflight": {"mode": "quick", "verdict": "pass", "duration_s": 8.0, "device_kind": "cuda", "checks": [
    {"name": "gemm_bf16", "device": 0, "verdict": "pass", "reason": "r", "value": 660.0, "unit": "TFLOP/s",
     "expected": "593-989 TFLOP/s (H200)"},
    {"name": "pcie_link", "device": 0, "verdict": "pass", "reason": "Gen5 x16", "value": "Gen5 x16"},
    {"name": "p2p", "verdict": "skipped", "reason": "one visible GPU"}]}}
B = {"preflight": {"mode": "quick", "verdict": "fail", "duration_s": 9.0, "device_kind": "cuda", "checks": [
    {"name": "gemm_bf16", "device": 0, "verdict": "fail", "reason": "r", "value": 330.0, "unit": "TFLOP/s"},
    {"name": "throttle", "device": 0, "verdict": "fail", "reason": "hardware slowdown under load: hw_slowdown",
     "value": "hw_slowdown"}]}}


def test_preflight_rows_align_two_manifests():
    rows = preflight_rows(A, B)
    assert [(r["name"], r["device"]) for r in rows] == [("gemm_bf16", 0), ("pcie_link", 0), ("p2p", None), ("throttle", 0)]
    gemm = rows[0]
    assert (gemm["a"], gemm["b"], gemm["unit"], gemm["verdict_a"], gemm["verdict_b"]) == (660.0, 330.0, "TFLOP/s", "pass", "fail")
    assert gemm["ratio"] == pytest.approx(0.5)
    assert rows[1]["b"] is None and rows[1]["verdict_b"] is None and rows[1]["ratio"] is None
    assert rows[3]["verdict_a"] is None and rows[3]["b"] == "hw_slowdown"
    assert preflight_rows({}, B)[0]["a"] is None  # a manifest without [preflight]


def test_render_hides_skipped_unless_asked():
    text = render(A)
    assert "593-989 TFLOP/s (H200)" in text and "p2p" not in text and "1 skipped (--all lists them)" in text
    assert "p2p" in render(A, verbose=True)
    failing = render(B)
    assert "FAIL" in failing and "hardware slowdown under load" in failing


def test_catalog_agrees_with_the_trial_catalog():
    from capture.trial.fit import load_catalog as load_trial_catalog

    trial = load_trial_catalog()  # fit.py's loader still accepts the shipped accelerators.toml
    pre = load_catalog()
    linked = [s for s in pre.skus if s.accelerator]
    assert {s.accelerator for s in linked} == {c.name for c in trial.cards}
    for s in linked:
        assert trial.get(s.accelerator).peak_bf16_dense_flops == s.peak_bf16_dense_flops, s.name
    for name, sku in (("NVIDIA H200", "H200 SXM 141GB"), ("NVIDIA H200 NVL", "H200 NVL"),
                      ("NVIDIA H100 80GB HBM3", "H100 SXM 80GB"), ("NVIDIA H100 NVL", "H100 NVL 94GB"),
                      ("NVIDIA H100 PCIe", "H100 PCIe 80GB"), ("NVIDIA A100-SXM4-80GB", "A100 SXM4 80GB"),
                      ("AMD Instinct MI300X", "MI300X 192GB"), ("MI300X-O", "MI300X 192GB"), ("MI300A", "MI300A"),
                      ("AMD Instinct MI210", "MI210")):
        assert pre.match(name).name == sku, name
    for s in pre.skus:
        assert s.source and s.healthy_basis and set(s.healthy) == {"gemm_bf16", "copy_d2d", "pcie", "p2p", "allreduce"}


def test_user_catalog_overrides_and_extends(tmp_path):
    user = tmp_path / "cfg" / "capture" / "preflight.toml"
    user.parent.mkdir(parents=True)
    user.write_text('[[sku]]\nname = "RTX 4090"\nmatch = "4090"\npeak_bf16_dense_flops = 165e12\n'
                    'healthy = { gemm_bf16 = { pass = 0.5, warn = 0.3 } }\n')
    cat = load_catalog()
    sku = cat.match("NVIDIA GeForce RTX 4090")
    assert sku is not None and sku.healthy["gemm_bf16"].pass_fraction == 0.5
    assert sku.healthy["copy_d2d"].pass_fraction == 0.75  # the shipped defaults fill the rest
    assert cat.match("NVIDIA H200").name == "H200 SXM 141GB"


def test_buffers_that_cannot_be_allocated_warn_not_fail():
    # an allocation refused under a memory limit says nothing about the card: warn, not measured
    from capture.preflight import perf
    from capture.preflight.stage import judge

    oom = perf.Figure("memory_copy", None, "GB/s", error="RuntimeError: DefaultCPUAllocator: can't allocate memory")
    check = judge(oom, 100.0, None, "memory bandwidth")
    assert check.verdict == "warn" and "not measured" in check.reason
    wrong = perf.Figure("memory_copy", None, "GB/s", error="the copy does not match its source", wrong=True)
    assert judge(wrong, 100.0, None, "memory bandwidth").verdict == "fail"
    broken = perf.Figure("gemm_fp32", None, "TFLOP/s", error="RuntimeError: CUDA error: an illegal memory access")
    assert judge(broken, 1.0, None, "gemm").verdict == "fail"


class _Events:
    """torch.cuda's event timing, which needs a GPU: a clock the calls advance by 4 ms each, and a
    log of what happened in which order (the one part of the Timer that cannot run here)."""

    def __init__(self) -> None:
        self.ms, self.log = 0.0, list[str]()
        outer = self

        class Event:
            def __init__(self, enable_timing: bool) -> None:
                assert enable_timing
                self.at: float | None = None

            def record(self) -> None:
                self.at = outer.ms
                outer.log.append("record")

            def synchronize(self) -> None:
                outer.log.append("synchronize")

            def elapsed_time(self, end: "Event") -> float:
                assert self.at is not None and end.at is not None
                return end.at - self.at

        self.Event = Event

    def synchronize(self, device: object) -> None:
        self.log.append("sync")

    def call(self) -> None:
        self.ms += 4.0
        self.log.append("call")


def test_gpu_timer_reads_the_device_events_per_call_and_runs_during_while_they_run():
    from types import SimpleNamespace

    from capture.preflight.perf import Timer

    cuda = _Events()
    timer = Timer(SimpleNamespace(cuda=cuda), SimpleNamespace(type="cuda", index=0))
    assert timer.burst_s(cuda.call, n=10) == pytest.approx(0.004)
    assert cuda.log[-13:] == ["record"] + ["call"] * 10 + ["record", "synchronize"]
    seen: list[float] = []
    cuda.log.clear()

    def during(expected_s: float) -> None:
        seen.append(expected_s)
        cuda.log.append("during")

    per_call, n = timer.per_call_s(cuda.call, target_s=1e9, during=during, max_iters=50)
    assert (per_call, n) == (pytest.approx(0.004), 50)
    # told how long the 50 calls should take while they run, before waiting for them
    assert cuda.log[-54:] == ["record"] + ["call"] * 50 + ["record", "during", "synchronize"]
    assert len(seen) == 1 and seen[0] > 0

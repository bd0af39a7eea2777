"""The Recorder around training loops we did not write: real torch on the CPU."""

from __future__ import annotations

import runpy
import sys
import time
from pathlib import Path

import pytest
import torch

from capture import manifest as mf
from capture import signing
from capture import Recorder

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    monkeypatch.delenv("CAPTURE_KEY", raising=False)


def _slow_loader(n: int, slow_every: int, delay_s: float):
    """A loader that stalls on every ``slow_every``-th batch, like a starved input pipeline."""
    for i in range(n):
        if i % slow_every == slow_every - 1:
            time.sleep(delay_s)
        yield torch.randn(16, 32)


def test_recorder_measures_steps_waits_and_memory_of_a_plain_loop():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with Recorder("cpu", warmup_steps=2, model=model) as rec:
        for x in rec.batches(_slow_loader(12, slow_every=3, delay_s=0.05)):
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            rec.step(tokens=x.shape[0], loss=loss)
    r = rec.result
    assert rec.steps == 12 and len(r.step_time_s) == 10 and len(r.warmup_step_time_s) == 2
    assert len(r.loss) == 10 and all(isinstance(v, float) for v in r.loss)
    # batches 3, 6, 9, 12 stall 50 ms; of the measured steps (3..12) that is steps 3, 6, 9, 12
    slow = [i for i, w in enumerate(r.data_wait_s) if w >= 0.045]
    assert slow == [0, 3, 6, 9]
    assert all(r.step_time_s[i] >= r.data_wait_s[i] for i in range(10))
    s = r.stats
    assert s.steps == 10 and s.data_wait_total_s >= 0.18
    assert s.stall_share == pytest.approx(s.data_wait_total_s / sum(r.step_time_s))
    assert s.tokens_per_step == 16 and s.tokens_per_s == pytest.approx(160 / sum(r.step_time_s))
    assert r.clock == "perf_counter" and r.memory.device_type == "cpu" and r.memory.device_used_bytes > 0
    assert "mfu_note" in r.throughput  # a CPU has no catalog peak: no MFU, and it says why
    table = rec.trial_table()
    assert table["run"]["params_total"] == sum(p.numel() for p in model.parameters())
    assert table["steps"]["data_wait_s"] == list(r.data_wait_s)


def test_recorder_keeps_what_it_measured_when_the_loop_fails():
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        with Recorder("cpu", warmup_steps=0) as rec:
            for i, x in enumerate(rec.batches(iter([torch.ones(2)] * 5))):
                if i == 3:
                    torch.empty(1 << 62, dtype=torch.uint8)  # a real allocator failure mid-run
                rec.step(tokens=2)
    assert len(rec.result.step_time_s) == 3 and rec.result.stats.steps == 3


def test_result_exists_only_after_the_block():
    rec = Recorder("cpu")
    with pytest.raises(RuntimeError, match="once the `with Recorder"):
        rec.result
    with pytest.raises(ValueError):
        Recorder("cpu", warmup_steps=-1)


def test_shipped_example_runs_and_writes_a_signed_manifest(tmp_path, monkeypatch, capsys):
    out = tmp_path / "rec.toml"
    monkeypatch.setattr(sys, "argv", ["recorder_example.py", str(out)])
    with pytest.raises(SystemExit) as info:
        runpy.run_path(str(ROOT / "examples" / "recorder_example.py"), run_name="__main__")
    assert info.value.code == 0
    printed = capsys.readouterr().out
    assert "10 measured steps" in printed and printed.strip().endswith(str(out))
    assert "token_id" not in printed + capsys.readouterr().err
    allowed = signing.AllowedSigners.load(tmp_path / "cfg" / "capture" / "allowed_signers")
    _info, body = signing.verify_signed_bytes(out.read_bytes(), allowed, str(out))
    m = mf.parse_body(body, str(out))
    t = m["trial"]
    assert m["kind"] == "trial" and t["config_source"].startswith("recorder")
    assert t["run"]["params_total"] > 100_000 and len(t["steps"]["step_time_s"]) == 10
    assert t["stats"]["tokens_per_step"] == 8 * 64 and t["memory"]["measured"]["device_used_bytes"] > 0
    html = out.with_suffix(".html")
    assert t["report"]["html"] == html.name and "Steps" in html.read_text()


def test_validation_and_checkpoint_are_timed_and_left_out_of_step_times(tmp_path):
    ckpt = tmp_path / "ckpt.bin"
    with Recorder("cpu", warmup_steps=1, tokens_per_step=4) as rec:
        for i in range(6):
            time.sleep(0.01)
            rec.step()
            if i == 2:
                with rec.validation():
                    time.sleep(0.2)
            if i == 4:
                with rec.checkpoint(ckpt):
                    ckpt.write_bytes(b"x" * 1000)
                    time.sleep(0.1)
        assert rec.measured_steps == 5
    r = rec.result
    assert len(r.step_time_s) == 5 and max(r.step_time_s) < 0.1  # the 0.2 s pass is not in a step
    assert r.validation.durations_s[0] >= 0.2 and r.checkpoint.durations_s[0] >= 0.1
    table = rec.trial_table()
    assert table["validation"]["count"] == 1 and table["checkpoint"]["size_bytes"] == 1000
    assert table["stats"]["tokens_per_step"] == 4


def test_public_import_and_no_runner_import(tmp_path):
    """`capture.Recorder` and the old path load without the trial runner (no import circle)."""
    import subprocess

    code = ("import sys, capture; from capture import Recorder; import capture.trial.recorder as old; "
            "assert old.Recorder is Recorder; assert 'capture.trial.runner' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path)

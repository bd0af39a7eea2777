"""The Lightning callback with a real Lightning fit on CPU: one process and 2-process DDP on gloo."""

from __future__ import annotations

import runpy

import pytest

pytest.importorskip("lightning")

from integrations_helpers import EXAMPLES, child_env, read_signed, torchrun, verify

from capture.integrations.lightning import precision_name


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    monkeypatch.delenv("CAPTURE_KEY", raising=False)
    monkeypatch.delenv("CAPTURE_EXEC_DIR", raising=False)
    monkeypatch.chdir(tmp_path)


def test_fit_writes_a_signed_manifest_with_steps_validation_and_checkpoints(tmp_path):
    out = tmp_path / "pl.toml"
    runpy.run_path(str(EXAMPLES / "lightning_example.py"))["main"]([str(out), str(tmp_path / "work")])
    verify(out, tmp_path, tmp_path)
    t = read_signed(out, tmp_path)["trial"]
    run = t["run"]
    assert run["grad_accum"] == 2 and run["micro_batch_size"] == 2 and run["global_batch_size"] == 4
    assert run["precision"] == {"dtype": "fp32"} and run["lightning_precision"] == "32-true"
    assert run["model"]["class"] == "GPT2LMHeadModel" and run["measured_steps"] == 5
    assert t["stats"]["tokens_per_step"] == 2 * 2 * 16  # two micro-batches of 2 x 16 tokens
    assert t["validation"]["count"] == 2  # val_check_interval counts batches: after batch 6 and 12
    assert t["checkpoint"]["count"] == 2 and t["checkpoint"]["size_bytes"] > 100_000


@pytest.mark.slow  # two processes each importing torch (and the framework)
def test_fit_under_torchrun_ddp_two_ranks_one_manifest(tmp_path):
    out = tmp_path / "pl2.toml"
    res = torchrun([str(EXAMPLES / "lightning_example.py"), str(out), str(tmp_path / "work")], child_env(tmp_path), tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert list(tmp_path.glob("*.toml")) == [out]
    verify(out, tmp_path, tmp_path)
    t = read_signed(out, tmp_path)["trial"]
    assert t["run"]["world_size"] == 2 and t["run"]["strategy"] == "DDPStrategy"
    assert t["run"]["global_batch_size"] == 8 and [r["rank"] for r in t["distributed"]["ranks"]] == [0, 1]


@pytest.mark.parametrize("given, name", [("bf16-mixed", "bf16"), ("16-mixed", "fp16"), ("32-true", "fp32"),
                                         ("bf16-true", "bf16"), ("64-true", "fp64")])
def test_precision_names(given, name):
    assert precision_name(given) == name

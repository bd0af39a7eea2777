"""The Hugging Face Trainer callback with the real Trainer on CPU: one process and 2-process gloo."""

from __future__ import annotations

import runpy

import pytest

pytest.importorskip("transformers")

from integrations_helpers import EXAMPLES, child_env, read_signed, torchrun, verify


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("CAPTURE_KEY", raising=False)
    monkeypatch.delenv("CAPTURE_EXEC_DIR", raising=False)
    monkeypatch.chdir(tmp_path)


def test_trainer_fine_tune_writes_a_signed_manifest_with_what_the_trainer_knows(tmp_path, capsys):
    out = tmp_path / "hf.toml"
    script = runpy.run_path(str(EXAMPLES / "hf_trainer_example.py"))
    script["main"]([str(out), str(tmp_path / "work")])
    assert "token_id" not in capsys.readouterr().err
    verify(out, tmp_path, tmp_path)
    t = read_signed(out, tmp_path)["trial"]
    run = t["run"]
    assert run["grad_accum"] == 2 and run["micro_batch_size"] == 2 and run["global_batch_size"] == 4
    assert run["precision"] == {"dtype": "fp32"} and run["model"]["class"] == "GPT2LMHeadModel"
    assert run["model"]["architecture"] == "gpt2" and run["data"]["rows"] == 64
    assert run["warmup_steps"] == 1 and run["measured_steps"] == 5
    assert len(t["steps"]["step_time_s"]) == 5 and t["stats"]["tokens_per_step"] == 4 * 16
    assert t["validation"]["count"] == 2 and t["checkpoint"]["count"] == 2
    assert t["checkpoint"]["size_bytes"] > 100_000  # checkpoint-6: the tiny model's weights and optimizer
    assert out.with_suffix(".html").exists()


@pytest.mark.slow  # two processes each importing torch (and the framework)
def test_trainer_under_torchrun_two_ranks_one_manifest(tmp_path):
    out = tmp_path / "hf2.toml"
    res = torchrun([str(EXAMPLES / "hf_trainer_example.py"), str(out), str(tmp_path / "work")], child_env(tmp_path), tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert list(tmp_path.glob("*.toml")) == [out]
    verify(out, tmp_path, tmp_path)
    t = read_signed(out, tmp_path)["trial"]
    assert t["run"]["world_size"] == 2 and t["run"]["global_batch_size"] == 8
    d = t["distributed"]
    assert [r["rank"] for r in d["ranks"]] == [0, 1] and d["stacks_identical"] is True
    assert t["stats"]["tokens_per_step"] == 4 * 16  # this rank's tokens: the global count over 2 ranks

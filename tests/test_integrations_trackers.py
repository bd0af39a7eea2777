"""Trackers with the real libraries: MLflow (local file store), W&B (offline), TensorBoard (event files)."""

from __future__ import annotations

import hashlib
import struct
import time
from pathlib import Path

import pytest
import torch

from capture import Recorder
from capture.integrations.trackers import (
    MLflow,
    TensorBoard,
    WandB,
    step_series,
    summary_scalars,
)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """One small loop recorded and signed, shared by the tracker tests."""
    home = tmp_path_factory.mktemp("trackers")
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_CONFIG_HOME", str(home / "cfg"))
    mp.delenv("CAPTURE_KEY", raising=False)
    mp.delenv("CAPTURE_EXEC_DIR", raising=False)
    model = torch.nn.Linear(8, 8)
    with Recorder("cpu", warmup_steps=1, tokens_per_step=4, model=model) as rec:
        for _ in range(5):
            model(torch.randn(4, 8)).sum().backward()
            time.sleep(0.002)
            rec.step(loss=torch.tensor(1.5))
    out = rec.write_manifest(home / "run.toml")
    yield rec, out, home
    mp.undo()


def test_scalars_are_the_recorded_figures(recorded):
    rec, out, _ = recorded
    series = step_series(rec.trial_table())
    assert series["capture/step_time_s"] == list(rec.result.step_time_s) and len(series["capture/loss"]) == 4
    scalars = summary_scalars(rec.trial_table())
    assert scalars["capture/step_time_median_s"] == rec.result.stats.step_time_median_s
    assert scalars["capture/memory/device_used_bytes"] > 0


def test_mlflow_file_store_gets_artifact_scalars_and_digest(recorded, tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    rec, out, _ = recorded
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind this switch
    uri = (tmp_path / "mlruns").as_uri()
    tracker = MLflow(tracking_uri=uri, experiment="capture-test")
    tracker.log(out, rec.trial_table() | {"report": {"html": out.with_suffix(".html").name}})
    client = MlflowClient(tracking_uri=uri)
    history = client.get_metric_history(tracker.run_id, "capture/step_time_s")
    assert [(m.step, m.value) for m in history] == list(enumerate(rec.result.step_time_s))
    run = client.get_run(tracker.run_id)
    assert run.data.metrics["capture/memory/device_used_bytes"] > 0
    assert run.data.tags["capture.manifest_sha256"] == hashlib.sha256(out.read_bytes()).hexdigest()
    assert sorted(a.path for a in client.list_artifacts(tracker.run_id, "capture")) == ["capture/run.html", "capture/run.toml"]
    local = Path(client.download_artifacts(tracker.run_id, "capture/run.toml", str(tmp_path)))
    assert local.read_bytes() == out.read_bytes()


def _wandb_records(path: Path):
    """The records of a W&B transaction log (.wandb): a LevelDB-style log of protobuf Records."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if pos + 7 + length > len(data):
            break  # a record still being written
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            break
        pending += chunk
        if kind in (1, 4):  # FULL or LAST
            rec = pb.Record()
            rec.ParseFromString(pending)
            pending = b""
            yield rec


def test_wandb_offline_run_holds_the_artifact_and_scalars(recorded, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    rec, out, _ = recorded
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "300")  # a loaded machine starts wandb's service slowly
    import wandb

    if wandb.run is not None:  # a run left by another test would take our figures and stay unfinished
        wandb.finish()
    tracker = WandB(init={"project": "capture-test", "dir": str(tmp_path)})
    tracker.log(out, rec.trial_table())
    log = next(Path(tracker.run_dir).glob("run-*.wandb"))
    # finish() returns once wandb's service has taken the exit record; the service writes and closes
    # the log in its own process, so read it until the exit record is in (CI once read it without
    # the history rows)
    deadline = time.monotonic() + 60
    while "exit" not in (kinds := [r.WhichOneof("record_type") for r in _wandb_records(log)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert kinds.count("history") == len(rec.result.step_time_s), (log.stat().st_size, kinds)
    steps, summary, artifacts = [], {}, []
    for r in _wandb_records(log):
        kind = r.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): i.value_json for i in r.history.item}
            if "capture/step_time_s" in items:
                steps.append(float(items["capture/step_time_s"]))
        elif kind == "summary":
            summary.update({i.key or "/".join(i.nested_key): i.value_json for i in r.summary.update})
        elif kind == "artifact":
            artifacts.append((r.artifact.type, sorted(m.path for m in r.artifact.manifest.contents)))
    assert steps == pytest.approx(list(rec.result.step_time_s))
    assert summary["capture/manifest_sha256"].strip('"') == hashlib.sha256(out.read_bytes()).hexdigest()
    assert float(summary["capture/step_time_median_s"]) == pytest.approx(rec.result.stats.step_time_median_s)
    assert ("capture-manifest", ["run.toml"]) in artifacts


def test_tensorboard_event_files_read_back(recorded, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rec, out, _ = recorded
    TensorBoard(tmp_path / "tb").log(out, rec.trial_table())
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    scalars = acc.Scalars("capture/step_time_s")
    assert [s.step for s in scalars] == [0, 1, 2, 3]
    assert [s.value for s in scalars] == pytest.approx(list(rec.result.step_time_s), rel=1e-6)  # stored as float32
    assert acc.Scalars("capture/memory/device_used_bytes")[0].value > 0
    assert (tmp_path / "tb" / "run.toml").read_bytes() == out.read_bytes()

"""The Recorder under a real 2-process gloo torchrun: one manifest, every rank's figures and stack."""

from __future__ import annotations

import subprocess
import sys

import pytest
from integrations_helpers import SCRIPTS, child_env, read_signed, verify

from capture.integrations.distributed import stack_differences, summarize_ranks


def _fake_dist(root, name: str, version: str):
    d = root / f"{name}-{version}.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n\n")


@pytest.mark.slow  # two processes each importing torch (and the framework)
def test_two_ranks_one_manifest_names_the_slowest_rank_and_the_differing_package(tmp_path):
    import tqdm

    shadow = tmp_path / "shadow"
    _fake_dist(shadow, "tqdm", "0.0.1")  # rank 1 only: a stack that differs in one package version
    env = child_env(tmp_path, SHADOW_DIR=str(shadow), PYTHON=sys.executable)
    out, wrapped = tmp_path / "dist.toml", tmp_path / "exec.toml"
    # `capture exec -- torchrun ...`: the launch wrapped, the Recorder's figures joining exec's manifest too
    res = subprocess.run([sys.executable, "-m", "capture", "exec", "-o", str(wrapped), "--", sys.executable, "-m",
                          "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--no-python",
                          str(SCRIPTS / "shadow_rank1.sh"), str(SCRIPTS / "recorder_dist.py"), str(out)],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"0 {out}" in res.stdout and "1 None" in res.stdout  # rank 0 wrote, rank 1 did not
    assert sorted(tmp_path.glob("*.toml")) == [out, wrapped]
    assert "stacks differ" in res.stderr and "packages.tqdm" in res.stderr
    verify(out, tmp_path, tmp_path)
    t = read_signed(out, tmp_path)["trial"]
    d = t["distributed"]
    assert d["world_size"] == 2 and [r["rank"] for r in d["ranks"]] == [0, 1]
    assert d["slowest_rank"] == 1 and t["run"]["slowest_rank"].startswith("rank 1")
    assert all(r["measured_steps"] == 5 and r["device_used_bytes"] > 0 and r["data_wait_total_s"] >= 0 for r in d["ranks"])
    assert d["ranks"][1]["step_time_mean_s"] > d["ranks"][0]["step_time_mean_s"] + 0.03
    assert d["stacks_identical"] is False
    assert d["stack_differences"] == [f"packages.tqdm: {tqdm.__version__} (rank 0), 0.0.1 (rank 1)"]
    assert d["ranks"][0]["stack_sha256"] != d["ranks"][1]["stack_sha256"]
    assert d["nodes"][0]["stack_consistent"] is False and d["nodes"][0]["stack_sha256"] == d["ranks"][0]["stack_sha256"] and d["tokens_per_s_all_ranks"] > 0
    html = out.with_suffix(".html").read_text()
    assert "<h2>Ranks</h2>" in html and "packages.tqdm" in html
    verify(wrapped, tmp_path, tmp_path)
    w = read_signed(wrapped, tmp_path)
    assert w["exec"]["exit_code"] == 0 and w["exec"]["command"][1:3] == ["-m", "torch.distributed.run"]
    assert w["trial"]["distributed"]["stack_differences"] == d["stack_differences"]


def test_summary_of_identical_ranks_has_no_warning():
    def rec(rank, mean, host="a"):
        stack = {"torch": "2.13.0", "packages": {"x": "1"}}
        return {"record": {"rank": rank, "hostname": host, "step_time_mean_s": mean, "data_wait_total_s": 0.0,
                           "tokens_per_s": 10.0, "stack_sha256": "d"}, "stack": stack}

    g = summarize_ranks([rec(1, 0.2, "b"), rec(0, 0.1)])
    assert g.warnings == () and g.table["stacks_identical"] is True and g.table["node_count"] == 2
    assert g.table["slowest_rank"] == 1 and g.table["step_time_spread"] == pytest.approx(1.0)
    assert g.table["tokens_per_s_all_ranks"] == 20.0
    assert stack_differences({0: {"driver": "550"}, 1: {"driver": "560"}}) == ["driver: 550 (rank 0), 560 (rank 1)"]


def _record(rank: int) -> dict:
    return {"record": {"rank": rank, "hostname": "a", "stack_sha256": "d" * 64, "step_time_mean_s": 0.1 * (rank + 1)},
            "stack": {"torch": "2.13.0", "packages": {"x": "1"}}}


def test_exchange_through_a_real_store_rank_0_reads_every_rank_in_order_and_leaves_no_keys():
    import torch.distributed as dist

    from capture.integrations.distributed import exchange

    base = dist.HashStore()
    store = dist.PrefixStore("capture/recorder/0/", base)
    assert exchange(store, 2, 3, _record(2)) is None and exchange(store, 1, 3, _record(1)) is None  # no waiting
    got = exchange(store, 0, 3, _record(0))
    assert [r["record"]["rank"] for r in got] == [0, 1, 2] and got[1] == _record(1)
    assert base.num_keys() == 0  # rank 0 deleted what the ranks wrote


def test_exchange_names_the_ranks_that_never_wrote_when_the_store_times_out():
    import datetime

    import torch.distributed as dist

    from capture.integrations.distributed import exchange

    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=0.2))
    exchange(store, 2, 4, _record(2))
    with pytest.raises(RuntimeError, match=r"ranks 1, 3 never called write_manifest"):
        exchange(store, 0, 4, _record(0))


@pytest.mark.parametrize("raw", [b"\xff", b"[]", b'{"record": {"rank": 0}, "stack": {}}', b'{"record": {"rank": 5, "stack_sha256": "d"}, "stack": {}}'])
def test_exchange_refuses_a_record_capture_did_not_write(raw):
    import torch.distributed as dist

    from capture.integrations.distributed import exchange

    store = dist.HashStore()
    store.set("1", raw)  # another writer on the unauthenticated store
    with pytest.raises(ValueError, match="rank 1 is not one"):
        exchange(store, 0, 2, _record(0))

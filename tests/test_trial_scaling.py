"""The scaling step: batch derivation, reading, launcher, and the real torchrun path on CPU.

The end-to-end tests launch ``python -m torch.distributed.run`` with 2 CPU processes (gloo) on
the shipped tiny example, DDP and FSDP both, restore included, then sign a manifest holding the
table and check it with the real ``ssh-keygen -Y verify``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from local_ports import free_port

from capture import manifest
from capture.errors import ConfigError, UsageError
from capture.trial import scaling, scaling_args
from capture.trial.scaling import BatchPlan, derive_batch

SECRET = "hunter2-scaling-secret"


def _args(*argv: str) -> scaling_args.ScalingOptions:
    p = argparse.ArgumentParser()
    scaling_args.add_arguments(p)
    return scaling_args.ScalingOptions.from_args(p.parse_args(list(argv)))



# --------------------------------------------------------------------------- batch derivation


def test_batch_keeps_micro_batch_and_divides_grad_accum():
    plan = derive_batch(micro_batch=8, grad_accum=4, world_size=2, seq_len=128)
    assert (plan.per_rank_micro_batch, plan.per_rank_grad_accum) == (8, 2)
    assert plan.method == "grad_accum divided by world_size"
    assert plan.tokens_per_optimizer_step == plan.baseline_tokens_per_optimizer_step == 8 * 4 * 128


def test_batch_divides_micro_batch_when_grad_accum_is_not_divisible():
    plan = derive_batch(micro_batch=8, grad_accum=1, world_size=2, seq_len=64)
    assert (plan.per_rank_micro_batch, plan.per_rank_grad_accum) == (4, 1)
    assert plan.method == "micro_batch divided by world_size"
    assert plan.tokens_per_optimizer_step == 8 * 64


def test_batch_splits_world_size_over_both():
    plan = derive_batch(micro_batch=6, grad_accum=2, world_size=4, seq_len=16)
    assert (plan.per_rank_micro_batch, plan.per_rank_grad_accum) == (3, 1)
    assert plan.tokens_per_optimizer_step == 6 * 2 * 16


def test_batch_world_size_one_is_unchanged():
    plan = derive_batch(micro_batch=5, grad_accum=3, world_size=1, seq_len=8)
    assert (plan.per_rank_micro_batch, plan.per_rank_grad_accum, plan.method) == (5, 3, "unchanged (world size 1)")


@pytest.mark.parametrize("mb, ga, n", [(3, 1, 2), (1, 1, 4), (5, 3, 4), (7, 2, 8)])
def test_batch_impossible_split_names_the_key(mb, ga, n):
    with pytest.raises(ConfigError, match=r"^trial\.batch\.grad_accum: .* cannot be split over") as info:
        derive_batch(mb, ga, n, 128)
    assert "trial.batch.micro_batch_size" in info.value.hint
    # The suggested grad_accum really works.
    suggested = int(info.value.hint.split("trial.batch.grad_accum to ")[1].split()[0])
    derive_batch(mb, suggested, n, 128)


def test_batch_every_small_case_keeps_tokens_or_refuses():
    for mb, ga, n in itertools.product(range(1, 9), range(1, 5), range(1, 9)):
        if (mb * ga) % n:
            with pytest.raises(ConfigError):
                derive_batch(mb, ga, n, 4)
            continue
        plan = derive_batch(mb, ga, n, 4)
        assert plan.tokens_per_optimizer_step == plan.baseline_tokens_per_optimizer_step, (mb, ga, n)
        assert 1 <= plan.per_rank_micro_batch <= mb and plan.per_rank_grad_accum >= 1
        if ga % n == 0:
            assert plan.per_rank_micro_batch == mb  # the preferred rule: keep the micro-batch


def test_batch_plan_round_trips_through_the_manifest_table():
    plan = derive_batch(8, 4, 4, 32)
    assert BatchPlan.from_manifest(plan.to_manifest()) == plan


# --------------------------------------------------------------------------- reading and rendering


def _table(ddp_tps: float, fsdp_tps: float, ddp_mem: int, fsdp_mem: int, base_tps: float = 1000.0) -> dict:
    def strat(tps: float, mem: int) -> dict:
        return {"throughput_tokens_per_s": tps, "efficiency": tps / (2 * base_tps), "peak_memory_per_rank_bytes": mem,
                "step_time_median_s": 0.5, "step_time_p90_s": 0.6, "step_time_cv": 0.05, "slowest_rank": 1,
                "comm_share": 0.2, "recovery": {"verdict": "bit-exact"}}
    return {"world_size": 2, "device_type": "cpu", "baseline": {"throughput_tokens_per_s": base_tps},
            "ddp": strat(ddp_tps, ddp_mem), "fsdp": strat(fsdp_tps, fsdp_mem)}


GIB = 2**30


def test_reading_throughput_and_memory_split():
    line = scaling.reading(_table(1900, 1500, 10 * GIB, 6 * GIB))
    assert line.startswith("choose DDP for throughput (1900 vs 1500 tokens/s, efficiency 0.95 vs 0.75), FSDP for memory")
    assert "10.00 GiB vs 6.00 GiB" in line


def test_reading_one_shape_wins_both():
    line = scaling.reading(_table(1200, 1800, 9 * GIB, 5 * GIB))
    assert line.startswith("choose FSDP for throughput and for memory")


def test_reading_ties_within_noise():
    line = scaling.reading(_table(1800, 1790, 5 * GIB, 5 * GIB + 1))
    assert line.startswith("DDP and FSDP are about equal here")
    line = scaling.reading(_table(1800, 1000, 5 * GIB, 5 * GIB))
    assert line.startswith("choose DDP for throughput and for both") and "FSDP saves no memory at this size" in line
    line = scaling.reading(_table(1800, 1790, 9 * GIB, 5 * GIB))
    assert line.startswith("choose FSDP for memory and for both") and "DDP is no faster" in line


def test_reading_low_efficiency_and_single_strategy():
    line = scaling.reading(_table(700, 600, 4 * GIB, 2 * GIB))
    assert line.endswith("2 ranks are not worth it at this size (best efficiency 0.35)")
    t = _table(1800, 0, GIB, GIB)
    del t["fsdp"]
    assert scaling.reading(t).startswith("only DDP was measured") and "--strategy both" in scaling.reading(t)
    assert scaling.reading({"world_size": 2}) == "no strategy was measured; nothing to choose from"


def test_render_puts_the_shapes_side_by_side():
    t = _table(1900, 1500, 10 * GIB, 6 * GIB)
    t["reading"] = scaling.reading(t)
    t["collective"] = {"library": "gloo", "version": "bundled with torch"}
    text = scaling.render_scaling(t)
    header = next(ln for ln in text.splitlines() if "1 device" in ln)
    assert header.index("1 device") < header.index("DDP x2") < header.index("FSDP x2")
    row = next(ln for ln in text.splitlines() if ln.strip().startswith("peak memory per rank"))
    assert "10.00 GiB" in row and "6.00 GiB" in row
    assert "reading: choose DDP for throughput" in text
    assert scaling.render_scaling({}) == "scaling: not measured"
    assert scaling.render_scaling({"skipped": "no --nproc"}) == "scaling: skipped (no --nproc)"


# --------------------------------------------------------------------------- statistics


def test_collective_names_from_real_profiler_traces():
    # Names as torch.profiler reported them for DDP/FSDP2 on gloo (CPU) and NCCL kernels on CUDA.
    for name in ("gloo:all_reduce", "c10d::allreduce_", "FSDP::all_gather (0)", "c10d::_reduce_scatter_base_",
                 "nccl:all_reduce", "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "fsdp::all_gather_copy_in"):
        assert scaling.is_collective(name), name
    for name in ("aten::mm", "Optimizer.step#AdamW.step", "aten::embedding_backward", "cudaLaunchKernel"):
        assert not scaling.is_collective(name), name


def test_union_counts_nested_and_overlapping_time_once():
    # FSDP::all_gather [0,100) holds c10d::_allgather_base_ [10,60); a gloo thread runs [50,150); then [200,210).
    assert scaling.union_seconds([(0, 100), (10, 60), (50, 150), (200, 210)]) == pytest.approx(160e-6)
    assert scaling.union_seconds([]) == 0.0


def test_step_stats_median_p90_cv():
    s = scaling.step_stats([1.0, 2.0, 3.0, 4.0])
    assert s["step_time_median_s"] == 2.5
    assert s["step_time_p90_s"] == pytest.approx(3.7)
    assert s["step_time_cv"] == pytest.approx((1.25 ** 0.5) / 2.5)
    assert s["step_time_total_s"] == 10.0


# --------------------------------------------------------------------------- launcher and flags


def test_single_node_launch_is_standalone_torchrun(tmp_path: Path):
    cmd = scaling.launch_command(_args("--nproc", "2"), tmp_path / "job.json")
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert cmd[cmd.index("--nproc-per-node") + 1] == "2" and "--standalone" in cmd
    assert cmd[-3:] == ["-m", "capture.trial._dist_worker", str(tmp_path / "job.json")]


def test_two_node_rendezvous_flags_pass_through(tmp_path: Path):
    args = _args("--nproc", "8", "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "node0:29400",
                 "--rdzv-id", "run42")
    cmd = scaling.launch_command(args, tmp_path / "j.json", "-restore")
    assert "--standalone" not in cmd
    for flag, value in (("--nnodes", "2"), ("--rdzv-backend", "c10d"), ("--rdzv-endpoint", "node0:29400"),
                        ("--rdzv-id", "run42-restore")):
        assert cmd[cmd.index(flag) + 1] == value
    static = scaling.launch_command(_args("--nproc", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1",
                                          "--master-port", "29500"), tmp_path / "j.json")
    assert static[static.index("--node-rank") + 1] == "1" and static[static.index("--master-port") + 1] == "29500"


@pytest.mark.parametrize("argv, match", [
    (["--nproc", "2", "--nnodes", "2"], r"^--nnodes 2: the nodes need a meeting point"),
    (["--nproc", "2", "--nnodes", "2", "--node-rank", "2", "--master-addr", "h"], r"^--node-rank: must be in 0\.\.1"),
    (["--nproc", "2", "--rdzv-endpoint", "h:1", "--master-addr", "h"], r"^--rdzv-endpoint and --master-addr both given"),
])
def test_bad_rendezvous_flags_are_usage_errors(argv, match):
    with pytest.raises(UsageError, match=match):
        _args(*argv)  # checked when the options are built


@pytest.mark.parametrize("argv", [["--nproc", "0"], ["--nproc", "two"], ["--strategy", "zero"], ["--master-port", "70000"]])
def test_bad_flag_values_exit_2(argv, capsys):
    p = argparse.ArgumentParser()
    scaling_args.add_arguments(p)
    with pytest.raises(SystemExit) as info:
        p.parse_args(argv)
    assert info.value.code == 2


def test_child_environment_turns_multicast_off_on_cuda_and_keeps_the_users_choice():
    env, added = scaling.child_environment("cuda", 2, {"PATH": "/bin", "NCCL_NVLS_ENABLE": "0"})
    assert env["NCCL_NVLS_ENABLE"] == "0" and "NCCL_NVLS_ENABLE" not in added
    assert added == {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    assert env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1" and env["NVSHMEM_DISABLE_NVLS"] == "1"
    # On CPU nothing multicast is added, but what the user set is kept; OMP threads are shared out,
    # and glibc's mmap threshold is fixed so that freed blocks leave the RSS (host memory is the device).
    env, added = scaling.child_environment("cpu", 2, {"NVSHMEM_DISABLE_NVLS": "1"})
    assert env["NVSHMEM_DISABLE_NVLS"] == "1" and "NCCL_NVLS_ENABLE" not in env
    assert added == {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // 2)), "MALLOC_MMAP_THRESHOLD_": str(2**20)}
    env, added = scaling.child_environment("cpu", 2, {"OMP_NUM_THREADS": "3", "MALLOC_MMAP_THRESHOLD_": "65536"})
    assert env["OMP_NUM_THREADS"] == "3" and env["MALLOC_MMAP_THRESHOLD_"] == "65536" and added == {}
    assert str(Path(scaling.__file__).resolve().parents[2]) in env["PYTHONPATH"].split(os.pathsep)


def test_launch_failure_is_one_line_with_the_ranks_reason(tmp_path: Path):
    out = tmp_path / "result.json"
    script = (f"open({str(out)!r} + '.rank1.error', 'w').write('rank 1: RuntimeError: boom\\n');"
              "import sys; print('noise'); sys.exit(1)")
    with pytest.raises(scaling.LaunchFailed, match=r"^scaling: the distributed launch failed \(exit 1\): rank 1: RuntimeError: boom$"):
        scaling.run_launch([sys.executable, "-c", script], os.environ, tmp_path / "l.log", out, 60)


def test_launch_timeout_stops_the_whole_process_group(tmp_path: Path):
    pid_file = tmp_path / "child.pid"
    # The launcher stands in for torchrun: it starts a grandchild, as torchrun starts the ranks.
    script = ("import subprocess, sys, time;"
              "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
              f"open({str(pid_file)!r}, 'w').write(str(c.pid)); time.sleep(60)")
    t0 = time.monotonic()
    with pytest.raises(scaling.LaunchFailed, match="did not finish within 3 s"):
        scaling.run_launch([sys.executable, "-c", script], os.environ, tmp_path / "l.log", tmp_path / "r.json", 3)
    assert time.monotonic() - t0 < 30
    grandchild = int(pid_file.read_text())
    for _ in range(50):
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the rank-like grandchild survived the timeout")


# --------------------------------------------------------------------------- per-rank facts


def test_cpu_lists_and_numa_nodes_from_a_sys_tree(tmp_path: Path):
    from capture.trial._dist_facts import cpu_ranges, numa_nodes_of, parse_cpulist

    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert cpu_ranges({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11"
    # The layout of /sys/devices/system/node on a two-socket host.
    for node, cpus in ((0, "0-15,32-47"), (1, "16-31,48-63")):
        (tmp_path / f"node{node}").mkdir()
        (tmp_path / f"node{node}" / "cpulist").write_text(cpus + "\n")
    (tmp_path / "possible").write_text("0-1\n")
    assert numa_nodes_of({1, 2}, tmp_path) == [0]
    assert numa_nodes_of({15, 16}, tmp_path) == [0, 1]
    assert numa_nodes_of({1}, tmp_path / "absent") is None


def test_sharded_loader_ranks_together_read_the_baselines_sequences():
    import torch

    from capture.trial._dist_build import Feed, ShardedLoader
    from capture.trial.workload import PackedLoader, PackedTokens

    source = PackedTokens(torch.arange(50 * 4).view(50, 4))
    cpu = torch.device("cpu")
    plan = derive_batch(micro_batch=6, grad_accum=2, world_size=4, seq_len=4)  # per rank 3 x 1
    baseline = PackedLoader(source, 6, seed=7, device=cpu)
    ranks = [ShardedLoader(source, plan.per_rank_micro_batch, 4, r, seed=7, device=cpu) for r in range(4)]
    for _step in range(9):  # crosses an epoch boundary (50 sequences, 12 per step)
        want = torch.cat([next(baseline).input_ids for _ in range(plan.baseline_grad_accum)])
        got = torch.cat([next(loader).input_ids for loader in ranks for _ in range(plan.per_rank_grad_accum)])
        assert sorted(map(tuple, want.tolist())) == sorted(map(tuple, got.tolist()))
    # Positions agree across ranks and restore in a new loader.
    assert len({json.dumps({k: v for k, v in r.state_dict().items() if k != "rank"}) for r in ranks}) == 1
    fresh = ShardedLoader(source, plan.per_rank_micro_batch, 4, 2, seed=7, device=cpu)
    fresh.load_state_dict(ranks[2].state_dict())
    assert torch.equal(next(fresh).input_ids, next(ranks[2]).input_ids)
    with pytest.raises(RuntimeError, match="data position is for 4 ranks"):
        ShardedLoader(source, 3, 2, 0, seed=7, device=cpu).load_state_dict(ranks[0].state_dict())
    # The feed counts tokens and lets DDP synchronise only on the last micro-batch of a step.
    ddp_flag = types.SimpleNamespace(require_backward_grad_sync=True)
    feed = Feed(iter(ranks[0]), accum=3, ddp_model=ddp_flag)
    seen = []
    for _ in range(6):
        next(feed)
        seen.append(ddp_flag.require_backward_grad_sync)
    assert seen == [False, False, True, False, False, True] and feed.tokens == 6 * 3 * 4


# --------------------------------------------------------------------------- the real torchrun path


def test_impossible_batch_fails_before_any_launch(tmp_path: Path):
    from capture.trial.config import load_example

    config = load_example("tiny").with_overrides(device="cpu", micro_batch_size=3)
    with pytest.raises(ConfigError, match=r"^trial\.batch\.grad_accum: 3 x 1 sequences"):
        scaling.run_scaling(config, _args("--nproc", "2"), tmp_path)
    assert not (tmp_path / "scaling").exists()


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory: pytest.TempPathFactory):
    """DDP and FSDP on 2 CPU processes (gloo), baseline and restore included, through the real
    command line (`capture trial CONFIG --nproc 2 --strategy both`): the tiny example, its 1024
    tokens per step taken as 2 x 4 micro-batches, so each rank accumulates 2 micro-batches (DDP's
    no_sync gating and FSDP's accumulation are on the path)."""
    import re

    from capture._cli import main
    from capture.trial.config import load_config, load_example

    work = tmp_path_factory.mktemp("scaling")
    text = load_example("tiny").source_text
    for key, value in (("micro_batch_size", "2"), ("grad_accum", "4")):
        text, n = re.subn(rf"(?m)^{key}\s*=.*$", f"{key} = {value}", text)
        assert n == 1, key
    cfg = work / "tiny-2x4.toml"
    cfg.write_text(text)
    config = load_config(cfg).with_overrides(device="cpu", warmup_steps=1, measured_steps=3)
    assert config.tokens_per_step == 2 * 4 * config.batch.max_seq_len
    key = work / "key"
    assert main(["keygen", "-o", str(key), "-C", "ci@capture"]) == 0
    out = work / "trial.toml"
    argv = ["trial", str(cfg), "--device", "cpu", "--warmup", "1", "--steps", "3", "--no-report", "--no-preflight",
            "--workdir", str(work / "trial-work"), "--key", str(key), "-o", str(out),
            "--nproc", "2", "--strategy", "both", "--master-addr", "127.0.0.1",
            "--master-port", str(free_port()), "--dist-dir", str(work / "dist")]
    planted = {"NCCL_DEBUG_FILE": f"https://user:{SECRET}@example.invalid/x", "HF_TOKEN": f"hf_{SECRET}abcdefgh"}
    saved = {k: os.environ.get(k) for k in planted}
    os.environ.update(planted)
    load_before = os.getloadavg()[0]
    try:
        t0 = time.perf_counter()
        assert main(argv) == 0
        elapsed = time.perf_counter() - t0
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    table = manifest.load_unverified(out).data["scaling"]
    busy = max(load_before, os.getloadavg()[0]) > 2 * (os.cpu_count() or 1)
    return types.SimpleNamespace(table=table, config=config, work=work, elapsed=elapsed, busy=busy,
                                 manifest_path=out, key=key)


def test_two_ranks_equal_tokens_per_optimizer_step(two_rank_run):
    t, config = two_rank_run.table, two_rank_run.config
    assert t["world_size"] == 2 and t["strategies"] == ["ddp", "fsdp"]
    batch = t["batch"]
    assert batch["baseline_micro_batch"] == config.batch.micro_batch_size
    assert batch["per_rank_micro_batch"] * batch["per_rank_grad_accum"] * 2 == (
        config.batch.micro_batch_size * config.batch.grad_accum)
    want = config.tokens_per_step
    assert batch["tokens_per_optimizer_step"] == batch["baseline_tokens_per_optimizer_step"] == want
    # Measured, not only planned: the tokens the ranks actually consumed.
    assert t["baseline"]["tokens_per_optimizer_step"] == t["ddp"]["tokens_per_optimizer_step"] == \
        t["fsdp"]["tokens_per_optimizer_step"] == want
    for s in ("ddp", "fsdp"):
        assert sum(r["tokens_measured"] for r in t[s]["ranks"]) == t[s]["tokens_measured"] == want * 3


def test_two_ranks_efficiency_from_measured_numbers(two_rank_run):
    t = two_rank_run.table
    base = t["baseline"]
    assert base["throughput_tokens_per_s"] == pytest.approx(base["tokens_measured"] / base["step_time_total_s"])
    for s in ("ddp", "fsdp"):
        st = t[s]
        wall = max(r["step_time_total_s"] for r in st["ranks"])
        assert st["throughput_tokens_per_s"] == pytest.approx(st["tokens_measured"] / wall)
        assert st["efficiency"] == pytest.approx(st["throughput_tokens_per_s"] / (2 * base["throughput_tokens_per_s"]))
        assert 0 < st["efficiency"] < 5
        assert [r["rank"] for r in st["ranks"]] == [0, 1]
        slowest = max(st["ranks"], key=lambda r: r["step_time_median_s"])
        assert st["slowest_rank"] == slowest["rank"] and st["step_time_median_s"] == slowest["step_time_median_s"]
        for r in st["ranks"]:
            assert 0 < r["step_time_median_s"] <= r["step_time_p90_s"] and r["step_time_cv"] >= 0
            assert r["peak_rss_bytes"] > 50 * 2**20  # a torch process holds far more than 50 MiB
        assert st["peak_memory_per_rank_bytes"] == max(r["peak_rss_bytes"] for r in st["ranks"])
        assert "peak RSS per rank" in st["memory_basis"]
        # gloo collectives show up in the profiler on CPU, so the share is a measured number.
        assert 0 < st["comm_share"] < 1, st.get("comm_share_note")
    assert t["ddp"]["wrapper"] == "DistributedDataParallel" and t["ddp"]["replicas_in_sync"] is True
    assert t["batch"]["per_rank_grad_accum"] == 2 and t["batch"]["method"] == "grad_accum divided by world_size"
    assert t["fsdp"]["wrapper"].startswith("FSDP2") and "GPT2Block" in t["fsdp"]["sharding_units"]


def test_two_ranks_restore_in_fresh_processes_is_bit_exact(two_rank_run):
    t, config = two_rank_run.table, two_rank_run.config
    k, n = config.recovery.save_at_step, config.recovery.total_steps
    for s in ("ddp", "fsdp"):
        rec = t[s]["recovery"]
        assert rec["verdict"] == "bit-exact", rec
        assert rec["fresh_processes"] is True and (rec["save_at_step"], rec["total_steps"]) == (k, n)
        assert len(rec["losses_uninterrupted"]) == n
        assert rec["losses_resumed"] == rec["losses_uninterrupted"][k:]
        assert rec["param_hash_resumed"] == rec["param_hash_uninterrupted"]
        assert rec["param_hash_uninterrupted"].startswith("sha256:") and rec["checkpoint_size_bytes"] > 0
    assert "torch.distributed.checkpoint" in t["fsdp"]["recovery"]["checkpoint_format"]
    assert "rank 0" in t["ddp"]["recovery"]["checkpoint_format"]


def test_two_ranks_record_binding_collective_and_environment(two_rank_run):
    t = two_rank_run.table
    assert [b["rank"] for b in t["binding"]] == [0, 1]
    for b in t["binding"]:
        assert b["device"] == "cpu" and b["cpu_affinity"] and b["cpu_affinity_count"] >= 1
        if Path("/sys/devices/system/node/node0").exists():
            assert b["numa_nodes"]
    assert t["collective"]["library"] == "gloo" and t["collective"]["backend_in_use"] == "gloo"
    variables = t["environment"]["variables"]
    assert variables["WORLD_SIZE"] == "2" and variables["MASTER_ADDR"] == "127.0.0.1"
    assert "OMP_NUM_THREADS" in variables and "RANK" in variables
    assert "NCCL_DEBUG_FILE" in t["environment"]["redacted"]
    assert "HF_TOKEN" not in variables and "HF_TOKEN" not in t["environment"]["redacted"]
    assert t["topology"]["skipped"].startswith("CPU ranks")
    assert t["launch_command"][1:3] == ["-m", "torch.distributed.run"] and "--master-port" in t["launch_command"]


def test_two_ranks_reading_and_time_budget(two_rank_run):
    t = two_rank_run.table
    assert t["reading"] == scaling.reading(t)
    assert "DDP" in t["reading"] and "FSDP" in t["reading"]
    text = scaling.render_scaling(t)
    assert "DDP x2" in text and "FSDP x2" in text and "bit-exact" in text
    # Issue 5: the whole CPU path, both strategies and the restore, inside two minutes. A wall-clock
    # budget says nothing while other jobs hold the cores twice over, so only then it is not held to.
    if not two_rank_run.busy:
        assert two_rank_run.elapsed < 120, two_rank_run.elapsed


def test_two_ranks_signed_manifest_holds_the_table(two_rank_run, tmp_path: Path):
    if shutil.which("ssh-keygen") is None:
        pytest.skip("ssh-keygen is not installed")
    signed = two_rank_run.manifest_path.read_bytes()
    body, trailer = manifest.split_signed(signed)
    assert trailer is not None
    # The real ssh-keygen agrees with the signature `capture trial` wrote (DESIGN.md decision 1).
    sig = tmp_path / "sig"
    sig.write_text(manifest.parse_trailer(trailer, "t")["signature"])
    pub = Path(f"{two_rank_run.key}.pub").read_text().split()
    allowed = tmp_path / "allowed"
    allowed.write_text(f'ci@capture namespaces="capture-manifest" {pub[0]} {pub[1]}\n')
    subprocess.run(["ssh-keygen", "-Y", "verify", "-f", str(allowed), "-I", "ci@capture", "-n", "capture-manifest",
                    "-s", str(sig)], input=body, check=True, capture_output=True)
    parsed = manifest.parse_body(body)
    s = parsed["scaling"]
    assert s["batch"]["tokens_per_optimizer_step"] == two_rank_run.config.tokens_per_step
    assert s["ddp"]["recovery"]["verdict"] == s["fsdp"]["recovery"]["verdict"] == "bit-exact"
    assert len(s["ddp"]["ranks"]) == len(s["fsdp"]["ranks"]) == len(s["binding"]) == 2
    assert s["reading"] == two_rank_run.table["reading"]
    # No planted secret reached the manifest, the job files or the launcher's logs.
    assert SECRET.encode() not in signed
    for f in two_rank_run.work.rglob("*"):
        if f.is_file():
            assert SECRET.encode() not in f.read_bytes(), f


def test_one_process_launcher_path(tmp_path: Path):
    """``--nproc 1`` (the single-H200 case): world size 1 through the same torchrun path."""
    from capture.trial.config import load_example

    config = load_example("tiny").with_overrides(device="cpu", warmup_steps=1, measured_steps=2, recovery_enabled=False)
    table = scaling.run_scaling(config, _args("--nproc", "1", "--strategy", "ddp"), tmp_path)
    assert table["world_size"] == 1 and table["strategies"] == ["ddp"] and "fsdp" not in table
    assert table["batch"]["method"] == "unchanged (world size 1)"
    ddp = table["ddp"]
    assert [r["rank"] for r in ddp["ranks"]] == [0] and "recovery" not in ddp
    assert ddp["efficiency"] == pytest.approx(ddp["throughput_tokens_per_s"] / table["baseline"]["throughput_tokens_per_s"])
    assert "--standalone" in table["launch_command"]
    assert table["reading"].startswith("only DDP was measured")


def test_a_failing_rank_becomes_one_line(tmp_path: Path):
    from capture.trial.config import load_example

    config = load_example("tiny").with_overrides(device="cpu", recovery_enabled=False)
    config = dataclasses.replace(config, data=dataclasses.replace(config.data, source="local",
                                                                  path=str(tmp_path / "no-such-data")))
    with pytest.raises(scaling.LaunchFailed, match=r"^scaling: the distributed launch failed \(exit 1\): rank \d: "
                                                   r"ConfigError: trial\.data\.path: .*no-such-data does not exist$") as info:
        scaling.run_scaling(config, _args("--nproc", "1", "--strategy", "ddp"), tmp_path)
    assert "launch-measure.log" in info.value.hint

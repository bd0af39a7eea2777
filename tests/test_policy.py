"""The verify comparison: flattening, the default policy, policy files."""

from __future__ import annotations

from pathlib import Path

import pytest

from capture.errors import ConfigError
from capture.verify import ABSENT, Policy, compare_manifests, flatten


def _stack(**over) -> dict:
    m = {
        "schema_version": 1, "kind": "fingerprint", "created_utc": "2026-12-02T00:00:00Z",
        "accelerator": {"vendor": "nvidia", "model": "NVIDIA H200", "count": 1, "runtime": "cuda", "runtime_version": "13.0"},
        "nvidia": {"driver_version": "580.159.04", "cuda_driver_version": "13.0",
                   "devices": [{"index": 0, "name": "NVIDIA H200", "uuid": "GPU-260c4f31", "serial": "1654024032490",
                                "compute_capability": "9.0"}]},
        "framework": {"name": "torch", "version": "2.11.0+cu130", "cudnn_version": "91900", "nccl_version": "2.28.9"},
        "python": {"version": "3.12.3", "packages": {"torch": {"version": "2.11.0"}, "numpy": {"version": "2.5.2"}}},
        "host": {"hostname": "vm", "kernel": "6.18.44"},
        "code": {"commit": "abc", "tree_hash": "t1"},
        "models": [{"repo_id": "org/m", "commit": "c1"}],
    }
    for k, v in over.items():
        m[k] = v
    return m


def test_flatten_keys_arrays_by_natural_key():
    flat = flatten(_stack())
    assert flat["nvidia.devices.0.name"] == "NVIDIA H200"
    assert flat["models.org/m.commit"] == "c1"
    assert flatten({"a": {"arch": ["sm_90", "sm_80"]}}) == {"a.arch": ("sm_90", "sm_80")}


def test_same_stack_ignores_time_host_and_serials():
    live = _stack(created_utc="2027-01-01T00:00:00Z", host={"hostname": "other", "kernel": "7.0"})
    live["nvidia"]["devices"][0] = dict(live["nvidia"]["devices"][0], uuid="GPU-other", serial="999")
    diffs, compared = compare_manifests(_stack(), live)
    assert diffs == [] and compared > 10


def test_strict_compares_board_identity():
    live = _stack()
    live["nvidia"] = dict(live["nvidia"], devices=[dict(live["nvidia"]["devices"][0], uuid="GPU-other")])
    diffs, _ = compare_manifests(_stack(), live, Policy.default(strict=True))
    assert [d.field for d in diffs] == ["nvidia.devices.0.uuid"]


def test_drift_names_each_field_with_both_values():
    live = _stack()
    live["python"] = {"version": "3.12.3", "packages": {"torch": {"version": "2.12.0"}, "peft": {"version": "0.1"}}}
    live["nvidia"] = dict(live["nvidia"], driver_version="550.54.14")
    diffs, _ = compare_manifests(_stack(), live)
    by = {d.field: d for d in diffs}
    assert by["python.packages.torch.version"].recorded == "2.11.0"
    assert by["python.packages.torch.version"].live == "2.12.0"
    assert by["python.packages.numpy.version"].live is ABSENT  # removed
    assert by["python.packages.peft.version"].recorded is ABSENT  # added
    assert by["nvidia.driver_version"].live == "550.54.14"
    assert "recorded \"580.159.04\", live \"550.54.14\"" in by["nvidia.driver_version"].line()


def test_device_count_and_model_drift():
    live = _stack(accelerator={"vendor": "none", "model": "cpu", "count": 0, "runtime": "cpu"})
    fields = {d.field for d in compare_manifests(_stack(), live)[0]}
    assert {"accelerator.vendor", "accelerator.model", "accelerator.count"} <= fields


def _policy(tmp_path: Path, text: str) -> Policy:
    p = tmp_path / "policy.toml"
    p.write_text(text)
    return Policy.load(p)


def test_policy_specifier_loosens_driver(tmp_path: Path):
    live = _stack()
    live["nvidia"] = dict(live["nvidia"], driver_version="565.57.01")
    assert compare_manifests(_stack(), live)[0]
    pol = _policy(tmp_path, '[fields]\n"nvidia.driver_version" = ">=550"\n')
    assert compare_manifests(_stack(), live, pol)[0] == []
    live["nvidia"] = dict(live["nvidia"], driver_version="535.104.12")
    (d,) = compare_manifests(_stack(), live, pol)[0]
    assert d.field == "nvidia.driver_version" and d.rule == ">=550"


def test_policy_ignore_and_tighten(tmp_path: Path):
    live = _stack(host={"hostname": "vm", "kernel": "7.0"})
    live["python"] = {"version": "3.12.3", "packages": {"torch": {"version": "2.11.0"}, "numpy": {"version": "9"}}}
    pol = _policy(tmp_path, '[ignore]\nfields = ["python.packages.numpy.*"]\n[compare]\nfields = ["host.kernel"]\n')
    assert [d.field for d in compare_manifests(_stack(), live, pol)[0]] == ["host.kernel"]


def test_policy_only_named_fields(tmp_path: Path):
    pol = _policy(tmp_path, '[compare]\ndefaults = false\nfields = ["framework.version"]\n')
    live = _stack(accelerator={"vendor": "none"})
    assert compare_manifests(_stack(), live, pol)[0] == []


def test_specifier_on_local_and_rocm_versions(tmp_path: Path):
    pol = _policy(tmp_path, '[fields]\n"framework.version" = "~=2.11.0"\n"framework.hip_version" = ">=6.2"\n')
    rec = _stack(framework={"version": "2.11.0+cu130", "hip_version": "6.2.41133-dd7f95766"})
    assert compare_manifests(rec, rec, pol)[0] == []


@pytest.mark.parametrize("text,match", [
    ("[fields]\n\"a\" = 3\n", "must be a string"),
    ("[fields]\n\"a\" = \"not a spec\"\n", "not a version specifier"),
    ("[ignore]\nfields = \"x\"\n", "must be a list"),
    ("[wat]\n", "unknown table"),
    ("[fields\n", "not valid TOML"),
    ("[compare]\ndefaults = 1\n", "true or false"),
])
def test_broken_policy_files(tmp_path: Path, text: str, match: str):
    with pytest.raises(ConfigError, match=match):
        _policy(tmp_path, text)

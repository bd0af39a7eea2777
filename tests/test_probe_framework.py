"""Framework probe: the real CPU torch (file-only and deep), and fabricated CUDA / ROCm wheel trees."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from capture import manifest
from capture.probes import ProbeOptions, Skipped
from capture.probes import framework

FIXTURES = Path(__file__).parent / "fixtures"
H200 = json.loads((FIXTURES / "h200" / "probe.json").read_text())["torch"]


def touch(path: Path, text: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def dist(site: Path, folder: str, name: str, version: str) -> None:
    touch(site / folder / "METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def torch_tree(site: Path, version_py: str, cmake_config: str | None = None) -> Path:
    """A torch package folder: ``version_py`` and, where given, a real ``TorchConfig.cmake``.

    The H200 trees default to that machine's own TorchConfig.cmake; the ROCm tree has none (no
    ROCm machine was available to capture one), so its XNNPACK build option is left to --deep."""
    shutil.copy(FIXTURES / "framework" / version_py, touch(site / "torch" / "version.py"))
    touch(site / "torch" / "__init__.py", "raise RuntimeError('the probe must not import torch')\n")
    if cmake_config is None and version_py.startswith("h200-"):
        cmake_config = "h200-cu130-TorchConfig.cmake"
    if cmake_config:
        shutil.copy(FIXTURES / "framework" / cmake_config, touch(site / "torch/share/cmake/Torch/TorchConfig.cmake"))
    return site


def test_real_cpu_torch_without_importing_it() -> None:
    code = textwrap.dedent("""
        import json, sys
        from capture.probes import ProbeOptions, framework
        info = framework.probe(ProbeOptions())
        print(json.dumps({"imported": "torch" in sys.modules, "table": info.to_manifest()}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    result = json.loads(out)
    assert result["imported"] is False
    table = result["table"]
    assert table["version"] == importlib.metadata.version("torch")
    assert table["version"].endswith("+cpu")
    assert table["source"] == "metadata"
    assert table["cuda_version"] is None and table["hip_version"] is None
    assert len(table["git_version"]) == 40
    assert table["deep_only"] is None  # a CPU build has no GPU libraries to ask about
    assert table["xnnpack"] is False  # this CPU wheel is built without XNNPACK


def test_real_cpu_torch_deep_reports_what_loaded() -> None:
    info = framework.probe(ProbeOptions(deep=True))
    assert isinstance(info, framework.FrameworkInfo)
    loaded = info.loaded
    assert loaded is not None and loaded.error is None
    assert loaded.version == info.version
    assert loaded.cuda_version is None and loaded.hip_version is None
    assert loaded.accelerator_available is False and loaded.device_count == 0
    assert loaded.arch_list == ()
    assert loaded.config and loaded.config[0] == "PyTorch built with:"
    assert any(line.startswith("- Build settings:") and "USE_CUDA=0" in line for line in loaded.config)
    assert loaded.import_time_s and loaded.import_time_s > 0
    assert loaded.xnnpack is not None and loaded.xnnpack == info.xnnpack  # the file says what torch says
    body = manifest.dumps({**manifest.new_manifest(), "framework": info.to_manifest()})
    assert b"[framework.loaded]" in body


def test_cuda_wheel_tree_like_the_h200(tmp_path: Path) -> None:
    site = torch_tree(tmp_path / "site", "h200-cu130-torch-version.py")
    touch(site / "torch/lib/libtorch_cuda.so")
    dist(site, "nvidia_cudnn_cu13-9.19.0.56.dist-info", "nvidia-cudnn-cu13", "9.19.0.56")
    dist(site, "nvidia_nccl_cu13-2.28.9.dist-info", "nvidia-nccl-cu13", "2.28.9")
    touch(site / "nvidia/cudnn/lib/libcudnn.so.9")
    touch(site / "nvidia/nccl/lib/libnccl.so.2")
    info = framework.probe(ProbeOptions(), path=[str(site)])
    assert isinstance(info, framework.FrameworkInfo)
    assert (info.version, info.cuda_version, info.git_version) == (H200["version"], H200["cuda"], H200["git"])
    assert info.hip_version is None
    assert info.cudnn_version == "9.19.0.56"
    assert info.nccl_version == H200["nccl"]
    assert info.origins == {"cudnn_version": "dist:nvidia-cudnn-cu13", "nccl_version": "dist:nvidia-nccl-cu13",
                            "xnnpack": "file:torch/share/cmake/Torch/TorchConfig.cmake"}
    assert info.libraries == {"cudnn": "nvidia/cudnn/lib/libcudnn.so.9", "nccl": "nvidia/nccl/lib/libnccl.so.2"}
    assert info.deep_only == ("arch_list",)
    table = manifest.to_toml_value(info.to_manifest())
    assert table["name"] == "torch" and "arch_list" not in table and "loaded" not in table


def test_cuda_wheel_tree_rebuilt_from_the_h200_listing(tmp_path: Path) -> None:
    # Dist-info names and library files as listed on the H200 (tests/fixtures/framework/README.md);
    # the probe must say exactly what it said there.
    site = torch_tree(tmp_path / "site", "h200-cu130-torch-version.py")
    for folder in (FIXTURES / "framework" / "h200-cu130-dist-info.txt").read_text().split():
        name, version = folder[: -len(".dist-info")].split("-", 1)
        dist(site, folder, name.replace("_", "-"), version)
    for rel in (FIXTURES / "framework" / "h200-cu130-lib-files.txt").read_text().split():
        touch(site / rel)
    info = framework.probe(ProbeOptions(), path=[str(site)])
    assert isinstance(info, framework.FrameworkInfo)
    there = json.loads((FIXTURES / "framework" / "h200-cu130-probe.json").read_text())
    assert there["deep"]["loaded"]["cudnn_version"] == "9.19.0"  # what the deep probe saw loaded there
    # the [framework] table of a fingerprint taken there on 2026-12-03 (TOML drops the None fields)
    table = json.loads((FIXTURES / "framework" / "h200-cu130-framework.json").read_text())
    assert manifest.to_toml_value(info.to_manifest()) == table


def test_versions_from_library_file_names_when_no_dists(tmp_path: Path) -> None:
    site = torch_tree(tmp_path / "site", "h200-cu130-torch-version.py")
    touch(site / "torch/lib/libcudnn.so.8")
    touch(site / "torch/lib/libcudnn.so.8.9.5")
    touch(site / "torch/lib/libnccl.so.2")
    info = framework.probe(ProbeOptions(), path=[str(site)])
    assert isinstance(info, framework.FrameworkInfo)
    assert info.cudnn_version == "8.9.5"
    assert info.origins["cudnn_version"] == "file:torch/lib/libcudnn.so.8.9.5"
    assert info.nccl_version is None  # libnccl.so.2 names only the major
    assert info.libraries["nccl"] == "torch/lib/libnccl.so.2"
    assert info.deep_only == ("arch_list", "nccl_version")


def test_rocm_wheel_tree(tmp_path: Path) -> None:
    site = torch_tree(tmp_path / "site", "torch-2.6.0.dev20240918+rocm6.2-version.py")
    for lib in ("libMIOpen.so", "librccl.so", "libamdhip64.so", "libtorch_hip.so"):
        touch(site / "torch/lib" / lib)
    info = framework.probe(ProbeOptions(), path=[str(site)])
    assert isinstance(info, framework.FrameworkInfo)
    assert info.version == "2.6.0.dev20240918+rocm6.2"
    assert info.hip_version == "6.2.41133-dd7f95766"
    assert info.cuda_version is None and info.cudnn_version is None
    assert info.libraries == {"miopen": "torch/lib/libMIOpen.so", "rccl": "torch/lib/librccl.so"}
    assert info.deep_only == ("arch_list", "miopen_version", "rccl_version", "xnnpack")


def test_rocm_sonames_are_not_taken_for_library_versions(tmp_path: Path) -> None:
    # /opt/rocm-6.2 ships librccl.so.1.0.60200 for RCCL 2.20.5: the soname tells the ROCm release.
    site = torch_tree(tmp_path / "site", "torch-2.6.0.dev20240918+rocm6.2-version.py")
    touch(site / "torch/lib/librccl.so.1.0.60200")
    touch(site / "torch/lib/libMIOpen.so.1.0.60200")
    info = framework.probe(ProbeOptions(), path=[str(site)])
    assert isinstance(info, framework.FrameworkInfo)
    assert info.rccl_version is None and info.miopen_version is None
    assert info.libraries == {"miopen": "torch/lib/libMIOpen.so.1.0.60200", "rccl": "torch/lib/librccl.so.1.0.60200"}


def test_no_torch_is_skipped(tmp_path: Path) -> None:
    assert framework.probe(ProbeOptions(), path=[str(tmp_path)]) == Skipped("torch is not installed")


@pytest.mark.parametrize(("text", "reason"), [
    ("__version__ = (\n", "cannot read"),
    ("version = '1.0'\n", "has no __version__"),
])
def test_broken_version_py_is_skipped(tmp_path: Path, text: str, reason: str) -> None:
    touch(tmp_path / "torch/__init__.py")
    touch(tmp_path / "torch/version.py", text)
    result = framework.probe(ProbeOptions(), path=[str(tmp_path)])
    assert isinstance(result, Skipped) and reason in result.reason


def test_version_py_is_parsed_never_executed(tmp_path: Path) -> None:
    marker = tmp_path / "executed"
    touch(tmp_path / "torch/__init__.py")
    touch(tmp_path / "torch/version.py",
          f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n__version__ = '9.9.9'\ncuda = make_cuda()\n")
    info = framework.probe(ProbeOptions(), path=[str(tmp_path)])
    assert isinstance(info, framework.FrameworkInfo) and info.version == "9.9.9"
    assert info.cuda_version is None
    assert not marker.exists()


def test_loaded_values_as_the_h200_reported_them() -> None:
    loaded = framework.loaded_from_json({
        "version": H200["version"], "cuda_version": H200["cuda"], "hip_version": None,
        "cudnn": H200["cudnn"], "nccl": H200["nccl"], "arch_list": H200["arch_list"],
        "accelerator_available": True, "device_count": 1, "device_names": [H200["device"]]})
    assert loaded.cudnn_version == "9.19.0" and loaded.cudnn_version_int == 91900
    assert loaded.nccl_version == "2.28.9" and loaded.rccl_version is None
    assert loaded.arch_list == ("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120")
    assert loaded.device_names == ("NVIDIA H200",)


def test_loaded_values_on_rocm_map_to_miopen_and_rccl() -> None:
    loaded = framework.loaded_from_json({"version": "2.6.0", "hip_version": "6.2.41133-dd7f95766",
                                         "cudnn": 3002000, "nccl": "2.20.5"})
    assert (loaded.miopen_version, loaded.rccl_version) == ("3.2.0", "2.20.5")
    assert loaded.cudnn_version is None and loaded.nccl_version is None


@pytest.mark.parametrize(("value", "text"), [(91900, "9.19.0"), (90100, "9.1.0"), (8905, "8.9.5"), (8600, "8.6.0")])
def test_decode_cudnn(value: int, text: str) -> None:
    assert framework.decode_cudnn(value) == text


def fake_python(tmp_path: Path, torch_init: str) -> str:
    """A wrapper interpreter whose `import torch` finds ``torch_init`` first."""
    touch(tmp_path / "fake" / "torch" / "__init__.py", textwrap.dedent(torch_init))
    script = touch(tmp_path / "python", f"#!/bin/sh\nPYTHONPATH={tmp_path / 'fake'} exec {sys.executable} \"$@\"\n")
    script.chmod(0o755)
    return str(script)


def test_deep_probe_reports_a_failing_import(tmp_path: Path) -> None:
    python = fake_python(tmp_path, "raise ImportError('libcudnn.so.9: cannot open shared object file')\n")
    loaded = framework.deep_probe(python)
    assert loaded.version is None
    assert loaded.error is not None and "libcudnn.so.9: cannot open shared object file" in loaded.error
    assert loaded.error.startswith("import torch failed (exit 1)")


def test_deep_probe_times_out(tmp_path: Path) -> None:
    python = fake_python(tmp_path, "import time\ntime.sleep(30)\n")
    loaded = framework.deep_probe(python, timeout_s=1)
    assert loaded.error == "import torch did not finish within 1 s"


def _collect_env_says(fact: str) -> str:
    """One line of the baseline's own report (python -m torch.utils.collect_env), by its label."""
    out = subprocess.run([sys.executable, "-m", "torch.utils.collect_env"], capture_output=True, text=True,
                         timeout=300).stdout
    return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith(fact + ":"))


def test_xnnpack_agrees_with_collect_env_on_the_real_torch() -> None:
    """What collect_env prints as "Is XNNPACK available" (torch imported), read from files only."""
    info = framework.probe(ProbeOptions())
    assert isinstance(info, framework.FrameworkInfo)
    assert str(info.xnnpack) == _collect_env_says("Is XNNPACK available")
    assert info.origins["xnnpack"] == "file:torch/share/cmake/Torch/TorchConfig.cmake"


@pytest.mark.parametrize("fixture, expected", [
    ("cpu-2.13.0-TorchConfig.cmake", False),   # this machine's CPU wheel: if(OFF)
    ("h200-cu130-TorchConfig.cmake", True),    # the H200's cu130 wheel: if(ON)
])
def test_xnnpack_from_real_torch_config_files(tmp_path: Path, fixture: str, expected: bool) -> None:
    site = torch_tree(tmp_path / "site", "h200-cu130-torch-version.py", cmake_config=fixture)
    info = framework.probe(ProbeOptions(), path=[str(site)])
    assert isinstance(info, framework.FrameworkInfo)
    assert info.xnnpack is expected and "xnnpack" not in info.deep_only


@pytest.mark.parametrize("text, expected", [
    ("if(ON)\n  append_torchlib_if_found(XNNPACK)\n", True),
    ("  if ( 1 )\r\n    append_torchlib_if_found( XNNPACK microkernels-prod)\n", True),
    ("if(FALSE)\nappend_torchlib_if_found(XNNPACK)\n", False),
    ("if(USE_XNNPACK-NOTFOUND)\nappend_torchlib_if_found(XNNPACK)\n", False),
    ("if(@USE_XNNPACK@)\nappend_torchlib_if_found(XNNPACK)\n", None),  # never substituted
    ("if(USE_XNNPACK)\nappend_torchlib_if_found(XNNPACK)\n", None),    # a variable, not a value
    ("if(ON)\nappend_torchlib_if_found(NNPACK)\n", None),
    ("", None),
])
def test_xnnpack_from_hostile_or_odd_config_files(tmp_path: Path, text: str, expected: bool | None) -> None:
    torch_dir = tmp_path / "torch"
    touch(torch_dir / "share/cmake/Torch/TorchConfig.cmake", text)
    assert framework.xnnpack_from_cmake(torch_dir) is expected


def test_xnnpack_unknown_is_left_to_deep(tmp_path: Path) -> None:
    site = torch_tree(tmp_path / "site", "h200-cu130-torch-version.py", cmake_config="")
    info = framework.probe(ProbeOptions(), path=[str(site)])
    assert isinstance(info, framework.FrameworkInfo)
    assert info.xnnpack is None and "xnnpack" in info.deep_only and "xnnpack" not in info.origins
    # an oversized file, or a FIFO where the file should be, is not read
    config = touch(site / "torch/share/cmake/Torch/TorchConfig.cmake", "if(ON)\nappend_torchlib_if_found(XNNPACK)\n" + "#" * 300_000)
    assert framework.xnnpack_from_cmake(site / "torch") is None
    config.unlink()
    os.mkfifo(config)
    assert framework.xnnpack_from_cmake(site / "torch") is None

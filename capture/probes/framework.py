"""The framework (torch) and the accelerator libraries it was built with, without importing it.

Importing torch costs seconds (7.3 s cold on an H200), so the default probe reads files only:
``torch/version.py`` (parsed with :mod:`ast`, never executed), the versions of the
``nvidia-cudnn-cu*`` / ``nvidia-nccl-cu*`` distributions, and the library files under
``torch/lib`` and ``site-packages/nvidia/*/lib``. What only a live import can tell (the cuDNN and
NCCL actually loaded, the compiled arch list, the devices) comes from the opt-in deep probe, which
imports torch in a subprocess so this process stays light.
"""

from __future__ import annotations

import ast
import importlib.machinery
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from capture._safe_read import read_prefix
from capture.probes import ProbeOptions, Skipped
from capture.probes._fs import listdir

DEEP_TIMEOUT_S = 300.0

# Fields the file-only probe cannot tell; the deep probe can.
_ALWAYS_DEEP = ("arch_list",)


@dataclass(frozen=True)
class LoadedInfo:
    """What ``import torch`` reports in a subprocess (``[framework.loaded]``)."""

    version: str | None = None
    cuda_version: str | None = None
    hip_version: str | None = None
    cudnn_version: str | None = None
    cudnn_version_int: int | None = None
    nccl_version: str | None = None
    miopen_version: str | None = None
    rccl_version: str | None = None
    arch_list: tuple[str, ...] | None = None
    accelerator_available: bool | None = None
    """torch.cuda.is_available() (True on ROCm builds too)."""
    device_count: int | None = None
    device_names: tuple[str, ...] | None = None
    config: tuple[str, ...] | None = None
    """torch.__config__.show(), one entry a line."""
    xnnpack: bool | None = None
    """``torch.backends.xnnpack.enabled``: built with XNNPACK (what collect_env reports)."""
    import_time_s: float | None = None
    error: str | None = None

    def to_manifest(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


@dataclass(frozen=True)
class FrameworkInfo:
    name: str
    version: str
    source: str = "metadata"
    cuda_version: str | None = None
    hip_version: str | None = None
    rocm_version: str | None = None
    git_version: str | None = None
    debug: bool | None = None
    arch_list: tuple[str, ...] | None = None
    cudnn_version: str | None = None
    nccl_version: str | None = None
    miopen_version: str | None = None
    rccl_version: str | None = None
    xnnpack: bool | None = None
    """Built with XNNPACK (``USE_XNNPACK``), from the ``TorchConfig.cmake`` the build wrote."""
    origins: Mapping[str, str] = field(default_factory=dict)
    """Where each library version came from: ``dist:<name>`` or ``file:<path under site-packages>``."""
    libraries: Mapping[str, str] = field(default_factory=dict)
    """The accelerator library files found (``cudnn``, ``nccl``, ``miopen``, ``rccl``), relative to site-packages."""
    deep_only: tuple[str, ...] = ()
    """Fields left out because only importing torch can tell them; run with ``--deep``."""
    loaded: LoadedInfo | None = None

    def to_manifest(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name, "version": self.version, "source": self.source,
            "cuda_version": self.cuda_version, "hip_version": self.hip_version,
            "rocm_version": self.rocm_version, "git_version": self.git_version, "debug": self.debug,
            "arch_list": list(self.arch_list) if self.arch_list is not None else None,
            "cudnn_version": self.cudnn_version, "nccl_version": self.nccl_version,
            "miopen_version": self.miopen_version, "rccl_version": self.rccl_version,
            "xnnpack": self.xnnpack, "origins": dict(self.origins) or None, "libraries": dict(self.libraries) or None,
            "deep_only": list(self.deep_only) or None,
        }
        if self.loaded is not None:
            out["loaded"] = self.loaded.to_manifest()
        return out


def read_version_py(path: Path) -> dict[str, Any]:
    """Module-level literal assignments of torch/version.py, without executing it."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    out: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name, value = node.targets[0].id, node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            name, value = node.target.id, node.value
        else:
            continue
        try:
            out[name] = ast.literal_eval(value)
        except ValueError:
            continue
    return out


def find_torch(path: Iterable[str] | None = None) -> Path | None:
    """The torch package folder import would use, found without importing it."""
    spec = importlib.machinery.PathFinder.find_spec("torch", None if path is None else list(path))
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


_DIST = {
    "cudnn": re.compile(r"^nvidia[_-]cudnn(?:[_-]cu\d+)?-([^-]+)\.dist-info$", re.I),
    "nccl": re.compile(r"^nvidia[_-]nccl(?:[_-]cu\d+)?-([^-]+)\.dist-info$", re.I),
}
_LIB = {
    "cudnn": re.compile(r"^libcudnn\.so(?:\.(\d+(?:\.\d+)*))?$"),
    "nccl": re.compile(r"^libnccl\.so(?:\.(\d+(?:\.\d+)*))?$"),
    "miopen": re.compile(r"^libMIOpen\.so(?:\.(\d+(?:\.\d+)*))?$"),
    "rccl": re.compile(r"^librccl\.so(?:\.(\d+(?:\.\d+)*))?$"),
}


def _dist_versions(site_dirs: Iterable[Path]) -> dict[str, tuple[str, str]]:
    found: dict[str, tuple[str, str]] = {}
    for site in site_dirs:
        try:
            names = listdir(site)
        except OSError:
            continue
        for name in names:
            for lib, pattern in _DIST.items():
                m = pattern.match(name)
                if m and lib not in found:
                    found[lib] = (m.group(1), "dist:" + name[: -len("-" + m.group(1) + ".dist-info")].replace("_", "-").lower())
    return found


def _library_files(site: Path, torch_dir: Path) -> dict[str, tuple[str | None, str]]:
    """(version from the file name or None, path relative to site) for each library found.

    ``libcudnn.so.9.1.0`` tells the version; ``libcudnn.so.9`` only the major, and ROCm's
    ``libMIOpen.so`` / ``librccl.so.1.0.60200`` not the library's own, so those give no version,
    only where the library lives.
    """
    folders = [torch_dir / "lib"]
    folders += sorted(site.glob("nvidia/*/lib")) + sorted(site.glob("_rocm_sdk_*/lib"))
    found: dict[str, tuple[str | None, str]] = {}
    for folder in folders:
        try:
            names = sorted(os.listdir(folder))
        except OSError:
            continue
        for name in names:
            for lib, pattern in _LIB.items():
                m = pattern.match(name)
                if not m:
                    continue
                version = m.group(1) if m.group(1) and "." in m.group(1) else None
                if lib in ("miopen", "rccl"):
                    version = None  # ROCm sonames carry the ROCm release (1.0.60200), not the library's
                rel = os.path.relpath(folder / name, site)
                best = found.get(lib)
                # Prefer a file that tells its full version, then the longest name (most specific).
                if best is None or (version and not best[0]) or (bool(version) == bool(best[0]) and len(rel) > len(best[1])):
                    found[lib] = (version, rel)
    return found


TORCH_CONFIG_CMAKE = ("share", "cmake", "Torch", "TorchConfig.cmake")
_CMAKE_CONFIG_MAX_BYTES = 256 * 1024
# The build substitutes `if(@USE_XNNPACK@)` in TorchConfig.cmake.in with the option's value.
_XNNPACK_BLOCK = re.compile(r"^[ \t]*if[ \t]*\([ \t]*([^()\s]*)[ \t]*\)[ \t]*\r?\n"
                            r"[ \t]*append_torchlib_if_found\([ \t]*XNNPACK\b", re.M | re.I)
_CMAKE_TRUE = frozenset({"ON", "YES", "TRUE", "Y"})
_CMAKE_FALSE = frozenset({"OFF", "NO", "FALSE", "N", "IGNORE", "NOTFOUND", ""})


def cmake_bool(value: str) -> bool | None:
    """CMake's truth of a constant in ``if(<constant>)``; None for anything else (a variable name)."""
    word = value.upper()
    if word in _CMAKE_TRUE:
        return True
    if word in _CMAKE_FALSE or word.endswith("-NOTFOUND"):
        return False
    try:
        return float(value) != 0
    except ValueError:
        return None


def xnnpack_from_cmake(torch_dir: Path) -> bool | None:
    """Whether this torch was built with XNNPACK, read from ``torch/share/cmake/Torch/TorchConfig.cmake``.

    ``torch.backends.xnnpack.enabled`` (what ``collect_env`` prints as "Is XNNPACK available")
    is the compile-time ``USE_XNNPACK``; the build writes the same option into TorchConfig.cmake
    as ``if(ON)`` / ``if(OFF)`` before ``append_torchlib_if_found(XNNPACK)``. None where the file
    is missing, oversized or says something else: ``--deep`` then asks torch itself."""
    data = read_prefix(torch_dir.joinpath(*TORCH_CONFIG_CMAKE), _CMAKE_CONFIG_MAX_BYTES + 1)
    if data is None or len(data) > _CMAKE_CONFIG_MAX_BYTES:
        return None
    m = _XNNPACK_BLOCK.search(data.decode("utf-8", "replace"))
    return cmake_bool(m.group(1)) if m else None


def probe(options: ProbeOptions, *, path: Iterable[str] | None = None) -> FrameworkInfo | Skipped:
    """``path`` replaces sys.path (tests point it at a fabricated site-packages)."""
    search = None if path is None else list(path)
    torch_dir = find_torch(search)
    if torch_dir is None:
        return Skipped("torch is not installed")
    version_py = torch_dir / "version.py"
    try:
        meta = read_version_py(version_py)
    except (OSError, SyntaxError, UnicodeDecodeError) as exc:
        return Skipped(f"cannot read {version_py}: {exc}")
    version = meta.get("__version__")
    if not isinstance(version, str):
        return Skipped(f"{version_py} has no __version__")
    site = torch_dir.parent
    others = [Path(p) for p in (sys.path if search is None else search) if p and Path(p) != site]
    dists = _dist_versions([site, *others])
    files = _library_files(site, torch_dir)

    versions: dict[str, str] = {}
    origins: dict[str, str] = {}
    for lib in ("cudnn", "nccl", "miopen", "rccl"):
        if lib in dists:
            versions[lib], origins[f"{lib}_version"] = dists[lib]
        elif lib in files and files[lib][0]:
            versions[lib] = files[lib][0]  # type: ignore[assignment]
            origins[f"{lib}_version"] = "file:" + files[lib][1]
    is_cuda = isinstance(meta.get("cuda"), str)
    is_hip = isinstance(meta.get("hip"), str)
    wanted = (("cudnn", "nccl") if is_cuda else ()) + (("miopen", "rccl") if is_hip else ())
    arch = meta.get("arch_list") or meta.get("cuda_arch_list")
    deep_only = [f for f in _ALWAYS_DEEP if not arch and (is_cuda or is_hip)]
    deep_only += [f"{lib}_version" for lib in wanted if lib not in versions]
    xnnpack = xnnpack_from_cmake(torch_dir)
    if xnnpack is None:
        deep_only.append("xnnpack")
    else:
        origins["xnnpack"] = "file:" + os.path.relpath(torch_dir.joinpath(*TORCH_CONFIG_CMAKE), site)
    info = FrameworkInfo(
        name="torch",
        version=version,
        cuda_version=meta.get("cuda") if is_cuda else None,
        hip_version=meta.get("hip") if is_hip else None,
        rocm_version=meta.get("rocm") if isinstance(meta.get("rocm"), str) else None,
        git_version=meta.get("git_version") if isinstance(meta.get("git_version"), str) else None,
        debug=meta.get("debug") if isinstance(meta.get("debug"), bool) else None,
        arch_list=tuple(arch) if isinstance(arch, (list, tuple)) else None,
        cudnn_version=versions.get("cudnn"),
        nccl_version=versions.get("nccl"),
        miopen_version=versions.get("miopen"),
        rccl_version=versions.get("rccl"),
        xnnpack=xnnpack,
        origins=origins,
        libraries={lib: rel for lib, (_, rel) in sorted(files.items())},
        deep_only=tuple(deep_only),
        loaded=deep_probe() if options.deep else None,
    )
    return info


# --------------------------------------------------------------------------- deep probe

_MARK = "CAPTURE_DEEP_JSON:"

# Runs in a fresh interpreter; prints one JSON line after the marker.
_DEEP_SCRIPT = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
out = {"import_time_s": round(time.perf_counter() - t0, 3), "version": torch.__version__,
       "cuda_version": torch.version.cuda, "hip_version": getattr(torch.version, "hip", None)}
def attempt(key, fn):
    try:
        out[key] = fn()
    except Exception as exc:
        out.setdefault("notes", []).append(f"{key}: {type(exc).__name__}: {exc}")
attempt("cudnn", lambda: torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None)
attempt("nccl", lambda: ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch._C, "_nccl_version") else None)
attempt("arch_list", lambda: list(torch.cuda.get_arch_list()))
attempt("accelerator_available", lambda: bool(torch.cuda.is_available()))
attempt("device_count", lambda: torch.cuda.device_count() if out.get("accelerator_available") else 0)
attempt("device_names", lambda: [torch.cuda.get_device_name(i) for i in range(out.get("device_count") or 0)])
def _xnnpack():
    import torch.backends.xnnpack
    return bool(torch.backends.xnnpack.enabled)
attempt("xnnpack", _xnnpack)
attempt("config", lambda: [l.strip() for l in torch.__config__.show().splitlines() if l.strip()])
print("%s" + json.dumps(out))
""" % _MARK


def decode_cudnn(value: int) -> str:
    """cuDNN 9 encodes 9.19.0 as 91900; cuDNN 8 encodes 8.9.5 as 8905."""
    if value >= 90000:
        return f"{value // 10000}.{value % 10000 // 100}.{value % 100}"
    return f"{value // 1000}.{value % 1000 // 100}.{value % 100}"


def decode_miopen(value: int) -> str:
    """PyTorch's ROCm build reports MIOpen 3.2.0 as 3002000 through torch.backends.cudnn.version()."""
    return f"{value // 1000000}.{value % 1000000 // 1000}.{value % 1000}"


def loaded_from_json(data: Mapping[str, Any]) -> LoadedInfo:
    hip = data.get("hip_version")
    raw = data.get("cudnn")
    dnn = None
    if isinstance(raw, int) and not isinstance(raw, bool):
        dnn = decode_miopen(raw) if hip else decode_cudnn(raw)
    nccl = data.get("nccl") or None
    tup = lambda v: tuple(v) if isinstance(v, list) else None  # noqa: E731
    notes = data.get("notes")
    return LoadedInfo(
        version=data.get("version"),
        cuda_version=data.get("cuda_version"),
        hip_version=hip,
        cudnn_version=None if hip else dnn,
        cudnn_version_int=raw if isinstance(raw, int) and not hip else None,
        miopen_version=dnn if hip else None,
        nccl_version=None if hip else nccl,
        rccl_version=nccl if hip else None,
        arch_list=tup(data.get("arch_list")),
        accelerator_available=data.get("accelerator_available"),
        device_count=data.get("device_count"),
        device_names=tup(data.get("device_names")),
        config=tup(data.get("config")),
        xnnpack=data.get("xnnpack") if isinstance(data.get("xnnpack"), bool) else None,
        import_time_s=data.get("import_time_s"),
        error="; ".join(notes) if notes else None,
    )


def deep_probe(python: str | None = None, timeout_s: float = DEEP_TIMEOUT_S) -> LoadedInfo:
    """Import torch in a subprocess of ``python`` (default: this interpreter) and report what loaded."""
    import subprocess  # --deep alone starts a process

    cmd = [python or sys.executable, "-c", _DEEP_SCRIPT]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return LoadedInfo(error=f"import torch did not finish within {timeout_s:g} s")
    except OSError as exc:
        return LoadedInfo(error=f"cannot start {cmd[0]}: {exc.strerror}")
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(_MARK):
            try:
                return loaded_from_json(json.loads(line[len(_MARK):]))
            except ValueError:
                break
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return LoadedInfo(error=f"import torch failed (exit {proc.returncode}): {tail[:300]}")

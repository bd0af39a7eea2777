"""The facts about one run that the index, `show` and `compare` all present.

Everything here reads a parsed manifest dict and never fails on a missing key: a fingerprint
has no ``[trial]``, a skipped probe has only ``skipped = "..."``, and an older manifest may lack
a figure. Missing values stay ``None`` and are shown as "-" / left out of JSON.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from capture.manifest import dig, table_at


CONTENT_ID_HEX = 12


def content_id(raw: bytes) -> str:
    """The short content id of a manifest file: the first 12 hex digits of sha256(bytes)."""
    return hashlib.sha256(raw).hexdigest()[:CONTENT_ID_HEX]


def _number(value: Any) -> float | int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value


def _first(data: Mapping[str, Any], *paths: str) -> tuple[Any, str | None]:
    for p in paths:
        v = dig(data, p)
        if v is not None:
            return v, p
    return None, None


def artifact_refs(data: Mapping[str, Any], section: str) -> tuple[str, ...]:
    """``repo@revision`` for each model or dataset; the resolved commit wins over a branch name.

    A trial whose model was not fingerprinted in ``[[models]]`` still names it in ``[trial.run.model]``.
    """
    out = []
    items = data.get(section) or ()
    if not items and section == "models" and isinstance(dig(data, "trial.run.model"), Mapping):
        items = (dig(data, "trial.run.model"),)
    for item in items:
        if not isinstance(item, Mapping) or "skipped" in item and len(item) == 1:
            continue
        name = item.get("repo_id") or item.get("spec") or item.get("path")
        if not name:  # a trial model built from a config has no repository: say what it is
            kind = item.get("model_type") or item.get("architecture") or "model"
            name = f"{kind} ({item['source']})" if item.get("source") else str(kind)
        rev = item.get("commit") or item.get("revision")
        if isinstance(rev, str) and re.fullmatch(r"[0-9a-f]{40}", rev):
            rev = rev[:12]
        out.append(f"{name}@{rev}" if rev else str(name))
    return tuple(out)


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def accelerator_slug(data: Mapping[str, Any]) -> str:
    """The folder a run is filed under: ``nvidia-h200-x1``, ``amd-instinct-mi300x-x8``, ``cpu``."""
    acc = data.get("accelerator")
    if not isinstance(acc, Mapping):
        return "unknown-accelerator"
    vendor = str(acc.get("vendor") or "")
    model = str(acc.get("model") or "")
    count = acc.get("count")
    if vendor in ("", "none") or model.lower() == "cpu" or not count:
        return "cpu"
    name = slug(model)
    if vendor and not name.startswith(slug(vendor)):
        name = f"{slug(vendor)}-{name}"
    return f"{name[:60].rstrip('-')}-x{int(count)}"


@dataclass(frozen=True)
class Figures:
    """Key trial figures (``None``: not measured in this run)."""

    tokens_per_s: float | None = None
    step_time_median_s: float | None = None
    step_time_p90_s: float | None = None
    step_time_cv: float | None = None
    """Coefficient of variation of the measured step times: the run's own noise."""
    peak_memory_bytes: int | None = None
    peak_memory_source: str | None = None
    """Which measurement ``peak_memory_bytes`` is: device total, allocator reserved or allocated."""
    peak_memory_basis: str | None = None
    """What it measures, in words: ``device memory (NVML)``, ``host RSS (a CPU run)``, ``allocator reserved``.
    Two peaks compare only on the same basis."""
    mfu: float | None = None
    checkpoint_write_s: float | None = None
    recovery_verdict: str | None = None


# Where each figure lives in [trial] (docs/architecture.md and capture/trial/runner.py). The
# first path present wins; device-wide memory beats the allocator's view because the allocator
# never sees the CUDA context (~651 MB on the H200).
FIGURE_PATHS: dict[str, tuple[str, ...]] = {
    "tokens_per_s": ("trial.stats.tokens_per_s",),
    "step_time_median_s": ("trial.stats.step_time_median_s",),
    "step_time_p90_s": ("trial.stats.step_time_p90_s",),
    "step_time_cv": ("trial.stats.step_time_cv",),
    "peak_memory_bytes": (
        "trial.memory.measured.device_used_bytes",
        "trial.memory.measured.peak_reserved_bytes",
        "trial.memory.measured.peak_allocated_bytes",
    ),
    "mfu": ("trial.stats.mfu",),
    "checkpoint_write_s": ("trial.checkpoint.duration_s", "trial.recovery.checkpoint_write_s"),
    "recovery_verdict": ("trial.recovery.verdict",),
}


def figures(data: Mapping[str, Any]) -> Figures:
    values: dict[str, Any] = {}
    for name, paths in FIGURE_PATHS.items():
        v, where = _first(data, *paths)
        if name == "recovery_verdict":
            values[name] = v if isinstance(v, str) else None
            continue
        v = _number(v)
        values[name] = v
        if name == "peak_memory_bytes" and v is not None and where:
            values["peak_memory_source"] = where.rsplit(".", 1)[1].removesuffix("_bytes")
            values["peak_memory_basis"] = memory_basis(data, values["peak_memory_source"])
    return Figures(**values)


def memory_basis(data: Mapping[str, Any], source: str) -> str:
    """What a peak-memory figure measures: a CPU run's device figure is the host's RSS, a GPU's
    is the device's (NVML/amdsmi), the allocator's view leaves the runtime's own memory out."""
    measured = table_at(data, "trial.memory.measured")
    if source == "device_used":
        how = str(measured.get("device_used_source") or "")
        if measured.get("device_type") == "cpu" or "RSS" in how:
            return "host RSS (a CPU run)"
        vendor = dig(data, "accelerator.vendor")
        return "device memory (" + ("amdsmi" if vendor == "amd" else "NVML" if vendor == "nvidia" else "device") + ")"
    return f"allocator {source.removeprefix('peak_')}"


@dataclass(frozen=True)
class RunSummary:
    """One row of the index; what `show` prints first."""

    content_id: str
    sha256: str
    kind: str | None
    created_utc: str | None
    accelerator: str
    """``NVIDIA H200 x1`` or ``cpu``."""
    accelerator_slug: str
    vendor: str | None
    model: str | None
    count: int | None
    memory_per_device_bytes: float | None
    """An int, or whatever number a foreign manifest holds."""
    driver_version: str | None
    runtime: str | None
    """``cuda``, ``rocm`` or ``cpu``."""
    runtime_version: str | None
    torch_version: str | None
    cudnn_version: str | None
    nccl_version: str | None
    python_version: str | None
    package_count: int | None
    code_commit: str | None
    code_dirty: bool | None
    image: str | None
    models: tuple[str, ...]
    datasets: tuple[str, ...]
    figures: Figures
    method: str | None = None
    """``full`` or ``lora`` (trial.run.method)."""
    scaling: str | None = None
    """``ddp x2 eff 0.90 · fsdp x2 eff 0.61``: the strategies the scaling step measured."""
    path: str | None = None
    signer: str | None = None
    signer_fingerprint: str | None = None
    exec: ExecRecord | None = None
    """The command a `capture exec` manifest ran, and how it ended."""
    costs: Any = None
    """The three cost figures (:class:`capture.costs.CostFigures`) of a trial, at its own price and the default target."""

    def to_json(self) -> dict[str, Any]:
        """Flat JSON object; unknown values are left out rather than written as null."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "figures":
                out.update({k: x for k, x in dataclasses.asdict(v).items() if x is not None})
            elif f.name in ("exec", "costs"):
                if v is not None:
                    out[f.name] = v.to_json()
            elif isinstance(v, tuple):
                out[f.name] = list(v)
            elif v is not None:
                out[f.name] = v
        return out


def summarize(data: Mapping[str, Any], raw: bytes, path: str | None = None,
              signer: str | None = None, signer_fingerprint: str | None = None) -> RunSummary:
    """Summarise a parsed manifest; ``raw`` is the whole file (its hash is the content id)."""
    acc, fw = table_at(data, "accelerator"), table_at(data, "framework")
    vendor = acc.get("vendor")
    model = acc.get("model")
    count = acc.get("count") if isinstance(acc.get("count"), int) else None
    if vendor in (None, "none") or not count:
        label = "cpu"
    else:
        label = f"{model} x{count}"
    packages = dig(data, "python.packages")
    commit = dig(data, "code.commit")
    image = dig(data, "container.image_ref") or dig(data, "container.image_id")
    return RunSummary(
        content_id=content_id(raw),
        sha256=hashlib.sha256(raw).hexdigest(),
        kind=data.get("kind"),
        created_utc=data.get("created_utc"),
        accelerator=label,
        accelerator_slug=accelerator_slug(data),
        vendor=vendor,
        model=model,
        count=count,
        memory_per_device_bytes=_number(acc.get("memory_per_device_bytes")),
        driver_version=acc.get("driver_version") or dig(data, "nvidia.driver_version") or dig(data, "amd.driver_version"),
        runtime=acc.get("runtime"),
        runtime_version=acc.get("runtime_version"),
        torch_version=fw.get("version") if fw.get("name", "torch") == "torch" else None,
        cudnn_version=_str(fw.get("cudnn_version")),
        nccl_version=_str(fw.get("nccl_version") or fw.get("rccl_version")),
        python_version=dig(data, "python.version"),
        package_count=len(packages) if isinstance(packages, Mapping) else None,
        code_commit=commit[:12] if isinstance(commit, str) else None,
        code_dirty=dig(data, "code.dirty") if isinstance(dig(data, "code.dirty"), bool) else None,
        image=image if isinstance(image, str) else None,
        models=artifact_refs(data, "models"),
        datasets=artifact_refs(data, "datasets"),
        figures=figures(data),
        method=_str(dig(data, "trial.run.method")),
        scaling=scaling_label(data),
        path=path,
        signer=signer,
        signer_fingerprint=signer_fingerprint,
        exec=exec_record(data),
        costs=_costs(data),
    )


def _costs(data: Mapping[str, Any]) -> Any:
    if not isinstance(dig(data, "trial.cost"), Mapping):
        return None
    from capture import costs

    return costs.figures(data)


def scaling_label(data: Mapping[str, Any]) -> str | None:
    """The strategies of ``[scaling]`` with their world size and efficiency, or None."""
    sc = data.get("scaling")
    if not isinstance(sc, Mapping) or sc.get("skipped"):
        return None
    parts = []
    for name in ("ddp", "fsdp"):
        s = sc.get(name)
        if isinstance(s, Mapping):
            eff = _number(s.get("efficiency"))
            parts.append(f"{name} x{sc.get('world_size', '?')}" + (f" eff {eff:.2f}" if eff is not None else ""))
    return " · ".join(parts) or None


def _str(v: Any) -> str | None:
    return None if v is None else str(v)


@dataclass(frozen=True)
class ExecRecord:
    """What `capture exec` recorded about the command it ran (``[exec]``)."""

    command: str
    exit_code: int | None
    signal: str | None
    wall_time_s: float | None
    outputs: tuple[dict[str, Any], ...]

    @property
    def failed(self) -> bool:
        return self.exit_code != 0 or self.signal is not None

    @property
    def status(self) -> str:
        """``succeeded (exit 0)``, ``FAILED (exit 3)``, ``FAILED (signal SIGTERM, exit 143)``."""
        code = "exit ?" if self.exit_code is None else f"exit {self.exit_code}"
        if self.signal:
            return f"FAILED (signal {self.signal}, {code})"
        return f"FAILED ({code})" if self.failed else f"succeeded ({code})"

    def outputs_text(self, digits: int = 12) -> str:
        parts = []
        for o in self.outputs:
            path = str(o.get("path", "?"))
            if not o.get("exists"):
                parts.append(f"{path} (missing)")
                continue
            n = o.get("files")
            what = f"folder, {n} files" if o.get("kind") == "folder" else "file"
            digest = str(o.get("sha256") or "")[:digits]
            parts.append(f"{path} ({what}, sha256 {digest}…)" if digest else f"{path} ({what})")
        return "; ".join(parts) or "none named (--output)"

    def line(self) -> str:
        """One line: the command, its status and wall time."""
        wall = f" after {_seconds(self.wall_time_s)}" if self.wall_time_s is not None else ""
        return f"`{self.command}` {self.status}{wall}"

    def to_json(self) -> dict[str, Any]:
        return {"command": self.command, "exit_code": self.exit_code, "signal": self.signal, "failed": self.failed,
                "wall_time_s": self.wall_time_s, "outputs": list(self.outputs)}


def _seconds(v: float | None) -> str:
    from capture.fmt import seconds_str

    return seconds_str(v)


def exec_record(data: Mapping[str, Any]) -> ExecRecord | None:
    """The ``[exec]`` table of a manifest written by `capture exec`, or None."""
    e = data.get("exec") if isinstance(data, Mapping) else None
    if not isinstance(e, Mapping):
        return None
    cmd = e.get("command_line")
    if not isinstance(cmd, str):
        argv = e.get("command")
        cmd = " ".join(map(str, argv)) if isinstance(argv, list) else "?"
    code = e.get("exit_code")
    outputs = tuple(dict(o) for o in e.get("outputs") or () if isinstance(o, Mapping))
    sig = e.get("signal")
    return ExecRecord(cmd, code if isinstance(code, int) and not isinstance(code, bool) else None,
                      sig if isinstance(sig, str) else None, _number(e.get("wall_time_s")), outputs)


# The one formatter (capture.fmt), under the names the index and pin used before.

"""What each accelerator should do: capture/data/preflight.toml, overlaid by the user's file.

Each SKU names its data-sheet figures (dense bf16 peak, memory bandwidth, PCIe link, GPU-to-GPU
bandwidth), where they come from, and the healthy ranges the checks judge measured figures by
(fractions of those figures; docs/preflight.md states them and their basis).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from capture._toml import TomlError
from capture._toml import loads as toml_loads
from capture._safe_read import read_overlays
from capture.errors import ConfigError
from capture.paths import config_dir

SHIPPED = "capture/data/preflight.toml"
FIGURES = ("gemm_bf16", "copy_d2d", "pcie", "p2p", "allreduce")
_NUMBERS = ("peak_bf16_dense_flops", "memory_bytes_per_s", "interconnect_bytes_per_s")


@dataclass(frozen=True)
class Range:
    """``pass`` and ``warn`` as fractions of the reference figure: >= pass passes, >= warn warns, else fails."""

    pass_fraction: float
    warn_fraction: float

    def verdict(self, fraction: float) -> str:
        if fraction >= self.pass_fraction:
            return "pass"
        return "warn" if fraction >= self.warn_fraction else "fail"


@dataclass(frozen=True)
class Sku:
    name: str
    vendor: str
    match: str
    peak_bf16_dense_flops: float | None = None
    memory_bytes_per_s: float | None = None
    pcie_gen: int | None = None
    pcie_width: int | None = None
    interconnect_bytes_per_s: float | None = None
    accelerator: str = ""
    """The entry's name in capture/data/accelerators.toml, if it has one."""
    source: str = ""
    healthy_basis: str = ""
    healthy: dict[str, Range] = field(default_factory=dict)

    def matches(self, device_name: str) -> bool:
        return re.search(self.match, device_name, re.IGNORECASE) is not None


@dataclass(frozen=True)
class PreflightCatalog:
    skus: tuple[Sku, ...]
    sources: tuple[str, ...]

    def match(self, device_name: str | None) -> Sku | None:
        if not device_name:
            return None
        return next((s for s in self.skus if s.matches(device_name)), None)


def user_catalog_path() -> Path:
    return config_dir() / "preflight.toml"


def _range(value: Any, where: str, hint: str) -> Range:
    if not isinstance(value, dict) or set(value) != {"pass", "warn"}:
        raise ConfigError(f"{where}: must be {{ pass = F, warn = F }}", hint)
    p, w = value["pass"], value["warn"]
    for v in (p, w):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 2:
            raise ConfigError(f"{where}: fractions must be numbers between 0 and 2, got {v!r}", hint)
    if w > p:
        raise ConfigError(f"{where}: warn ({w}) must not exceed pass ({p})", hint)
    return Range(float(p), float(w))


def parse_catalog(text: str, source: str, defaults: dict[str, Range] | None = None) -> tuple[list[Sku], dict[str, Range]]:
    hint = f"fix {source}; see {SHIPPED} for the format"
    try:
        doc = toml_loads(text)
    except TomlError as exc:
        raise ConfigError(f"{source}: not valid TOML ({exc})", hint) from None
    extra = sorted(set(doc) - {"defaults", "sku"})
    if extra:
        raise ConfigError(f"{source}: {extra[0]}: unknown key (the file holds [defaults] and [[sku]] tables)", hint)
    ranges = dict(defaults or {})
    for key, value in (doc.get("defaults") or {}).items():
        if key not in FIGURES:
            raise ConfigError(f"{source}: defaults.{key}: unknown figure; known: {', '.join(FIGURES)}", hint)
        ranges[key] = _range(value, f"{source}: defaults.{key}", hint)
    skus = []
    entries = doc.get("sku", [])
    if not isinstance(entries, list):
        raise ConfigError(f"{source}: sku must be an array of tables ([[sku]])", hint)
    known = {"name", "vendor", "match", "pcie_gen", "pcie_width", "accelerator", "source", "healthy_basis",
             "healthy", *_NUMBERS}
    for i, e in enumerate(entries):
        where = f"{source}: sku[{i}]"
        bad = sorted(set(e) - known)
        if bad:
            raise ConfigError(f"{where}.{bad[0]}: unknown key; known: {', '.join(sorted(known))}", hint)
        name = e.get("name")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where}.name: required (a string)", hint)
        match = e.get("match", re.escape(name))
        try:
            re.compile(match)
        except (re.error, TypeError) as exc:
            raise ConfigError(f"{where}.match: not a regular expression ({exc})", hint) from None
        numbers: dict[str, Any] = {}
        for key in _NUMBERS:
            v = e.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
                raise ConfigError(f"{where}.{key}: must be a positive number, got {v!r}", hint)
            numbers[key] = float(v) if v is not None else None
        for key in ("pcie_gen", "pcie_width"):
            v = e.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise ConfigError(f"{where}.{key}: must be a positive integer, got {v!r}", hint)
            numbers[key] = v
        own = dict(ranges)
        for key, value in (e.get("healthy") or {}).items():
            if key not in FIGURES:
                raise ConfigError(f"{where}.healthy.{key}: unknown figure; known: {', '.join(FIGURES)}", hint)
            own[key] = _range(value, f"{where}.healthy.{key}", hint)
        skus.append(Sku(name=name, vendor=str(e.get("vendor", "")), match=match, accelerator=str(e.get("accelerator", "")),
                        source=str(e.get("source", "")), healthy_basis=str(e.get("healthy_basis", "")), healthy=own,
                        **numbers))
    return skus, ranges


def load_catalog(path: str | Path | None = None) -> PreflightCatalog:
    """The shipped SKUs, then ~/.config/capture/preflight.toml, then ``path``; a user entry with a
    shipped name replaces it, and user entries are tried first (they are usually narrower)."""
    shipped = (resources.files("capture") / "data" / "preflight.toml").read_text(encoding="utf-8")
    skus, defaults = parse_catalog(shipped, SHIPPED)
    sources = [SHIPPED]
    for p, text in read_overlays(user_catalog_path(), path, "preflight.toml"):
        mine, defaults = parse_catalog(text, p, defaults)
        names = {s.name for s in mine}
        skus = mine + [s for s in skus if s.name not in names]
        sources.append(p)
    return PreflightCatalog(tuple(skus), tuple(sources))


def default_ranges() -> dict[str, Range]:
    shipped = (resources.files("capture") / "data" / "preflight.toml").read_text(encoding="utf-8")
    return parse_catalog(shipped, SHIPPED)[1]


# PCIe bandwidth per lane and direction, bytes/s, after line coding (8b/10b to Gen2, 128b/130b
# Gen3-5, FLIT mode Gen6): the ceiling a pinned copy is judged against.
PCIE_LANE_BYTES_PER_S = {1: 0.25e9, 2: 0.5e9, 3: 8e9 * 128 / 130 / 8, 4: 16e9 * 128 / 130 / 8,
                         5: 32e9 * 128 / 130 / 8, 6: 64e9 * 242 / 256 / 8}


def pcie_bytes_per_s(gen: int | None, width: int | None) -> float | None:
    if gen is None or width is None or gen not in PCIE_LANE_BYTES_PER_S:
        return None
    return PCIE_LANE_BYTES_PER_S[gen] * width

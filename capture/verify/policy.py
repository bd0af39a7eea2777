"""Which fields make "the same stack": the default policy, policy files, and the review policy.

- :meth:`Policy.default`: what `capture verify` and `capture diff` compare (``--strict`` adds the
  boards' identity).
- :meth:`Policy.load`: a policy file (``--policy F``) that loosens or tightens fields.
- :meth:`Policy.review`: what `capture compare` shows a reviewer: the default fields and, in
  addition, the host, the environment, the code's branch/remote/dirty state, the image reference
  and labels, device details and the run definition (``trial.run.*``). Every field the default
  policy compares is in it, so `diff` and `compare` agree on whether two stacks differ there.

Variables that torch and its compilers set inside the process after start
(:data:`IN_PROCESS_VARIABLES`) are never compared: a manifest records the environment as the
process found it, but older manifests carry them, and "absent -> /tmp/torchinductor_root" is not a
difference anybody made.
"""

from __future__ import annotations

import fnmatch
import functools
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

try:
    import tomli as tomllib
except ImportError:  # pragma: no cover - tomli is a dependency
    import tomllib  # type: ignore[no-redef]

from packaging.specifiers import InvalidSpecifier, SpecifierSet

from capture._toml import TomlError
from capture._toml import loads as toml_loads

from capture._safe_read import CONFIG_MAX_BYTES, read_regular
from capture.errors import ConfigError

# "Same stack": what must be equal for a result to be reproducible on the live machine.
DEFAULT_COMPARE: tuple[str, ...] = (
    "accelerator.vendor",
    "accelerator.model",
    "accelerator.count",
    "accelerator.runtime",
    "accelerator.runtime_version",
    "nvidia.driver_version",
    "nvidia.cuda_driver_version",
    "nvidia.devices.*.name",
    "nvidia.devices.*.compute_capability",
    "nvidia.devices.*.mig_enabled",
    "amd.driver_version",
    "amd.devices.*.market_name",
    "amd.devices.*.gfx_target",
    "framework.name",
    "framework.version",
    "framework.cuda_version",
    "framework.hip_version",
    "framework.git_version",
    "framework.cudnn_version",
    "framework.nccl_version",
    "framework.miopen_version",
    "framework.rccl_version",
    "framework.loaded.cudnn_version",
    "framework.loaded.nccl_version",
    "python.version",
    "python.implementation",
    "python.packages.*.version",
    "python.packages.*.commit",
    "code.commit",
    "code.tree_hash",
    "models.*.commit",
    "models.*.content_hash",
    "datasets.*.commit",
    "datasets.*.content_hash",
    "container.image_id",
)
# --strict: the very same boards, not just the same model.
STRICT_COMPARE: tuple[str, ...] = (
    "nvidia.devices.*.uuid",
    "nvidia.devices.*.serial",
    "nvidia.devices.*.pci_bus_id",
    "amd.devices.*.uuid",
    "amd.devices.*.bdf",
)
# `capture compare`: what a reviewer wants to see changed, on top of the default fields.
REVIEW_COMPARE: tuple[str, ...] = (
    "accelerator.memory_per_device_bytes",
    "nvidia.devices.*.memory_total_bytes",
    "nvidia.devices.*.vbios_version",
    "nvidia.devices.*.ecc_enabled",
    "nvidia.devices.*.power_limit_w",
    "nvidia.devices.*.visible",
    "amd.devices.*.vram_total_bytes",
    "amd.devices.*.vbios_version",
    "amd.devices.*.visible",
    "framework.loaded.*",
    "code.remote_url",
    "code.branch",
    "code.dirty",
    "container.image_ref",
    "container.labels.*",
    "host.os",
    "host.kernel",
    "host.cpu_model",
    "host.cpu_count",
    "host.memory_total_bytes",
    "environment.variables.*",
    "models.*.revision",
    "datasets.*.revision",
)
# Never part of "same stack": when and where, and results (a live probe has none).
ALWAYS_IGNORED: tuple[str, ...] = ("schema_version", "kind", "created_utc", "tool.*", "probe.*", "trial.*",
                                   "scaling.*", "preflight.*")
IN_PROCESS_VARIABLES: tuple[str, ...] = (
    "environment.variables.TORCHINDUCTOR_CACHE_DIR",  # torch._inductor sets it on first compile
    "environment.variables.TRITON_CACHE_DIR",         # ... and this one beside it
    "environment.variables.CUDA_MODULE_LOADING",      # torch.cuda sets LAZY at initialisation when unset
)


@dataclass(frozen=True)
class Rule:
    """How one field is compared: ``equal``, ``ignore`` or a version specifier."""

    pattern: str
    kind: str  # "equal" | "ignore" | "specifier"
    spec: str = ""


def _match_any(key: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(key, p) for p in patterns)


@dataclass(frozen=True)
class Policy:
    """Which fields must match. Explicit field rules > ignore list > default/strict compare set."""

    compare: tuple[str, ...] = DEFAULT_COMPARE
    ignore: tuple[str, ...] = IN_PROCESS_VARIABLES
    rules: tuple[Rule, ...] = ()
    source: str = "default"

    @classmethod
    def default(cls, strict: bool = False) -> Policy:
        return cls(compare=DEFAULT_COMPARE + (STRICT_COMPARE if strict else ()))

    @classmethod
    def review(cls, strict: bool = False) -> Policy:
        """`capture compare`: the default fields plus :data:`REVIEW_COMPARE` and the run definition."""
        return cls(compare=cls.default(strict).compare + REVIEW_COMPARE,
                   rules=(Rule("trial.run.*", "equal"),), source="review")

    @classmethod
    def everything(cls) -> Policy:
        """`capture diff --all`: every field but timestamps, tool and probe metadata."""
        return cls(compare=("*",), ignore=("created_utc", "tool.*", "probe.*", *IN_PROCESS_VARIABLES),
                   source="everything")

    @classmethod
    def load(cls, path: str | os.PathLike[str], strict: bool = False) -> Policy:
        """Read a policy file (a regular file of at most 1 MiB; a bad one is exit 2)::

            [fields]                      # loosen or tighten single fields
            "nvidia.driver_version" = ">=550"
            "python.packages.numpy.version" = "ignore"
            "host.kernel" = "equal"
            [ignore]
            fields = ["environment.*", "python.packages.pip.*"]
            [compare]
            fields = ["host.os"]          # compared in addition to the defaults
            defaults = true               # false: compare only what this file names
        """
        p = Path(path)
        try:
            data = toml_loads(read_regular(p, CONFIG_MAX_BYTES, ConfigError, "policy file").decode("utf-8"), tomllib)
        except FileNotFoundError:
            raise ConfigError(f"policy file {p}: no such file", "check the --policy path") from None
        except IsADirectoryError:
            raise ConfigError(f"policy file {p}: is a folder", "check the --policy path") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"policy file {p}: cannot read ({exc})", "check the --policy path") from None
        except TomlError as exc:  # also nested too deeply, or an integer of thousands of digits
            raise ConfigError(f"policy file {p}: not valid TOML ({exc})", "fix the TOML syntax") from None
        unknown = set(data) - {"fields", "ignore", "compare"}
        if unknown:
            raise ConfigError(f"policy file {p}: unknown table [{sorted(unknown)[0]}]",
                              "allowed tables are [fields], [ignore] and [compare]")
        for table in ("fields", "ignore", "compare"):
            if not isinstance(data.get(table, {}), dict):
                raise ConfigError(f"policy file {p}: {table} must be a table", f"write [{table}]")
        rules: list[Rule] = []
        for pattern, value in (data.get("fields") or {}).items():
            if not isinstance(value, str):
                raise ConfigError(f"policy file {p}: fields.{pattern!r} must be a string",
                                  'use "equal", "ignore" or a version specifier such as ">=550"')
            if value in ("equal", "ignore"):
                rules.append(Rule(pattern, value))
                continue
            try:
                SpecifierSet(value)
            except InvalidSpecifier:
                raise ConfigError(f"policy file {p}: fields.{pattern!r} = {value!r} is not a version specifier",
                                  'use "equal", "ignore" or a specifier such as ">=550" or "~=2.11"') from None
            rules.append(Rule(pattern, "specifier", value))

        def _list(table: str) -> tuple[str, ...]:
            value = (data.get(table) or {}).get("fields", [])
            if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
                raise ConfigError(f"policy file {p}: {table}.fields must be a list of strings",
                                  'e.g. fields = ["environment.*"]')
            return tuple(value)

        use_defaults = (data.get("compare") or {}).get("defaults", True)
        if not isinstance(use_defaults, bool):
            raise ConfigError(f"policy file {p}: compare.defaults must be true or false", "write defaults = false")
        base = cls.default(strict).compare if use_defaults else ()
        return cls(compare=base + _list("compare"), ignore=IN_PROCESS_VARIABLES + _list("ignore"),
                   rules=tuple(rules), source=str(p))

    def rule_for(self, key: str) -> Rule | None:
        """The rule that decides ``key``, or None when the field is not compared. Remembered per
        (policy, field): every manifest repeats the same few hundred field names, and matching each
        against every pattern again was a sixth of a type-fuzz run over show, compare and verify.
        Long names (only a hostile file has them) are matched each time, not kept."""
        return _rule_for(self, key) if len(key) <= 256 else self._decide(key)

    def _decide(self, key: str) -> Rule | None:
        if _match_any(key, ALWAYS_IGNORED) and not any(fnmatch.fnmatchcase(key, r.pattern) for r in self.rules):
            return None
        for rule in self.rules:
            if fnmatch.fnmatchcase(key, rule.pattern):
                return None if rule.kind == "ignore" else rule
        if _match_any(key, self.ignore):
            return None
        for pattern in self.compare:
            if fnmatch.fnmatchcase(key, pattern):
                return Rule(pattern, "equal")
        return None


@functools.lru_cache(maxsize=1 << 15)
def _rule_for(policy: Policy, key: str) -> Rule | None:
    return policy._decide(key)

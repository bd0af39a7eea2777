"""`capture verify` and `capture diff`: signature, trust, parse, live fingerprint, comparison.

The order is fixed (shared/DESIGN.md): nothing in a manifest body is parsed, let alone
believed, before its signature has been checked over the exact bytes and its signer has been
found in an allowed-signers file.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from capture import manifest as mf
from capture.errors import EXIT_DRIFT, EXIT_OK, CaptureError, ConfigError

ABSENT = "(absent)"

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
# Never part of "same stack": when and where, and results (a live probe has none).
ALWAYS_IGNORED: tuple[str, ...] = ("schema_version", "kind", "created_utc", "tool.*", "probe.*", "trial.*", "scaling.*")

# Natural keys of arrays of tables, so that reordering is not drift and a device is compared
# with the same device.
_ARRAY_KEYS = {
    "devices": ("index",),
    "models": ("repo_id", "spec", "path"),
    "datasets": ("repo_id", "spec", "path"),
    "files": ("path",),
    "links": ("a", "b"),
    "mig_instances": ("uuid", "index"),
}


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted paths to leaf values; arrays of tables are keyed by their natural key."""
    out: dict[str, Any] = {}
    if isinstance(data, Mapping):
        for k, v in data.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(data, list) and data and all(isinstance(x, Mapping) for x in data):
        name = prefix.rsplit(".", 1)[-1]
        keys = _ARRAY_KEYS.get(name, ())
        for pos, item in enumerate(data):
            ident = next((item[k] for k in keys if k in item and not isinstance(item[k], (dict, list))), None)
            if name == "links" and "a" in item and "b" in item:
                ident = f"{item['a']}-{item['b']}"
            out.update(flatten(item, f"{prefix}.{ident if ident is not None else pos}"))
    elif isinstance(data, list):
        out[prefix] = tuple(data)
    else:
        out[prefix] = data
    return out


def _lenient_version(value: Any) -> Version | None:
    text = str(value).strip()
    try:
        return Version(text)
    except InvalidVersion:
        m = re.match(r"v?(\d+(?:\.\d+)*)", text)  # "6.2.41133-dd7f95766", "580.159.04"
        return Version(m.group(1)) if m else None


@dataclass(frozen=True)
class Rule:
    """How one field is compared: ``equal``, ``ignore`` or a version specifier."""

    pattern: str
    kind: str  # "equal" | "ignore" | "specifier"
    spec: str = ""


@dataclass(frozen=True)
class Policy:
    """Which fields must match. Explicit field rules > ignore list > default/strict compare set."""

    compare: tuple[str, ...] = DEFAULT_COMPARE
    ignore: tuple[str, ...] = ()
    rules: tuple[Rule, ...] = ()
    source: str = "default"

    @classmethod
    def default(cls, strict: bool = False) -> "Policy":
        return cls(compare=DEFAULT_COMPARE + (STRICT_COMPARE if strict else ()))

    @classmethod
    def load(cls, path: str | os.PathLike[str], strict: bool = False) -> "Policy":
        """Read a policy file::

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
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"policy file {p}: no such file", "check the --policy path") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"policy file {p}: cannot read ({exc})", "check the --policy path") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"policy file {p}: not valid TOML ({exc})", "fix the TOML syntax") from None
        unknown = set(data) - {"fields", "ignore", "compare"}
        if unknown:
            raise ConfigError(f"policy file {p}: unknown table [{sorted(unknown)[0]}]",
                              "allowed tables are [fields], [ignore] and [compare]")
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
        return cls(compare=base + _list("compare"), ignore=_list("ignore"), rules=tuple(rules), source=str(p))

    def rule_for(self, key: str) -> Rule | None:
        """The rule that decides ``key``, or None when the field is not compared."""
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


def _match_any(key: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(key, p) for p in patterns)


@dataclass(frozen=True)
class Difference:
    """One field whose live (or second) value does not satisfy the policy."""

    field: str
    recorded: Any
    live: Any
    rule: str = "equal"

    def line(self, left: str = "recorded", right: str = "live") -> str:
        return f"{self.field}: {left} {_show(self.recorded)}, {right} {_show(self.live)}" + (
            f" (policy {self.rule})" if self.rule not in ("equal",) else "")


def _show(value: Any) -> str:
    if value is ABSENT:
        return ABSENT
    if isinstance(value, tuple):
        value = list(value)
    return json.dumps(value, default=str)


def compare_manifests(recorded: Mapping[str, Any], live: Mapping[str, Any],
                      policy: Policy | None = None) -> tuple[list[Difference], int]:
    """Compare two manifest dicts field by field. Returns (differences, number of fields compared)."""
    policy = policy or Policy.default()
    a, b = flatten(recorded), flatten(live)
    diffs: list[Difference] = []
    compared = 0
    for key in sorted(set(a) | set(b)):
        rule = policy.rule_for(key)
        if rule is None:
            continue
        compared += 1
        va, vb = a.get(key, ABSENT), b.get(key, ABSENT)
        if rule.kind == "specifier":
            live_version = None if vb is ABSENT else _lenient_version(vb)
            if live_version is None or not SpecifierSet(rule.spec).contains(live_version, prereleases=True):
                diffs.append(Difference(key, va, vb, rule.spec))
        elif va != vb:
            diffs.append(Difference(key, va, vb))
    return diffs, compared


# --------------------------------------------------------------------------- verify


@dataclass(frozen=True)
class VerifyReport:
    """What `capture verify` found, in the order it checked."""

    path: str
    exit_code: int
    signer: dict[str, Any] | None = None
    allowed_signers: str | None = None
    differences: tuple[Difference, ...] = ()
    compared: int = 0
    stack_checked: bool = False
    code_dir: str | None = None
    policy: str = "default"
    error: str | None = None
    hint: str | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["differences"] = [
            {"field": x.field, "recorded": None if x.recorded is ABSENT else x.recorded,
             "live": None if x.live is ABSENT else x.live, "rule": x.rule}
            for x in self.differences
        ]
        d["status"] = {0: "ok", 1: "drift", 2: "usage", 3: "malformed", 4: "untrusted"}.get(self.exit_code, "error")
        return d


def check_signature(path: str | os.PathLike[str], allowed_signers: str | os.PathLike[str] | None = None,
                    raw: bytes | None = None) -> tuple[Any, dict[str, Any]]:
    """Steps 1-3 of verify: signature over the exact bytes, trust, then parse.

    Returns ``(SignatureInfo, manifest dict)``; raises SignatureError (exit 4) or ManifestError (3).
    """
    from capture import signing

    raw = mf.read_bytes(path) if raw is None else raw
    body, trailer = mf.split_signed(raw)
    if trailer is None:
        # Rejected either way; parsing only decides which message helps: "malformed" (3) for a
        # file that is not a manifest at all, "not signed" (4) for a good but unsigned one.
        mf.parse_body(body, str(path))
    found = signing.find_allowed_signers(path, allowed_signers)
    allowed = signing.AllowedSigners.load(found) if found else None
    info, body = signing.verify_signed_bytes(raw, allowed, str(path))
    return info, mf.parse_body(body, str(path))


def live_fingerprint(recorded: Mapping[str, Any], code_dir: str | os.PathLike[str] | None = None,
                     verify_artifacts: bool = False) -> tuple[dict[str, Any], str | None]:
    """Probe this machine the way the recorded manifest was probed. Returns (manifest, code dir used)."""
    from capture.fingerprint import collect
    from capture.probes import ProbeOptions

    probe = recorded.get("probe") or {}
    code = Path(code_dir) if code_dir else None
    if code is None:
        rec_path = (recorded.get("code") or {}).get("path")
        code = Path(rec_path) if rec_path and Path(rec_path).is_dir() else Path.cwd()

    def _specs(name: str) -> tuple[str, ...]:
        value = probe.get(name, [])
        return tuple(str(x) for x in value) if isinstance(value, list) else ()

    options = ProbeOptions(
        models=_specs("models"), datasets=_specs("datasets"), code=code,
        verify_artifacts=verify_artifacts, deep=bool(probe.get("deep", False)), progress=False,
    )
    return collect(options, kind="fingerprint", raise_user_errors=False), str(code)


def verify_file(path: str | os.PathLike[str], allowed_signers: str | os.PathLike[str] | None = None,
                policy: Policy | None = None, strict: bool = False,
                code_dir: str | os.PathLike[str] | None = None, stack: bool = True,
                live: Mapping[str, Any] | None = None, verify_artifacts: bool = False) -> VerifyReport:
    """Signature → trust → parse → live fingerprint → comparison; never raises CaptureError."""
    path = str(path)
    try:
        info, data = check_signature(path, allowed_signers)
    except CaptureError as exc:
        return VerifyReport(path, exc.exit_code, error=exc.message, hint=exc.hint)
    signer = {"principal": info.principal, "public_key": info.public_key, "fingerprint": info.fingerprint}
    if not stack:
        return VerifyReport(path, EXIT_OK, signer=signer, allowed_signers=info.allowed_signers)
    policy = policy or Policy.default(strict)
    notes: list[str] = []
    try:
        if live is None:
            live, used_code = live_fingerprint(data, code_dir, verify_artifacts)
        else:
            used_code = str(code_dir) if code_dir else None
    except CaptureError as exc:
        return VerifyReport(path, exc.exit_code, signer=signer, allowed_signers=info.allowed_signers,
                            error=exc.message, hint=exc.hint)
    rec_code = data.get("code")
    if isinstance(rec_code, dict) and "skipped" in rec_code:
        # Nothing was recorded to compare with: probing some folder here would only invent drift.
        live = {**live, "code": rec_code}
        notes.append(f"code: not recorded in the manifest ({rec_code['skipped']}); not compared")
    if data.get("kind") == "trial":
        notes.append("trial results are signed facts about the recorded run; only the stack is compared")
    diffs, compared = compare_manifests(data, live, policy)
    return VerifyReport(
        path, EXIT_DRIFT if diffs else EXIT_OK, signer=signer, allowed_signers=info.allowed_signers,
        differences=tuple(diffs), compared=compared, stack_checked=True, code_dir=used_code,
        policy=policy.source, notes=tuple(notes),
    )


def format_report(report: VerifyReport) -> str:
    """The human-readable report (stdout)."""
    lines = [f"{report.path}"]
    if report.error and report.signer is None:
        lines.append(f"  signature: FAILED — {report.error}")
        if report.hint:
            lines.append(f"  hint: {report.hint}")
        return "\n".join(lines)
    s = report.signer or {}
    lines.append(f"  signature: valid ({s.get('fingerprint')}, principal {s.get('principal')!r})")
    lines.append(f"  trust:     signer listed in {report.allowed_signers}")
    if report.error:
        lines.append(f"  stack:     not checked — {report.error}")
        if report.hint:
            lines.append(f"  hint: {report.hint}")
        return "\n".join(lines)
    if not report.stack_checked:
        lines.append("  stack:     not compared (signature and trust only)")
        return "\n".join(lines)
    if report.differences:
        lines.append(f"  stack:     DRIFT — {len(report.differences)} of {report.compared} compared fields differ "
                     f"(policy: {report.policy})")
        lines.extend(f"    {d.line()}" for d in report.differences)
    else:
        lines.append(f"  stack:     same stack — {report.compared} fields compared (policy: {report.policy})")
    lines.extend(f"  note: {n}" for n in report.notes)
    return "\n".join(lines)


def diff_files(a: str | os.PathLike[str], b: str | os.PathLike[str], policy: Policy | None = None,
               everything: bool = False) -> tuple[list[Difference], int]:
    """`capture diff A B`: the verify comparison between two manifests (no live probe).

    ``everything`` compares every field except timestamps and tool metadata.
    """
    da = mf.load_unverified(a).data
    db = mf.load_unverified(b).data
    if everything:
        policy = Policy(compare=("*",), ignore=("created_utc", "tool.*", "probe.*"), source="everything")
    return compare_manifests(da, db, policy)

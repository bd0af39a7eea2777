"""`capture verify FILE`, and the judgment every verified manifest gets, alone or in a tree.

:func:`judge` is the one judgment: `verify FILE` and each row of `verify DIR` call it with the
same flags, so the same file gets the same verdict either way. Its steps: open through the door
(signature, trust, parse), then, unless ``stack=False``, probe this machine the way the manifest
was probed (:class:`LiveStack`, shared by a tree run) and compare under the policy. A manifest that
recorded no code (no ``[code]`` table, or ``code.skipped``) is never compared with whatever folder
the command runs in.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from capture._escape import printable
from capture.errors import EXIT_DRIFT, EXIT_OK, CaptureError, ManifestError, NotAManifest, SignatureError
from capture.manifest import table_at
from capture.verify.compare import Difference, compare_manifests
from capture.verify.open import OpenedManifest, SignatureStatus, Trust, open_manifest
from capture.verify.policy import Policy

STATUSES = ("OK", "DRIFT", "MALFORMED", "UNSIGNED", "UNTRUSTED", "INVALID", "ERROR", "SKIPPED")
"""The report vocabulary (lower case in JSON): ok, drift, malformed, unsigned, untrusted, invalid, error;
and, in a tree run only, skipped (a ``*.toml`` file that is no manifest, such as a trial config; exit 0)."""
TRIAL_NOTE = "trial results are signed facts about the recorded run; only the stack is compared"


@dataclass(frozen=True)
class Verdict:
    """What verification found for one manifest; one shape for `verify FILE` and each `verify DIR` row."""

    path: str
    status: str
    """One of :data:`STATUSES`."""
    exit_code: int
    reason: str | None = None
    hint: str | None = None
    signature: SignatureStatus | None = None
    """Set once the signature was checked and valid (``OK``, ``DRIFT``, ``ERROR``)."""
    differences: tuple[Difference, ...] = ()
    compared: int = 0
    stack_checked: bool = False
    code_dir: str | None = None
    policy: str | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def principal(self) -> str | None:
        return self.signature.principal if self.signature else None

    @property
    def fingerprint(self) -> str | None:
        return self.signature.fingerprint if self.signature else None

    @property
    def refused(self) -> bool:
        """The manifest itself was refused (malformed, unsigned, invalid, untrusted)."""
        return self.signature is None

    def line(self, width: int = 10) -> str:
        """One row of `verify DIR` (escaped: paths and reasons come from files)."""
        text = f"{self.status:<{width}} {printable(self.path)}"
        if self.status == "OK":
            return text + (f"  ({printable(self.principal)}, {self.fingerprint})" if self.principal else "")
        if self.status == "DRIFT":
            shown = "; ".join(d.line() for d in self.differences[:3])
            more = f"; and {len(self.differences) - 3} more" if len(self.differences) > 3 else ""
            return f"{text}  {len(self.differences)} field(s) differ: {printable(shown)}{more}"
        return f"{text}  {printable(self.reason)}"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"path": self.path, "status": self.status.lower(), "exit_code": self.exit_code}
        if self.reason:
            out["reason"] = self.reason
        if self.hint:
            out["hint"] = self.hint
        if self.signature is not None:
            out["signer"] = {"principal": self.signature.principal, "fingerprint": self.signature.fingerprint,
                             "public_key": self.signature.public_key}
            out["allowed_signers"] = self.signature.allowed_signers
        out["stack_checked"] = self.stack_checked
        if self.stack_checked:
            out.update(compared=self.compared, policy=self.policy, code_dir=self.code_dir)
        out["differences"] = [d.to_json() for d in self.differences]
        out["notes"] = list(self.notes)
        return out


def refusal(path: str, exc: CaptureError) -> Verdict:
    """The verdict for a manifest the door refused (or an error met on the way)."""
    if isinstance(exc, NotAManifest):
        status = "SKIPPED"
    elif isinstance(exc, ManifestError):
        status = "MALFORMED"
    elif isinstance(exc, SignatureError):
        status = exc.state.upper()
    else:
        status = "ERROR"
    reason = exc.message.removeprefix(f"{path}: ").removeprefix(f"{Path(path)}: ")
    return Verdict(path, status, EXIT_OK if status == "SKIPPED" else exc.exit_code, reason, exc.hint)


def _has_code(data: Mapping[str, Any]) -> bool:
    code = data.get("code")
    return isinstance(code, Mapping) and "skipped" not in code


def _specs(probe: Mapping[str, Any], name: str) -> tuple[str, ...]:
    value = probe.get(name, [])
    return tuple(str(x) for x in value) if isinstance(value, list) else ()


class LiveStack:
    """This machine's fingerprint, probed once per distinct way a manifest was probed."""

    def __init__(self, code_dir: str | os.PathLike[str] | None = None, verify_artifacts: bool = False,
                 live: Mapping[str, Any] | None = None) -> None:
        self.code_dir = Path(code_dir) if code_dir else None
        self.verify_artifacts = verify_artifacts
        self._given = dict(live) if live is not None else None
        self._cache: dict[str, tuple[dict[str, Any] | None, CaptureError | None]] = {}

    def code_for(self, recorded: Mapping[str, Any]) -> Path | None:
        """The folder compared with the recorded code: --code, else the recorded path if it is a
        folder here, else the current folder; None when the manifest recorded no code."""
        if not _has_code(recorded):
            return None
        if self.code_dir is not None:
            return self.code_dir
        rec_path = recorded["code"].get("path")
        return Path(rec_path) if isinstance(rec_path, str) and rec_path and Path(rec_path).is_dir() else Path.cwd()

    def probe(self, recorded: Mapping[str, Any]) -> tuple[dict[str, Any], str | None]:
        """(live manifest, code folder used); raises :class:`CaptureError` when probing fails."""
        code = self.code_for(recorded)
        if self._given is not None:
            return self._given, str(code) if code else None
        probe = table_at(recorded, "probe")
        key = json.dumps([probe, str(code)], sort_keys=True, default=str)
        if key not in self._cache:
            from capture.fingerprint import collect
            from capture.probes import ProbeOptions

            options = ProbeOptions(models=_specs(probe, "models"), datasets=_specs(probe, "datasets"), code=code,
                                   verify_artifacts=self.verify_artifacts, deep=probe.get("deep") is True,
                                   progress=False)
            try:
                self._cache[key] = (collect(options, kind="fingerprint", raise_user_errors=False), None)
            except CaptureError as exc:
                self._cache[key] = (None, exc)
        live, error = self._cache[key]
        if error is not None:
            raise error
        assert live is not None
        return live, str(code) if code else None


def judge(opened: OpenedManifest | CaptureError, path: str, policy: Policy | None = None, stack: bool = True,
          live: LiveStack | None = None) -> Verdict:
    """The verdict for one manifest (already through the door, or the door's refusal)."""
    if isinstance(opened, CaptureError):
        return refusal(path, opened)
    sig = opened.signature
    if not stack:
        return Verdict(path, "OK", EXIT_OK, signature=sig)
    policy = policy or Policy.default()
    live = live or LiveStack()
    data = opened.data
    notes: list[str] = []
    try:
        live_data, used_code = live.probe(data)
    except CaptureError as exc:
        return Verdict(path, "ERROR", exc.exit_code, f"live stack not checked: {exc.message}", exc.hint, signature=sig)
    recorded: Mapping[str, Any] = data
    if not _has_code(data):
        # Nothing was recorded to compare with: probing some folder here would only invent drift.
        code = data.get("code")
        why = code.get("skipped") if isinstance(code, Mapping) else "no [code] table"
        recorded = {k: v for k, v in data.items() if k != "code"}
        live_data = {k: v for k, v in live_data.items() if k != "code"}
        notes.append(f"code: not recorded in the manifest ({why}); not compared")
    if data.get("kind") == "trial":
        notes.append(TRIAL_NOTE)
    diffs, compared = compare_manifests(recorded, live_data, policy)
    return Verdict(path, "DRIFT" if diffs else "OK", EXIT_DRIFT if diffs else EXIT_OK, signature=sig,
                   differences=tuple(diffs), compared=compared, stack_checked=True, code_dir=used_code,
                   policy=policy.source, notes=tuple(notes))


def verify_file(path: str | os.PathLike[str], allowed_signers: Trust = None, policy: Policy | None = None,
                strict: bool = False, code_dir: str | os.PathLike[str] | None = None, stack: bool = True,
                live: Mapping[str, Any] | None = None, verify_artifacts: bool = False) -> Verdict:
    """Signature → trust → parse → live fingerprint → comparison; never raises for a bad manifest.

    A bad ``allowed_signers`` file is a usage error and is raised (exit 2).
    """
    path = str(path)
    try:
        opened: OpenedManifest | CaptureError = open_manifest(path, allowed_signers, require_trusted=True)
    except (ManifestError, SignatureError) as exc:
        opened = exc
    return judge(opened, path, policy or Policy.default(strict), stack,
                 LiveStack(code_dir, verify_artifacts, live))


def format_report(v: Verdict) -> str:
    """The human-readable report of one manifest (stdout)."""
    lines = [printable(v.path)]
    if v.refused:
        lines.append(f"  signature: FAILED — {printable(v.reason)}")
        if v.hint:
            lines.append(f"  hint: {printable(v.hint)}")
        return "\n".join(lines)
    s = v.signature
    assert s is not None
    lines.append(f"  signature: valid, principal {printable(repr(s.principal))}")
    lines.append(f"  key:       {s.fingerprint}")
    lines.append(f"  trust:     signer listed in {printable(s.allowed_signers)}")
    if v.status == "ERROR":
        lines.append(f"  stack:     not checked — {printable(v.reason)}")
        if v.hint:
            lines.append(f"  hint: {printable(v.hint)}")
        return "\n".join(lines)
    if not v.stack_checked:
        lines.append("  stack:     not compared (signature and trust only)")
        return "\n".join(lines)
    if v.differences:
        lines.append(f"  stack:     DRIFT — {len(v.differences)} of {v.compared} compared fields differ "
                     f"(policy: {printable(v.policy)})")
        lines.extend(f"    {printable(x)}" for d in v.differences for x in d.lines(indent=4))
    else:
        lines.append(f"  stack:     same stack — {v.compared} fields compared (policy: {printable(v.policy)})")
    lines.extend(f"  note: {printable(n)}" for n in v.notes)
    return "\n".join(lines)

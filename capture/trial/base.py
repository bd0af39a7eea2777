"""The frozen base of a LoRA run: not written into the checkpoint, verified in the fresh process.

A LoRA run saves its adapter; when it resumes it loads the base again from where it came from.
The recovery check proves that the base the fresh process trains on is the base the run trained
on, in the way that fits where the base comes from:

- **pretrained** (``trial.model.source = "hub"`` or ``"local"``): its files. The expectation is
  what the trial's fingerprint recorded for the model (``[[models]]``, capture.probes.artifacts):
  the hub snapshot's blob ids, which are content hashes, or a local folder's per-file sha256. The
  fresh process re-reads every file and checks it, as ``--verify-artifacts`` does, in threads
  started as soon as it knows the config, so the hashing overlaps its imports and the parent's
  reference run, and the files are in the page cache when the model loads from them. This is the
  state the base loads *from*, so it holds for any base, a quantized one included.
- **from a config** (random weights, seeded): the base is rebuilt from the seed; the sha256 of its
  state (:func:`capture.trial.state.base_state`: every state_dict entry that is not trained) is
  taken once in the process that saved the checkpoint and once in the fresh one, after its build.

Either way the digest is computed once per process, never per restore. The result is the
``base_model`` row of ``[[trial.recovery.restored_state]]`` and ``[trial.recovery.base_model]``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

FILES = "pretrained files"
REBUILT = "rebuilt from config and seed"


@dataclass(frozen=True)
class Expectation:
    """What the fresh process's base must be. ``digest`` is the artifact's ``content_hash`` (files)
    or the base state's sha256 (rebuilt; filled in by the process that saved the checkpoint)."""

    kind: str
    spec: str | None = None
    """The model as the fingerprint names it: ``REPO@REV`` or a local folder (files only)."""
    digest: str = ""
    files: tuple[tuple[str, str], ...] = ()
    """(path, blob id or sha256) per file, as recorded (files only)."""

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "spec": self.spec, "digest": self.digest, "files": [list(f) for f in self.files]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Expectation:
        return cls(data["kind"], data.get("spec"), data.get("digest", ""),
                   tuple((str(p), str(i)) for p, i in data.get("files", ())))


def model_spec(config: Any) -> str | None:
    """The model as ``capture fingerprint --model`` takes it (None for a model built from a config)."""
    m = config.model
    if m.source == "hub":
        return f"{m.repo_id}@{m.revision}" if m.revision else str(m.repo_id)
    if m.source == "local":
        return str(config.resolve_path(m.path or ""))
    return None


def _file_ids(table: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((str(f["path"]), str(f.get("sha256") or f.get("blob_id") or ""))
                        for f in table.get("files", ()) if isinstance(f, Mapping)))


def expect(config: Any, models: Any = None) -> Expectation | None:
    """The expectation for a LoRA run's base; None for a full fine-tune (the checkpoint holds the
    whole model). ``models``: the fingerprint's ``[[models]]`` tables, reused when one names this
    model (so a local folder is not hashed twice); otherwise the artifact is probed here (a hub
    snapshot costs no read: its blob ids are content hashes)."""
    if config.method != "lora":
        return None
    spec = model_spec(config)
    if spec is None:
        return Expectation(REBUILT)
    for table in models or ():
        if isinstance(table, Mapping) and table.get("spec") == spec and table.get("content_hash"):
            return Expectation(FILES, spec, str(table["content_hash"]), _file_ids(table))
    from capture.probes import ProbeOptions
    from capture.probes.artifacts import probe_artifact

    info = probe_artifact(spec, "model", ProbeOptions(progress=False))
    table = info.to_manifest()
    return Expectation(FILES, spec, info.content_hash, _file_ids(table))


# --------------------------------------------------------------------------- in the fresh process


@dataclass
class Check:
    """The base as the fresh process found it."""

    kind: str
    digest: str = ""
    mismatched: tuple[str, ...] = ()
    """Files whose content differs from the record, or that are missing or new (files only)."""
    seconds: float = 0.0
    error: str | None = None

    def equal(self, expected: Expectation) -> bool:
        return self.error is None and not self.mismatched and self.digest == expected.digest

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "digest": self.digest, "mismatched": list(self.mismatched),
                "seconds": self.seconds, "error": self.error}


class FileCheck:
    """Hash a pretrained base's files in a background thread (started at once; :meth:`result` waits)."""

    def __init__(self, expected: Expectation) -> None:
        self.expected = expected
        self._result: Check | None = None
        self._thread = threading.Thread(target=self._run, name="capture-base-verify", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            self._result = self._verify()
        except Exception as exc:  # a folder gone, a cache pruned: the row says why
            self._result = Check(FILES, error=f"{type(exc).__name__}: {exc}".splitlines()[0])
        self._result.seconds = time.perf_counter() - t0

    def _verify(self) -> Check:
        from capture.probes import ProbeOptions
        from capture.probes.artifacts import probe_artifact

        # verify_artifacts: every hub blob is re-read and checked against its id; a local folder
        # is always read and hashed. Both lists are then held against what the parent recorded.
        info = probe_artifact(str(self.expected.spec), "model", ProbeOptions(verify_artifacts=True, progress=False))
        got = dict(_file_ids(info.to_manifest()))
        want = dict(self.expected.files)
        bad = {p for p in want.keys() | got.keys() if want.get(p) != got.get(p)}
        bad |= set(info.mismatches) | set(info.missing_files)
        digest = info.content_hash if not (info.mismatches or info.missing_files) else ""
        return Check(FILES, digest, tuple(sorted(bad)))

    def result(self) -> Check:
        self._thread.join()
        assert self._result is not None
        return self._result


def rebuilt_digest(model: Any) -> str:
    """sha256 of a LoRA model's frozen base state (capture.trial.state.base_state)."""
    from capture.trial import state

    return state.digest(state.base_state(model) or {})


class RebuiltCheck:
    """Hash a rebuilt base in a background thread: the base is frozen, so reading it while the
    process trains or waits is safe."""

    def __init__(self, model: Any) -> None:
        self._out: Check | None = None
        self._thread = threading.Thread(target=self._run, args=(model,), name="capture-base-hash", daemon=True)
        self._thread.start()

    def _run(self, model: Any) -> None:
        t0 = time.perf_counter()
        try:
            self._out = Check(REBUILT, rebuilt_digest(model))
        except Exception as exc:
            self._out = Check(REBUILT, error=f"{type(exc).__name__}: {exc}".splitlines()[0])
        self._out.seconds = time.perf_counter() - t0

    def result(self) -> Check:
        self._thread.join()
        assert self._out is not None
        return self._out


def row(expected: Expectation, check: Check | None) -> dict[str, Any]:
    """The ``base_model`` row of the restored-state table."""
    equal = check is not None and check.equal(expected)
    out: dict[str, Any] = {"component": "base_model", "equal": equal, "saved_sha256": expected.digest,
                           "restored_sha256": check.digest if check is not None else ""}
    if check is None:
        out["note"] = "not verified"
    elif check.error:
        out["note"] = f"could not be verified: {check.error}"
    elif check.mismatched:
        more = f" (and {len(check.mismatched) - 1} more)" if len(check.mismatched) > 1 else ""
        out["note"] = f"{expected.kind}: {check.mismatched[0]} differs from the record{more}"
    else:
        out["note"] = f"verified, not in the checkpoint: {expected.kind}"
    return out


def table(expected: Expectation, check: Check | None) -> dict[str, Any]:
    """``[trial.recovery.base_model]``: how the base was verified, and what was found."""
    out: dict[str, Any] = {"kind": expected.kind, "in_checkpoint": False,
                           "expected_sha256": expected.digest,
                           "equal": check is not None and check.equal(expected)}
    if expected.spec:
        out["spec"] = expected.spec
        out["files"] = len(expected.files)
    if check is not None:
        out["found_sha256"] = check.digest
        out["verify_s"] = check.seconds
        if check.mismatched:
            out["mismatched_files"] = list(check.mismatched)
        if check.error:
            out["error"] = check.error
    out["basis"] = ("every file re-read in the fresh process and checked against the fingerprint's record "
                    "(hub blob ids are content hashes; a local folder's sha256 per file)" if expected.kind == FILES else
                    "sha256 of the frozen base's state (every state_dict entry that is not trained), taken after the "
                    "build in the process that saved the checkpoint and in the fresh process")
    return out

"""Opening every manifest of a decision, and what each one says about the run it defines.

Every file goes through the one door (:func:`capture.verify.open.open_manifest`, trust not
required): a malformed file is listed with its reason, an unsigned, tampered or untrusted one is
kept and shown as such, but never ranked as trusted (:mod:`capture.decide.rank`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from capture.errors import EXIT_MALFORMED, EXIT_USAGE, CaptureError, UsageError
import capture.verify.walk as walk
from capture.manifest import dig, table_at
from capture.results.summary import ExecRecord, content_id, exec_record
from capture.verify.open import OpenedManifest, open_manifest

SKIP_DIRS = {".git", ".capture", "site", "node_modules", "__pycache__"}


NOT_SETTINGS = frozenset({
    "device", "device_name",  # the configuration's card, not the run
    "name", "seed",  # a label; the seed changes neither memory nor speed
    "measured_steps", "warmup_steps", "scheduler.horizon_steps",  # the trial's length, not the run's
    "params_source",  # how a figure was counted
    # where files were on the machine that ran it: their content (config_file_sha256, data.files) is the identity
    "model.config_file", "model.path", "model.tokenizer_dir", "data.path", "data.measured_on",
    "lora.target_modules_requested",  # how the config said it; lora.target_modules is what peft resolved
})
"""Keys of ``[trial.run]`` that describe the trial rather than the run it measures; so do keys ending
in ``_note`` (prose) and ``_version`` (a library's version: stack drift, shown as such). Every other
key, at any depth (new settings included, as the trial records them), is part of the run definition."""


def _settings(table: Mapping[str, Any], prefix: str = "") -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for k in sorted(table):
        key = f"{prefix}{k}"
        v = table[k]
        if key in NOT_SETTINGS or k.endswith(("_note", "_version")):
            continue
        if isinstance(v, Mapping):
            out += _settings(v, key + ".")
        else:
            out.append((key, json.dumps(v, sort_keys=True, default=str)))
    return out


@dataclass(frozen=True)
class RunDefinition:
    """What must be equal for two runs to be ranked against each other (guide point 1): every
    setting the trial recorded in ``[trial.run]`` (less :data:`NOT_SETTINGS`), read generically, so
    a setting a newer trial records splits groups without a change here."""

    model: str
    method: str
    precision: str
    seq_len: str
    global_batch_tokens: str
    settings: tuple[tuple[str, str], ...] = ()
    """``(dotted key under trial.run, JSON value)`` for every setting, sorted: the grouping key."""

    HEADLINE = ("model", "method", "precision", "seq_len", "global_batch_tokens")
    LABELS = {"model": "model and revision", "method": "method", "precision": "precision",
              "seq_len": "sequence length", "global_batch_tokens": "global batch (tokens per optimizer step)"}
    COVERED = ("model", "params_", "trainable_share", "method", "precision.dtype", "precision.autocast",
               "max_seq_len", "tokens_per_step")
    """Settings the headline fields already name (not repeated in :meth:`differences`)."""

    def label(self) -> str:
        """The group's heading: the headline fields and the settings that make a run fit, so that
        two groups of one model, method and batch (QLoRA and LoRA, checkpointing on and off) read
        apart: ``llama (...) · lora r16 · nf4 · checkpointing · sdpa · bf16 · seq 2048 · 8192 tokens/step``."""
        return " · ".join([self.model, self.method + self._rank(), *self.fit_words(), self.precision,
                           f"seq {self.seq_len}", f"{self.global_batch_tokens} tokens/step"])

    def _rank(self) -> str:
        rank = dict(self.settings).get("lora.rank")
        return f" r{json.loads(rank)}" if rank is not None and self.method == "lora" else ""

    def fit_words(self) -> list[str]:
        """The recorded settings that decide which card a run fits, as words: quantization,
        checkpointing, the attention kernel, compile, a chunked loss, an optimizer other than AdamW."""
        s = {k: json.loads(v) for k, v in self.settings}
        words = [str(s["training.quantization.method"]) if s.get("training.quantization.method") not in (None, "none") else "",
                 "checkpointing" if s.get("training.gradient_checkpointing.enabled") is True else "",
                 str(s.get("model.attn_implementation") or ""),
                 "compiled" if s.get("training.compile.enabled") is True else "",
                 f"{s['training.loss.name']} loss" if s.get("training.loss.name") not in (None, "standard") else "",
                 str(s["optimizer.name"]) if s.get("optimizer.name") not in (None, "adamw") else ""]
        return [w for w in words if w]

    def differences(self, other: RunDefinition) -> list[str]:
        out = [f"{self.LABELS[f]}: {getattr(self, f)} vs {getattr(other, f)}"
               for f in self.HEADLINE if getattr(self, f) != getattr(other, f)]
        mine, theirs = dict(self.settings), dict(other.settings)
        for k in sorted(set(mine) | set(theirs)):
            if mine.get(k) != theirs.get(k) and not k.startswith(self.COVERED):
                out.append(f"{k}: {mine.get(k, '(absent)')} vs {theirs.get(k, '(absent)')}")
        return out

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {f: getattr(self, f) for f in self.HEADLINE}
        out["settings"] = {k: json.loads(v) for k, v in self.settings}
        return out


@dataclass(frozen=True)
class FileStatus:
    """One file of the decision and what became of it."""

    path: str
    state: str
    """The shared vocabulary: ok, unsigned, invalid, untrusted, malformed, error."""
    principal: str | None
    reason: str | None
    kind: str | None
    content_id: str | None
    note: str | None = None
    """Why it is not in a ranking, when it is not (a fingerprint, no measured steps, ...)."""

    @property
    def trusted(self) -> bool:
        return self.state == "ok"

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass(frozen=True)
class Run:
    """A trial manifest, opened."""

    path: str
    opened: OpenedManifest
    file: FileStatus
    definition: RunDefinition

    @property
    def data(self) -> dict[str, Any]:
        return self.opened.data

    @property
    def trusted(self) -> bool:
        return self.file.trusted

    @property
    def created_utc(self) -> str:
        return str(self.data.get("created_utc", ""))

    @property
    def slug(self) -> str:
        return self.file.content_id or Path(self.path).stem

    @property
    def command(self) -> ExecRecord | None:
        """What `capture exec` ran, for a run recorded around a command."""
        return exec_record(self.data)


def _text(v: Any, default: str = "?") -> str:
    return default if v is None or v == "" else str(v)


def model_identity(data: Mapping[str, Any]) -> str:
    """``repo@commit[:12]``, a local path, or for a model built from a config its architecture and
    counted parameters (the config is its revision)."""
    model = table_at(data, "trial.run.model")
    rev = model.get("commit") or model.get("revision")
    rev = str(rev)[:12] if rev else None
    name = model.get("repo_id") or model.get("path")
    if name:
        return f"{name}@{rev}" if rev else str(name)
    params = dig(data, "trial.run.params_total")
    trainable = dig(data, "trial.run.params_trainable")
    if dig(data, "trial.run.method") == "lora" and isinstance(params, int) and isinstance(trainable, int):
        params -= trainable  # the base model's parameters: a LoRA adapter adds its own
    kind = model.get("architecture") or model.get("model_type") or model.get("class") or "model"
    src = model.get("source") or "unknown source"
    return f"{kind} ({src}, {params:,} params)" if isinstance(params, int) else f"{kind} ({src})"


def run_definition(data: Mapping[str, Any]) -> RunDefinition:
    run = table_at(data, "trial.run")
    prec = table_at(run, "precision")
    precision = _text(prec.get("dtype")) + (" autocast" if prec.get("autocast") else "")
    batch = run.get("tokens_per_step")
    if batch is None and isinstance(run.get("max_seq_len"), int) and isinstance(run.get("micro_batch_size"), int):
        batch = run["max_seq_len"] * run["micro_batch_size"] * int(run.get("grad_accum") or 1)
    return RunDefinition(model_identity(data), _text(run.get("method")), precision, _text(run.get("max_seq_len")),
                         _text(batch), tuple(_settings(run)))


def expand(inputs: Iterable[str]) -> list[Path]:
    """Folders (every ``*.toml`` below, hidden and site folders skipped), globs and files: the one
    bounded expansion (:func:`capture.verify.walk.expand`); each file once, even through links."""
    inputs = list(inputs)
    out = walk.expand(inputs, skip_dirs=SKIP_DIRS, missing_ok=False, glob_suffix=".toml")
    seen: set[str] = set()
    unique = []
    for p in out:
        real = os.path.realpath(p)  # never raises, even for a link loop (the door then refuses it)
        if real not in seen:
            seen.add(real)
            unique.append(Path(p))
    if not unique:
        raise UsageError(f"no manifests (*.toml) in {', '.join(inputs)}", "name a results folder or manifest files")
    return unique


def open_all(paths: Iterable[Path], trust: Any = None) -> tuple[list[Run], list[FileStatus]]:
    """Every trial as a :class:`Run`, and the status of every file (trials included)."""
    runs: list[Run] = []
    files: list[FileStatus] = []
    for p in paths:
        path = str(p)
        try:
            opened = open_manifest(path, trust=trust, require_trusted=False)
        except CaptureError as exc:
            if exc.exit_code == EXIT_USAGE:  # a bad trust file is the command's problem, not the manifest's
                raise
            state = "malformed" if exc.exit_code == EXIT_MALFORMED else "error"
            files.append(FileStatus(path, state, None, exc.message.removeprefix(f"{path}: "), None, None,
                                    "cannot be read: not ranked"))
            continue
        sig = opened.signature
        kind = opened.data.get("kind")
        command = exec_record(opened.data)
        note = None if kind == "trial" else f"a {kind or 'manifest without a kind'}: no trial to rank"
        if command is not None:
            note = (f"capture exec: {command.line()}; outputs: {command.outputs_text(8)}"
                    + ("" if kind == "trial" else "; no trial to rank"))
        status = FileStatus(path, sig.state, sig.principal, sig.reason, kind if isinstance(kind, str) else None,
                            content_id(opened.raw), note)
        files.append(status)
        if kind == "trial":
            runs.append(Run(path, opened, status, run_definition(opened.data)))
    return runs, files

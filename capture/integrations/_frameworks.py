"""What the framework callbacks share: their options and recorder, where the manifest goes when
training ends, and reading a model's and a data set's identity."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from capture.recorder import Recorder


class RecordingCallback:
    """The options and end of both framework callbacks (mixed in before the framework's own base).

    ``output``: the manifest path (default ``<run folder>/capture.toml``; under ``capture exec``
    with no ``output``, only exec's manifest gets the figures). ``tokens_per_step``: global tokens
    per optimizer step where the framework does not count them. ``dataset_revision``: the data
    set's ``repo@revision``. ``key``/``principal``: the signing key; ``report``: write the HTML
    report beside the manifest; ``trackers``: see :mod:`capture.integrations.trackers`.
    """

    def __init__(self, output: str | os.PathLike[str] | None = None, *, warmup_steps: int = 1,
                 tokens_per_step: int | None = None, dataset_revision: str | None = None,
                 key: str | os.PathLike[str] | None = None, principal: str | None = None, report: bool = True,
                 trackers: Sequence[Any] = ()) -> None:
        super().__init__()
        self.output = output
        self.warmup_steps = warmup_steps
        self.tokens_per_step = tokens_per_step
        self.dataset_revision = dataset_revision
        self.key, self.principal, self.report, self.trackers = key, principal, report, tuple(trackers)
        self.recorder: Recorder | None = None
        self.manifest_path: Path | None = None
        self._world = 1
        self._reset()

    def _reset(self) -> None:
        """Set the framework's own per-run counters (a subclass's; none here)."""

    def _active(self) -> Recorder | None:
        return self.recorder if self.recorder is not None and self.recorder.recording else None

    def _finish(self, rec: Recorder, run_dir: str | os.PathLike[str]) -> None:
        """Stop recording and write (on rank 0) the signed manifest: to ``output``, else to
        ``run_dir/capture.toml`` unless ``capture exec`` is recording the process."""
        rec.stop()
        from capture.integrations import exec_side

        output = self.output
        if output is None and not exec_side.active():
            output = Path(run_dir) / "capture.toml"
        if output is not None:
            Path(output).parent.mkdir(parents=True, exist_ok=True)
        self.manifest_path = rec.write_manifest(output, self.key, self.principal, report=self.report,
                                                trackers=self.trackers)


def model_fields(model: Any) -> dict[str, Any]:
    """``[trial.run.model]`` from a Hugging Face model (or a module that holds one): class, the
    hub id or local path it was loaded from, and the commit (``config._commit_hash``)."""
    if model is None:
        return {}
    inner = model
    for attr in ("module", "model", "_orig_mod"):  # DDP wrapper, Lightning module, torch.compile
        if getattr(inner, "config", None) is None and getattr(inner, attr, None) is not None:
            inner = getattr(inner, attr)
    out: dict[str, Any] = {"class": type(inner).__name__}
    config = getattr(inner, "config", None)
    if config is not None:
        name = getattr(config, "name_or_path", None) or getattr(config, "_name_or_path", None)
        if name:
            out["path" if os.path.isdir(str(name)) else "repo_id"] = str(name)
        commit = getattr(config, "_commit_hash", None)
        if commit:
            out["commit"] = str(commit)
        arch = getattr(config, "model_type", None)
        if arch:
            out["architecture"] = str(arch)
    return out


def dataset_fields(dataset: Any, revision: str | None = None) -> dict[str, Any]:
    """``[trial.run.data]``: what the data set object says about itself (a ``datasets.Dataset``
    carries its builder name, config, version and content fingerprint), plus ``revision`` when given."""
    out: dict[str, Any] = {}
    if revision:
        out["revision"] = revision
    if dataset is None:
        return out
    out["class"] = type(dataset).__name__
    try:
        out["rows"] = len(dataset)
    except TypeError:
        pass
    info = getattr(dataset, "info", None)
    for key, attr in (("name", "dataset_name"), ("config", "config_name"), ("version", "version")):
        value = getattr(info, attr, None) if info is not None else None
        if value:
            out[key] = str(value)
    fingerprint = getattr(dataset, "_fingerprint", None)
    if isinstance(fingerprint, str):
        out["fingerprint"] = fingerprint
    return out


def count_tokens(batch: Any) -> int | None:
    """Tokens in a batch: ``input_ids`` of a mapping, else the first tensor's elements."""
    if isinstance(batch, dict):
        ids: Any = batch.get("input_ids")
        return int(ids.numel()) if ids is not None and hasattr(ids, "numel") else None
    if hasattr(batch, "numel") and getattr(batch, "dtype", None) is not None and not batch.dtype.is_floating_point:
        return int(batch.numel())
    if isinstance(batch, (list, tuple)) and batch:
        return count_tokens(batch[0])
    return None


def framework_version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None

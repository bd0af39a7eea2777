"""Data order across resumes: the batches each step consumed, and an epoch boundary where resumes break.

A resumed run can restore every tensor and still train on other data: a loader whose position
forgets the epoch, an epoch shortened after a resume (datasets#7447), a shuffle whose RNG replays
(transformers#17032). Equal losses do not show it early enough, and equal state_dicts not at all.
So the recovery check hashes what every step *consumed* and compares it with the uninterrupted
run:

- :class:`BatchLog` sits between the loader and ``Workload.train_step(batch_iter)``; each
  micro-batch the step pulls is hashed (:func:`batch_hash`: sha256 of its input ids) before the
  step uses it. The loader itself is untouched: its position advances as in training.
- :func:`arrange_epoch_boundary` starts the uninterrupted run near the end of an epoch, so that
  the loader wraps into the next epoch in the step after the first save: the first resume then
  crosses the boundary and the second resume starts in the new epoch, where positions that lose
  the epoch go wrong. It uses the loader's documented position only (``state_dict()`` with
  ``epoch`` and ``index``, ``len(loader.source)`` items per epoch).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from typing import Any

HASH_BASIS = ("sha256 of each micro-batch's input ids (dtype, shape, then their bytes row-major: "
              "capture.trial.build.data.Batch.token_hash), in the order the step consumed them")


def batch_hash(batch: Any) -> str:
    """sha256 of a micro-batch's input ids: a :class:`~capture.trial.build.data.Batch`'s
    ``token_hash``, the same digest for a tensor of ids or a mapping with ``input_ids``."""
    if hasattr(batch, "token_hash"):
        return "sha256:" + batch.token_hash()
    import torch

    ids = batch.get("input_ids") if isinstance(batch, Mapping) else batch
    if isinstance(ids, torch.Tensor):
        t = ids.detach().to("cpu").contiguous()
        return "sha256:" + hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode() + t.numpy().tobytes()).hexdigest()
    from capture.trial.state import value_hash

    return value_hash(ids)


class BatchLog:
    """An iterator over ``loader`` that hashes every micro-batch it hands out; :meth:`take` returns
    (and forgets) the hashes since the last call: one step's micro-batches."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self._hashes: list[str] = []

    def __iter__(self) -> BatchLog:
        return self

    def __next__(self) -> Any:
        batch = next(self.loader)
        self._hashes.append(batch_hash(batch))
        return batch

    def take(self) -> list[str]:
        out, self._hashes = self._hashes, []
        return out


def items_per_step(config: Any) -> int:
    return int(config.batch.micro_batch_size) * int(config.batch.grad_accum)


def arrange_epoch_boundary(loader: Any, config: Any, save_at_step: int) -> dict[str, Any]:
    """Place the loader so that its epoch ends inside step ``save_at_step + 1`` (mid-step when a
    step takes more than one item). Returns what was arranged, for the manifest."""
    position = loader.state_dict()
    size = len(getattr(loader, "source", None) or ())
    if not size or not isinstance(position, Mapping) or "index" not in position:
        return {"arranged": False, "note": "the loader exposes no (epoch, index) position: the resumes start "
                                           "where the uninterrupted run's data set starts"}
    per_step = items_per_step(config)
    before_wrap = save_at_step * per_step + math.ceil(per_step / 2)
    index = (size - before_wrap % size) % size
    loader.load_state_dict({**position, "epoch": 0, "index": index})
    return {"arranged": True, "items_per_epoch": size, "items_per_step": per_step, "start_index": index,
            "wraps_in_step": save_at_step + 1,
            "basis": f"the uninterrupted run starts at item {index} of epoch 0, so the loader wraps into epoch 1 "
                     f"in step {save_at_step + 1}, after the first save and before the second"}


def first_difference(reference: Sequence[Sequence[str]], resumed: Sequence[Sequence[str]],
                     first_step: int) -> int | None:
    """The 1-based global step whose batches first differ (None when all equal; a run that is
    shorter than the reference differs at its first missing step)."""
    for i, ref in enumerate(reference):
        if i >= len(resumed) or list(resumed[i]) != list(ref):
            return first_step + i
    return None


def table(reference: Sequence[Sequence[str]], first: Sequence[Sequence[str]] | None, k: int,
          second: Sequence[Sequence[str]] | None = None, k2: int | None = None,
          boundary: Mapping[str, Any] | None = None, positions: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``[trial.recovery.data_order]``: the batches of each resume against the uninterrupted run."""
    out: dict[str, Any] = {"hash": HASH_BASIS, "batch_sha256_uninterrupted": [list(s) for s in reference]}
    differs: list[tuple[int, str]] = []
    if first is not None:
        out["batch_sha256_resumed"] = [list(s) for s in first]
        step = first_difference(reference[k:], first, k + 1)
        if step is not None:
            differs.append((step, f"first resume (from step {k})"))
    if second is not None and k2 is not None:
        out["batch_sha256_resumed_again"] = [list(s) for s in second]
        step = first_difference(reference[k2:], second, k2 + 1)
        if step is not None:
            differs.append((step, f"second resume (from step {k2})"))
    if boundary:
        out["epoch_boundary"] = dict(boundary)
    if positions:
        out["positions"] = dict(positions)
    out["equal"] = not differs
    if differs:
        step, where = differs[0]
        out["first_differing_step"] = step
        out["differs_in"] = where
        out["verdict"] = f"the {where} consumed other batches than the uninterrupted run from step {step}"
    else:
        resumes = "both resumes" if second is not None else "the resume"
        across = " and across the epoch boundary" if boundary and boundary.get("arranged") else ""
        out["verdict"] = f"{resumes} consumed the uninterrupted run's batches, step for step{across}"
    return out

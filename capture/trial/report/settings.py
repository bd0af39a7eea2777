"""The user's run settings as a person reads them: one row each, in the report's Run section.

What the trial recorded as in effect, read back from the running objects (``trial.run.training``
and the model's ``attn_implementation``): the attention kernel, gradient checkpointing,
quantization, torch.compile and the loss. Each row says what ran, not what was asked for, and
where the two differ (compile asked for but not applied, liger-kernel asked for but unavailable)
it says both.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from capture.trial.report.values import _is_num

TRAINING_KEYS = ("gradient_checkpointing", "quantization", "compile", "loss")
"""The keys of ``trial.run.training`` these rows show (the rest falls to the generic rows)."""


def _mapping(v: Any) -> Mapping[str, Any]:
    return v if isinstance(v, Mapping) else {}


def attention(model: Any) -> str | None:
    impl = _mapping(model).get("attn_implementation")
    return str(impl) if impl else None


def checkpointing(gc: Mapping[str, Any]) -> str | None:
    if not gc:
        return None
    done, layers = gc.get("layers_checkpointed"), gc.get("layers")
    counted = f"{done:,} of {layers:,} decoder layers" if _is_num(done) and _is_num(layers) else ""
    if not gc.get("enabled"):
        return "off" + (f" ({counted})" if counted and done else "")
    reentrant = gc.get("use_reentrant")
    how = None if reentrant is None else "reentrant" if reentrant else "non-reentrant"
    return "on" + (f": {counted}" if counted else "") + (f", {how}" if how else "")


def quantization(q: Mapping[str, Any]) -> str | None:
    if not q:
        return None
    method = str(q.get("method") or "none")
    if method == "none":
        return "none"
    lib = " ".join(str(x) for x in (q.get("library"), q.get("library_version")) if x)
    parts = [f"{q['layers']:,} layers" if _is_num(q.get("layers")) else ""]
    if q.get("compute_dtype"):
        parts.append(f"compute {q['compute_dtype']}")
    if q.get("double_quant") is not None:
        parts.append("double quant" if q["double_quant"] else "no double quant")
    if _is_num(q.get("blocksize")):
        parts.append(f"block {q['blocksize']}")
    details = ", ".join(p for p in parts if p)
    return method + (f" ({lib})" if lib else "") + (f": {details}" if details else "")


def compile_text(c: Mapping[str, Any]) -> str | None:
    if not c:
        return None
    if c.get("enabled"):
        return "on" + (f" ({c['target']})" if c.get("target") else "")
    return "asked for, not applied" if c.get("requested") else "off"


def loss(info: Mapping[str, Any]) -> str | None:
    if not info:
        return None
    text = str(info.get("name") or "?")
    if info.get("implementation"):
        text += f": {info['implementation']}"
    if _is_num(info.get("chunk_tokens")):
        text += f"; {info['chunk_tokens']:,}-token chunks"
    if info.get("liger_unavailable"):
        text += f" (liger-kernel not used: {info['liger_unavailable']})"
    return text


def training_rows(run: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(label, text) for each setting the run recorded, in the order a fine-tune is made to fit."""
    t = _mapping(run.get("training"))
    rows = (("attention", attention(run.get("model"))),
            ("checkpointing", checkpointing(_mapping(t.get("gradient_checkpointing")))),
            ("quantization", quantization(_mapping(t.get("quantization")))),
            ("compile", compile_text(_mapping(t.get("compile")))),
            ("loss", loss(_mapping(t.get("loss")))))
    return [(label, text) for label, text in rows if text]

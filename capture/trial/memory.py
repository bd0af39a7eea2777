"""The memory budget, estimated before the first step and compared with the measurement after.

Parameters x bytes per weight is only a lower bound. The estimate adds, term by term and each
with the inputs that produced it: gradients, optimizer state, the autocast weight copies,
the activations the backward pass keeps, the output-logit tensors of the loss, and the framework
overhead measured before the model was built (the CUDA context on a GPU, the Python process on a
CPU). After the run the measured figures stand beside it with the relative error, so the next
estimate can be judged (shared/DESIGN.md decision 5: an estimate is always marked as one).

Activation bytes per token per layer, for a decoder block with fused attention (SDPA) that keeps
no attention matrix::

    attention: r*h (norm input) + a*h (norm output) + a*(h + 2*h_kv) (q, k, v) + a*h (attention out)
    MLP gated (SwiGLU):     r*h + a*h + 4*a*i      (gate, up, act(gate), act*up)
    MLP plain (GELU):       r*h + a*h + 2*a*i + g*a*i (fc out, act out; g = extra GELU temporaries)
    dropout:                1 byte per element per dropout site when p > 0

with ``a`` the activation bytes (2 under bf16/fp16 autocast, else the weight size), ``r`` the
residual-stream bytes (the weight dtype), ``h`` hidden, ``h_kv`` the key/value width, ``i`` the
MLP width. On a CPU the attention may take the math path, which keeps heads x s x s scores.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class Term:
    name: str
    bytes: int
    formula: str
    inputs: dict[str, Any] = field(default_factory=dict)

    def to_manifest(self) -> dict[str, Any]:
        return {"bytes": self.bytes, "formula": self.formula, "inputs": self.inputs}


@dataclass(frozen=True)
class MemoryEstimate:
    terms: tuple[Term, ...]
    note: str = "estimate, made before the first step; each term shows its inputs"

    @property
    def total_bytes(self) -> int:
        return sum(t.bytes for t in self.terms)

    @property
    def allocator_bytes(self) -> int:
        """The part the framework's allocator would see (everything but the framework overhead)."""
        return sum(t.bytes for t in self.terms if t.name != "framework_overhead")

    def term(self, name: str) -> Term | None:
        return next((t for t in self.terms if t.name == name), None)

    def to_manifest(self) -> dict[str, Any]:
        out: dict[str, Any] = {"total_bytes": self.total_bytes, "allocator_bytes": self.allocator_bytes, "note": self.note}
        for t in self.terms:
            out[t.name] = t.to_manifest()
        return out


@dataclass(frozen=True)
class Shape:
    """What the activation estimate needs from a model's config (read, not declared)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    gated_mlp: bool
    dropout_sites: int
    """Dropout layers per block with p > 0 (attention probabilities, residuals)."""
    extra_act_temporaries: int = 0


def shape_of(model: Any) -> Shape:
    """Read the transformer shape from a (possibly peft-wrapped) Hugging Face model."""
    cfg = model.config
    if hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()

    def first(*names: str, default: Any = None) -> Any:
        for n in names:
            v = getattr(cfg, n, None)
            if v is not None:
                return v
        return default

    hidden = int(first("hidden_size", "n_embd", "d_model"))
    layers = int(first("num_hidden_layers", "n_layer", "num_layers"))
    heads = int(first("num_attention_heads", "n_head", default=1))
    kv_heads = int(first("num_key_value_heads", default=heads))
    inter = int(first("intermediate_size", "n_inner", "ffn_dim", default=None) or 4 * hidden)
    names = [n for n, _ in model.named_modules()]
    gated = any(n.endswith(("gate_proj", "gate_up_proj", ".w1")) for n in names)
    act = str(first("hidden_act", "activation_function", default=""))
    dropouts = sum(1 for k in ("attention_dropout", "attn_pdrop", "resid_pdrop", "hidden_dropout") if (first(k, default=0.0) or 0.0) > 0)
    # GPT-2's tanh GELU is written out in Python: each elementwise op keeps its input for backward.
    extra = 3 if act in ("gelu_new", "gelu_pytorch_tanh") and not gated else 0
    return Shape(layers, hidden, inter, heads, kv_heads, int(cfg.vocab_size), gated, dropouts, extra)


def estimate(*, shape: Shape, params_total: int, params_trainable: int, weight_dtype: str, precision: str,
             autocast: bool, optimizer: str, momentum: float, micro_batch: int, seq_len: int,
             device_type: str, framework_overhead_bytes: int | None, framework_overhead_source: str) -> MemoryEstimate:
    """Every term of the budget, in bytes, with its inputs."""
    w = _BYTES[weight_dtype]
    mixed = autocast and precision != "fp32"
    a = _BYTES[precision] if mixed else w
    tokens = micro_batch * seq_len
    terms = [
        Term("weights", params_total * w, "params_total x bytes_per_weight",
             {"params_total": params_total, "bytes_per_weight": w, "weight_dtype": weight_dtype}),
        Term("gradients", params_trainable * w, "params_trainable x bytes_per_weight",
             {"params_trainable": params_trainable, "bytes_per_weight": w}),
    ]
    states = {"adamw": 2, "adam": 2, "sgd": 1 if momentum > 0 else 0}[optimizer]
    terms.append(Term("optimizer_state", params_trainable * w * states, "params_trainable x states x bytes_per_weight",
                      {"optimizer": optimizer, "states": states, "bytes_per_weight": w}))
    if mixed:
        terms.append(Term("autocast_weight_copies", params_total * a, "params_total x activation_bytes",
                          {"activation_bytes": a, "why": f"autocast caches {precision} copies of the weights for the step"}))
    s = shape
    h_kv = s.hidden * s.kv_heads // s.heads
    attn = w * s.hidden + a * s.hidden + a * (s.hidden + 2 * h_kv) + a * s.hidden
    mlp_width = 4 * s.intermediate if s.gated_mlp else (2 + s.extra_act_temporaries) * s.intermediate
    mlp = w * s.hidden + a * s.hidden + a * mlp_width
    drop = s.dropout_sites * s.hidden  # 1-byte masks
    per_token_layer = attn + mlp + drop
    inputs = {"layers": s.layers, "hidden": s.hidden, "kv_width": h_kv, "intermediate": s.intermediate,
              "gated_mlp": s.gated_mlp, "activation_bytes": a, "residual_bytes": w, "micro_batch": micro_batch,
              "seq_len": seq_len, "tokens": tokens, "bytes_per_token_per_layer": per_token_layer}
    terms.append(Term("activations", per_token_layer * tokens * s.layers,
                      "bytes_per_token_per_layer x tokens x layers (see capture.trial.memory)", inputs))
    if device_type == "cpu":
        scores = s.heads * seq_len * seq_len * micro_batch * s.layers * (w + (1 if s.dropout_sites else 0))
        terms.append(Term("attention_scores", scores, "heads x seq_len^2 x micro_batch x layers x bytes",
                          {"heads": s.heads, "why": "the CPU attention path may keep the score matrix"}))
    logit_bytes = (a + 12) if mixed else 12
    terms.append(Term("logits", tokens * s.vocab * logit_bytes, "tokens x vocab x bytes_per_logit",
                      {"vocab": s.vocab, "bytes_per_logit": logit_bytes,
                       "why": "logits, their fp32 copy for the loss, log-softmax and its gradient" if mixed
                       else "logits, log-softmax and its gradient"}))
    if framework_overhead_bytes is not None:
        terms.append(Term("framework_overhead", framework_overhead_bytes, "measured before the model was built",
                          {"source": framework_overhead_source}))
    return MemoryEstimate(tuple(terms))


def relative_error(estimate_bytes: int, measured_bytes: int | None) -> float | None:
    """(estimate - measured) / measured: negative means the estimate was too low."""
    if not measured_bytes:
        return None
    return (estimate_bytes - measured_bytes) / measured_bytes

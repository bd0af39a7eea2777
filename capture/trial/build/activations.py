"""What a decoder layer allocates in a training step, op by op, as transformers, peft and
bitsandbytes run it: the activation term of the memory estimate (beside :mod:`.model`).

One layer's forward and backward become allocation events (``capture.trial.memory.Trace``):
each tensor with its size, its tag (the estimate term it belongs to) and its lifetime. A tensor
autograd saves for backward lives until that layer's backward; a temporary dies at once. The
rules, read from the code (transformers 5, peft 0.21, bitsandbytes 0.50, torch 2.x) and checked
against the H200 (docs/measurements):

- RMSNorm (Llama family) upcasts its input to fp32 and saves that copy (4 bytes an element);
  its output is saved only when the norm's weight trains (full fine-tune). Gemma's variant
  multiplies in fp32, so that saved output is fp32 too.
- a linear layer saves its input only when its weight trains; a frozen base (LoRA) saves none,
  and bitsandbytes' 4-bit matmul saves none either (it dequantizes the weight again in backward).
  Under autocast every linear call casts its fp32 input to bf16 separately (the cast cache holds
  weights only), and the cast weight is saved for backward.
- peft keeps LoRA adapters in fp32 on a bf16 base (``autocast_adapter_dtype``): the adapter
  input is cast to fp32, dropout saves a 1-byte mask and its fp32 output.
- SDPA's flash and efficient kernels save q (after rotary), k, v, the output and the fp32
  log-sum-exp; GQA keys and values are repeated only when a padding mask is present. Eager
  attention saves the fp32 softmax and its bf16 copy: heads x seq² per sequence.
- gated MLPs save the gate output, the activation and the up output (and their product when the
  down projection trains); GPT-2's tanh GELU, written out in Python, saves three more.
- gradient checkpointing (non-reentrant) keeps only each layer's input and recomputes the layer
  in backward, one layer at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

NORM_KINDS = ("rms", "rms_fp32", "layernorm")


@dataclass(frozen=True)
class Linear:
    name: str
    role: str
    """attn_in | attn_out | mlp_in | mlp_out"""
    in_f: int
    out_f: int
    trainable: bool
    quantized: str | None = None
    lora_rank: int = 0
    lora_dropout: float = 0.0
    lora_bytes: int = 4

    @property
    def numel(self) -> int:
        return self.in_f * self.out_f


@dataclass(frozen=True)
class LayerShape:
    """One decoder layer, read from the built (meta) model."""

    hidden: int
    q_width: int
    kv_width: int
    heads: int
    kv_heads: int
    intermediate: int
    gated: bool
    linears: tuple[Linear, ...]
    norm_kind: str
    norms: int
    """RMSNorm/LayerNorm modules per layer (2 for Llama, 4 for Gemma 2)."""
    norm_trainable: bool
    act_extra: int = 0
    """Extra saved temporaries of an activation written out in Python (GPT-2's gelu_new: 3)."""
    dropout_sites: int = 0
    """Residual/attention dropouts with p > 0 (GPT-2)."""
    attn_dropout: bool = False
    softcap: bool = False
    """Attention logits soft-capped with tanh (Gemma 2) on the eager path."""
    layer_params: int = 0

    def by_role(self, role: str) -> list[Linear]:
        return [lin for lin in self.linears if lin.role == role]


@dataclass(frozen=True)
class Precision:
    r: int
    """bytes of the residual stream and unquantized weights (4 under autocast with fp32 weights)"""
    a: int
    """bytes of compute (2 under bf16/fp16 autocast, else r)"""
    mixed: bool
    compute_dtype: str


@dataclass
class LayerRun:
    """What one layer's forward left for its backward: ids to free, grads to make."""

    saved: list[int] = field(default_factory=list)
    casts: list[int] = field(default_factory=list)
    cast_of: dict[str, int] = field(default_factory=dict)
    """The autocast copy of each linear's weight, freed by that linear's backward."""
    mlp_start: int = 0
    """Index in ``saved`` where the MLP block's tensors begin (its backward runs first)."""


def _role(path: str, leaf: str) -> str | None:
    if leaf in ("q_proj", "k_proj", "v_proj", "qkv_proj", "c_attn", "query_key_value", "Wqkv", "wq", "wk", "wv"):
        return "attn_in"
    if leaf in ("o_proj", "dense", "out_proj", "wo") or (leaf == "c_proj" and ".attn" in path):
        return "attn_out"
    if leaf in ("gate_proj", "up_proj", "gate_up_proj", "c_fc", "fc1", "w1", "w3", "dense_h_to_4h"):
        return "mlp_in"
    if leaf in ("down_proj", "fc2", "w2", "dense_4h_to_h") or (leaf == "c_proj" and ".mlp" in path):
        return "mlp_out"
    return None


def _features(mod: Any) -> tuple[int, int]:
    if hasattr(mod, "in_features"):
        return int(mod.in_features), int(mod.out_features)
    w = mod.weight  # transformers' Conv1D stores (in, out)
    return int(w.shape[0]), int(w.shape[1])


def layer_shape(model: Any, quantized: str | None) -> LayerShape:
    """The first decoder layer of ``model`` (peft-wrapped or not), as the estimate needs it."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    cfg = base.config.get_text_config()
    names = set(getattr(base, "_no_split_modules", None) or ())
    layer = next((m for m in base.modules() if type(m).__name__ in names), None)
    if layer is None:
        lists = [m for m in base.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
        layer = lists[0][0]
    linears: list[Linear] = []
    norms = 0
    norm_kind = "rms"
    norm_trainable = False
    for path, mod in layer.named_modules():
        leaf = path.rsplit(".", 1)[-1]
        tname = type(mod).__name__
        if "Norm" in tname and hasattr(mod, "weight"):
            norms += 1
            norm_kind = "layernorm" if tname == "LayerNorm" or isinstance(mod, torch.nn.LayerNorm) else (
                "rms_fp32" if "Gemma" in tname else "rms")
            norm_trainable = bool(mod.weight.requires_grad)
            continue
        role = _role("." + path, leaf)
        if role is None or not (hasattr(mod, "weight") or hasattr(mod, "base_layer")):
            continue
        if hasattr(mod, "base_layer"):  # a peft LoRA wrapper
            base_layer = mod.base_layer
            rank = int(next(iter(mod.r.values()))) if getattr(mod, "r", None) else 0
            drop = mod.lora_dropout[next(iter(mod.lora_dropout))] if getattr(mod, "lora_dropout", None) else None
            p = float(getattr(drop, "p", 0.0) or 0.0)
            a_w = mod.lora_A[next(iter(mod.lora_A))].weight
            in_f, out_f = _features(base_layer)
            linears.append(Linear(path, role, in_f, out_f, bool(base_layer.weight.requires_grad), quantized, rank, p,
                                  a_w.element_size()))
        elif path and "lora_" not in path and "base_layer" not in path:
            in_f, out_f = _features(mod)
            linears.append(Linear(path, role, in_f, out_f, bool(mod.weight.requires_grad), quantized))
    hidden = int(cfg.hidden_size)
    heads = int(getattr(cfg, "num_attention_heads", 1))
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or hidden // heads)
    attn_in = [lin for lin in linears if lin.role == "attn_in"]
    total_qkv = sum(lin.out_f for lin in attn_in) or (heads + 2 * kv_heads) * head_dim
    q_w = heads * head_dim
    kv_w = (total_qkv - q_w) // 2
    mlp_in = [lin for lin in linears if lin.role == "mlp_in"]
    gated = len(mlp_in) >= 2 or any(lin.name.endswith("gate_up_proj") for lin in mlp_in)
    inter = int(getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None) or 4 * hidden)
    act = str(getattr(cfg, "hidden_act", None) or getattr(cfg, "activation_function", "") or "")
    drops = sum(1 for k in ("resid_pdrop",) if (getattr(cfg, k, 0.0) or 0.0) > 0) * 2
    attn_drop = (getattr(cfg, "attn_pdrop", 0.0) or getattr(cfg, "attention_dropout", 0.0) or 0.0) > 0
    return LayerShape(hidden=hidden, q_width=q_w, kv_width=kv_w, heads=heads, kv_heads=kv_heads, intermediate=inter,
                      gated=gated, linears=tuple(linears), norm_kind=norm_kind, norms=norms or 2,
                      norm_trainable=norm_trainable, act_extra=3 if act == "gelu_new" and not gated else 0,
                      dropout_sites=drops, attn_dropout=bool(attn_drop),
                      softcap=bool(getattr(cfg, "attn_logit_softcapping", None)),
                      layer_params=sum(p.numel() for p in layer.parameters()))


# --------------------------------------------------------------------------- events


class LayerModel:
    """Emits one layer's forward and backward events into a :class:`capture.trial.memory.Trace`."""

    def __init__(self, shape: LayerShape, prec: Precision, tokens: int, batch: int, seq: int, attn: str,
                 masked: bool, device: str) -> None:
        self.s, self.p, self.T, self.B, self.S = shape, prec, tokens, batch, seq
        self.attn, self.masked, self.device = attn, masked, device

    def _mask_bytes(self, x_bytes: int) -> int:
        """A dropout mask: a bool tensor from CUDA's fused kernel, the input's dtype on a CPU."""
        return 1 if self.device == "cuda" else x_bytes

    # ---- pieces

    def _norm(self, tr: Any, run: LayerRun, x_bytes: int, x_id: int = -1) -> None:
        """RMSNorm/LayerNorm on ``x_id`` (``x_bytes`` an element): what it saves, its temporaries.
        An fp32 input is saved as it is (the upcast is a no-op), else its fp32 copy."""
        s, p, T, h = self.s, self.p, self.T, self.s.hidden
        if s.norm_kind == "layernorm":  # native layer_norm saves its input, mean and rstd
            tr.keep(run.saved, tr.alloc(T * 8, "activations"))
            if x_id > 0:
                tr.keep(run.saved, x_id)
            else:
                tr.keep(run.saved, tr.alloc(x_bytes * h * T, "activations"))
            return
        if x_bytes == 4 and x_id > 0:
            tr.keep(run.saved, x_id)
            up = -1
        else:
            up = tr.alloc(4 * h * T, "activations")  # x.float(), saved by pow and mul
        sq = tr.alloc(4 * h * T, "transient")
        tr.free(sq)
        tr.keep(run.saved, tr.alloc(4 * T, "activations"))  # rsqrt
        n32 = tr.alloc(4 * h * T, "transient")
        if s.norm_trainable:
            if s.norm_kind == "rms_fp32" or p.r == 4:
                tr.keep(run.saved, n32)
            else:
                tr.free(n32)
                tr.keep(run.saved, tr.alloc(p.r * h * T, "activations"))
        else:
            tr.free(n32)
        if up > 0:
            tr.keep(run.saved, up)

    def _linear(self, tr: Any, run: LayerRun, lin: Linear, x_id: int, x_bytes: int, x_saved: list[bool],
                lora_cache: dict[str, int]) -> int:
        """One projection (base, and LoRA when adapted); returns the output id (compute dtype)."""
        p, T = self.p, self.T
        a = p.a
        if p.mixed and lin.quantized is None:
            w = tr.alloc(lin.numel * 2, "autocast_weight_copies")
            run.casts.append(w)
            run.cast_of[lin.name] = w
            if x_bytes != 2:
                xc = tr.alloc(2 * lin.in_f * T, "activations" if lin.trainable else "transient")
                if lin.trainable:
                    tr.keep(run.saved, xc)
                else:
                    tr.free(xc)
            elif lin.trainable:
                x_saved[0] = True
        elif lin.trainable:
            x_saved[0] = True
        deq = tr.alloc(lin.numel * 2, "transient") if lin.quantized else -1
        out = tr.alloc(a * lin.out_f * T, "transient")
        tr.free(deq)
        if not lin.lora_rank:
            return out
        lb = lin.lora_bytes
        key = f"{lin.role}:{lin.in_f}"
        xl = -1
        if x_bytes != lb and not (p.mixed and lin.quantized):
            xl = tr.alloc(lb * lin.in_f * T, "transient")
        dt = lb if xl > 0 or x_bytes == lb else x_bytes
        if lin.lora_dropout > 0:
            tr.keep(run.saved, tr.alloc(self._mask_bytes(dt) * lin.in_f * T, "activations"))
            xd = tr.alloc(dt * lin.in_f * T, "activations")
            tr.free(xl)
        else:
            xd = xl
            if xd < 0:
                x_saved[0] = True
        if p.mixed:  # lora_A's matmul under autocast casts its input again, and saves the cast
            xc = tr.alloc(2 * lin.in_f * T, "activations")
            tr.keep(run.saved, xc)
            if xd > 0:
                tr.free(xd)
        elif xd > 0:
            tr.keep(run.saved, xd)
        lora_cache[key] = 1
        ab = 2 if p.mixed else lb
        tr.keep(run.saved, tr.alloc(ab * lin.lora_rank * T, "activations"))  # lora_A out, saved by lora_B
        bo = tr.alloc(ab * lin.out_f * T, "transient")
        sc = tr.alloc(ab * lin.out_f * T, "transient")
        tr.free(bo)
        if lin.quantized:  # peft's bnb path: clone, cast back, add
            cl = tr.alloc(a * lin.out_f * T, "transient")
            tr.free(out)
            cb = tr.alloc(a * lin.out_f * T, "transient")
            tr.free(sc)
            res = tr.alloc(a * lin.out_f * T, "transient")
            tr.free(cl, cb)
            return res
        summed = tr.alloc(max(a, ab) * lin.out_f * T, "transient")
        tr.free(sc, out)
        if max(a, ab) != a:
            res = tr.alloc(a * lin.out_f * T, "transient")
            tr.free(summed)
            return res
        return summed

    # ---- forward

    def _block_in(self, tr: Any, run: LayerRun, x_id: int, role: str, lc: dict[str, int]) -> list[int]:
        """A block's norm, then its input projections reading the norm's output, which is saved
        when one of them trains; returns the projections' outputs."""
        p = self.p
        self._norm(tr, run, p.r, x_id)
        y = tr.alloc(p.r * self.s.hidden * self.T, "transient")
        saved = [False]
        outs = [self._linear(tr, run, lin, y, p.r, saved, lc) for lin in self.s.by_role(role)]
        if saved[0]:
            tr.keep(run.saved, y)
        else:
            tr.free(y)
        return outs

    def forward(self, tr: Any, x_id: int, keep_input: bool = False, checkpointed: bool = False) -> tuple[int, LayerRun]:
        """Forward of one layer over the residual stream ``x_id`` (r bytes); returns the new
        residual stream and what the backward needs. ``keep_input``: the input stays alive (a
        checkpointed layer keeps it for the recompute). ``checkpointed``: nothing is saved: each
        block's tensors die when the block ends (the forward of a checkpointed layer)."""
        s, p, T, h = self.s, self.p, self.T, self.s.hidden
        run = LayerRun()
        lc: dict[str, int] = {}
        # attention block
        outs = self._block_in(tr, run, x_id, "attn_in", lc)
        # rotary on q and k: new tensors, saved by the attention kernel
        q = tr.alloc(p.a * s.q_width * T, "activations")
        k = tr.alloc(p.a * s.kv_width * T, "activations")
        tmp = tr.alloc(p.a * s.q_width * T, "transient")
        tr.free(tmp)
        v_id = outs[-1] if outs else -1
        tr.free(*outs[:-1])
        repeat = self.masked or self.attn == "eager"
        if repeat and s.kv_heads != s.heads:
            kr = tr.alloc(p.a * s.q_width * T, "activations")
            vr = tr.alloc(p.a * s.q_width * T, "activations")
            tr.free(k, v_id)
            k, v_id = kr, vr
        # SDPA with dropout on a CPU: no fused kernel takes it, so the math path runs, in fp32
        # (bf16/fp16 inputs upcast): it saves fp32 q, k, v, the softmax, the dropout's noise (the
        # dtype of its input) and the dropped probabilities, and no log-sum-exp.
        math_cpu = self.attn != "eager" and self.device == "cpu" and s.attn_dropout
        if math_cpu and p.a != 4:
            q32, k32, v32 = (tr.alloc(4 * w * T, "activations") for w in (s.q_width, s.kv_width, s.kv_width))
            tr.free(q, k, v_id)
            q, k, v_id = q32, k32, v32
        tr.keep(run.saved, q, k, v_id)
        if self.attn == "eager":
            per = s.heads * self.S * T  # heads x seq x seq per sequence = heads x seq per token
            scores = tr.alloc(p.a * per, "transient")
            masked_scores = tr.alloc(max(p.a, p.r) * per, "transient")
            tr.free(scores)
            if s.softcap:  # tanh(scores / cap) * cap: the tanh is saved
                tr.keep(run.saved, tr.alloc(p.a * per, "attention"), tag="attention")
            probs32 = tr.alloc(4 * per, "attention")
            tr.free(masked_scores)
            probs = tr.alloc(p.a * per, "attention") if p.a != 4 else probs32
            tr.keep(run.saved, probs32, *([probs] if probs != probs32 else []), tag="attention")
            if s.attn_dropout:
                tr.keep(run.saved, tr.alloc(self._mask_bytes(p.a) * per, "attention"), tag="attention")
                tr.keep(run.saved, tr.alloc(p.a * per, "attention"), tag="attention")
            o = tr.alloc(p.a * s.q_width * T, "transient")
            att = tr.alloc(p.a * s.q_width * T, "activations")  # transpose(1, 2).contiguous()
            tr.free(o)
        else:
            att = tr.alloc(p.a * s.q_width * T, "activations")  # (b, s, h, d) layout: o_proj's input is a view
            if math_cpu:
                per = s.heads * self.S * T  # the softmax, the dropout's noise, the dropped probabilities
                tr.keep(run.saved, *(tr.alloc(4 * per, "attention") for _ in range(3)), tag="attention")
            else:
                tr.keep(run.saved, tr.alloc(4 * s.heads * T, "attention"), tag="attention")  # log-sum-exp
        att_saved = [False]
        o_out = [self._linear(tr, run, lin, att, p.a, att_saved, lc) for lin in s.by_role("attn_out")]
        tr.keep(run.saved, att)
        if s.dropout_sites:
            tr.keep(run.saved, tr.alloc(self._mask_bytes(p.a) * h * T, "activations"))
            d = tr.alloc(p.a * h * T, "transient")
            tr.free(*o_out)
            o_out = [d]
        if s.norms >= 4:  # post-attention norm (Gemma 2)
            self._norm(tr, run, p.a, o_out[0] if p.a == 4 and o_out else -1)
        h1 = tr.alloc(p.r * h * T, "transient")
        tr.free(*(i for i in o_out if i not in run.saved))
        if not keep_input and x_id not in run.saved:
            tr.free(x_id)
        if checkpointed:
            tr.free(*(i for i in run.saved if i != x_id), *run.casts)
            run.saved, run.casts, run.cast_of = [], [], {}
        run.mlp_start = len(run.saved)
        # MLP block
        ins = self._block_in(tr, run, h1, "mlp_in", lc)
        i = s.intermediate
        down = s.by_role("mlp_out")
        down_trains = any(lin.trainable for lin in down)
        if s.gated:
            tr.keep(run.saved, *ins)  # gate (act input), up (mul operand); a fused gate_up output is one tensor
            act = tr.alloc(p.a * i * T, "activations")
            tr.keep(run.saved, act)
            prod = tr.alloc(p.a * i * T, "activations" if down_trains else "transient")
        else:
            tr.keep(run.saved, *ins)
            for _ in range(s.act_extra):
                tr.keep(run.saved, tr.alloc(p.a * i * T, "activations"))
            prod = tr.alloc(p.a * i * T, "activations" if down_trains else "transient")
        prod_saved = [False]
        d_out = [self._linear(tr, run, lin, prod, p.a, prod_saved, lc) for lin in down]
        if prod_saved[0] or down_trains:
            tr.keep(run.saved, prod)
        else:
            tr.free(prod)
        if s.dropout_sites:
            tr.keep(run.saved, tr.alloc(self._mask_bytes(p.a) * h * T, "activations"))
            d = tr.alloc(p.a * h * T, "transient")
            tr.free(*d_out)
            d_out = [d]
        if s.norms >= 4:
            self._norm(tr, run, p.a, d_out[0] if p.a == 4 and d_out else -1)
        out = tr.alloc(p.r * h * T, "transient")
        tr.free(*(i for i in d_out if i not in run.saved))
        if h1 not in run.saved:
            tr.free(h1)
        if checkpointed:
            tr.free(*(i for i in run.saved if i != x_id), *run.casts)
            run.saved, run.casts, run.cast_of = [], [], {}
        return out, run

    # ---- backward

    def backward(self, tr: Any, run: LayerRun, g_id: int, grads: Any) -> int:
        """Backward of one layer: input gradients as transients, weight gradients through
        ``grads(linear)`` (which allocates them), the layer's saved tensors released."""
        s, p, T, h, i = self.s, self.p, self.T, self.s.hidden, self.s.intermediate

        def lin_grads(lin: Linear) -> None:
            grads(lin)
            w = run.cast_of.pop(lin.name, -1)
            tr.free(w)
            if w > 0:
                run.casts.remove(w)

        # MLP: grad of the down projection's input, the product's operands, the gate
        gp = tr.alloc(p.a * i * T, "transient")
        for lin in s.by_role("mlp_out"):
            lin_grads(lin)
        g_act = tr.alloc(p.a * i * T, "transient")
        g_up = tr.alloc(p.a * i * T, "transient")
        tr.free(gp)
        g_gate = tr.alloc(p.a * i * T, "transient")
        tr.free(g_act)
        for lin in s.by_role("mlp_in"):
            lin_grads(lin)
        g_y2 = tr.alloc(p.r * h * T, "transient")
        tr.free(g_gate, g_up)
        tr.free(*run.saved[run.mlp_start:])
        g_h1 = tr.alloc(p.r * h * T, "transient")
        tr.free(g_y2, g_id)
        # attention: o_proj input grad, the kernel's q/k/v grads (fp32 dq accumulator on flash)
        g_o = tr.alloc(p.a * s.q_width * T, "transient")
        for lin in s.by_role("attn_out"):
            lin_grads(lin)
        if self.attn == "eager":
            per = s.heads * self.S * T
            g_p = tr.alloc(p.a * per, "transient")
            g_s = tr.alloc(4 * per, "transient")
            tr.free(g_p)
            g_q = tr.alloc(p.a * s.q_width * T, "transient")
            g_k = tr.alloc(p.a * s.q_width * T, "transient")
            tr.free(g_s)
            g_v = tr.alloc(p.a * s.q_width * T, "transient")
        else:
            acc = tr.alloc(4 * s.q_width * T, "transient") if self.device == "cuda" else -1
            g_q = tr.alloc(p.a * s.q_width * T, "transient")
            g_k = tr.alloc(p.a * s.kv_width * T, "transient")
            g_v = tr.alloc(p.a * s.kv_width * T, "transient")
            tr.free(acc)
        tr.free(g_o)
        for lin in s.by_role("attn_in"):
            lin_grads(lin)
        g_y = tr.alloc(p.r * h * T, "transient")
        tr.free(g_q, g_k, g_v)
        tr.free(*run.saved[:run.mlp_start])
        tr.free(*run.casts)
        g_x = tr.alloc(p.r * h * T, "transient")
        tr.free(g_y, g_h1)
        return g_x

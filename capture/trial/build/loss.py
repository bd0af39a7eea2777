"""The loss of the user's run: the model's own cross-entropy over the full logits (``standard``)
or a chunked one that never materialises them (``chunked``).

Llama-3's 128,256-token vocabulary makes the logits of an 8B step several GiB: at micro-batch
2 x 2048 the standard loss holds about 12 bytes per token per vocabulary entry at the start of
the backward pass (the fp32 log-softmax, its gradient and the gradient of the loss), 6.3 GB. The
chunked loss takes the decoder's last hidden states and computes logits, loss and both gradients
one chunk of tokens at a time inside the forward pass (gradients are kept, logits are not):
liger-kernel's fused linear cross-entropy where it runs (CUDA/ROCm with triton, ``capture-stack[kernels]``),
else :class:`ChunkedLinearCrossEntropy` here, in plain torch. Both match the standard loss (mean
over the tokens that carry a label, shifted by one), with the model's final-logit softcapping
(Gemma 2) and logit scaling (Cohere, Granite) applied.
"""

from __future__ import annotations

from typing import Any

import torch

from capture.errors import ConfigError
from capture.trial.build.data import IGNORE, Batch
from capture.trial.config import TrialConfig


def _logit_transform(cfg: Any) -> tuple[float | None, float]:
    """(softcap, multiplier) the model applies to its logits before the loss."""
    softcap = getattr(cfg, "final_logit_softcapping", None)
    scale = 1.0
    if getattr(cfg, "logit_scale", None) is not None:
        scale *= float(cfg.logit_scale)
    if getattr(cfg, "logits_scaling", None) is not None:
        scale /= float(cfg.logits_scaling)
    return (float(softcap) if softcap else None), scale


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Sum of the token losses of ``hidden @ weight.T`` against ``labels``, chunk by chunk; the
    gradients for ``hidden`` and ``weight`` are computed in the forward pass and scaled in backward."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int,
                softcap: float | None, scale: float, compute: torch.dtype, need_grad: bool) -> torch.Tensor:
        n = hidden.shape[0]
        w = weight if weight.dtype == compute else weight.to(compute)
        grad_h = torch.empty_like(hidden) if need_grad and ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32 if weight.dtype == torch.float32 else weight.dtype,
                             device=weight.device) if need_grad and ctx.needs_input_grad[1] else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, n, chunk):
            h = hidden[start:start + chunk].to(compute)
            y = labels[start:start + chunk]
            z = (h @ w.t()).float() * scale
            t = None
            if softcap is not None:
                t = torch.tanh(z / softcap)
                z = t * softcap
            valid = y != IGNORE
            lse = torch.logsumexp(z, dim=-1)
            picked = z.gather(1, y.clamp(min=0).unsqueeze(1)).squeeze(1)
            total += ((lse - picked) * valid).sum()
            if grad_h is None and grad_w is None:
                continue
            g = torch.softmax(z, dim=-1)
            del z
            g[torch.arange(g.shape[0], device=g.device), y.clamp(min=0)] -= 1.0
            g *= valid.unsqueeze(1)
            if t is not None:
                g *= 1.0 - t * t
            if scale != 1.0:
                g *= scale
            g = g.to(compute)
            if grad_h is not None:
                grad_h[start:start + chunk] = (g @ w).to(hidden.dtype)
            if grad_w is not None:
                grad_w.addmm_(g.t().to(grad_w.dtype), h.to(grad_w.dtype))
            del g, h
        ctx.save_for_backward(*(x for x in (grad_h, grad_w) if x is not None))
        ctx.has = (grad_h is not None, grad_w is not None)
        return total

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        saved = list(ctx.saved_tensors)
        grads: list[Any] = []
        for has in ctx.has:
            g = saved.pop(0) if has else None
            grads.append(g.mul_(grad_out.to(g.dtype)) if g is not None else None)  # in place: no second copy
        return grads[0], grads[1], None, None, None, None, None, None


class Loss:
    """Computes a batch's mean token loss the configured way; ``info`` is what the manifest records."""

    def __init__(self, model: Any, config: TrialConfig, device: torch.device) -> None:
        self.kind = config.training.loss
        self.chunk = config.training.loss_chunk_size
        self.device = device
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.info: dict[str, Any] = {"name": self.kind}
        if self.kind == "standard":
            self.info["implementation"] = f"{type(base).__name__}.forward(labels=...): cross-entropy over the full logits"
            return
        self.decoder = base.get_decoder()
        self.head = base.get_output_embeddings()
        if self.decoder is None or self.head is None or not hasattr(self.head, "weight"):
            raise ConfigError(f"trial.training.loss: {type(base).__name__} has no separable decoder and output "
                              "embedding for a chunked loss", 'use loss = "standard"')
        if type(self.head).__module__.startswith("peft") or getattr(self.head, "bias", None) is not None:
            raise ConfigError("trial.training.loss: the chunked loss reads lm_head's weight, but lm_head carries "
                              "a LoRA adapter or a bias", 'leave lm_head out of trial.lora.target_modules, or use loss = "standard"')
        self.softcap, self.scale = _logit_transform(base.config.get_text_config())
        self.liger = None
        if device.type == "cuda" and self.scale == 1.0:
            try:
                from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

                self.liger = liger_fused_linear_cross_entropy
            except Exception as exc:  # not installed, or no triton for this device
                self.info["liger_unavailable"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        if self.liger is not None:
            from importlib import metadata

            self.info["implementation"] = (f"liger-kernel {metadata.version('liger-kernel')} fused linear cross-entropy "
                                           "(logits computed and dropped chunk by chunk, gradients in the forward pass)")
        else:
            self.info["implementation"] = ("capture's chunked linear cross-entropy in torch (logits computed and "
                                           "dropped chunk by chunk, gradients in the forward pass)")
            self.info["chunk_tokens"] = self.chunk
        if self.softcap:
            self.info["final_logit_softcapping"] = self.softcap
        if self.scale != 1.0:
            self.info["logit_scale"] = self.scale

    def __call__(self, model: Any, batch: Batch) -> torch.Tensor:
        if self.kind == "standard":
            return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels).loss
        hidden = self.decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
        h = hidden[:, :-1, :].reshape(-1, hidden.shape[-1])
        y = batch.labels[:, 1:].reshape(-1)
        count = (y != IGNORE).sum().clamp(min=1)
        weight = self.head.weight
        dt = self.device.type
        compute = torch.get_autocast_dtype(dt) if torch.is_autocast_enabled(dt) else h.dtype
        with torch.autocast(dt, enabled=False):
            if self.liger is not None:
                total = self.liger(h.to(compute), weight.to(compute), y, ignore_index=IGNORE, reduction="sum",
                                   softcap=self.softcap)
            else:
                need = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
                total = ChunkedLinearCrossEntropy.apply(h, weight, y, self.chunk, self.softcap, self.scale, compute, need)
        return total / count


# --------------------------------------------------------------------------- the logits term


def liger_chunk(tokens: int, vocab: int, hidden: int) -> int:
    """liger-kernel's chunk: the tokens whose logits take about as much as the hidden states."""
    inc = -(-vocab // hidden)
    want = -(-tokens // inc)
    return min(tokens, 1 << max(0, (want - 1).bit_length()))


def loss_forward(tr: Any, kind: str, liger: bool, T: int, V: int, h: int, a: int, r: int, mixed: bool,
                 head_trains: bool, chunk: int) -> dict[str, Any]:
    """The output projection and the loss in the forward pass; returns what its backward frees."""
    held: dict[str, Any] = {"saved": [], "casts": []}
    if mixed and r == 4:  # autocast casts lm_head's fp32 weight once; saved for backward
        held["casts"].append(tr.alloc(V * h * 2, "autocast_weight_copies"))
    if kind == "standard":
        logits = tr.alloc(a * V * T, "logits")
        up = tr.alloc(4 * V * T, "logits") if a != 4 else -1
        held["saved"].append(tr.alloc(4 * V * T, "logits"))  # log_softmax output
        tr.free(up)
        tr.free(logits)  # the model output (and its logits) is dropped once .loss is read
        return held
    c = 2 if mixed else a
    if mixed and r != 2:
        held["casts"].append(tr.alloc(c * h * T, "logits"))  # hidden.to(compute)
    held["grad_h"] = tr.alloc((c if liger else r) * h * T, "logits")
    if head_trains:
        held["grad_w"] = tr.alloc(V * h * (4 if r == 4 else r), "gradients")
    if liger:
        buf = tr.alloc(c * liger_chunk(T, V, h) * V, "transient")
        tr.alloc(4 * T, "transient")
        tr.free(buf)
    else:
        n = min(chunk, T)
        z = tr.alloc(4 * n * V, "transient")
        g = tr.alloc(4 * n * V, "transient")
        tr.free(z)
        g16 = tr.alloc(c * n * V, "transient")
        tr.free(g, g16)
    return held


def loss_backward(tr: Any, held: dict[str, Any], kind: str, T: int, V: int, h: int, a: int, r: int,
                  head_grad: Any) -> int:
    """The loss's backward down to the gradient of the final hidden states (returned)."""
    if kind == "standard":
        g_nll = tr.alloc(4 * V * T, "logits")
        g_ls = tr.alloc(4 * V * T, "logits")
        tr.free(*held["saved"])
        tr.free(g_nll)
        g16 = tr.alloc(a * V * T, "logits") if a != 4 else -1
        tr.free(g_ls)
        g_y = tr.alloc(a * h * T, "transient")
        head_grad()
        tr.free(g16)
        tr.free(*held["casts"])
        return g_y
    tr.free(*held["casts"])
    return held["grad_h"]

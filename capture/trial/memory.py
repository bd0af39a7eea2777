"""The memory budget, estimated before the first step and compared with the measurement after.

Parameters x bytes per weight is only a lower bound. The estimate replays one training run as
the framework allocates it: the weights as they are built, then training steps op by op (each
part from the module where its setting lives: :mod:`capture.trial.build.activations` for the
decoder layers, :mod:`~capture.trial.build.loss` for the logits, :mod:`~capture.trial.build.optim`
for the optimizer state and step), as allocation events with their sizes, lifetimes and terms.
From that list:

- the **peak of allocated tensors** and what was live at that moment, by term (weights,
  optimizer state, gradients, autocast copies, activations, attention, logits, temporaries);
- the **caching allocator's reserve** beyond it: the events replayed through a model of
  PyTorch's caching allocator (:mod:`capture.trial.allocator`), and with
  ``expandable_segments:True`` for comparison;
- the device-level terms the allocator never sees: the CUDA/ROCm context and library
  workspaces (measured when the trial runs; from the H200 reference otherwise), paged optimizer
  state (unified memory).

Each term has its formula and inputs; the trial records the estimate beside the measurement and
the error per term it can measure (DESIGN decision 5: an estimate is always marked as one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from capture.trial.allocator import replay
from capture.trial.build import activations as act
from capture.trial.build import loss as loss_mod
from capture.trial.build import optim as optim_mod

CONTEXT_REFERENCE_BYTES = 650_969_088
"""CUDA context of torch on an H200 (tests/fixtures/h200/probe.json ``ctx_overhead_bytes``)."""
LIBRARIES_REFERENCE_BYTES = 150_994_944
"""Device memory the libraries take outside the allocator after the first steps (cuBLAS handles and
workspaces): NVML's figure minus reserved minus the context, 144 MiB on the H200 reference runs
(docs/measurements, memory grid)."""
CUBLAS_WORKSPACES_BYTES = 2 * 32 * 2**20
"""cuBLAS and cuBLASLt workspaces, 32 MiB each on sm90, taken through the caching allocator at the
first matmul and kept (measured on the H200: peak allocated minus every tensor, 64.1 MiB)."""
MAX_STEPS = 3
MAX_MICRO_REPLAYED = 3
"""Micro-batches of one step replayed: from the second on, each adds its gradients into those the
first made and frees everything else, so every later one repeats the same events from the same
state (checked against replaying all of them: tests/test_memory_estimate.py). A grad_accum of
65,536 (the config's bound) costs what 3 does."""


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
    peak_phase: str = ""
    expandable_bytes: int | None = None
    """The device total with ``expandable_segments:True`` (allocator reserve modelled that way)."""
    note: str = "estimate, made before the first step; each term shows its inputs"

    @property
    def total_bytes(self) -> int:
        return sum(t.bytes for t in self.terms)

    @property
    def allocator_bytes(self) -> int:
        """The allocator's peak of allocated tensors (every tensor-level term)."""
        return sum(t.bytes for t in self.terms if t.name not in OUTSIDE_TENSORS)

    @property
    def reserved_bytes(self) -> int:
        return self.allocator_bytes + self.term_bytes("allocator_reserve")

    def term_bytes(self, name: str) -> int:
        t = self.term(name)
        return t.bytes if t else 0

    def term(self, name: str) -> Term | None:
        return next((t for t in self.terms if t.name == name), None)

    def to_manifest(self) -> dict[str, Any]:
        out: dict[str, Any] = {"total_bytes": self.total_bytes, "allocator_bytes": self.allocator_bytes,
                               "reserved_bytes": self.reserved_bytes, "peak_phase": self.peak_phase, "note": self.note}
        if self.expandable_bytes is not None:
            out["expandable_segments_total_bytes"] = self.expandable_bytes
        for t in self.terms:
            out[t.name] = t.to_manifest()
        return out


OUTSIDE_TENSORS = ("allocator_reserve", "framework_overhead", "cuda_context", "libraries", "optimizer_state_paged")


# --------------------------------------------------------------------------- the event list


class Trace:
    """Allocation events: ``alloc`` returns an id, ``free`` takes ids (negative ids are no-ops)."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.n = 0

    def alloc(self, nbytes: int, tag: str) -> int:
        if nbytes <= 0:
            return -1
        self.n += 1
        self.events.append(("alloc", self.n, int(nbytes), tag))
        return self.n

    def free(self, *ids: int) -> None:
        for i in ids:
            if i is not None and i > 0:
                self.events.append(("free", i))

    def keep(self, ids: list[int], *new: int, tag: str = "activations") -> None:
        """``new`` tensors are saved for backward: appended to ``ids`` and counted under ``tag``."""
        for i in new:
            if i is not None and i > 0:
                ids.append(i)
                self.events.append(("retag", i, tag))

    def mark(self, *event: Any) -> None:
        self.events.append(event)


@dataclass(frozen=True)
class Plan:
    """Everything the estimate needs, read from the config and its model built on the meta device."""

    params: tuple[Any, ...]
    shape: act.LayerShape
    layers: int
    vocab: int
    hidden: int
    prec: act.Precision
    attn: str
    masked: bool
    seq: int
    seq_source: str
    head_trains: bool
    embed_trains: bool
    loss: str
    liger: bool
    chunk: int
    optimizer: str
    opt_impl: str
    momentum: float
    gradient_checkpointing: bool
    quantization: str
    device_type: str
    from_config: bool
    grad_accum: int
    tied_head: bool = False
    """The output layer shares the input embedding's weight: one ``.grad`` for both."""
    other_grad_numel: int = 0
    """Trainable base parameters outside the decoder layers' linears, the embeddings and the head
    (norm weights, biases, position embeddings): their gradients, made as backward ends."""


def plan_for(config: Any, device_type: str, seq: int | None = None, seq_source: str | None = None,
             built: tuple[Any, Any] | None = None) -> Plan:
    """Build the model of ``config`` on the meta device (no weights, no GPU) and read the plan.
    ``built``: what :func:`capture.trial.build.model.build_meta` returned for a config that differs
    from this one only in its batch (a replay of many shapes of one model builds it once)."""
    from capture.trial.build import model as model_mod

    model: Any  # a transformers (or peft) model: its config and embeddings are not torch.nn.Module's
    model, resolved = built if built is not None else model_mod.build_meta(config)
    p = config.precision
    wb = 4 if p.autocast else {"bf16": 2, "fp16": 2, "fp32": 4}[p.dtype]
    mixed = p.autocast and p.dtype != "fp32"
    prec = act.Precision(r=wb, a=2 if mixed else wb, mixed=mixed, compute_dtype=p.dtype)
    quant = config.model.quantization
    if quant == "none" and getattr(resolved.hf_config, "quantization_config", None) is not None:
        qc = resolved.hf_config.quantization_config
        quant = "nf4" if (qc.get("load_in_4bit") if isinstance(qc, dict) else getattr(qc, "load_in_4bit", False)) else "int8"
    params = tuple(model_mod.param_plan(model, quant, wb))
    shape = act.layer_shape(model, quant if quant != "none" else None)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    cfg = base.config.get_text_config()
    attn = config.model.attn_implementation or getattr(base.config, "_attn_implementation", None) or "sdpa"
    out_w = getattr(base.get_output_embeddings(), "weight", None)
    in_w = getattr(base.get_input_embeddings(), "weight", None)
    liger = device_type == "cuda" and config.training.loss == "chunked" and model_mod._has("liger_kernel")
    layers = int(cfg.num_hidden_layers)
    tied = out_w is not None and out_w is in_w
    head_trains, embed_trains = bool(out_w is not None and out_w.requires_grad), bool(in_w is not None and in_w.requires_grad)
    modelled = (layers * sum(lin.numel for lin in shape.linears if lin.trainable)
                + (in_w.numel() if in_w is not None and embed_trains else 0)
                + (out_w.numel() if out_w is not None and head_trains and not tied else 0))
    other = sum(prm.numel for prm in params if prm.trainable and prm.kind != "lora") - modelled
    return Plan(
        params=params, shape=shape, layers=layers, vocab=int(cfg.vocab_size), hidden=int(cfg.hidden_size),
        prec=prec, attn="eager" if attn == "eager" else "sdpa", masked=not config.data.packing and config.data.source != "synthetic",
        seq=seq or config.batch.max_seq_len,
        seq_source=seq_source or "trial.batch.max_seq_len (the longest batch the config allows)",
        head_trains=head_trains, embed_trains=embed_trains, tied_head=tied, other_grad_numel=max(0, other),
        loss=config.training.loss, liger=liger, chunk=config.training.loss_chunk_size, optimizer=config.optimizer.name,
        opt_impl=optim_mod.implementation(config.optimizer.name, config.optimizer.fused, device_type),
        momentum=config.optimizer.momentum, gradient_checkpointing=config.training.gradient_checkpointing,
        quantization=quant, device_type=device_type, from_config=config.model.source == "from_config",
        grad_accum=config.batch.grad_accum)


def _build_events(tr: Trace, plan: Plan) -> list[int]:
    """The weights as the build allocates them (a quantized model from a config: full precision
    first, then each linear quantized and its full-precision weight freed)."""
    ids = []
    if plan.quantization != "none" and plan.from_config:
        tmp = []
        for prm in plan.params:
            if prm.storage in ("nf4", "int8"):
                tmp.append((tr.alloc(prm.numel * 2, "weights"), prm))
            elif prm.kind != "lora":
                ids.append(tr.alloc(prm.nbytes, "weights"))
        for t, prm in tmp:
            ids.append(tr.alloc(prm.nbytes, "weights"))
            tr.free(t)
        tr.mark("empty_cache")  # build() gives the full-precision staging back (capture.trial.build.model)
        ids += [tr.alloc(prm.nbytes, "weights") for prm in plan.params if prm.kind == "lora"]
        return ids
    return [tr.alloc(prm.nbytes, "weights") for prm in plan.params]


def _step_events(tr: Trace, plan: Plan, mb: int, first: bool, opt_states: list[int]) -> None:
    s, p = plan.shape, plan.prec
    T, h, V = mb * plan.seq, plan.hidden, plan.vocab
    layer = act.LayerModel(s, p, T, mb, plan.seq, plan.attn, plan.masked, plan.device_type)
    grads: list[int] = []
    gb = p.r  # a gradient has its parameter's dtype (fp32 master weights under autocast: 4)
    accumulating = False  # from the second micro-batch on: each new gradient is added into .grad and freed

    def grad(nbytes: int, into_existing: bool = False) -> None:
        """A gradient made in backward: kept as ``.grad``, or a transient added into one that exists."""
        added = accumulating or into_existing
        t = tr.alloc(nbytes, "transient" if added else "gradients")
        if added:
            tr.free(t)
        else:
            grads.append(t)

    def weight_grad(lin: act.Linear) -> None:
        if lin.trainable:
            if p.mixed and p.r == 4:
                t = tr.alloc(lin.numel * 2, "transient")
                grad(lin.numel * 4)
                tr.free(t)
            else:
                grad(lin.numel * gb)
        if lin.lora_rank:
            grad(lin.lora_rank * lin.in_f * lin.lora_bytes)
            grad(lin.lora_rank * lin.out_f * lin.lora_bytes)

    for micro in range(min(plan.grad_accum, MAX_MICRO_REPLAYED)):
        accumulating = micro > 0
        tr.mark("phase", "forward")
        x = tr.alloc(p.r * h * T, "transient")  # embedding output
        emb_saved = tr.alloc(8 * T, "activations") if plan.embed_trains else -1
        runs, inputs = [], []
        for _ in range(plan.layers):
            if plan.gradient_checkpointing:
                inputs.append(x)
                x, run = layer.forward(tr, x, keep_input=True, checkpointed=True)
            else:
                x, run = layer.forward(tr, x)
            runs.append(run)
        fn = act.LayerRun()
        layer._norm(tr, fn, p.r)
        y = tr.alloc(p.r * h * T, "transient")
        tr.free(x)
        held = loss_mod.loss_forward(tr, plan.loss, plan.liger, T, V, h, p.a, p.r, p.mixed, plan.head_trains, plan.chunk)
        if not plan.head_trains:
            tr.free(y)
        tr.mark("phase", "backward")

        def head_grad() -> None:
            if plan.head_trains:
                grad(V * h * gb)

        g = loss_mod.loss_backward(tr, held, plan.loss, T, V, h, p.a, p.r, head_grad)
        if "grad_w" in held:  # the chunked loss's head gradient, made in forward
            if accumulating:
                tr.free(held["grad_w"])
            else:
                grads.append(held["grad_w"])
        if plan.head_trains:
            tr.free(y)
        tr.free(*fn.saved)
        for li in reversed(range(plan.layers)):
            if plan.gradient_checkpointing:
                tr.mark("phase", "backward (recompute)")
                out, run = layer.forward(tr, inputs[li], keep_input=True)
                tr.free(out)
                kept = inputs[li] in run.saved  # an fp32 input the first norm saves itself
                g = layer.backward(tr, run, g, weight_grad)
                if not kept:
                    tr.free(inputs[li])
            else:
                g = layer.backward(tr, runs[li], g, weight_grad)
        tr.free(g, emb_saved)
        if plan.embed_trains:
            emb = next(prm for prm in plan.params if prm.kind == "embedding")
            # a tied head made this weight's .grad earlier in backward: the embedding's is added into it
            grad(emb.numel * gb, into_existing=plan.tied_head and plan.head_trains)
        grad(plan.other_grad_numel * gb)
    tr.mark("phase", "optimizer step")
    trainable = [(prm.numel, int(prm.bytes_per)) for prm in plan.params if prm.trainable]
    if first:
        counter = optim_mod.step_counter_bytes(plan.optimizer, plan.opt_impl, plan.device_type)
        for prm in plan.params:
            if prm.trainable:
                own = optim_mod.state_bytes(plan.optimizer, prm.numel, _shape_of(prm, plan), int(prm.bytes_per), plan.momentum)
                opt_states.append(tr.alloc(own - _paged(plan, prm.numel), "optimizer_state"))  # paged: unified memory
                opt_states.append(tr.alloc(counter, "optimizer_state"))
    t = tr.alloc(optim_mod.step_transient_bytes(plan.opt_impl, plan.optimizer, trainable), "transient")
    tr.free(t)
    tr.free(*grads)  # zero_grad(set_to_none=True)


def _shape_of(prm: Any, plan: Plan) -> tuple[int, ...]:
    if prm.kind in ("embedding", "output"):
        return (plan.vocab, plan.hidden)
    if prm.kind in ("linear", "lora"):
        return (max(1, prm.numel // plan.hidden), plan.hidden)
    return (prm.numel,)


def simulate(plan: Plan, micro_batch: int, steps: int = MAX_STEPS, bench: bool = False, expandable: bool = True) -> Any:
    """Replay the build and ``steps`` training steps. ``bench``: the benchmark's protocol (one
    step, ``empty_cache``, peaks reset, one measured step). ``expandable``: model
    ``expandable_segments:True`` beside the default allocator."""
    tr = Trace()
    _build_events(tr, plan)
    tr.mark("reset_peaks")
    states: list[int] = []
    if plan.device_type == "cuda":
        tr.alloc(CUBLAS_WORKSPACES_BYTES, "library_workspaces")
    for k in range(2 if bench else steps):
        if bench and k == 1:
            tr.mark("empty_cache")
            tr.mark("reset_peaks")
        _step_events(tr, plan, micro_batch, k == 0, states)
    return replay(tr.events, device_type=plan.device_type, expandable=expandable)


# --------------------------------------------------------------------------- the estimate


def _fmt_storage(plan: Plan) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for prm in plan.params:
        if prm.kind == "lora":
            continue
        d = out.setdefault(prm.storage, {"params": 0, "bytes": 0})
        d["params"] += prm.numel
        d["bytes"] += prm.nbytes
    return out


def estimate_plan(plan: Plan, micro_batch: int, overhead_bytes: int | None = None, overhead_source: str = "",
                  libraries_bytes: int | None = None, expandable: bool = True) -> MemoryEstimate:
    """Every term at the allocated peak of the replayed run, the allocator's reserve, and the
    device-level terms. ``overhead_bytes``: the measured context (GPU) or process (CPU).
    ``expandable=False``: no ``expandable_segments`` figure (a fit search needs the total only)."""
    r = simulate(plan, micro_batch, expandable=expandable)
    tags = dict(r.peak_tags)
    T = micro_batch * plan.seq
    lora = [prm for prm in plan.params if prm.kind == "lora"]
    lora_bytes = sum(prm.nbytes for prm in lora)
    weights = tags.pop("weights", 0) - lora_bytes
    trainable = sum(prm.numel for prm in plan.params if prm.trainable)
    per_layer = _layer_saved_bytes(plan, micro_batch)
    common = {"micro_batch": micro_batch, "seq_len": plan.seq, "seq_source": plan.seq_source, "tokens": T}
    terms = [
        Term("weights", weights, "parameters x bytes as stored (nf4: 0.5 + statistics; int8: 1 + scales)",
             {"by_storage": _fmt_storage(plan), "quantization": plan.quantization}),
    ]
    if lora:
        terms.append(Term("lora_adapters", lora_bytes, "adapter parameters x bytes (peft keeps them in fp32 on a 16-bit base)",
                          {"params": sum(prm.numel for prm in lora), "bytes_per_param": lora[0].bytes_per}))
    opt = tags.pop("optimizer_state", 0)
    paged_by_param = [(prm.numel, _paged(plan, prm.numel)) for prm in plan.params if prm.trainable]
    paged = sum(nbytes for _, nbytes in paged_by_param)
    terms.append(Term("optimizer_state", opt, _OPT_FORMULA[plan.optimizer],
                      {"optimizer": plan.optimizer, "params_trainable": trainable, "implementation": plan.opt_impl}))
    names = {"gradients": "trainable parameters' gradients live at the peak (param dtype; fp32 under autocast)",
             "autocast_weight_copies": "bf16 casts of fp32 weights live at the peak (saved for backward)",
             "activations": "tensors autograd saves for backward, live at the peak (per layer: inputs below)",
             "attention": "the attention kernel's saved state: log-sum-exp (SDPA/flash) or the softmax (eager, heads x seq²)",
             "logits": "output logits and the loss: log-softmax, its gradient and the loss gradient (standard), or the "
                       "chunked loss's hidden-state gradient",
             "transient": "temporaries live at the peak (recompute, backward workspaces, dequantized weights, optimizer step)",
             "library_workspaces": "cuBLAS and cuBLASLt workspaces through the caching allocator (32 MiB each on sm90)"}
    for name, formula in names.items():
        inputs: dict[str, Any] = dict(common)
        if name == "activations":
            inputs.update(layers=plan.layers, saved_bytes_per_layer=per_layer, gradient_checkpointing=plan.gradient_checkpointing,
                          bytes_per_token_per_layer=per_layer / T if T else 0, attn_implementation=plan.attn,
                          padding_mask=plan.masked)
        if name == "logits":
            inputs.update(vocab=plan.vocab, loss=plan.loss, implementation=("liger-kernel" if plan.liger else "torch")
                          if plan.loss == "chunked" else "standard")
        terms.append(Term(name, tags.pop(name, 0), formula, inputs))
    for name, value in tags.items():
        terms.append(Term(name, value, "other tensors live at the peak", {}))
    if plan.device_type == "cuda":
        terms.append(Term("allocator_reserve", r.peak_reserved - r.peak_allocated,
                          "caching allocator: peak reserved - peak allocated, replaying the run's allocations through "
                          "PyTorch's block-caching rules (capture.trial.allocator)",
                          {"peak_allocated_bytes": r.peak_allocated, "peak_reserved_bytes": r.peak_reserved,
                           "expandable_segments_reserved_bytes": r.peak_reserved_expandable}))
        ctx = overhead_bytes if overhead_bytes is not None else CONTEXT_REFERENCE_BYTES
        terms.append(Term("cuda_context", ctx, "device memory the runtime takes before the first tensor",
                          {"source": overhead_source or "measured on the H200 reference (torch 2.11, CUDA 13): assumed for this device"}))
        lib = libraries_bytes if libraries_bytes is not None else LIBRARIES_REFERENCE_BYTES
        terms.append(Term("libraries", lib, "cuBLAS handles and workspaces outside the allocator",
                          {"source": "measured on the H200 reference runs (NVML - reserved - context)"}))
        if paged:
            terms.append(Term("optimizer_state_paged", paged, "8-bit moments in CUDA unified memory (paged), outside the allocator: "
                              f"tensors of {optim_mod.PAGED_MIN_NUMEL:,} elements or more (their absmax statistics and "
                              "smaller tensors' state are device tensors, in optimizer_state)",
                              {"params_trainable": trainable,
                               "params_paged": sum(numel for numel, nbytes in paged_by_param if nbytes)}))
    elif overhead_bytes is not None:
        terms.append(Term("framework_overhead", overhead_bytes, "measured before the model was built", {"source": overhead_source}))
    est = MemoryEstimate(tuple(terms), peak_phase=r.peak_phase)
    if plan.device_type == "cuda" and expandable:
        exp = est.total_bytes - (r.peak_reserved - r.peak_allocated) + (r.peak_reserved_expandable - r.peak_allocated)
        est = MemoryEstimate(est.terms, est.peak_phase, exp)
    return est


def _paged(plan: Any, numel: int) -> int:
    """Bytes of a parameter's state in unified memory: a paged optimizer on CUDA only."""
    return optim_mod.paged_state_bytes(plan.optimizer, numel) if plan.device_type == "cuda" else 0


_OPT_FORMULA = {
    "adamw": "2 moments x trainable params x param bytes", "adam": "2 moments x trainable params x param bytes",
    "sgd": "momentum buffer x trainable params x param bytes (none without momentum)",
    "adamw_8bit": "2 x 1-byte moments + fp32 absmax per 256 (fp32 moments for tensors under 4096 elements)",
    "paged_adamw_8bit": "as adamw_8bit; on CUDA the moments of large tensors are in unified memory: see optimizer_state_paged",
    "adafactor": "factored second moment: rows + columns per matrix (no first moment)",
}


def _layer_saved_bytes(plan: Plan, micro_batch: int) -> int:
    """Bytes one layer leaves saved for backward at ``micro_batch`` (the activation per layer)."""
    tr = Trace()
    T = micro_batch * plan.seq
    layer = act.LayerModel(plan.shape, plan.prec, T, micro_batch, plan.seq, plan.attn, plan.masked, plan.device_type)
    x = tr.alloc(plan.prec.r * plan.hidden * T, "transient")
    _out, run = layer.forward(tr, x)
    sizes = {e[1]: e[2] for e in tr.events if e[0] == "alloc"}
    return sum(sizes.get(i, 0) for i in run.saved)


def relative_error(estimate_bytes: int, measured_bytes: int | None) -> float | None:
    """(estimate - measured) / measured: negative means the estimate was too low."""
    if not measured_bytes:
        return None
    return (estimate_bytes - measured_bytes) / measured_bytes

"""Run the staged trial in order and write its results, signed, after the stack they ran on.

Stages: config → fingerprint (stack first) → framework and CUDA context (measured) → workload →
memory estimate (before any step) → warm-up and measured steps → validation → checkpoint write
→ optional largest-micro-batch search → recoverability (fresh process; capture.trial.recover) →
cost → report (capture.trial.report) → signed manifest.

The ``[trial]`` table::

    config_toml          the config file exactly as written (absent for an example: config_source says which)
    config_source        a path, or "example:NAME"
    [trial.overrides]    command-line overrides applied on top of the file (method, steps, ...)
    [trial.run]          the resolved definition: name, seed, device, device_name, method,
                         params_total, params_trainable (measured from the built model), trainable_share,
                         params_source, cpu_threads (CPU runs),
                         max_seq_len, micro_batch_size, grad_accum, tokens_per_step, warmup_steps,
                         measured_steps, [model] (source, repo_id, revision, commit, path, architecture,
                         model_type, class, attn_implementation, vocab_size, weights), [lora],
                         [optimizer], [scheduler], [precision], [data], [validation_schedule],
                         [checkpoint_schedule]
    [trial.memory]       [estimate] (total_bytes, allocator_bytes, one table per term: bytes, formula,
                         inputs), [measured] (device_type, peak_allocated_bytes, peak_reserved_bytes,
                         device_used_bytes, device_used_source, allocator_gap_bytes, device_total_bytes,
                         device_total_source), estimate_error, estimate_error_basis,
                         allocator_estimate_error, framework_overhead_bytes
    [trial.steps]        step_time_s, data_wait_s, loss, tokens (measured steps), warmup_step_time_s, clock
    [trial.stats]        measured_steps, step_time_median_s, step_time_mean_s, step_time_p90_s,
                         step_time_p99_s, step_time_min_s, step_time_max_s, step_time_cv,
                         data_wait_total_s, stall_share, tokens_per_step, tokens_per_s, mfu,
                         peak_flops, peak_flops_source, flops_per_token, flops_formula (or mfu_note), clock
    [trial.validation]   duration_s, batches, tokens, tokens_per_s, loss (or skipped)
    [trial.checkpoint]   duration_s, size_bytes, bytes_per_s, fsync, contents (or skipped)
    [trial.fit]          fits, verdict, oom, failed_at, headroom, limit_bytes, limit_source,
                         measured_bytes, measured_basis, [search] (max_micro_batch, candidates, ...),
                         [[cards]] (name, memory_bytes, usable_bytes, fits, margin_bytes, tested, basis)
    [trial.recovery]     written by capture.trial.recover (or skipped)
    [trial.cost]         wall_total_s, [phases], trained_tokens, price_per_hour, price_source,
                         trial_cost, cost_per_million_trained_tokens, [projection]
    [trial.report]       html, html_sha256, duration_s (or skipped)
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import logging
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from capture.errors import CaptureError, UsageError
from capture.fmt import bytes_str
from capture.termtable import keep_together, say_wrapped
from capture import manifest as mf
from capture.trial.config import TrialConfig
from capture.trial.cost import PhaseTimer, Projection, cost_table, project, resolve_price
from capture.trial import hostmem, measured, scratch, state
from capture.trial.fit import DEFAULT_HEADROOM, cards_fit, find_max_batch, is_oom, load_catalog, oom_text
from capture.trial.scaling_args import ScalingOptions
from capture.trial.state import release_memory

if TYPE_CHECKING:
    from capture.trial.recover import EarlyWorkers

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrialOptions:
    """What the command line (or a caller) asks of a trial beyond its config."""

    output: Path | None = None
    key: Path | None = None
    principal: str | None = None
    recovery: bool = True
    preflight: str | None = "quick"
    """The preflight stage's mode (quick/full), None to skip it (--no-preflight)."""
    ignore_preflight_failure: bool = False
    report: bool = True
    find_max_batch: bool = False
    headroom: float = DEFAULT_HEADROOM
    memory_limit_bytes: int | None = None
    max_batch: int = 1024
    catalog: Path | None = None
    price_per_hour: float | None = None
    target_tokens: int | None = None
    target_epochs: float | None = None
    workdir: Path | None = None
    deep: bool = False
    code: Path | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    scaling: ScalingOptions | None = None
    """The scaling step (``--nproc``/``--strategy``/rendezvous flags); None: no scaling step."""


@dataclass(frozen=True)
class TrialOutcome:
    path: Path
    manifest: dict[str, Any]
    html: Path | None
    terminal: str


def default_output(name: str, folder: Path | None = None) -> Path:
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return (folder or Path.cwd()) / f"trial-{name}-{stamp}.toml"


def write_manifest(path: Path, manifest: dict[str, Any], key: Path | str | None, principal: str | None) -> Path:
    """Write ``manifest`` signed with ``key`` (default: the user's key, created on first use)."""
    from capture import signing

    body = mf.dumps(manifest)
    key_path = Path(key) if key else signing.ensure_default_key()
    signing.write_signed(path, body, key_path, principal)
    return path


def _artifact_specs(config: TrialConfig) -> tuple[tuple[str, ...], tuple[str, ...]]:
    from capture.trial.base import model_spec

    d = config.data
    spec = model_spec(config)  # the spec the recovery check finds the base's record by
    models: tuple[str, ...] = (spec,) if spec else ()
    datasets: tuple[str, ...] = ()
    if d.source == "hub":
        datasets = (f"{d.repo_id}@{d.revision}" if d.revision else str(d.repo_id),)
    elif d.source == "local":
        datasets = (str(config.resolve_path(d.path or "")),)
    return models, datasets


def _quiet_libraries() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    for mod in ("transformers", "peft", "torch"):
        warnings.filterwarnings("ignore", category=FutureWarning, module=mod)
        warnings.filterwarnings("ignore", category=UserWarning, module=mod)


def run_trial(config: TrialConfig, opts: TrialOptions, timer: PhaseTimer | None = None,
              progress: Callable[[str], None] | None = None) -> TrialOutcome:
    """Run every stage and write the signed manifest. Returns where it went and what it holds."""
    timer = timer or PhaseTimer()

    def to_stderr(msg: str) -> None:
        sys.stderr.write(f"capture: {msg}\n")

    say = progress or to_stderr
    stem = config.source.removeprefix("example:") if config.source.startswith("example:") else Path(config.source).stem
    output = Path(opts.output) if opts.output else default_output(stem or config.name)
    if not output.parent.is_dir():
        raise UsageError(f"-o: folder {output.parent} does not exist", "create it first or choose another path")

    with timer.phase("config"):
        catalog = load_catalog(opts.catalog)
    with timer.phase("import_framework"):
        import torch

        from capture.trial import devmem
        from capture.trial import memory as memory_mod
        from capture.trial.build.data import longest_batch_len
        from capture.trial.build.model import preflight as model_preflight
        from capture.trial.recorder import Recorder, device_name
        from capture.trial.workload import build_workload, import_model_code, resolve_device

        _quiet_libraries()
        model_preflight(config)  # packages and the model's config, before anything is measured (exit 2)
        import_model_code(config)  # transformers imports the model's module lazily: import time, not load time
        if config.method == "lora":
            import peft  # noqa: F401  (its import time belongs to this phase, not to loading)
        device = resolve_device(config.device)
    dm = devmem.DeviceMemory(device)
    dm.before_context()  # before this process touches the device: the context is measured, not assumed

    with timer.phase("fingerprint"):
        from capture.fingerprint import collect
        from capture.probes import ProbeOptions

        models, datasets = _artifact_specs(config)
        manifest = collect(ProbeOptions(models=models, datasets=datasets, code=opts.code, deep=opts.deep,
                                        progress=False), kind="trial")

    with timer.phase("device_context"):
        if device.type == "cuda":
            torch.zeros(1, device=device)
            state.sync(device)
            overhead, overhead_src = dm.context_bytes(), "CUDA context: device memory gained when this process first used the device"
            if opts.memory_limit_bytes:
                total = torch.cuda.get_device_properties(device).total_memory
                torch.cuda.set_per_process_memory_fraction(min(1.0, opts.memory_limit_bytes / total), device)
        else:
            overhead, overhead_src = devmem.rss_bytes(), "RSS of this process after importing the framework, before the model"
        name = device_name(device)
    tested_card = catalog.match(name)
    if opts.preflight:  # first measured stage; a failed check writes fingerprint + [preflight] and stops (exit 5)
        from capture.preflight.stage import trial_preflight

        with timer.phase("preflight"):
            trial_preflight(manifest, device, opts.preflight, opts.ignore_preflight_failure,
                            lambda: write_manifest(output, manifest, opts.key, opts.principal), say)

    trial: dict[str, Any] = {"config_source": config.source, "config_toml": config.source_text}
    if opts.overrides:
        trial["overrides"] = {k: v for k, v in opts.overrides.items() if v is not None}

    workdir = scratch.scratch_folder(output.parent, opts.workdir, say)  # removed in any case, interrupted or not
    html: Path | None = None
    written = False
    oom: str | None = None
    failed_at: str | None = None
    trained_tokens = 0
    wl = None
    est = None
    rec = None
    completed_steps = 0
    early: EarlyWorkers | None = None
    early_device_bytes: dict[str, int] = {}
    try:
        say(f"building the {config.method} workload on {device} ({name})")
        allocated_before = devmem.allocated_bytes(device)
        meta = None
        with timer.phase("load"):
            if device.type == "cpu":  # past the host's memory the kernel kills the run: check first
                meta, oom = hostmem.before_build(config, say)
                failed_at = "building the model" if oom else None
            try:
                wl = build_workload(config, device) if oom is None else None
            except Exception as exc:
                if not is_oom(exc):
                    raise
                oom, failed_at = oom_text(exc), "building the model"
            if wl is not None and device.type != "cuda" and overhead is not None:
                # The process after the build, less the tensors the estimate counts itself.
                overhead = max(0, (devmem.rss_bytes() or 0) - wl.tensor_bytes())
                overhead_src = ("RSS after the model and data were built, less their tensors' bytes "
                                "(interpreter, libraries, allocator slack)")
        host_start = overhead if device.type == "cpu" else None  # a fresh process's host memory (hostmem)
        weights_measured = None
        if wl is not None:
            weights_measured = (devmem.allocated_bytes(device) - allocated_before if device.type == "cuda"
                                else wl.tensor_bytes())
        run = _run_table(config, device, name, wl)
        trial["run"] = run

        if wl is not None:
            with timer.phase("estimate"):
                seq = longest_batch_len(wl.data, config.batch.micro_batch_size)
                plan = memory_mod.plan_for(config, device.type, seq=seq,
                                           seq_source="the longest batch of the data" if seq != config.batch.max_seq_len
                                           else "trial.batch.max_seq_len (every batch is that long)", built=meta)
                est = memory_mod.estimate_plan(plan, config.batch.micro_batch_size, overhead, overhead_src)
            # 100 columns with "capture: ", never between a term and its figure
            terms = ", ".join(keep_together(f"{t.name} {bytes_str(t.bytes)}") for t in est.terms if t.bytes)
            say_wrapped(f"memory estimate before running: {bytes_str(est.total_bytes)}: {terms}", say)
            short = hostmem.before_steps(est.total_bytes, say) if device.type == "cpu" else None
            if wl.compiled:
                say("torch.compile: compiling before the first step (timed on its own)")
                with timer.phase("compile"):
                    trial["compile"] = wl.compile_now()
                trial["compile"]["duration_s"] = timer.phases.get("compile")

            w, n = config.warmup_steps, config.measured_steps
            if opts.recovery and config.recovery.enabled and short is None:
                early = _start_early(config, device, workdir, dm, manifest.get("models"), with_steps=True,
                                     start_bytes=host_start)
            if short is None:
                say(f"{w} warm-up + {n} measured steps of {wl.tokens_per_step} tokens")
            with timer.phase("steps"):
                rec = Recorder(device, warmup_steps=w, precision=config.precision.dtype,
                               params_total=wl.params_total, params_trainable=wl.params_trainable, catalog=catalog,
                               memory=dm, expected_steps=w + n)
                step_tokens: list[tuple[int, int]] = []
                try:
                    with rec:
                        batches = rec.batches(wl.loader)
                        if short is not None:  # not started: the kernel would kill it (no manifest)
                            oom, failed_at = short, f"training step 1 of {w + n} (not started: estimated)"
                        for _ in range(w + n if short is None else 0):
                            loss = wl.train_step_async(batches)
                            rec.step(tokens=wl.last_tokens, loss=loss)
                            step_tokens.append((wl.last_tokens, wl.last_pad_tokens))
                except Exception as exc:
                    if not is_oom(exc):
                        raise
                    oom, failed_at = oom_text(exc), f"training step {rec.steps + 1} of {w + n}"
                    if early is not None:  # no recovery stage follows
                        early.stop()
                        early = None
                completed_steps = rec.steps
                for role, worker in (early.workers() if early is not None else {}).items():
                    held = dm.process_bytes(worker.proc.pid)  # what it held while the steps were measured
                    if held is not None:
                        early_device_bytes[role] = held
            result = rec.result
            trial["memory"] = measured.memory_table(est, result.memory, overhead, weights_measured, wl)
            trial["steps"] = result.steps_table()
            trial["stats"] = result.stats_table() if oom is None else {"skipped": f"the run did not fit ({failed_at})"}
            trained_tokens = sum(t for t, _ in step_tokens)
            if oom is None:
                measured.token_accounting(trial, step_tokens, w)
                measured.attention_mfu(trial["stats"], plan, config)
                if trial["stats"].get("loss_finite") is False:
                    say(f"the loss is not finite from measured step {trial['stats']['loss_first_nonfinite_step']}: "
                        "these steps are not a run to book on (check lr, precision and the data)")

            if oom is None and opts.recovery and config.recovery.enabled and early is None:
                early = _start_early(config, device, workdir, dm, manifest.get("models"), with_steps=False,
                                     start_bytes=host_start)
            if oom is None:
                with timer.phase("validation"):
                    trial["validation"] = _validation(wl, config, device)
                with timer.phase("checkpoint"):
                    trial["checkpoint"] = _checkpoint(wl, config, workdir, completed_steps)
            else:
                trial["validation"] = {"skipped": "the training step did not fit"}
                trial["checkpoint"] = {"skipped": "the training step did not fit"}
        else:
            trial["memory"] = {"estimate_skipped": "the model did not fit"}

        train_tokens_in_data = run.get("data", {}).get("train_tokens")
        tokens_per_step = trial.get("stats", {}).get("tokens_per_step") or config.tokens_per_step
        del wl
        wl = None
        release_memory(device)

        fit = _fit_table(oom, failed_at, trial.get("memory", {}).get("measured"), opts, dm, catalog, tested_card)
        if opts.find_max_batch:
            limit, limit_src = _search_limit(opts, dm, device)
            say(f"searching the largest micro-batch within {bytes_str(limit)} with {opts.headroom:.0%} headroom")
            with timer.phase("fit_search"):
                fit["search"] = find_max_batch(config, device, limit, limit_src, opts.headroom, opts.max_batch,
                                               progress=say, memory=dm)
        trial["fit"] = fit

        if not (opts.recovery and config.recovery.enabled):
            trial["recovery"] = {"skipped": "--no-recovery" if not opts.recovery else "trial.recovery.enabled = false"}
        elif oom is not None:
            trial["recovery"] = {"skipped": "the training step did not fit"}
        else:
            say("recoverability: checkpoint, restore in a fresh process, compare")
            with timer.phase("recovery"):
                trial["recovery"] = _recovery(config, device, workdir, trial, manifest.get("models"), say, early)
                early = None  # stopped by the stage
            if early_device_bytes and "phases" in trial["recovery"]:
                trial["recovery"]["phases"]["device_bytes_during_steps"] = early_device_bytes
            _determinism_cost(trial["recovery"], trial.get("stats", {}))

        if opts.scaling is not None:
            # The user asked for --nproc: a failed launch is their error to see (exit 2), not a note.
            say("scaling: DDP/FSDP against the single-device baseline (torchrun)")
            with timer.phase("scaling"):
                from capture.trial.scaling import run_scaling

                manifest["scaling"] = run_scaling(config, opts.scaling, workdir, start_bytes=host_start)

        stats = trial.get("stats", {})
        projection = _projection(opts, stats, trial, tokens_per_step, train_tokens_in_data, config, timer)
        price = resolve_price(opts.price_per_hour, tested_card)
        trial["cost"] = cost_table(timer=timer, wall_total_s=timer.total_s(), price=price,
                                   trained_tokens=trained_tokens, completed_steps=completed_steps,
                                   projection=projection, device_name=name)
        trial["cost"]["wall_clock_note"] = ("from the start of the trial command to the cost table; the report, "
                                            "signing and writing the manifest come after it")
        manifest["trial"] = trial

        terminal = ""
        if opts.report:
            scratch.pause_point("report")
            t_report = time.perf_counter()
            html, terminal, report_table = _report(manifest, output)
            report_table["duration_s"] = time.perf_counter() - t_report
            trial["report"] = report_table
        else:
            trial["report"] = {"skipped": "--no-report"}
        scratch.pause_point("manifest")
        write_manifest(output, manifest, opts.key, opts.principal)
        written = True
    finally:
        if early is not None:
            early.stop()
        if wl is not None:
            del wl
        scratch.remove(workdir)
        if html is not None and not written:
            html.unlink(missing_ok=True)  # a report without its manifest is half of a result
    return TrialOutcome(output, manifest, html, terminal)


# --------------------------------------------------------------------------- tables


def _run_table(config: TrialConfig, device: Any, name: str, wl: Any) -> dict[str, Any]:
    run: dict[str, Any] = {
        "name": config.name, "seed": config.seed, "device": str(device), "device_name": name, "method": config.method,
        "max_seq_len": config.batch.max_seq_len, "micro_batch_size": config.batch.micro_batch_size,
        "grad_accum": config.batch.grad_accum, "tokens_per_step": config.tokens_per_step,
        "warmup_steps": config.warmup_steps, "measured_steps": config.measured_steps,
        "validation_schedule": {"every_steps": config.validation.every_steps, "batches": config.validation.batches},
        "checkpoint_schedule": {"enabled": config.checkpoint.enabled, "every_steps": config.checkpoint.every_steps},
    }
    if wl is None:
        run["model"] = {"source": config.model.source}
        run["precision"] = {"dtype": config.precision.dtype, "autocast": config.precision.autocast}
        return run
    if device.type != "cuda":
        import torch

        run["cpu_threads"] = torch.get_num_threads()
    run["params_total"] = wl.params_total
    run["params_trainable"] = wl.params_trainable
    run["trainable_share"] = wl.params_trainable / wl.params_total if wl.params_total else 0.0
    run["params_source"] = "counted from the built model (shared weights once)"
    for key, value in wl.info.items():
        run[key] = value
    return run


def _validation(wl: Any, config: TrialConfig, device: Any) -> dict[str, Any]:
    if wl.val_source is None:
        return {"skipped": "trial.data.validation_fraction = 0: no held-out data"}
    batches = config.validation.batches
    state.sync(device)
    t0 = time.perf_counter()
    try:
        loss = wl.evaluate(batches)
    except Exception as exc:
        if not is_oom(exc):
            raise
        return {"skipped": f"validation did not fit: {oom_text(exc)}"}
    state.sync(device)
    dt = time.perf_counter() - t0
    tokens = batches * config.batch.micro_batch_size * config.batch.max_seq_len
    return {"duration_s": dt, "batches": batches, "tokens": tokens, "tokens_per_s": tokens / dt if dt else None,
            "loss": loss, "every_steps": config.validation.every_steps}


def _checkpoint(wl: Any, config: TrialConfig, workdir: Path, steps: int) -> dict[str, Any]:
    """One checkpoint written as the user's run writes it (``[trial.checkpoint] format``), timed:
    how long training is blocked and how long until the bytes are durable; then the optional
    timed copy to ``copy_to``."""
    from capture.trial import checkpoint_io

    c = config.checkpoint
    if not c.enabled:
        return {"skipped": "trial.checkpoint.enabled = false"}
    path = workdir / checkpoint_io.file_name(c.format)
    saved = state.capture_state(wl, wl.device, steps)  # what the recovery check writes: a LoRA run's adapter only
    state.sync(wl.device)
    try:
        timing = checkpoint_io.save(saved, path, c.format, wl.device.type)
    except checkpoint_io.NoSpace as exc:  # a result about this machine's disk, not a crash
        return {"skipped": f"not written: {exc}", "format": c.format,
                "model_state": "adapter" if state.is_adapter(wl.model) else "full"}
    out: dict[str, Any] = {"duration_s": timing.durable_s, "size_bytes": timing.size_bytes,
                           "bytes_per_s": timing.size_bytes / timing.durable_s if timing.durable_s else None,
                           "blocked_s": timing.blocked_s, "durable_s": timing.durable_s, "fsync": True,
                           "contents": sorted(k for k in saved if k not in ("format", "step")),
                           "model_state": "adapter" if state.is_adapter(wl.model) else "full", "format": c.format,
                           "every_steps": c.every_steps,
                           "note": "written to the trial's work folder (beside the manifest) and removed; "
                                   "durable_s includes fsync; blocked_s is how long training waits"}
    try:
        if c.copy_to:
            out["copy"] = checkpoint_io.copy_timed(path, config.resolve_path(c.copy_to))
    except OSError as exc:
        out["copy"] = {"destination": c.copy_to, "skipped": f"copy failed: {exc.strerror or exc}"}
    finally:
        checkpoint_io.remove(path)
    return out


def _search_limit(opts: TrialOptions, dm: Any, device: Any) -> tuple[int, str]:
    """The max-batch search's limit: :func:`_limit`, on a CPU no more than the process can get."""
    limit, src = _limit(opts, dm)
    if device.type == "cpu":
        return hostmem.search_limit(limit, src)
    return limit, src


def _limit(opts: TrialOptions, dm: Any) -> tuple[int, str]:
    if opts.memory_limit_bytes:
        return opts.memory_limit_bytes, "--memory-limit"
    total, src = dm.total_bytes()
    if total is None:
        raise UsageError("the device's memory size is unknown", "pass --memory-limit BYTES")
    return total, src


def _fit_table(oom: str | None, failed_at: str | None, measured: dict[str, Any] | None, opts: TrialOptions,
               dm: Any, catalog: Any, tested_card: Any) -> dict[str, Any]:
    limit, limit_src = _limit(opts, dm)
    headroom = opts.headroom
    out: dict[str, Any] = {"headroom": headroom, "limit_bytes": limit, "limit_source": limit_src}
    if oom is not None:
        out.update(fits=False, verdict=f"does not fit: out of memory at {failed_at}", oom=oom, failed_at=failed_at)
        return out
    used = (measured or {}).get("device_used_bytes")
    basis = (measured or {}).get("device_used_source", "")
    if used is None:
        used = (measured or {}).get("peak_reserved_bytes")
        basis = "peak reserved by the allocator (no device-level reading)"
    out["measured_bytes"] = used
    out["measured_basis"] = basis
    if used is None:
        out.update(fits=True, verdict="completed full steps; memory use unknown, headroom not checked")
        return out
    usable = int(limit * (1 - headroom))
    out["usable_bytes"] = usable
    if used <= usable:
        out.update(fits=True, verdict=f"fits: full steps completed with at least {headroom:.0%} of {limit_src} free")
    else:
        out.update(fits=False, verdict=f"does not fit with {headroom:.0%} headroom: used {used} bytes, usable {usable}")
    card_basis = basis if getattr(dm, "type", "") == "cuda" else f"{basis}; the CUDA context is not included"
    out["cards"] = cards_fit(used, headroom, catalog, tested_card, card_basis)
    out["cards_note"] = "memory only: cards that were not tested get no speed figures"
    return out


def _start_early(config: TrialConfig, device: Any, workdir: Path, dm: Any, models: Any,
                 with_steps: bool, start_bytes: int | None = None) -> EarlyWorkers | None:
    """The recovery stage's fresh processes, started early so that their imports overlap other
    work (capture.trial.recover.early_start says when): with the measured steps where they
    wait on an accelerator, cores are spare and the device gives per-process memory figures,
    else once they end, while validation, checkpoint and fit run. None where it is not this
    moment's turn, nothing to start, or no room on the host for their imports (``start_bytes``: a
    CPU's measured overhead, None: a process like this one)."""
    from capture.trial.recover import WITH_STEPS, early_start, start_early
    from capture.trial.recover_memory import room_to_start

    when = early_start(device, process_figures=dm.process_bytes(os.getpid()) is not None)
    if (when == WITH_STEPS) != with_steps:
        return None
    if not room_to_start(start_bytes):  # the host's, beside this process as it is now
        return None
    return start_early(config, device, workdir, models, when=when)


def _recovery(config: TrialConfig, device: Any, workdir: Path, trial: dict[str, Any], models: Any,
              say: Callable[[str], None], early: EarlyWorkers | None) -> dict[str, Any]:
    from capture.trial.recover import budget_from_trial, run_recoverability

    try:
        budget = budget_from_trial(trial, scratch=workdir)
        return run_recoverability(config, device, workdir, budget=budget, models=models, progress=say, early=early)
    except Exception as exc:  # a failed check is a result to record, not a reason to lose the others
        if isinstance(exc, CaptureError):
            raise
        log.debug("recoverability failed", exc_info=True)
        return {"skipped": f"recoverability check failed: {type(exc).__name__}: {exc}"}


def _determinism_cost(recovery: dict[str, Any], stats: dict[str, Any]) -> None:
    """Beside a deterministic recovery check: its step time against the run's own (the cost of determinism)."""
    det, user = recovery.get("step_time_median_s"), stats.get("step_time_median_s")
    if not (recovery.get("deterministic", {}).get("enabled") and isinstance(det, float) and isinstance(user, float)):
        return
    recovery["determinism_cost"] = {
        "step_time_deterministic_median_s": det, "step_time_run_settings_median_s": user,
        "ratio": det / user if user else None,
        "basis": "median step of the deterministic recovery reference (few steps, each waited for) against the "
                 "median measured step of the trial with the run's own settings ([trial.stats])"}


def _projection(opts: TrialOptions, stats: dict[str, Any], trial: dict[str, Any], tokens_per_step: int,
                train_tokens: int | None, config: TrialConfig, timer: PhaseTimer) -> Projection | None:
    if opts.target_tokens is None and opts.target_epochs is None:
        return None
    mean = stats.get("step_time_mean_s")
    if mean is None:
        return None
    if opts.target_tokens is not None:
        target, source = opts.target_tokens, "--target-tokens"
    else:
        if not train_tokens:
            return None
        target = int(opts.target_epochs * train_tokens)  # type: ignore[operator]
        source = f"--target-epochs {opts.target_epochs:g} x {train_tokens} training tokens in the data set"
    val = trial.get("validation", {}).get("duration_s")
    ckpt = trial.get("checkpoint", {}).get("duration_s")
    fixed = sum(timer.phases.get(k, 0.0) for k in ("import_framework", "device_context", "load"))
    return project(target, source, tokens_per_step, mean, val, config.validation.every_steps, ckpt,
                   config.checkpoint.every_steps, fixed)


def _report(manifest: dict[str, Any], output: Path) -> tuple[Path | None, str, dict[str, Any]]:
    from capture.trial import report

    html_path = output.with_suffix(".html")
    terminal = report.render_terminal(manifest)
    report.write_html(manifest, html_path)
    digest = hashlib.sha256(html_path.read_bytes()).hexdigest()
    return html_path, terminal, {"html": html_path.name, "html_sha256": digest}

"""train(cfg, plan, rt): the training run, top to bottom.

    topology -> data -> checks -> model + DeepSpeed engine -> resume -> run folder -> loop(step, eval, log, gc, save)
    -> save, export, plot

Nothing is written into run.out_dir before the model is built and the checkpoint loaded: every refusal comes first
(engine/run/folder.py says what the folder holds and why its files agree).
"""
from __future__ import annotations

import dataclasses
import gc
import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist

from configs import Plan, TrainConfig
from ds_ulysses_ext import init_topology
from ds_ulysses_ext.attention.masks import cu_seqlens_of

from ..checkpoints import checkpoint
from ..checkpoints.export import export_hf
from ..checkpoints.preemption import Preemption
from ..checkpoints.reshard import finish_reshard, needs_reshard, optimizer_layout, to_universal
from ..data import GlobalBatchSampler, build_dataset, collate, pad_id_of
from ..ds.build import build, is_moe, moe_step_end
from ..ds.config import effective_zero_stage
from ..ds.distributed import Runtime, cp_group_node_spans, cp_placement_warning
from ..ds.hf_config import hf_config_of, position_warning
from ..observe.flops import attention_sq, count_params, detect_peak_tflops, layer_windows, step_flops
from ..observe.host_memory import log_offload_estimate
from ..observe.nonfinite import NonFiniteStep, judge, skipped_warning
from ..observe.memory_report import log_memory_breakdown
from ..observe.memory_snapshot import check_device as check_snapshot_device, maybe_record_memory
from ..observe.oom import oom_advice
from ..observe.plot import plot_loss
from ..observe.profile import maybe_profile
from ..observe.tracking import Tracker
from ..observe.versions import installed, pinned, version_warning
from . import folder
from .evaluate import eval_set, evaluate
from .retrieval import log_retrieval
from .step import train_step

log = logging.getLogger(__name__)
FP8_SCALES = "fp8_scales"  # the checkpoint's file of fp8.recipe=delayed's amax history


def train(cfg: TrainConfig, plan: Plan, rt: Runtime) -> dict:
    out_dir = Path(cfg.run.out_dir)
    check_snapshot_device(cfg.logging.memory_snapshot_step, rt.device)  # before anything is built
    topo = init_topology(plan.cp, plan.ep, plan.ring)
    if rt.is_main:
        libraries = installed()
        log.info("libraries: %s", ", ".join(f"{k} {v}" for k, v in libraries.items()))
        if (mismatch := version_warning(libraries, pinned())):
            log.warning(mismatch)
    if rt.is_main and plan.cp > 1:
        log.info("cp layout: ring=%d (Ulysses groups of %d): %s", plan.ring, plan.cp // plan.ring, plan.ring_reason)
    placement = cp_placement_warning(cp_group_node_spans(plan.world_size, plan.cp), plan.cp)
    if placement and rt.is_main:
        log.warning(placement)

    # --- data: a step's samples depend only on (seed, data, global batch), never on the layout
    hf_config = hf_config_of(cfg.model).get_text_config()  # a VL checkpoint's language model: its text config
    long_positions = (position_warning(hf_config, plan.seq_len, plan.cp, plan.ring)
                      if cfg.model.source == "pretrained" else None)
    if long_positions and rt.is_main:
        log.warning(long_positions)
    dataset, stats, tokenizer = build_dataset(cfg.data, seed=cfg.run.seed, vocab_size=hf_config.vocab_size)
    num_train, eval_data, eval_indices = eval_set(cfg.data, dataset, cfg.run.seed, hf_config.vocab_size)
    sampler = GlobalBatchSampler(num_train, plan.global_batch_size, cfg.run.seed)
    pad_id = pad_id_of(tokenizer)
    if rt.is_main:
        log.info("data: %s", stats.summary())

    # --- resume point, checked before the model is built (refused if written with other model, data, seed or batch)
    fingerprint = checkpoint.resume_fingerprint(dataclasses.asdict(cfg))
    layout = optimizer_layout(plan.world_size, effective_zero_stage(cfg, plan.world_size), plan.ep)
    # verified first (every rank together): a damaged `latest` stops the run or falls back to an older checkpoint
    tag = checkpoint.resume_tag(out_dir, rt.rank, cfg.trainer.on_corrupt_checkpoint) if cfg.trainer.resume else None
    fell_back = tag is not None and tag != checkpoint.latest_tag(out_dir)  # read by every rank before `latest` moves
    load_root = None  # checkpoints/, unless a checkpoint of other ranks is re-partitioned first (a copy)
    if tag is not None:
        checkpoint.check_resume(out_dir, tag, fingerprint)
        saved_layout = needs_reshard(out_dir, tag, layout, cfg.trainer.reshard_on_resume)
        if saved_layout is not None:
            load_root = to_universal(out_dir, tag, rt.rank, saved_layout["zero_stage"])
    else:
        # an earlier run's outputs there must be movable aside
        folder.check_fresh_start(out_dir, cfg.model.path if cfg.model.source == "pretrained" else None)
    reshard = load_root is not None

    # --- model and engine; what offload will ask of the host is said first (a host OOM kills without an error)
    if rt.is_main:
        log_offload_estimate(cfg, plan, hf_config, log)
    engine, hf, scale = build(cfg, plan, topo, rt.device, load_universal=reshard)
    fp8_scales = getattr(engine.fp8_report, "scales", None)  # fp8.recipe=delayed's scale state, rolled every step
    fp8_warned = []  # the steps whose clamped operands were logged
    moe_aux_coef = cfg.moe.aux_loss_coef if is_moe(cfg) else None
    num_params = count_params(hf)
    peak_tflops = cfg.logging.peak_tflops or detect_peak_tflops(rt.device)

    # --- resume
    start = 0
    if tag is not None:
        start = checkpoint.load(engine, out_dir, tag, rt.rank, load_root)
        if reshard:
            finish_reshard(engine, out_dir, rt.rank, tag)
        if fp8_scales is not None:
            _resume_fp8_scales(fp8_scales, checkpoint.load_extra(out_dir, tag, rt.rank, FP8_SCALES), tag, rt.is_main)
        if fell_back:  # `latest` names the checkpoint this run continues, not the damaged one it stepped over
            checkpoint.settle_fallback(out_dir, tag, rt.rank)
        if rt.is_main:
            log.info("resumed from %s at step %d%s", tag, start, ", re-partitioned for these ranks" if reshard else "")

    # --- from here on this run writes the folder: an earlier run's outputs aside, or what the resume makes stale
    stop = min(cfg.trainer.max_steps, cfg.trainer.stop_after_steps or cfg.trainer.max_steps)
    if tag is None:
        folder.start_fresh(out_dir, rt.rank)
    else:
        folder.continue_at(out_dir, start, stop, rt.rank)
    run_config = {"config": dataclasses.asdict(cfg), "plan": dataclasses.asdict(plan)}
    if rt.is_main:
        folder.write_config(out_dir, run_config)
    holds = tag  # the checkpoint of this run's state now: the one it resumed from, then its own last save

    def save(at_step: int) -> None:
        # every save carries what a resume is checked against (settings, optimizer layout) and what an export of
        # it builds (the config), then prunes
        nonlocal holds
        checkpoint.save(engine, out_dir, at_step, rt.rank, fingerprint, keep=cfg.trainer.keep_checkpoints,
                        layout=layout, config=run_config,
                        extra={FP8_SCALES: fp8_scales.state_dict()} if fp8_scales is not None else None)
        holds = checkpoint.tag_of(at_step)
        preemption.saved()

    tracker = Tracker(out_dir, cfg.logging, rt.is_main, cfg.trainer.max_steps, start,
                      dataclasses.asdict(cfg))
    # automatic GC pauses one rank at a random moment and stalls every collective; collect together instead
    gc.disable()
    # signal handlers (restored in `finally`) and the run's clocks
    preemption = Preemption(cfg.trainer.save_every_minutes, cfg.trainer.max_minutes)
    out_of_time = False
    try:
        for step in range(start, stop):
            micro_batches = [collate([dataset[i] for i in idx], cfg.data.seq_len, pad_id)
                             for idx in sampler.local_indices(step, topo.dp_rank, plan.dp, plan.micro_batch_size)]
            lr = engine.get_lr()[0]
            _sync(rt.device)
            t0 = time.perf_counter()
            try:
                with maybe_profile(cfg.logging.profile_step, step + 1, out_dir, rt.rank, rt.device), \
                        maybe_record_memory(cfg.logging.memory_snapshot_step, step + 1, out_dir, rt.rank, rt.device):
                    result = train_step(engine, micro_batches, topo, scale, rt.device, pad_id,
                                        cfg.logging.phase_times, moe_aux_coef)
            except torch.OutOfMemoryError as err:
                raise torch.OutOfMemoryError(oom_advice(cfg, plan, step + 1, rt.device)) from err
            _sync(rt.device)
            dt = time.perf_counter() - t0
            record = _metrics(step + 1, result, lr, dt, rt, plan, num_params, hf_config, peak_tflops,
                              packed_attention_sq(micro_batches, hf_config, topo, rt.device))
            if step == start and getattr(engine, "fp8_report", None) is not None:  # each run's first row: what runs in FP8
                record["fp8"] = engine.fp8_report.as_dict()
            if step + 1 in (cfg.logging.profile_step, cfg.logging.memory_snapshot_step):
                record["profiled"] = True  # its step time includes the profiler's (or recorder's) overhead and export
            # once, what the device holds part by part: after the second step, the first with every part in place
            # (the optimizer allocates its states inside the first step, after that step's activation peak)
            if step == min(start + 1, stop - 1) and rt.is_main:
                record["memory_gib"] = log_memory_breakdown(engine, rt.device)
            skipped, fatal = judge(result, cfg.trainer.on_nonfinite)
            if skipped:
                record["skipped"] = True
            if moe_aux_coef is not None:  # MoE: the balance loss, the load figure, and the bias step of balance=bias
                record["moe_aux_loss"] = result.moe_aux_loss
                record.update(moe_step_end(hf, cfg, apply_bias=not (skipped or fatal)))
            if fp8_scales is not None:  # the amax history rolls once a step, after the optimizer's (collective)
                record.update(fp8_scales.finish_step())
                _warn_fp8_saturation(record, rt.is_main, fp8_warned)
            # one collective per step: a signal, a timed checkpoint, the wall-time limit (the last ends the run here)
            stop_now, save_due, out_of_time = preemption.agreed(rt.device, rt.is_main)
            last = step + 1 == cfg.trainer.max_steps or (out_of_time and not stop_now)
            every = cfg.trainer.eval_every
            if not fatal and every and ((step + 1) % every == 0 or last):
                t_eval = time.perf_counter()
                record["eval_loss"], record["eval_tokens"] = evaluate(
                    engine, eval_data, eval_indices, topo, plan.dp, plan.micro_batch_size,
                    cfg.data.seq_len, pad_id, rt.device)
                if cfg.data.source == "passkey":  # the held-out grid's exact match, and its heatmap
                    scored = log_retrieval(engine, tokenizer, cfg, plan, topo, pad_id, rt, tracker, step + 1)
                    record["retrieval_acc"] = scored["mean_accuracy"]
                    record["retrieval_token_acc"] = scored["mean_token_accuracy"]
                record["eval_time_s"] = time.perf_counter() - t_eval
            tracker.log(record)
            if fatal:  # logged first, so the bad step is on record; raised before any save
                raise NonFiniteStep(step + 1, result, checkpoint.latest_tag(out_dir))
            if skipped and rt.is_main:
                log.warning(skipped_warning(step + 1, result))
            if cfg.trainer.gc_every and (step + 1) % cfg.trainer.gc_every == 0:
                gc.collect()
            if save_due or (cfg.trainer.save_every and (step + 1) % cfg.trainer.save_every == 0):
                save(step + 1)
            if step + 1 < stop and stop_now:
                if holds != checkpoint.tag_of(step + 1):
                    save(step + 1)
                return {"preempted_at": step + 1}
            if out_of_time and step + 1 < stop:
                stop = step + 1
                if rt.is_main:
                    log.warning("trainer.max_minutes=%g reached after step %d of %d: ending the run here (final "
                                "checkpoint and export; the lr schedule was planned for trainer.max_steps)",
                                cfg.trainer.max_minutes, stop, cfg.trainer.max_steps)
                break
    finally:
        tracker.close()
        preemption.restore()
        gc.enable()
    if stop < cfg.trainer.max_steps and not out_of_time:  # stop_after_steps (tests of resume): no final save/export
        return {"stopped_at": stop}

    # --- end of run: checkpoint, HF export, loss plot
    outputs = {"metrics": str(out_dir / "metrics.jsonl")}
    # this run's own state, never a checkpoint of the same step that `latest` may name from another run
    if cfg.trainer.save_at_end and holds != checkpoint.tag_of(stop):
        save(stop)
    if cfg.trainer.export_hf:
        record = {"step": stop, "checkpoint": holds if holds == checkpoint.tag_of(stop) else None, **run_config}
        outputs["hf_export"] = str(export_hf(engine, hf, out_dir / "hf_export", rt.rank, tokenizer, record))
    if rt.is_main and (out_dir / "metrics.jsonl").exists():
        outputs["loss_plot"] = str(plot_loss(out_dir / "metrics.jsonl", out_dir / "loss.png"))
    dist.barrier()
    return outputs


def _resume_fp8_scales(scales, state, tag: str, is_main: bool) -> None:
    if state is not None:
        scales.load_state_dict(state)
    elif is_main:
        log.warning("checkpoint %s holds no fp8.recipe=delayed amax history (written with another precision or "
                    "recipe): the first step after the resume takes dynamic scales", tag)


def _warn_fp8_saturation(record: dict, is_main: bool, warned: list) -> None:
    """Transformer Engine clamps silently where an operand outgrows its delayed scale; here every step's row counts
    such operands (fp8_saturated), and the log says so: the first such step, then at most once per 100 steps."""
    if not (is_main and (record.get("fp8_saturated") or record["fp8_nonfinite_amax"])):
        return
    if warned and record["step"] < warned[-1] + 100:
        return
    warned.append(record["step"])
    which = ", ".join(f"{name} x{n}" for name, n in sorted(record.get("fp8_saturated_by_operand", {}).items()))
    log.warning("step %d: fp8.recipe=delayed: %d operand(s) clamped at the float8 range (%s; amax up to %.3gx what its "
                "scale covered), %d non-finite amax(es) left out of the history; metrics.jsonl counts them every step "
                "(fp8_saturated); a longer fp8.amax_history covers more of a growing range", record["step"],
                record.get("fp8_saturated", 0), which or "none", record.get("fp8_amax_over_scale", 0.0),
                record["fp8_nonfinite_amax"])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def packed_attention_sq(micro_batches, hf_config, topo, device):
    """Packed rows: the global batch's attention_sq by document (one all-reduce of a scalar); else None."""
    if "position_ids" not in micro_batches[0]:
        return None
    windows = layer_windows(hf_config)
    local = 0.0
    for mb in micro_batches:
        bounds = cu_seqlens_of(mb["position_ids"]).tolist()
        local += attention_sq([b - a for a, b in zip(bounds[:-1], bounds[1:])], windows)
    total = torch.tensor([local], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(total)
    return total.item() / topo.cp_size  # the ranks of a CP group hold the same rows


def _metrics(step, result, lr, dt, rt: Runtime, plan: Plan, num_params, hf_config, peak_tflops,
             attn_sq=None) -> dict:
    seq_len = result.input_tokens // plan.global_batch_size
    flops = step_flops(num_params, hf_config, plan.global_batch_size, seq_len, attn_sq)
    tflops = flops / dt / rt.world_size / 1e12
    mfu = tflops / peak_tflops if peak_tflops else None
    if mfu is not None and mfu > 1.0:
        raise RuntimeError(f"measured MFU {mfu:.0%} exceeds 100%: the token count or context parallelism is "
                           f"broken (FLOPs per step {flops:.3e} for {result.input_tokens} tokens in {dt:.3f} s)")
    peak, reserved = _memory(rt.device)
    return {"step": step, "loss": result.loss, "grad_norm": result.grad_norm, "lr": lr, "tokens": result.tokens,
            "input_tokens": result.input_tokens, "step_time_s": dt,
            "tokens_per_sec_per_gpu": result.input_tokens / dt / rt.world_size,
            "tflops_per_gpu": tflops, "mfu": mfu, "peak_mem_gib": peak, "peak_reserved_gib": reserved,
            **{f"time_{k}_s": v for k, v in result.phase_s.items()}}


def _memory(device: torch.device) -> tuple[float, float]:
    if device.type != "cuda":
        import resource  # CPU runs: the process's peak resident memory (Linux reports KiB)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        return rss, rss
    return torch.cuda.max_memory_allocated(device) / 2**30, torch.cuda.max_memory_reserved(device) / 2**30

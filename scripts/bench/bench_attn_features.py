#!/usr/bin/env python3
"""Kernel side of the attention features on one GPU: the ring's per-block kernels and sliding windows at 128k.

    python3 scripts/bench/bench_attn_features.py --parts ring,window           # one H200, bf16, Llama-3.2-1B shape
    python3 scripts/bench/bench_attn_features.py --device cpu --seq 256 --rings 2,4 --windows 32,8 --sink-windows 8 \
        --reps 1 --query-block 48 --mask-block 64 --check                    # smoke test + exactness check, CPU

Shape: B=1, Hq=32, Hkv=8, head dim 64 (Llama-3.2-1B attention), causal, forward + backward (dout given), bf16 on
CUDA, fp32 on CPU. Every variant runs on the same tensors, interleaved (A B C A B C ...) so clock and thermal drift
hit all alike; each reported time is the median of its repetitions, timed with torch.cuda.synchronize around the
call. Anchor in every row: ONE full-sequence causal SDPA call (ds_ulysses_ext.attention.backends.sdpa_attention, cuDNN on
Hopper), forward + backward, the same call. One JSON line per result, prefixed RESULT, also appended to --out.

Parts:
  ring         A ring of R ranks simulated on one GPU, no communication. `ring_torch` is what ring.py runs: its
               _ring_forward and _ring_backward (the zigzag step slices, the exact torch block kernel of fp32 logits,
               QUERY_BLOCK query rows at a time, the fp32 online-softmax merge, the fp32 dK|dV accumulator) for ring
               rank 0, with a stand-in ring that hands over the next rank's K|V share instead of receiving it. Every
               ring rank does the same work (zigzag balances it; the torch kernel computes each block whole, masked),
               so the ring's kernel time for the whole sequence is R x rank 0's (`--ring-ranks all` runs every rank
               instead). `ring_sdpa_blocks` is a projection, not what ring.py runs: the same blocks of every rank
               through SDPA (step 0 causal over the rank's share, later steps a half block with no mask), forward +
               backward each, plus the fp32 merge arithmetic on stand-in log-sum-exps: what the kernel side would cost
               with a flash kernel per block (the issue's 10% target is about this).
  window       A sliding-window layer through our attention path at cp=1 (backends.local_attention: on CUDA in bf16
               flash_varlen.py, torch's varlen flash kernel with the window as its reach, sinks on its log-sum-exp;
               elsewhere masks.py's torch path) against full causal SDPA, and against masks.py's torch path itself
               (SDPA on query blocks whose key span starts at the window's reach; with --sink-windows also GPT-OSS's
               sinks as one extra key).
  documents    (not in the default parts) one row of --seq tokens packed with chat-like documents (lognormal
               lengths, median 600, 16..16384): the shipped path (as for window) against masks.py's per-document
               torch path and one full causal call over the row.
  ring_documents  (not in the default parts) ring.py at rank 0 with that packed row: one varlen call per block
               against one fused call per document part, and against the ring without documents.
  ring_window  (not in the default parts) ring.py's torch kernel with a window at ring R, rank 0 (steps the window
               hides entirely are skipped) against ring.py without a window.
--check (CPU or GPU): the simulation of every rank reassembles exact attention: outputs and dq/dk/dv against full
causal SDPA (and, with a window, against masks.py's torch path) at rel 1e-5 in fp32, before any timing.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))
import ds_ulysses_ext.attention.ring_blocks as blocks_mod  # noqa: E402
import ds_ulysses_ext.attention.ring_varlen as varlen_mod  # noqa: E402
from ds_ulysses_ext.attention import flash_varlen  # noqa: E402
from ds_ulysses_ext.attention.backends import local_attention, sdpa_attention  # noqa: E402
from ds_ulysses_ext.attention.masks import cu_seqlens_of as masks_cu_seqlens, masked_attention  # noqa: E402
from ds_ulysses_ext.attention.ring_blocks import BlockMask  # noqa: E402
from ring_sim import check_ring, kv_shares, rank_inputs, ring_rank, ring_sdpa_blocks  # noqa: E402


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device):
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


# --- the parts ----------------------------------------------------------------------------------------------


def interleaved(variants, reps, device, budget_s):
    """({name: [seconds]}, {name: warm-up seconds}): one warm-up call each, then reps rounds of A B C ... A variant
    whose warm-up says its repetitions would overrun budget_s gets fewer (none when the warm-up alone took longer:
    its time is then the warm-up's, flagged by reps 0), so one slow variant cannot eat the device call."""
    warm, errors = {}, {}
    for name, fn in variants.items():
        try:
            warm[name] = timed(fn, device)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: report it, keep the other variants
            errors[name] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"variant {name} failed: {errors[name]}", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    left = {name: min(reps, int(budget_s / max(w, 1e-9))) for name, w in warm.items()}
    times = {name: [] for name in warm}
    for i in range(reps):
        for name in warm:
            if i < left[name]:
                times[name].append(timed(variants[name], device))
    return times, warm, errors


def medians(times, warm, errors):
    med = {n: statistics.median(t) if t else warm[n] for n, t in times.items()}
    return {**med, **{n: None for n in errors}}


def ms(x):
    return None if x is None else x * 1e3


def ratio(a, b):
    return None if a is None or b is None else a / b


def pct(a, b):
    return None if a is None or b is None else (a / b - 1) * 100


def sdp_choice(q_BhSD, k_BhSD, mask=None, causal=True):
    """The kernel SDPA picks for these shapes (cuDNN, flash, efficient, math), as anchor-bench records it."""
    try:
        from torch.nn.attention import SDPBackend
        return SDPBackend(torch._fused_sdp_choice(q_BhSD, k_BhSD, k_BhSD, mask, 0.0, causal and mask is None,
                                                  scale=None, enable_gqa=q_BhSD.shape[1] != k_BhSD.shape[1])).name
    except Exception as e:  # noqa: BLE001 - a private API: report, do not fail the run
        return f"n/a ({type(e).__name__})"


def window_block_kernel(q_BShD, k_BShD, bq, w, with_sinks):
    qb, kb = q_BShD[:, :bq].transpose(1, 2), k_BShD[:, :min(q_BShD.shape[1], bq + w - 1)].transpose(1, 2)
    if with_sinks:
        Dp = -(-(qb.shape[-1] + 1) // 8) * 8
        qb, kb = F.pad(qb, (0, Dp - qb.shape[-1])), F.pad(kb, (0, Dp - kb.shape[-1], 0, 1))
    mask = torch.ones(1, 1, qb.shape[2], kb.shape[2], dtype=torch.bool, device=qb.device)
    return ("sink key + " if with_sinks else "") + sdp_choice(qb, kb, mask)


def causal_flops(S, hq, D):
    return 3.5 * 2 * 2 * hq * S * S * D / 2  # causal forward (QK^T and PV) + 2.5x for backward, bench_attention's


def part_ring(args, q, k, v, dout, anchor, base):
    S = q.shape[2]
    for R in args.rings:
        shares = kv_shares(k, v, R)
        prepared = [rank_inputs(q, k, v, dout, R, r, None, shares) for r in range(R)]
        ranks = range(R) if args.ring_ranks == "all" else [0]

        def ring_torch():
            for r in ranks:
                ring_rank(q, k, v, dout, R, r, prepared=prepared[r])

        def sdpa_blocks():
            ring_sdpa_blocks(q, k, v, dout, R, prepared)

        times, warm, errors = interleaved({"anchor": anchor, "ring_torch": ring_torch,
                                           "ring_sdpa_blocks": sdpa_blocks}, args.reps, q.device, args.budget_s)
        med = medians(times, warm, errors)
        scale = R / len(ranks)  # one rank's work x R when only rank 0 ran
        torch_all = None if med["ring_torch"] is None else med["ring_torch"] * scale
        L = S // R
        (qr, kr, _, _), _, _, _ = prepared[0]
        emit(args, dict(base, part="ring", ring=R, anchor="sdpa full causal, one call",
                        anchor_ms=ms(med["anchor"]),
                        anchor_tflops=ratio(causal_flops(S, args.hq, args.head_dim) / 1e12, med["anchor"]),
                        # "ring_torch" is ring.py as shipped: its block kernel is the fused one (CUDA bf16/fp16,
                        # ring_blocks.CUDA_KERNELS, checked at first use) where it takes the blocks, else the torch one
                        ring_block_kernel=getattr(blocks_mod._fused_kernel(qr), "__name__", "exact torch"),
                        ring_torch_ranks_run=len(ranks), ring_torch_ms_measured=ms(med["ring_torch"]),
                        ring_torch_ms_all_ranks=ms(torch_all), ring_torch_overhead_pct=pct(torch_all, med["anchor"]),
                        # the torch kernel computes step 0's share block whole (masked) and each later half block:
                        # S^2 (R + 1) / (2R) logits over all ranks, against S^2 / 2 for the causal triangle
                        ring_torch_work_vs_causal=(R + 1) / R,
                        ring_sdpa_blocks_ms_all_ranks=ms(med["ring_sdpa_blocks"]),
                        ring_sdpa_blocks_overhead_pct=pct(med["ring_sdpa_blocks"], med["anchor"]),
                        sdpa_block_kernels=dict(step0_causal=sdp_choice(qr, kr) if q.is_cuda else "cpu",
                                                half_block=sdp_choice(qr[:, :, L // 2:], kr.contiguous(), causal=False)
                                                if q.is_cuda else "cpu"),
                        query_block=blocks_mod.QUERY_BLOCK, reps={n: len(t) for n, t in times.items()},
                        warmup_ms={n: ms(w) for n, w in warm.items()}, errors=errors,
                        times_ms={n: [ms(x) for x in t] for n, t in times.items()}))
        prepared = shares = None  # free this ring size's shares before the next


def part_window(args, leaves, anchor, base):
    qs, ks, vs, ds = leaves  # [B S h D], what the attention path takes; q, k, v require grad
    S = qs.shape[1]
    g = torch.Generator(device=qs.device).manual_seed(1)
    sinks = (torch.randn(args.hq, device=qs.device, generator=g) * 2).to(qs.dtype).requires_grad_()
    configs = [(w, False) for w in args.windows] + [(w, True) for w in args.sink_windows]
    variants = {"anchor": anchor}
    for w, with_sinks in configs:
        for road, fn in (("", local_attention), ("_torch", None)):
            def run(w=w, with_sinks=with_sinks, fn=fn):
                for t in (qs, ks, vs, sinks):
                    t.grad = None
                kw = dict(causal=True, window=w, sinks=sinks if with_sinks else None)
                out = fn(args.backend, qs, ks, vs, **kw) if fn else masked_attention(qs, ks, vs, **kw)
                out.backward(ds)
            variants[f"w{w}{'+sinks' if with_sinks else ''}{road}"] = run
    times, warm, errors = interleaved(variants, args.reps, qs.device, args.budget_s)
    med = medians(times, warm, errors)
    bq = min(args.mask_block, S)
    for w, with_sinks in configs:
        name = f"w{w}{'+sinks' if with_sinks else ''}"
        emit(args, dict(base, part="window", window=w, sinks=with_sinks, backend=args.backend,
                        path=shipped_path(args, qs), torch_path=f"masks.masked_attention (query blocks of "
                                                                f"{args.mask_block})",
                        anchor="sdpa full causal, one call",
                        anchor_ms=ms(med["anchor"]), window_ms=ms(med[name]),
                        speedup_vs_full=ratio(med["anchor"], med[name]),
                        torch_path_ms=ms(med[name + "_torch"]),
                        speedup_vs_torch_path=ratio(med[name + "_torch"], med[name]),
                        # the kernel SDPA takes for one full query block of the torch path (bool mask, key span
                        # bq + w - 1); with sinks, the same block as masks.py's sink operands make it (head dim
                        # padded to a multiple of 8, one more key)
                        block_kernel=window_block_kernel(qs, ks, bq, w, with_sinks),
                        # keys a query sees at most: min(q + 1, window); the visible pairs against the causal triangle
                        visible_pairs_vs_causal=min(1.0, (w * S - w * (w - 1) / 2) / (S * (S + 1) / 2)),
                        reps=len(times.get(name, [])), warmup_ms=ms(warm.get(name)), error=errors.get(name),
                        times_ms=[ms(x) for x in times.get(name, [])],
                        anchor_times_ms=[ms(x) for x in times.get("anchor", [])]))


def shipped_path(args, q_BShD) -> str:
    # what backends.local_attention runs for a window, sinks or documents under args.backend
    if args.backend in ("sdpa", "auto") and flash_varlen.usable(q_BShD):
        return "backends.local_attention -> flash_varlen (torch's varlen flash kernel, one call)"
    return f"backends.local_attention ({args.backend})"


def chat_lengths(total, seed=0, median=600, sigma=1.0, lo=16, hi=16384):
    """Document lengths drawn like a chat set (lognormal, median 600, clipped), filling `total` tokens exactly."""
    g = torch.Generator().manual_seed(seed)
    lengths, left = [], total
    while left > 0:
        n = int(torch.exp(torch.randn((), generator=g) * sigma + math.log(median)).clamp(lo, hi))
        lengths.append(min(n, left))
        left -= lengths[-1]
    return lengths


def part_documents(args, leaves, anchor, base):
    """One row of S tokens packed with chat-like documents: the shipped path against masks.py's torch path and one
    full causal call over the row (what an unpacked row of S costs)."""
    qs, ks, vs, ds = leaves
    S = qs.shape[1]
    lengths = chat_lengths(S)
    pos = torch.cat([torch.arange(n, device=qs.device) for n in lengths])[None]
    cu = masks_cu_seqlens(pos)
    for t in (qs, ks, vs):
        t.grad = None

    def run(fn):
        def go():
            for t in (qs, ks, vs):
                t.grad = None
            if fn is None:
                out = masked_attention(qs, ks, vs, causal=True, cu_seqlens=cu)
            else:
                out = fn(args.backend, qs, ks, vs, causal=True, cu_seqlens=cu, max_seqlen=max(lengths))
            out.backward(ds)
        return go

    times, warm, errors = interleaved({"anchor": anchor, "shipped": run(local_attention), "torch": run(None)},
                                      args.reps, qs.device, args.budget_s)
    med = medians(times, warm, errors)
    visible = sum(n * (n + 1) / 2 for n in lengths) / (S * (S + 1) / 2)
    emit(args, dict(base, part="documents", documents=len(lengths), median_len=sorted(lengths)[len(lengths) // 2],
                    max_len=max(lengths), path=shipped_path(args, qs), anchor="sdpa full causal, one call",
                    anchor_ms=ms(med["anchor"]), shipped_ms=ms(med["shipped"]), torch_path_ms=ms(med["torch"]),
                    speedup_vs_torch_path=ratio(med["torch"], med["shipped"]),
                    speedup_vs_full=ratio(med["anchor"], med["shipped"]), visible_pairs_vs_causal=visible,
                    errors=errors, reps={n: len(t) for n, t in times.items()}))


def part_ring_documents(args, q, k, v, dout, base):
    """ring.py at rank 0 with a row of packed chat-like documents (as in part documents): one varlen call per block
    (ring_varlen._VarlenBlock) against one fused call per document part, and against the ring without documents."""
    from ds_ulysses_ext.attention.masks import document_ids
    S = q.shape[2]
    lengths = chat_lengths(S)
    cu = masks_cu_seqlens(torch.cat([torch.arange(n, device=q.device) for n in lengths])[None])
    doc = document_ids(cu, 1, S)
    saved = varlen_mod.VARLEN_PARTS
    for R in args.rings:
        shares = kv_shares(k, v, R)
        plain = rank_inputs(q, k, v, dout, R, 0, None, shares)
        packed = rank_inputs(q, k, v, dout, R, 0, None, shares, doc)

        def with_parts(n, prepared):
            def run():
                varlen_mod.VARLEN_PARTS = n
                ring_rank(q, k, v, dout, R, 0, prepared=prepared)
            return run
        variants = {"ring": with_parts(saved, plain), "varlen": with_parts(0, packed),
                    "per_part": with_parts(1 << 30, packed)}
        times, warm, errors = interleaved(variants, args.reps, q.device, args.budget_s)
        varlen_mod.VARLEN_PARTS = saved
        med = medians(times, warm, errors)
        emit(args, dict(base, part="ring_documents", ring=R, rank=0, documents=len(lengths),
                        anchor="ring.py at rank 0, no documents", anchor_ms=ms(med["ring"]),
                        varlen_ms=ms(med["varlen"]), per_part_ms=ms(med["per_part"]),
                        varlen_vs_per_part=ratio(med["per_part"], med["varlen"]),
                        varlen_vs_no_documents=ratio(med["ring"], med["varlen"]),
                        shipped="varlen" if varlen_mod.varlen_block(
                            packed[0][0], BlockMask(True, packed[1].q_pos, packed[1].q_pos, doc)) is not None
                        else "per part", errors=errors, reps={n: len(t) for n, t in times.items()}))


def part_ring_window(args, q, k, v, dout, base):
    for R in args.rings:
        for w in args.windows:
            shares = kv_shares(k, v, R)
            plain = rank_inputs(q, k, v, dout, R, 0, None, shares)
            windowed = rank_inputs(q, k, v, dout, R, 0, w, shares)
            calls = {"n": 0}
            forward = blocks_mod.block_forward

            def counting(*a):
                calls["n"] += 1
                return forward(*a)

            blocks_mod.block_forward = counting
            ring_rank(q, k, v, dout, R, 0, prepared=windowed)
            blocks_mod.block_forward = forward
            variants = {"ring_torch": lambda: ring_rank(q, k, v, dout, R, 0, prepared=plain),
                        "ring_torch_window": lambda: ring_rank(q, k, v, dout, R, 0, prepared=windowed)}
            times, warm, errors = interleaved(variants, args.reps, q.device, args.budget_s)
            med = medians(times, warm, errors)
            emit(args, dict(base, part="ring_window", ring=R, window=w, rank=0, anchor="ring.py at rank 0, no window",
                            anchor_ms=ms(med["ring_torch"]), window_ms=ms(med["ring_torch_window"]),
                            speedup=ratio(med["ring_torch"], med["ring_torch_window"]), errors=errors,
                            block_calls_forward=f"{calls['n']} of {R}", reps={n: len(t) for n, t in times.items()}))


def emit(args, row):
    row["date"] = time.strftime("%Y-%m-%d %H:%M")
    line = json.dumps(row)
    print("RESULT " + line, flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "a") as f:
            f.write(line + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="ring,window", help="comma list of ring, window, ring_window, documents")
    ap.add_argument("--seq", type=int, default=131072)
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--rings", default="2,4")
    ap.add_argument("--ring-ranks", default="one", choices=["one", "all"],
                    help="ring_torch: rank 0's work x R (one) or every rank's (all)")
    ap.add_argument("--windows", default="4096,128")
    ap.add_argument("--sink-windows", default="128", help="windows also run with GPT-OSS sinks ('' for none)")
    ap.add_argument("--backend", default="sdpa", help="the window part's backend (sdpa: masks.py's torch path)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=30.0, help="most seconds of repetitions per variant and part")
    ap.add_argument("--query-block", type=int, default=None, help="ring.py's QUERY_BLOCK (default: its own)")
    ap.add_argument("--mask-block", type=int, default=None, help="masks.py's QUERY_BLOCK (default: its own)")
    ap.add_argument("--check", action="store_true", help="first check the simulation against exact attention")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=os.path.join(os.environ["OUT"], "attn_features.jsonl") if os.environ.get("OUT")
                    else None)
    args = ap.parse_args()
    args.rings = [int(x) for x in args.rings.split(",") if x]
    args.windows = [int(x) for x in args.windows.split(",") if x]
    args.sink_windows = [int(x) for x in args.sink_windows.split(",") if x]
    if args.query_block:
        blocks_mod.QUERY_BLOCK = args.query_block
    import ds_ulysses_ext.attention.masks as masks_mod
    if args.mask_block:
        masks_mod.QUERY_BLOCK = args.mask_block
    args.mask_block = masks_mod.QUERY_BLOCK
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    S, D = args.seq, args.head_dim
    for R in args.rings:
        if S % (2 * R):
            raise SystemExit(f"--seq {S} must be a multiple of 2 x ring = {2 * R} (zigzag chunks)")
    parts = [p for p in args.parts.split(",") if p]
    failed = []
    if args.check:  # fp32 on the check's own small tensors
        gen = torch.Generator(device=device).manual_seed(0)
        Sc = math.lcm(*(2 * R for R in args.rings)) * 8
        qc, kc, vc, dc = (torch.randn(1, h, Sc, D, device=device, generator=gen)
                          for h in (args.hq, args.hkv, args.hkv, args.hq))
        saved = blocks_mod.QUERY_BLOCK
        blocks_mod.QUERY_BLOCK = 5  # several query blocks per ring block
        for R in args.rings:
            for w in [None] + [max(1, Sc // (4 * R)), 3]:
                try:
                    rels = check_ring(qc, kc, vc, dc, R, w)
                    print(f"check ring={R} window={w} S={Sc}: exact, rel {max(rels.values()):.1e}", flush=True)
                except AssertionError as e:  # the timings below still stand; the exit status says it failed
                    failed.append(str(e))
                    print(f"CHECK FAILED: {e}", flush=True)
        blocks_mod.QUERY_BLOCK = saved
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, dout = (torch.randn(1, h, S, D, device=device, dtype=dtype, generator=gen)
                     for h in (args.hq, args.hkv, args.hkv, args.hq))  # [B h S D], ring.py's layout
    qs, ks, vs = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))  # [B S h D] leaves
    ds = dout.transpose(1, 2)

    def anchor():
        for t in (qs, ks, vs):
            t.grad = None
        sdpa_attention(qs, ks, vs, causal=True, softmax_scale=None).backward(ds)

    base = dict(S=S, hq=args.hq, hkv=args.hkv, D=D, dtype=str(dtype).replace("torch.", ""), torch=torch.__version__,
                device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                anchor_kernel=sdp_choice(q, k) if device.type == "cuda" else "math (cpu)")
    for part in parts:
        print(f"=== part {part} {time.strftime('%T')}", flush=True)
        if part == "ring":
            part_ring(args, q, k, v, dout, anchor, base)
        elif part == "window":
            part_window(args, (qs, ks, vs, ds), anchor, base)
        elif part == "ring_window":
            part_ring_window(args, q, k, v, dout, base)
        elif part == "documents":
            part_documents(args, (qs, ks, vs, ds), anchor, base)
        elif part == "ring_documents":
            part_ring_documents(args, q, k, v, dout, base)
        else:
            raise SystemExit(f"unknown part {part!r}: choose from ring, window, ring_window, documents, "
                             "ring_documents")
        if device.type == "cuda":
            print(f"peak GPU memory so far {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB", flush=True)
    if failed:
        raise SystemExit(f"{len(failed)} exactness check(s) failed: {failed}")


if __name__ == "__main__":
    main()

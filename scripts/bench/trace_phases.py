#!/usr/bin/env python3
"""Where one profiled step's time goes, phase by phase, from the Chrome trace that logging.profile_step writes.

    python3 scripts/bench/trace_phases.py outputs/run/profile_step4_rank0.json [--top 15]

torch.profiler's op table sums over the whole step; it cannot say which phase an op ran in, nor whether the
GPU sat idle waiting for the host. For each phase.* range (engine/observe/profile.py marks forward, backward and
optimizer) this prints:
- host side: the span, the top-level operators by total time, and how many kernels were launched;
- device side (CUDA traces): the span of the phase's GPU range, the time kernels and copies kept the GPU
  busy in it (the union of their intervals), the idle remainder (host-bound time), and the kernels by total time;
- device work by launch: the kernels and copies whose launch (matched by its correlation id) lies in the
  phase's host span, from any thread, rolled up by kind (GEMM, attention, copy, ...). The GPU range of
  phase.backward holds almost nothing: autograd launches backward's kernels from its own thread, outside the
  main thread's range, so only this view says what backward's GPU time was spent on. Its span runs from the
  first such kernel's start to the last one's end, and its idle time is what the span's union of busy intervals
  leaves (side-stream copies overlapping compute count once);
- last, the whole step's device side: from the first phase's first kernel to the last phase's last one, busy and
  idle as above (idle time between phases shows only here); and the step's two ends: how long the GPU waited
  for the host's first kernel after the step's first operator (sharding, copies, the token count), and how long
  the host went on after the last kernel (the loss and norm read back, the all-reduces). The profiler wraps one
  train_step, which starts and ends on an idle GPU, so both ends are time the GPU spends idle in every step.
"""
import argparse
import json
from collections import defaultdict

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def _within(e, lo, hi):
    return lo <= e["ts"] and e["ts"] + e.get("dur", 0) <= hi + 1e-3


def _top_level(ops):
    """Operators not nested in another operator of the same thread (their times do not double count)."""
    out, ends = [], {}
    for e in sorted(ops, key=lambda e: (e["ts"], -e.get("dur", 0))):
        key = (e.get("pid"), e.get("tid"))
        if e["ts"] >= ends.get(key, -1.0):
            out.append(e)
            ends[key] = e["ts"] + e.get("dur", 0)
    return out


def _table(events, top):
    by = defaultdict(lambda: [0.0, 0])
    for e in events:
        by[e["name"]][0] += e.get("dur", 0)
        by[e["name"]][1] += 1
    rows = sorted(by.items(), key=lambda kv: -kv[1][0])[:top]
    return [f"    {ms(d):>9} ms  x{n:<5} {name[:100]}" for name, (d, n) in rows]


# (kind, substrings of a kernel's name), first match wins: attention before GEMM (FA4's kernels are CUTLASS ones),
# torch's own kernels (at::native) before the rest, which are Triton's (Liger's, ours: ce_rows, _adamw, ...)
KINDS = (("attention", ("flash", "fmha", "sdpa", "attention")),
         ("gemm", ("nvjet", "gemm", "Gemm", "xmma", "cutlass")),
         ("copy", ("copy", "Memcpy", "Memset", "CatArray")),
         ("torch elementwise / reduce", ("at::native", "elementwise", "reduce", "Reduce", "SoftMax", "multi_tensor")))


def kind(name: str) -> str:
    return next((k for k, subs in KINDS if any(s in name for s in subs)), "Triton and other")


def _union(events):
    """(span, busy) of device events in us: first start to last end, and the length of the union of intervals."""
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events)
    busy, end = 0.0, -float("inf")
    for lo, hi in spans:
        if hi > end:
            busy += hi - max(lo, end)
            end = hi
    return end - spans[0][0], busy


def ms(us):
    return f"{us / 1000:.2f}"


def report(events, top):
    lines = []
    phases = sorted((e for e in events if e.get("name", "").startswith("phase.") and e.get("ph") == "X"),
                    key=lambda e: e["ts"])
    cpu_ops = [e for e in events if e.get("cat") == "cpu_op" and e.get("ph") == "X"]
    # cuBLAS launches through the driver API (cuLaunchKernelEx, category cuda_driver), the rest through the runtime
    api = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    launches = [e for e in api if "Launch" in e.get("name", "")]
    device = [e for e in events if e.get("cat") in DEVICE_CATS and e.get("ph") == "X"]
    launched_at = {e["args"]["correlation"]: e["ts"] for e in api if "correlation" in e.get("args", {})}
    step = []  # every phase's device work, by launch
    for ph in phases:
        lo, hi = ph["ts"], ph["ts"] + ph["dur"]
        if ph.get("cat") == "gpu_user_annotation":
            inside = [e for e in device if _within(e, lo, hi)]
            busy = _union(inside)[1] if inside else 0.0  # a side-stream copy beside a kernel counts once
            lines.append(f"{ph['name']} GPU: span {ms(ph['dur'])} ms, busy {ms(busy)} ms, "
                         f"idle {ms(ph['dur'] - busy)} ms, {len(inside)} kernels/copies")
            lines += _table(inside, top)
        else:
            ops = _top_level([e for e in cpu_ops if _within(e, lo, hi)])
            n_launch = sum(1 for e in launches if _within(e, lo, hi))
            lines.append(f"{ph['name']} host: span {ms(ph['dur'])} ms, {len(ops)} top-level ops, "
                         f"{n_launch} kernel launches")
            lines += _table(ops, top)
            mine = [e for e in device if lo <= launched_at.get(e.get("args", {}).get("correlation"), -1.0) <= hi]
            if mine:
                step += mine
                by = defaultdict(float)
                for e in mine:
                    by[kind(e["name"])] += e["dur"]
                span, busy = _union(mine)
                lines.append(f"{ph['name']} GPU by launch: busy {ms(sum(by.values()))} ms in {len(mine)} "
                             "kernels/copies: " + ", ".join(f"{k} {ms(d)}" for k, d in sorted(by.items(),
                                                                                           key=lambda kv: -kv[1])))
                lines.append(f"{ph['name']} GPU by launch: span {ms(span)} ms from its first kernel to its last, "
                             f"idle {ms(span - busy)} ms")
                lines += _table(mine, top)
    if step:
        span, busy = _union(step)
        lines.append(f"step GPU (every phase's work by launch): span {ms(span)} ms, busy {ms(busy)} ms, "
                     f"idle {ms(span - busy)} ms")
    host = [e for e in cpu_ops if "ts" in e]
    if host and device:
        first, last = min(e["ts"] for e in host), max(e["ts"] + e.get("dur", 0) for e in host)
        k0, k1 = min(e["ts"] for e in device), max(e["ts"] + e.get("dur", 0) for e in device)
        lines.append(f"step ends: the GPU's first work started {ms(k0 - first)} ms after the first host op, its last "
                     f"ended {ms(last - k1)} ms before the last host op ended")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    with open(args.trace) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    print(report(events, args.top))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The GPU exactness matrix: every fast path against the fp32 eager unsplit model, on the inputs real models feed it.

    python3 scripts/bench/gpu_matrix.py --out outputs/gpu_matrix.jsonl            # on one GPU (bench_gpu.sh gpu_matrix)
    python3 scripts/bench/gpu_matrix.py --device cpu --quick                      # the harness itself, on CPU (a test)

Each family is built at a small shape with its real head dims (2 layers, few experts) through the engine's own build
(engine/ds/build.py: kernels, memory policies, MoE layer, DeepSpeed) and takes one forward and backward of a fixed
batch of SEQ tokens with some labels masked (and, for `packed` cells, documents whose positions restart at 0).

    reference  precision=fp32, model.kernels=none, memory=none, deepspeed=zero0: the unsplit model, eager, fp32
    eager      precision=bf16, model.kernels=none, memory=none, deepspeed=zero0: the plain bf16 path
    cell       precision=bf16 and the cell's kernels / memory preset / deepspeed / options
    fp8 eager  precision=fp8, fp8.recipe=tensorwise, fp8.compile=false, model.kernels=none, memory=none (--fp8 cells)
    fp8 cell   precision=fp8 and the cell's recipe / linears / memory preset / packing (--fp8)

A cell passes when its loss and every parameter's gradient are no further from the reference (relative, in the norm)
than BOUND x the eager path's own error on the same parameter, or FLOOR where the eager error is below it (docs/design.md
§3.1). FP8 is not exact, so an FP8 cell's eager path is FP8's own: torchao's tensorwise recipe run eagerly, on the
same linears, is FP8's bound; a fast FP8 path (fp8.recipe=delayed's Triton casts, the compiled casts) may be at most
BOUND x as far from fp32 as that on every parameter. Delayed scaling's first step takes each operand's own amax, as
tensorwise does, so at the matrix's one step the two differ by rounding only, and a wrong kernel output (the e5m2
transposes of 2026-12-07) lands far outside.

`optimizer_in_backward` frees the gradients it steps with, so that cell reads them off its step: in fp32 with AdamW's
lr = eps = STEP_SCALE (constant schedule), the first update is -g * lr / (|g| + eps), which is -g to within |g| / eps,
and -update is judged as the gradients like any cell. (Comparing two bf16 updates at a small eps, as
before 2026-12-04, judged Adam's sign-like first step: rounding flips the sign of gradients that are zero in exact
arithmetic, such as k_proj.bias's under softmax's shift invariance, and two of those cells failed on noise.) The
table (docs/gpu_matrix.md) gives each cell's worst ratio and the parameter it sits in.

--reinstate-contiguity-bug: the self-check. The RMSNorm backward reads its input as if contiguous again (the defect
of 2026-12-03: MLA's kv_a_layernorm takes a slice of torch.split) and the first-use check is bypassed; the MLA cells
must then fail.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from matrix_cells import (FAMILIES, FP8_CELLS, FP8_EAGER, FP8_MOE_CELLS, HYBRID, QUICK,  # noqa: E402,F401
                          cells)  # the cells; FP8_CELLS and FP8_MOE_CELLS read by its test

BOUND, FLOOR = 2.0, 2e-3
STEP_SCALE = 1000.0  # optimizer_in_backward's lr and Adam eps: the first update is then -g to within |g| / 1000
SEQ = 4096
COMMON = ["data=synthetic", "parallelism.cp=1", "trainer.global_batch_size=1", "trainer.micro_batch_size=1",
          "trainer.grad_clip=0", "model.attn_backend=sdpa", "trainer.warmup_steps=0"]


def compose(fam_spec, precision: str, overrides, device: str):
    from configs import compose_config
    preset, arch = fam_spec
    over = [f"model={preset}", f"precision={precision}", f"device={device}", f"data.seq_len={SEQ}"] + COMMON
    if precision == "bf16":  # an FP8 cell's too: it names precision=fp8 among its overrides
        over += ["deepspeed.master_weights=bf16"]
    if device == "cpu" and "precision=fp8" in overrides:  # torch's CPU float8 matmul: the harness's own test
        over += ["fp8.emulate_on_cpu=true"]
    if not any(o.startswith("deepspeed=") for o in overrides):
        over.append("deepspeed=zero0")
    over += [f"model.arch.{k}={json.dumps(v)}" for k, v in arch.items()]
    named = {o.split("=", 1)[0] for o in overrides}  # a cell's own value replaces COMMON's (Hydra refuses a key twice)
    over = [o for o in over if o.split("=", 1)[0] not in named] + list(overrides)
    return compose_config(over)


def batch(vocab: int, packed: bool, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, SEQ), generator=g)
    labels = ids.clone()
    labels[torch.rand(1, SEQ, generator=g) < 0.1] = -100
    out = {"input_ids": ids, "labels": labels}
    if packed:  # documents of uneven lengths, positions restarting at 0 (HF's DataCollatorWithFlattening)
        starts = sorted({0, *torch.randint(1, SEQ, (5,), generator=g).tolist()})
        pos = torch.zeros(SEQ, dtype=torch.long)
        for a, b in zip(starts, starts[1:] + [SEQ]):
            pos[a:b] = torch.arange(b - a)
        out["position_ids"] = pos[None]
    return out


def run_cell(cfg, data: dict, device, step: bool = False):
    """(loss, {name: fp32 gradient} or None, {name: fp32 update of one step} or None) of one forward + backward."""
    from configs import validate
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    from ds_ulysses_ext import init_topology, shard_batch
    from ds_ulysses_ext.memory import remove_all
    from engine.ds.build import build
    plan = validate(cfg, 1)
    topo = init_topology(1)
    if cfg.memory.auto:
        raise ValueError("the matrix names its presets")
    engine, hf, scale = build(cfg, plan, topo, device)
    try:
        def weights():
            # clone: an fp32 parameter on the CPU is its own .float().cpu(), and a step would change the copy too
            return {n: (safe_get_full_fp32_param(p) if hasattr(p, "ds_id") else p).detach().float().cpu().clone()
                    for n, p in engine.module.named_parameters()}
        before = weights() if step else None  # before the forward: optimizer_in_backward steps inside backward
        shard = {k: v.to(device) for k, v in shard_batch(data, topo).items()}
        loss_sum, count = engine(**shard)
        engine.backward(loss_sum * (scale / count), scale_wrt_gas=False)
        loss = float(loss_sum.detach().double() / count)
        grads = None
        if not cfg.trainer.optimizer_in_backward:
            grads = {}
            for n, p in engine.module.named_parameters():
                g = safe_get_full_grad(p)
                g = g if g is not None else p.grad
                if g is not None:
                    grads[n] = g.detach().float().cpu()
        updates = None
        if step:
            engine.step()
            updates = {n: w - before[n] for n, w in weights().items()}
        return loss, grads, updates
    finally:
        remove_all(getattr(engine, "memory_policies", []) or [])
        engine.destroy()
        del engine, hf
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def judge(cell_loss, cell_grads, ref, eager) -> dict:
    """The cell's worst ratio to the eager error (loss and every gradient), and where it sits."""
    ref_loss, ref_grads = ref
    eager_loss, eager_grads = eager
    rows = [("loss", abs(cell_loss - ref_loss) / abs(ref_loss), abs(eager_loss - ref_loss) / abs(ref_loss))]
    missing = sorted(set(ref_grads) - set(cell_grads))
    for n, r in ref_grads.items():
        if n in cell_grads:
            rows.append((n, rel(cell_grads[n], r), rel(eager_grads[n], r)))
    worst = max(rows, key=lambda t: t[1] / max(t[2], FLOOR / BOUND))
    ok = not missing and all(err <= max(BOUND * e, FLOOR) for _, err, e in rows)
    return dict(ok=ok, worst_param=worst[0], worst_err=worst[1], eager_err=worst[2],
                ratio=worst[1] / max(worst[2], FLOOR / BOUND), missing=missing[:3])


def reinstate_contiguity_bug() -> None:
    """The self-check: the RMSNorm backward misreads a strided x as contiguous, and no first-use check stops it."""
    from ds_ulysses_ext.kernels import providers, rms_norm
    original = rms_norm.rms_norm_backward

    def misreading(dy, x, w, rstd, llama_order):
        return original(dy, x.as_strided(x.shape, (x.shape[1], 1), x.storage_offset()), w, rstd, llama_order)
    rms_norm.rms_norm_backward = misreading
    providers.Checked._first_use = lambda *a, **k: None


def first_use_refusal(error: str) -> bool:
    """A kernel's first-use check that found it cannot run on the run's input (fla_kernels.CannotRun): the run stops
    before its first step with the fix named, as a refusal does, one forward later. Rows written before the harness
    knew this (2026-12-04) carry ok=false; the table reads them by their error."""
    return error.startswith("CannotRun:")


def table(paths) -> str:
    """The docs' markdown table of result files (a later row of the same cell replaces an earlier one)."""
    cells_seen = {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            r = json.loads(line)
            cells_seen[(r["family"], r["cell"])] = r
    out = ["| family | cell | verdict | worst error (relative) | eager's there (bf16; FP8's for fp8 cells) | ratio | where |",
           "|---|---|---|---|---|---|---|"]
    for (fam, cell), r in cells_seen.items():
        if first_use_refusal(r.get("error", "")):
            out.append(f"| {fam} | {cell} | refused at first use | | | | {r['error'][:110]} |")
        elif r.get("refused"):
            out.append(f"| {fam} | {cell} | refused before the build | | | | {r['error'][:110]} |")
        elif "error" in r:
            out.append(f"| {fam} | {cell} | **fails** | | | | {r['error'][:110]} |")
        elif "compared_with" in r and "ratio" not in r:  # optimizer_in_backward rows of 2026-12-03/04
            out.append(f"| {fam} | {cell} | {'ok' if r['ok'] else '**fails**'} | {r['worst_err']:.2e} | | | "
                       f"{r['worst_param']} ({r['compared_with']}) |")
        else:
            out.append(f"| {fam} | {cell} | {'ok' if r['ok'] else '**fails**'} | {r['worst_err']:.2e} | "
                       f"{r['eager_err']:.2e} | {r['ratio']:.2f} | {r['worst_param']}"
                       + (f" ({r['compared_with']})" if "compared_with" in r else "") + " |")
    return "\n".join(out)


START = time.time()
# the errors of a cell that found the GPU full: its neighbours' memory, not its own verdict (2026-12-06: 8 processes
# side by side on an 80 GiB H100 ran out in 54 cells), so --resume runs such a cell again
OUT_OF_MEMORY = ("OutOfMemoryError", "CUBLAS_STATUS_ALLOC_FAILED")
# a process's peak on the matrix's largest families (12-19 GiB seen in those errors), with room: --jobs 0 runs as many
# processes as fit the GPU's memory at this much each
GIB_PER_JOB = 20


def out_of_memory(row) -> bool:
    return any(e in row.get("error", "") for e in OUT_OF_MEMORY)


def jobs_for_memory(total_bytes: int) -> int:
    return max(1, total_bytes // (GIB_PER_JOB << 30))


def todo_cells(args, families) -> list:
    """The cells to run: those of `families` that --only names, less those with a row in --skip-from / --out."""
    only = [s for s in args.only.split(",") if s]
    skip_from = args.skip_from or (args.out if args.resume else "")
    done = set()
    if skip_from and Path(skip_from).exists():
        for line in Path(skip_from).read_text().splitlines():
            row = json.loads(line)
            if bool(row.get("self_check")) == args.reinstate_contiguity_bug and not out_of_memory(row):
                done.add((row["family"], row["cell"]))
    return [c for c in cells(families, args.quick, args.fa4, args.fla, args.fp8)
            if (not only or any(s in c[1] for s in only)) and (c[0], c[1]) not in done]


def fan_out(args) -> int:
    """Run the families in args.jobs child processes sharing the GPU, then append their rows to args.out.

    A cell's time is mostly the host building its model and DeepSpeed engine (8-25 s against well under a second of
    GPU work at 4k tokens), so processes side by side divide the matrix's wall time; each child owns whole families
    (their reference is computed once per family) and its own rendezvous port. Families are dealt largest first so
    the groups hold about as many cells each."""
    specs = QUICK if args.quick else FAMILIES
    families = [f for f in args.families.split(",") if f in specs]
    if args.resume:
        args.skip_from = args.out
    size = {f: len(todo_cells(args, [f])) for f in families}
    families = [f for f in families if size[f]]
    groups = [[] for _ in range(min(args.jobs, len(families)))]
    for f in sorted(families, key=lambda f: -size[f]):
        min(groups, key=lambda g: sum(size[x] for x in g)).append(f)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    procs = []
    for i, group in enumerate(groups):
        part = out.with_name(f"{out.stem}.part{i}{out.suffix}")
        part.unlink(missing_ok=True)
        env = dict(os.environ, MASTER_PORT=str(int(os.environ.get("MASTER_PORT", "29600")) + 1 + i))
        # the parent's own arguments, then each child's: argparse keeps an option's last value
        child = [*sys.argv[1:], "--jobs", "1", "--families", ",".join(group), "--out", str(part),
                 "--skip-from", args.skip_from]
        procs.append((part, subprocess.Popen([sys.executable, __file__, *child], env=env)))
    codes = []
    with out.open("a") as f:
        for part, proc in procs:
            codes.append(proc.wait())
            if part.exists():
                f.write(part.read_text())
                part.unlink()
    print(f"gpu_matrix: {len(groups)} processes, exit codes {codes}; rows appended to {out}", flush=True)
    for group, code in zip(groups, codes):
        if code < 0:  # a signal: on 2026-12-04, SIGKILL of the process holding the largest model, 8 on 128 GiB of host
            print(f"gpu_matrix: the process of {','.join(group)} was killed by signal {-code} (host memory, most "
                  f"likely); its cells left run alone: --families {','.join(group)} --jobs 1 --resume", flush=True)
    return 1 if any(codes) else 0


def main() -> int:
    if sys.argv[1:2] == ["--table"]:
        print(table(sys.argv[2:]))
        return 0
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--only", default="", help="comma-separated substrings: run only cells whose name has one")
    ap.add_argument("--quick", action="store_true", help="tiny shapes and a few cells (the CPU test)")
    ap.add_argument("--reinstate-contiguity-bug", action="store_true")
    ap.add_argument("--fa4", action="store_true", help="add the FlashAttention-4 cells (the FA4 wheels installed)")
    ap.add_argument("--fla", action="store_true", help="add the hybrids' fla cells (fla-core installed)")
    ap.add_argument("--fp8", action="store_true", help="add the FP8 cells (torchao installed; an SM89+ GPU)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per batch (default 4096; --quick 64)")
    ap.add_argument("--out", default=str(ROOT / "outputs" / "gpu_matrix.jsonl"))
    ap.add_argument("--resume", action="store_true",
                    help="skip the cells that already have a row in --out (a call cut off by its deadline, run again)")
    ap.add_argument("--skip-from", default="", help=argparse.SUPPRESS)  # --resume's file, handed to --jobs' children
    ap.add_argument("--deadline-s", type=float, default=0,
                    help="start no cell after this many seconds (0: none); --resume in the next call runs the rest")
    ap.add_argument("--jobs", type=int, default=1,
                    help="run the families in this many processes at once on the one GPU (see fan_out); 0: as many "
                         f"as its memory holds at {GIB_PER_JOB} GiB each")
    args = ap.parse_args()
    if args.jobs == 0:
        args.jobs = jobs_for_memory(torch.cuda.get_device_properties(0).total_memory)
        print(f"gpu_matrix: {args.jobs} processes for {torch.cuda.get_device_name(0)}'s memory", flush=True)
    if args.jobs > 1:
        return fan_out(args)
    global SEQ
    if args.quick:
        SEQ = 64
    SEQ = args.seq or SEQ
    if args.reinstate_contiguity_bug:
        reinstate_contiguity_bug()
    specs = QUICK if args.quick else FAMILIES
    families = [f for f in args.families.split(",") if f in specs]
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    from engine.ds.distributed import init_distributed, read_runtime
    rt = read_runtime(args.device)
    init_distributed(rt)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    failed = 0
    todo = todo_cells(args, families)
    refs = {}
    with out.open("a") as f:
        for i, (fam, name, overrides, packed) in enumerate(todo):
            if args.deadline_s and time.time() - START > args.deadline_s:
                left = len(todo) - i
                print(f"gpu_matrix: deadline reached, {left} cells not run (run again with --resume)", flush=True)
                failed += left
                break
            t0 = time.time()
            key = (fam, packed)
            row = dict(family=fam, cell=name, packed=packed, seq=SEQ, overrides=overrides,
                       self_check=args.reinstate_contiguity_bug)
            try:
                if key not in refs:  # the fp32 reference and the eager bf16 path, once per family and batch
                    cfg = compose(specs[fam], "fp32", ["model.kernels=none", "memory=none"], args.device)
                    arch = cfg.model.arch
                    data = batch(arch["vocab_size"] if "vocab_size" in arch else arch["text_config"]["vocab_size"], packed)
                    ref = run_cell(cfg, data, rt.device)[:2]
                    plain = ["model.kernels=none", "memory=none"]
                    plain += ["model.linear_attn_kernel=torch"] if fam in HYBRID else []  # auto takes fla in bf16
                    eager = run_cell(compose(specs[fam], "bf16", plain, args.device), data, rt.device)[:2]
                    refs[key] = (data, ref, eager)
                data, ref, eager = refs[key]
                if "precision=fp8" in overrides:  # FP8's own bound: torchao tensorwise, eager, on the cell's linears
                    linears = [o for o in overrides if o.startswith("fp8.linears=")]
                    fp8_key = key + (*linears, "fp8")  # once per family, batch and fp8.linears
                    if fp8_key not in refs:
                        refs[fp8_key] = run_cell(compose(specs[fam], "bf16", FP8_EAGER + linears, args.device), data,
                                                 rt.device)[:2]
                    eager = refs[fp8_key]
                    row["compared_with"] = "FP8 eager: torchao tensorwise, uncompiled, on the same linears"
                cfg = compose(specs[fam], "bf16", overrides, args.device)
                if cfg.trainer.optimizer_in_backward:
                    scale = [f"trainer.lr={STEP_SCALE}", f"trainer.adam_eps={STEP_SCALE}", "trainer.lr_decay=constant"]
                    cfg = compose(specs[fam], "fp32", overrides + scale, args.device)
                    loss, _, update = run_cell(cfg, data, rt.device, step=True)
                    row.update(judge(loss, {n: -u for n, u in update.items()}, ref, eager),
                               compared_with="the gradients its fp32 step used (-update at lr = eps = 1000)")
                else:
                    loss, grads, _ = run_cell(cfg, data, rt.device)
                    row.update(judge(loss, grads, ref, eager))
            except Exception as err:  # a refusal before the build is a result too: it names the fix
                from configs.errors import ConfigError
                from ds_ulysses_ext.errors import UnsupportedError
                error = f"{type(err).__name__}: {str(err)[:300]}"
                refused = isinstance(err, (ConfigError, UnsupportedError)) or first_use_refusal(error)
                row.update(ok=refused, refused=refused, error=error)
            row["seconds"] = round(time.time() - t0, 1)
            failed += not row["ok"]
            f.write(json.dumps(row) + "\n")
            f.flush()
            print(json.dumps(row), flush=True)
    print(f"gpu_matrix: {len(todo) - failed} of {len(todo)} cells within bounds", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

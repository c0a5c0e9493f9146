#!/usr/bin/env python3
"""One dense SwiGLU MLP, forward + backward, in bf16 and in FP8 (torchao Float8Linear), by where the casts compile.

    python3 scripts/bench/bench_fp8_mlp.py [--model llama3_2_1b] [--tokens 16384,32768] [--recipes rowwise]

Why: precision=fp8's speed rests on how the amax / scale / cast kernels around each FP8 GEMM are compiled. Variants:
- `bf16`: HF's MLP, eager (the reference; our step binds Liger's fused SiLU-and-multiply, one kernel less);
- `bf16_compiled`: the same MLP compiled whole (SiLU and product fused by inductor);
- `fp8_eager`: Float8Linear's casts eager;
- `fp8_per_linear`: each Float8Linear's forward compiled alone (casts fused among themselves, never with a
  neighbour; three compiled regions per MLP);
- `fp8_mlp`: the MLP compiled whole with its three Float8Linear: one cast of x feeds gate and up, SiLU-and-product
  fuses with the cast of down's input, and the backward's casts fuse with the SwiGLU backward.
- `fp8_mlp_once`: as `fp8_mlp`, each linear's x and W cast once in the forward and handed to torchao's matmul in
  float8, which then saves them for the backward instead of casting the bf16 ones again (tensorwise only: its
  backward casts equal the forward's, so the numbers are fp8_mlp's bit for bit); `fp8_mlp_once_x`: x only. An
  experiment: on an H100 neither was faster than `fp8_mlp` (inductor already shares the casts across the region's
  forward and backward), and both peaked higher (docs/benchmarks.md, 2026-12-06, eighth part).
- `fp8_mlp_static`: every scale fixed in advance from one bf16 pass, so no amax pass at all: the ceiling of any
  recipe whose scales need no amax pass of their own;
- `fp8_mlp_delayed`: as `fp8_mlp_static`, and each cast operand's amax taken as well, as delayed scaling must (for
  the next step's scale): forward amaxes written into buffers, backward ones returned as a sink's gradient. What
  inductor makes of that decides whether delayed scaling can pay: where it fuses each amax into its cast kernel
  this variant runs as fast as the static one, where not as slow as `fp8_mlp` (torchtitan's PR 698 found the latter).
- `fp8_mlp_fused`: fp8.recipe=delayed's MLP (ds_ulysses_ext/kernels/fp8_delayed.py) with the static scales: our
  Triton casts, each taking its amax in the same pass as the cast and its transposed copy (no torch.compile), run as
  the first-use check chose (kernels/fp8_casts.py kernels_ok: the e5m2 transposed copies the first way of E5_WAYS
  that agreed there);
- `fp8_mlp_fused_bytes`, `fp8_mlp_fused_torch_t`: the same with the e5m2 transposes made after the casts, by the
  byte-transpose kernel and by torch's copy (the check's fallbacks): what they cost.
Each JSON line: variant, recipe, tokens, median ms of forward + backward (input and weight gradients), peak memory of
the timed steps, the ratio to `bf16`, the forward output's relative distance from bf16's, and whether the
`fp8_mlp_*` variants' output and gradients equal `fp8_mlp`'s bit for bit (the cast-once ones should; the
static one, whose scales come from a bf16 pass, need not). Shapes from hydra_conf/model/<model>.yaml.
"""
import argparse
import ast
import copy
import functools
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from bench_attention import timed  # noqa: E402
from bench_gemm import layer_linears  # noqa: E402
from ds_ulysses_ext.kernels.fp8_casts import D_GU, DY, H, W_DOWN, W_GU, X  # noqa: E402


def mlp(hidden: int, inter: int, device) -> torch.nn.Module:
    from transformers.models.llama.modeling_llama import LlamaMLP
    from transformers import LlamaConfig
    torch.manual_seed(0)
    m = LlamaMLP(LlamaConfig(hidden_size=hidden, intermediate_size=inter, hidden_act="silu", mlp_bias=False))
    return m.to(device=device, dtype=torch.bfloat16)


def cast_once_forward(linear: torch.nn.Module, weight: bool, x: torch.Tensor) -> torch.Tensor:
    """A tensorwise Float8Linear's forward with x (and W) cast before torchao's matmul: its backward then uses the
    float8 tensors as they are (the path torchao's FSDP float8 all-gather takes) rather than casting bf16 again."""
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole
    c, mm = linear.config, linear.linear_mm_config
    x8 = hp_tensor_to_float8_dynamic(x, c.cast_config_input.target_dtype, mm, gemm_input_role=GemmInputRole.INPUT)
    w = linear.weight
    if weight:
        w = hp_tensor_to_float8_dynamic(w, c.cast_config_weight.target_dtype, mm, gemm_input_role=GemmInputRole.WEIGHT)
    return matmul_with_hp_or_float8_args.apply(x8, w.t(), mm, c)


@torch._dynamo.allow_in_graph
class _GradToFloat8Static(torch.autograd.Function):
    """Forward: nothing. Backward: the gradient to float8_e5m2 with a fixed scale, which torchao's matmul then takes
    as it is for both of its GEMMs (torchao's NoopFwToFloat8BwDynamic with the amax pass taken out). `sink`: None, or
    a 0-dim fp32 leaf whose gradient receives the gradient's amax (fp8_mlp_delayed: the amax stays in the graph)."""

    @staticmethod
    def forward(ctx, y, scale, mm, sink):
        ctx.save_for_backward(scale)
        ctx.mm, ctx.sink = mm, sink is not None
        return y

    @staticmethod
    def backward(ctx, g):
        from torchao.float8.float8_training_tensor import GemmInputRole, hp_tensor_and_scale_to_float8
        (scale,) = ctx.saved_tensors
        g8 = hp_tensor_and_scale_to_float8(g, scale, torch.float8_e5m2, ctx.mm, GemmInputRole.GRAD_OUTPUT)
        return g8, None, None, (g.abs().amax().float() if ctx.sink else None)


def static_scales(m: torch.nn.Module, x: torch.Tensor, g: torch.Tensor) -> dict:
    """Each operand's scale as dynamic scaling would set it on these inputs (one bf16 pass): float8 max / amax."""
    from torchao.float8.float8_utils import amax_to_scale
    x = x.detach().requires_grad_()
    gate, up = m.gate_proj(x), m.up_proj(x)
    h = m.act_fn(gate) * up
    out = m.down_proj(h)
    for t in (gate, up, out):
        t.retain_grad()
    out.backward(g)
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    amaxes = {"x": (x, e4), "h": (h, e4), "gate": (m.gate_proj.weight, e4), "up": (m.up_proj.weight, e4),
              "down": (m.down_proj.weight, e4), "d_gate": (gate.grad, e5), "d_up": (up.grad, e5), "d_down": (out.grad, e5)}
    m.zero_grad(set_to_none=True)
    return {k: amax_to_scale(t.detach().abs().max().float(), dtype) for k, (t, dtype) in amaxes.items()}


def static_mlp_forward(m: torch.nn.Module, scales: dict, x: torch.Tensor, amax: dict = None) -> torch.Tensor:
    """`amax`: None (fp8_mlp_static), or fp8_mlp_delayed's record: a 0-dim fp32 buffer per forward operand (x, h and
    the weights), each overwritten with that operand's amax, and a sink leaf per gradient (d_gate, d_up, d_down)."""
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
    from torchao.float8.float8_training_tensor import GemmInputRole, hp_tensor_and_scale_to_float8
    e4 = torch.float8_e4m3fn

    def cast(name, t, role, mm):
        if amax is not None:
            amax[name].copy_(t.detach().abs().amax().float())
        return hp_tensor_and_scale_to_float8(t, scales[name], e4, mm, role)

    def linear(name, x8):
        lin = getattr(m, f"{name}_proj")
        w8 = cast(name, lin.weight, GemmInputRole.WEIGHT, lin.linear_mm_config)
        y = matmul_with_hp_or_float8_args.apply(x8, w8.t(), lin.linear_mm_config, lin.config)
        sink = amax[f"d_{name}"] if amax is not None else None
        return _GradToFloat8Static.apply(y, scales[f"d_{name}"], lin.linear_mm_config, sink)
    x8 = cast("x", x, GemmInputRole.INPUT, m.gate_proj.linear_mm_config)
    h = m.act_fn(linear("gate", x8)) * linear("up", x8)
    return linear("down", cast("h", h, GemmInputRole.INPUT, m.down_proj.linear_mm_config))


# the fused variants' operands and their slots (kernels/fp8_casts.py SLOTS["mlp"]); gradients' names start with d_
FUSED_SLOTS = {"x": X, "h": H, "gate_up": W_GU, "down": W_DOWN, "d_gate_up": D_GU, "d_down": DY}


def slot_scales(scales: dict) -> torch.Tensor:
    """static_scales' in the Function's slot order (kernels/fp8_casts.py SLOTS["mlp"]): gate and up share the smaller
    of their scales (the larger amax), as do their gradients; an unused slot repeats its neighbour's."""
    v = {k: t.float().reshape(()) for k, t in scales.items()}
    gu, dgu = torch.minimum(v["gate"], v["up"]), torch.minimum(v["d_gate"], v["d_up"])
    return torch.stack([v["x"], v["h"], gu, gu, v["down"], dgu, dgu, v["d_down"]])


def delayed_record(device) -> dict:
    """fp8_mlp_delayed's amax buffers (forward operands) and sinks (gradients: leaves whose .grad takes the amax)."""
    record = {k: torch.zeros((), device=device) for k in ("x", "h", "gate", "up", "down")}
    record.update({k: torch.zeros((), device=device, requires_grad=True) for k in ("d_gate", "d_up", "d_down")})
    return record


# the fused variants: how each makes its e5m2 transposed copies (kernels/fp8_casts.py E5_WAYS); None: as the first-use
# check chose
FUSED_WAYS = {"fp8_mlp_fused": None, "fp8_mlp_fused_bytes": "bytes", "fp8_mlp_fused_torch_t": "torch"}


def variant(base: torch.nn.Module, name: str, recipe: str, x: torch.Tensor, g: torch.Tensor) -> torch.nn.Module:
    m = copy.deepcopy(base)
    if name == "bf16":
        return m
    if name == "bf16_compiled":
        return torch.compile(m)
    if name.startswith("fp8_mlp_fused"):  # the MLP's own nn.Linear weights, read by the Function
        from ds_ulysses_ext.kernels.fp8_casts import Launch
        from ds_ulysses_ext.kernels.fp8_delayed import bind_delayed_mlp
        from ds_ulysses_ext.kernels.fp8_scales import DelayedScales
        state = DelayedScales(["mlp"], 1, x.device)
        state.set_scales(0, slot_scales(static_scales(base, x, g)))
        bind_delayed_mlp(m, state, 0, FUSED_WAYS[name] and Launch(FUSED_WAYS[name]))
        m.scales = {k: state.scales[0, i] for k, i in FUSED_SLOTS.items()}
        m.amax_record = {k: state.amax[0, i] for k, i in FUSED_SLOTS.items()}  # views: the step raises them
        return m
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    convert_to_float8_training(m, config=Float8LinearConfig.from_recipe_name(recipe))
    if name == "fp8_per_linear":
        for lin in (m.gate_proj, m.up_proj, m.down_proj):
            lin.forward = torch.compile(lin.forward)
    elif name in ("fp8_mlp_static", "fp8_mlp_delayed"):
        record = delayed_record(x.device) if name == "fp8_mlp_delayed" else None
        m.scales = static_scales(base, x, g)
        m.forward = functools.partial(static_mlp_forward, m, m.scales, amax=record)
        m.amax_record = record
        m = torch.compile(m)
    elif name in ("fp8_mlp", "fp8_mlp_once", "fp8_mlp_once_x"):
        if name != "fp8_mlp":
            for lin in (m.gate_proj, m.up_proj, m.down_proj):
                lin.forward = functools.partial(cast_once_forward, lin, name == "fp8_mlp_once")
        m = torch.compile(m)
    return m


def top_kernels(step, n: int) -> list:
    """One step under torch.profiler: its n largest GPU kernels by total time, [name, ms, calls]."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    rows = [(e.key, e.self_device_time_total / 1e3, e.count) for e in prof.key_averages()
            if e.device_type == torch.autograd.DeviceType.CUDA]
    return [[k, round(ms, 3), c] for k, ms, c in sorted(rows, key=lambda r: -r[1])[:n]]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3_2_1b")
    ap.add_argument("--tokens", default="16384,32768")
    ap.add_argument("--recipes", default="rowwise")
    ap.add_argument("--variants", default="bf16,bf16_compiled,fp8_eager,fp8_per_linear,fp8_mlp")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--inductor", default="", help="inductor settings for every compiled variant, comma-separated "
                    "dotted=value (e.g. triton.prefer_nd_tiling=True,triton.max_tiles=3)")
    ap.add_argument("--profile", type=int, default=0, help="after timing, profile one step and print its N largest "
                    "GPU kernels (full names, total ms) as one JSON line")
    args = ap.parse_args()
    import torch._inductor.config as inductor_config
    for item in filter(None, args.inductor.split(",")):
        key, value = item.split("=", 1)
        *path, leaf = key.split(".")
        node = inductor_config
        for part in path:
            node = getattr(node, part)
        setattr(node, leaf, ast.literal_eval(value))
    device = torch.device("cuda")
    (inter, hidden) = layer_linears(args.model)["gate"]
    base = mlp(hidden, inter, device)
    for s in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(s, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(s, hidden, device=device, dtype=torch.bfloat16)
        ref_out, ref_ms, fp8_mlp_grads, static_grads = None, None, None, None
        for recipe in args.recipes.split(","):
            for name in args.variants.split(","):
                if name.startswith("bf16") and recipe != args.recipes.split(",")[0]:
                    continue
                torch._dynamo.reset()  # each variant compiles afresh: no shapes or dynamism from another variant
                m = variant(base, name, recipe, x, g)

                record = getattr(m, "amax_record", None)

                def step():
                    x.grad = None
                    for p in m.parameters():
                        p.grad = None
                    for sink in (record or {}).values():
                        sink.grad = None
                    m(x).backward(g)
                for _ in range(3):  # compile, autotune, warm
                    step()
                torch.cuda.reset_peak_memory_stats(device)
                ms = statistics.median(timed(step, device) for _ in range(args.reps)) * 1e3
                with torch.no_grad():
                    out = m(x).float()
                step()  # the gradients of this variant, kept for the comparison below
                grads = [out, x.grad.clone()] + [p.grad.clone() for p in m.parameters()]
                if name == "fp8_mlp":
                    fp8_mlp_grads = grads
                if name == "fp8_mlp_static":
                    static_grads = grads
                # the fixed-scale variants against fp8_mlp_static (the same scales): the largest relative distance
                # of the output and the gradients
                to_static = (max(float((a - b).float().norm() / b.float().norm()) for a, b in zip(grads, static_grads))
                             if (name == "fp8_mlp_delayed" or name in FUSED_WAYS)
                             and static_grads is not None else None)
                same = (all(torch.equal(a, b) for a, b in zip(grads, fp8_mlp_grads))
                        if name.startswith("fp8_mlp_") and fp8_mlp_grads is not None else None)
                if name == "bf16":
                    ref_out, ref_ms = out, ms
                # fp8_mlp_delayed: the amaxes it took, against those its fixed scales came from (scale = float8 max /
                # amax, from bf16's pass): about 1e-7 for x, the weights and d_down, about 1e-2 for h and the gate/up
                # gradients (FP8 GEMMs made them here, bf16 ones there); 1 where an amax was left out of the graph
                amax_err = None if record is None else max(
                    abs(float(t.grad if t.requires_grad else t) * float(m.scales[k]) /
                        torch.finfo(torch.float8_e5m2 if k.startswith("d_") else torch.float8_e4m3fn).max - 1)
                    for k, t in record.items())
                err = float((out - ref_out).norm() / ref_out.norm())
                if args.profile:
                    print(json.dumps({"bench": "fp8_mlp_kernels", "variant": name, "inductor": args.inductor,
                                      "kernels": top_kernels(step, args.profile)}), flush=True)
                print(json.dumps({"bench": "fp8_mlp", "model": args.model, "tokens": s, "variant": name,
                                  "inductor": args.inductor,
                                  "recipe": recipe if name.startswith("fp8") else "-", "ms": round(ms, 3),
                                  "peak_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 3),
                                  "speedup_vs_bf16": round(ref_ms / ms, 3), "rel_err_vs_bf16": float(f"{err:.3e}"),
                                  "output_and_grads_equal_fp8_mlp": same, "amax_rel_err": amax_err,
                                  "rel_dist_static": to_static}),
                      flush=True)
                del m


if __name__ == "__main__":
    main()

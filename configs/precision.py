"""The run's precision: fp32, bf16, or fp8, and Fp8Config (`fp8.*`, read only under precision=fp8).

precision=fp8 keeps the weights, master weights, gradients and everything outside the chosen linears as
precision=bf16 does; the chosen linears cast their inputs and weights to float8 for their three GEMMs
(ds_ulysses_ext/kernels/fp8.py, torchao's float8 training). FP8 is not exact: docs/precision.md states its measured
bound against bf16.
"""

from dataclasses import dataclass

from configs.device import runs_on_cuda
from configs.errors import one_of, require
from ds_ulysses_ext.attention.layout import padded_length

PRECISIONS = ("fp32", "bf16", "fp8")


def bf16_weights(precision: str) -> bool:
    """fp8 keeps bf16 weights, gradients and activations; only the chosen linears' GEMMs run in float8."""
    return precision in ("bf16", "fp8")


# torchao's recipe names (Float8LinearConfig.from_recipe_name): tensorwise (one scale per tensor, the fastest),
# rowwise (one scale per row: per token for activations, per output feature for weights), rowwise_with_gw_hp
# (rowwise, the weight gradient's GEMM kept in bf16: the most accurate); and ours, delayed: tensorwise scales from the
# amaxes of the last fp8.amax_history steps, the amax taken inside the cast kernels, for the gated MLPs and (under
# fp8.linears=all) q/k/v and o_proj (kernels/fp8_delayed.py; any other FP8 linear runs tensorwise). On an H100 it is
# the fastest (1B: 1.144x bf16's step at 16k against tensorwise's 1.093x), but tensorwise stays the default: delayed
# is refused under ZeRO-3 on several ranks and clamps what its history did not foresee (docs/precision.md)
FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "delayed")
# which decoder linears run in FP8: the MLPs' (the default) or all. On an H200 with compiled casts, the 1B shape's
# q/k/v and o GEMMs ran 0.95x / 0.82x in FP8 at 16k tokens against bf16, gate+up and down 1.38x / 1.33x
# (docs/precision.md); all-linears rowwise under full_recompute measured 0.93x bf16's step at 16k, and all-linears
# tensorwise with the regions no faster than the MLPs alone (H100, 16k, no recompute, FA4: 0.2989 against 0.2991 s).
# On the Llama-3.1-8B layer shape (q and o 4096 x 4096) all is the faster: 1.235x bf16's step against mlp's 1.206x.
# mlp stays the default because all is also the noisier: on the 1B 500-step track it had a loss spike of its own and
# 1.3x mlp's mean distance from bf16 (H100, 2026-12-06, docs/precision.md)
FP8_LINEARS = ("mlp", "all")
FP8_COMPILE = ("auto", "regions", "mlp", "linear", "false")
ALIGN_TOKENS = 16  # torch._scaled_mm's alignment, for the token axis too (the weight gradient's reduction)


@dataclass
class Fp8Config:
    # tensorwise: the step measured 1.08x bf16's on the 1B shape (H200 and H100) and 1.18x on the 8B layer shape
    # (H100) with the MLPs in FP8, where rowwise measured 1.01x and 1.09x (docs/precision.md). Rowwise's forward is
    # the one that equals cp=1's under CP (per-token scales); tensorwise's activation amax spans the local shard
    recipe: str = "tensorwise"
    linears: str = "mlp"
    # where the casts' amax and scale kernels are compiled: eager casts made FP8 slower than bf16 on an H200
    # (docs/precision.md). mlp: each gated MLP as one region (one cast of x feeds gate and up; the activation fuses
    # with down's input cast), each other FP8 linear alone, and every linear alone under ZeRO-3 on several ranks;
    # regions: as mlp, and each attention's q/k/v, where all three run in FP8 (fp8.linears=all), as one region too
    # (one cast of x feeds all three: the 8B layer shape's step 1.011x the per-linear casts');
    # linear: each FP8 linear's forward alone; false: eager. auto: on CUDA regions for tensorwise and linear for the
    # rowwise recipes (what measured faster for each: kernels/fp8.py resolve_compile); a CPU run (emulate_on_cpu) stays
    # eager
    compile: str = "auto"
    # run the FP8 GEMMs through torch's CPU float8 matmul: slow and only for checking layouts on CPU (the tests do);
    # without it precision=fp8 on CPU is refused
    emulate_on_cpu: bool = False
    # fp8.recipe=delayed: how many steps of amaxes a scale is made from (their max). Longer rides out a quiet step
    # without clamping the next loud one; shorter follows a shrinking range sooner (Transformer Engine's default
    # history is 1024, torchao's old delayed recipe took 16)
    amax_history: int = 16


def check_fp8(cfg) -> None:
    """The FP8 settings a config can be refused for before anything is built; the device's own check (FP8 GEMMs on
    this GPU, torchao importable) runs at the build (ds_ulysses_ext/kernels/fp8.py)."""
    one_of("fp8.recipe", cfg.fp8.recipe, FP8_RECIPES)
    one_of("fp8.linears", cfg.fp8.linears, FP8_LINEARS)
    one_of("fp8.compile", cfg.fp8.compile, FP8_COMPILE)
    require(cfg.fp8.amax_history >= 1, f"fp8.amax_history must be >= 1 (steps of amaxes a delayed scale is made "
            f"from), got {cfg.fp8.amax_history}")
    if cfg.precision != "fp8":
        return
    require(runs_on_cuda(cfg.device) or cfg.fp8.emulate_on_cpu,
            "precision=fp8 needs a GPU with FP8 GEMMs (compute capability 8.9 or newer: H100, H200, L40S, B200); "
            f"this run is on the CPU (device={cfg.device}): set precision=bf16 (or fp32)")
    # an FP8 weight gradient reduces over the rank's tokens, and torch._scaled_mm takes reduction lengths in multiples
    # of 16 only: otherwise the first backward fails (measured on an H100: 1,000 tokens fail, 1,008 run). Rows are
    # padded to data.seq_len and split cp ways, so each rank's slice of a row must be a multiple of 16. The CPU's
    # emulation (tests only) multiplies in high precision and has no such limit
    cp = cfg.parallelism.cp
    require(cfg.fp8.emulate_on_cpu or cfg.data.seq_len % (ALIGN_TOKENS * cp) == 0,
            f"precision=fp8 needs each rank's slice of a row in multiples of {ALIGN_TOKENS} tokens (the FP8 weight "
            f"gradient's GEMM reduces over them); data.seq_len={cfg.data.seq_len} over parallelism.cp={cp} is not: "
            f"set data.seq_len to a multiple of {ALIGN_TOKENS * cp} (e.g. "
            f"{padded_length(cfg.data.seq_len, ALIGN_TOKENS * cp)}), or precision=bf16")

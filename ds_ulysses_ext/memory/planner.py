"""The memory planner: each memory policy's peak GPU memory and step time for one run, before anything is built.

A small cost model, linear in its coefficients, which are calibrated on measured one-H200 steps
(planner_calibration.json: the rows, their source files, and the fitted coefficients; refit with
`python scripts/bench/fit_planner.py`). Everything else scales from the model's shape (shape.py: hidden, layers,
heads, head dim, vocab, intermediate, experts) and the layout (local tokens = micro-batch x seq_len / cp; ZeRO shards
the states over the world). docs/memory.md has the model's errors against the rows.

Peak GPU memory (bytes) =
    states:      parameters x bytes per parameter: bf16 weights 2, gradients 2 (the weights' dtype), and master
                 weights + Adam moments 4 + 8 in fp32 or, under deepspeed.master_weights=bf16, 0 + 4 at ZeRO-1/2
                 (the master partition shares the weights' storage) and 2 + 4 at ZeRO-3; sharded over the world
                 under ZeRO (ZeRO-1/2 keep the weights whole), times the calibrated `state_scale`
  + kept:        local tokens x sum over layers of the bytes per token the policy keeps on the GPU until backward,
                 times `act_scale` (counts below)
  + transient:   one recomputed layer's activations while its backward runs (`transient_scale` x its bytes per
                 token x local tokens; a tiled MLP contributes one tile); the loss's chunk has no term of its own
  + `const_gib`.
Bytes per token per layer, bf16, from the HF modules' saved tensors: RMSNorm 6H eager (fp32 input + bf16 output)
or 2H fused; q/k/v projections 2(q+2kv), RoPE'd q/k 2(q+kv), attention output and o_proj input 4q (q = heads x
head_dim, kv = kv_heads x head_dim; under MLA v and the output have v's head dim, and the q / kv latents add 4 bytes
an element, norm input and output); SwiGLU MLP 8I eager or 6I fused; an MoE block top_k x (8 I_expert + 4H) + 6E, or
top_k x 4 I_expert + 6E where moe/lean_pass.py runs (h alone; nothing under moe.recompute=experts). Under
trainer.optimizer_in_backward no gradient waits for the step.
`except_attention` keeps the layer input 2H and the kernel's q, k, v, out 2(q+k+v+out) (+2H at cp > 1); full
recompute keeps 2H (on the host under offload, but for the three layers' inputs an offloaded backward holds: the
one in use and two prefetched); selective drops the norms' and SwiGLU's element-wise tensors; a tiled MLP keeps no
[tokens, intermediate] tensor; attention_offload moves except_attention's attention tensors to the host but for
about two layers'.

Step time (s) = dense FLOPs / dense rate + expert FLOPs / expert rate + attention FLOPs / attention rate (per
backend) + elementwise passes x local tokens x layers x hidden x a per-kernel-mode cost + optimizer cost
(DeepSpeed's ZeRO phase by master dtype, or zero0's own step) x parameters per GPU. FLOPs are 6 x active
parameters x tokens plus causal attention (engine/observe/flops.py), plus what the policy recomputes: one more
forward of every recomputed layer (attention included only where it re-runs), one more MLP forward under tiling, one
more expert forward under moe.recompute=experts (its first projection only under the lean expert pass). Offload
copies are taken as hidden behind compute (measured for attention_offload with and without layer-input offload at
128k and 256k on one H200). cp > 1 divides tokens and attention per GPU and adds no
communication term: the calibration rows are one GPU's.

Hybrid models (config.layer_types "linear_attention": Qwen3.5 / 3.6, Qwen3-Next, Ling-3.0): a linear layer counts its
own parameters (linear_params), the bytes our torch delta rule keeps per token (_linear_core_bytes, plus the gated
output norm) in place of attention's, under except_attention its core kept as attention's is, and its recurrence's
FLOPs (linear_layer_flops, linear in S) at the dense rate; the causal attention term counts the full layers only.
These are estimates (no calibration row has a linear layer); with flash-linear-attention's kernels the recurrence
saves less than counted here.

Pure Python: no torch import, so scripts/plan.py plans an 8-GPU run on a laptop.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

from .shape import ModelShape
# the families' tuples lived here before shape.py; kept importable from planner for any reader of them
from .shape import GATED_ATTENTION_FAMILIES, KDA_FAMILIES, QK_NORM_FAMILIES  # noqa: F401

GIB = 2 ** 30
OFFLOAD_WINDOW = 3  # layer inputs on the GPU during an offloaded backward: the one in use and two prefetched
LINEAR_CHUNK = 64  # linear_attention/delta_rule.py CHUNK: tokens per chunk of the delta rule
CALIBRATION_FILE = Path(__file__).with_name("planner_calibration.json")


@dataclass(frozen=True)
class RunShape:
    """The layout and settings that change memory or time (not the policy)."""

    seq_len: int
    cp: int = 1
    world: int = 1
    micro_batch: int = 1
    zero_stage: int = 3  # 0: deepspeed=zero0 (one rank, gradients in each parameter's .grad)
    master_weights: str = "fp32"  # deepspeed.master_weights
    # ZeRO-1/2's bf16 master partition shares the weights' storage (engine/ds/patches.share_master_weights); False
    # only for calibration rows measured before that existed, when it was a separate copy
    shared_master: bool = True
    attn_backend: str = "sdpa"  # sdpa | fa4 | flash_attn (auto resolved by the caller)
    kernels: str = "none"  # none (HF eager) | fused (Liger or compile)
    moe_recompute: str = "none"  # moe.recompute: none | act | experts
    moe_group: int = 1  # moe.recompute_group_size
    # moe/lean_pass.py runs (ep=1, CUDA, fused kernels, Qwen3-layout experts): an MoE layer keeps h alone
    moe_lean: bool = False
    # trainer.optimizer_in_backward: each gradient is consumed as backward makes it, none waits for the step
    grads_in_backward: bool = False
    loss_chunk: int = 4096
    ranks_per_node: int = 1

    @property
    def local_tokens(self) -> int:
        return self.micro_batch * -(-self.seq_len // self.cp)


@dataclass(frozen=True)
class Policy:
    """The MemoryConfig fields the model reads (a preset's YAML)."""

    recompute: str = "none"
    recompute_num_layers: int = 0
    selective_kept: bool = False
    offload_activations: bool = False
    offload_max_gib: float = 0.0
    attention_offload: bool = False  # except_attention's kept attention tensors in pinned host memory
    tiled_mlp: bool = False
    mlp_tile_tokens: int = 8192

    @classmethod
    def of(cls, memory_cfg: Any) -> "Policy":
        get = memory_cfg.get if isinstance(memory_cfg, Mapping) else lambda k, d: getattr(memory_cfg, k, d)
        return cls(**{f: get(f, getattr(cls, f)) for f in cls.__dataclass_fields__})


@dataclass(frozen=True)
class Prediction:
    peak_gib: float  # peak allocated GPU memory per GPU
    step_s: float
    host_gib: float  # pinned host memory per rank (offload)
    tokens_per_s_per_gpu: float
    parts: dict = field(default_factory=dict, compare=False)  # GiB per memory term and s per time term


# --- bytes per token of one layer, bf16


def _norm_bytes(s: ModelShape, run: RunShape) -> float:
    return (2 if run.kernels == "fused" else 6) * s.hidden


def _attention_bytes(s: ModelShape, run: RunShape) -> float:
    qk_norms = (2 if run.kernels == "fused" else 6) * (s.q + s.kv) if s.qk_norm else 0
    # q/k/v projections' outputs, RoPE'd q/k, attention's output and o_proj's input; MLA's latents and their norms
    return 2 * (s.q + s.kv + s.v_width) + 2 * (s.q + s.kv) + 4 * s.out_width + qk_norms + 4 * s.latent_width


def _full_attention_bytes(s: ModelShape, run: RunShape) -> float:
    # the output gate: q_proj's q-sized second half, its sigmoid and the product's other operand (an estimate: 4q)
    return _attention_bytes(s, run) + (4 * s.q if s.attn_gate else 0)


def _linear_core_bytes(s: ModelShape) -> float:
    """What one linear-attention layer's core saves per token (layer.py's _exchange_and_mix: the conv, the gates and
    delta_rule.py's chunked recurrence), counted from what autograd keeps there in our torch path (bf16 model: 2 bytes,
    the recurrence in fp32: 4). tests/test_linear_attention_memory.py measures it. Per token, h = value heads (q and k
    are repeated to them before the recurrence), C = LINEAR_CHUNK:
      conv: its input, its output (the activation's input) and the activation's output, 3 x 2 x conv channels;
      gates: the decay's and beta's inputs and outputs, 2 + 4 + 4 + 2 bytes a value head (KDA: a decay per key channel);
      recurrence, fp32 per head: q and k before the L2 norm and their norms 2 dk + 2, about twelve [C, d] tensors per
        chunk (q, k, v, beta k, beta v, the solves' inputs and outputs: six of dk, six of dv; an estimate of which dim
        each has), six [C, C] matrices (the decays, A, the scores: 6 C a token), the per-chunk w (dv) and the state each
        chunk reads (dk x dv per chunk of C tokens: dk dv / C a token), a few scalars (3); KDA's decay per key channel
        adds its [C, C, dk] exponents and their products (3 C dk, measured) and its per-channel decays (6 dk).
    Nothing grows with S but through the tokens: the chunk's C x C and the state are per chunk, not per sequence."""
    if not s.linear_idx:
        return 0.0
    h, dk, dv, C = s.lin_v_heads, s.lin_k_dim, s.lin_v_dim, LINEAR_CHUNK
    kda = s.linear_kind == "kda"
    conv = 3 * 2 * s.lin_conv_channels
    gates = (2 + 4 + 4) * h * (dk if kda else 1) + 2 * h
    per_head = 2 * dk + 2 + 6 * dk + 6 * dv + 6 * C + dv + dk * dv / C + 3 + ((3 * C + 6) * dk if kda else 0)
    return conv + gates + 4 * h * per_head


def _linear_bytes(s: ModelShape, run: RunShape) -> float:
    """One linear-attention layer's mixer per token: the core, and the gated output norm (fp32 input, the fp32 gate's
    activation input and output, the bf16 normed value and product, the per-row rsqrt; the product is out_proj's input).
    Kernel mode does not change it: the fused RMSNorm never takes the gated norm (kernels/bind.py)."""
    width = s.lin_v_heads * s.lin_v_dim
    return _linear_core_bytes(s) + 3 * 4 * width + 2 * 2 * width + 4 * s.lin_v_heads


def _mlp_bytes(s: ModelShape, run: RunShape, moe: bool, policy: Policy, transient: bool = False) -> float:
    """The MLP's saved bytes per token; tiled dense MLPs keep none (one tile is counted apart)."""
    if moe and run.moe_lean:
        # h [N, 2I] alone; under moe.recompute=experts nothing (h is made again in backward, where it is transient)
        experts = 0.0 if run.moe_recompute == "experts" and not transient else s.top_k * 4 * s.expert_intermediate
        return experts + 6 * s.experts + 8 * s.shared_intermediate
    if moe:
        experts = s.top_k * (8 * s.expert_intermediate + 4 * s.hidden)
        if run.moe_recompute == "experts":  # only the dispatched inputs wait; a group's FFN exists in backward
            kept = s.top_k * 4 * s.hidden  # dispatched inputs, and the outputs the combine weights multiply
            experts = kept + (experts - kept) * min(1.0, run.moe_group / max(s.experts, 1)) if transient else kept
        elif run.moe_recompute == "act":
            experts -= s.top_k * 4 * s.expert_intermediate
        return experts + 6 * s.experts + 8 * s.shared_intermediate
    if policy.tiled_mlp:
        return 0.0
    return (6 if run.kernels == "fused" else 8) * s.intermediate


def _selective_saving(s: ModelShape, run: RunShape, moe: bool, tiled: bool) -> float:
    """What selective recompute drops per token and layer: the norms' internals, SwiGLU's product inputs."""
    norms = 2 * (_norm_bytes(s, run) - 2 * s.hidden)
    swiglu = 0 if moe or tiled else (2 if run.kernels == "fused" else 4) * s.intermediate
    return norms + swiglu


def _layer_bytes(s: ModelShape, run: RunShape, moe: bool, policy: Policy, selective: bool,
                 transient: bool = False, linear: bool = False) -> float:
    mixer = _linear_bytes(s, run) if linear else _full_attention_bytes(s, run)
    b = 2 * _norm_bytes(s, run) + mixer + _mlp_bytes(s, run, moe, policy, transient)
    return b - (_selective_saving(s, run, moe, policy.tiled_mlp) if selective else 0.0)


def _whole_recomputed(s: ModelShape, policy: Policy) -> list[bool]:
    """Per layer: recomputed whole, attention included (uniform spread for block / except_attention's N)."""
    if policy.recompute == "full":
        return [True] * s.layers
    if policy.recompute in ("block", "except_attention") and policy.recompute_num_layers > 0:
        n = min(policy.recompute_num_layers, s.layers)
        picked = {math.floor(i * s.layers / n) for i in range(n)}
        return [i in picked for i in range(s.layers)]
    return [False] * s.layers


def _is_moe_layer(s: ModelShape) -> list[bool]:
    return [i >= s.dense_layers for i in range(s.layers)]  # which ones does not matter to the sums


def _is_linear_layer(s: ModelShape) -> list[bool]:
    return [i in s.linear_idx for i in range(s.layers)]


def _core_kept_bytes(s: ModelShape, run: RunShape, linear: bool) -> float:
    """What except_attention keeps of a layer it does not recompute whole, beside the layer input: the attention
    kernel's q, k, v and output (+ the output in sequence layout at cp > 1), or a linear layer's core, whose saved
    tensors and output (o, [B s nv dv]) it keeps the same way (memory/except_attention.py)."""
    if linear:
        return _linear_core_bytes(s) + 2 * s.lin_v_heads * s.lin_v_dim
    return 2 * (s.q + s.kv + s.v_width + s.out_width) + (2 * s.hidden if run.cp > 1 else 0)


def linear_layer_flops(s: ModelShape, tokens: int) -> float:
    """One linear layer's chunked recurrence, forward, on `tokens` tokens of every value head (matmuls, 2 FLOPs a
    multiply-add): per token and head A = (beta k) k^T over the chunk (C dk), the two triangular solves (C dv / 2 +
    C dk / 2), the scores q k^T (C dk) and their product with w (C dv), and three state products (w's correction, the
    output's read, the state's update: 3 dk dv). Linear in the tokens: no S x S term. Its projections and conv are in
    the parameters (6 x parameters x tokens)."""
    if not s.linear_idx:
        return 0.0
    C, dk, dv = LINEAR_CHUNK, s.lin_k_dim, s.lin_v_dim
    return 2.0 * tokens * s.lin_v_heads * (C * (2.5 * dk + 1.5 * dv) + 3 * dk * dv)


ZERO0_GRAD_SHARE = 0.2


def _state_bytes(s: ModelShape, run: RunShape) -> float:
    """Bytes of weights, master weights, gradients and Adam moments (bf16 weights: RunShape has no precision, and an
    fp32 run's 4 + 0 + 4 + 8 at ZeRO-1/2 totals the same 16 as bf16 weights with an fp32 master)."""
    p = s.params()
    master = 2 if run.master_weights == "bf16" else 4
    adam = 2 * master  # two moments in the master's dtype
    grads = 2  # DeepSpeed keeps them in the weights' dtype, fp32 master or not (measured: 2.30 GiB for 1.24B)
    if run.zero_stage == 0:
        # ZeRO-0's gradients are made layer by layer as the checkpoints are freed, where ZeRO-2 allocates its whole
        # flat partition at the backward's start: at the peak only a share of them is alive. Measured (one H200,
        # docs/benchmarks.md AJ/AK): 0.66-0.97 of the gradient bytes under ZeRO-2's peak at 16k-64k (dense), 0.81
        # (MoE, 16k); the share counted here is the rest, rounded
        grads = 0 if run.grads_in_backward else 2 * ZERO0_GRAD_SHARE
    if master == 2 and run.zero_stage <= 2 and run.shared_master:
        master = 0  # the master partition is the weights' own slice
    if run.zero_stage == 3 and run.world > 1:
        return p * (2 + master + adam + grads) / run.world
    return p * 2 + p * (master + adam + grads) / run.world


def memory_features(shape: ModelShape, run: RunShape, policy: Policy) -> dict:
    """GiB per memory term before its coefficient, and the host GiB per rank (offload)."""
    s, T = shape, run.local_tokens
    whole = _whole_recomputed(s, policy)
    moe_layer = _is_moe_layer(s)
    linear = _is_linear_layer(s)
    selective_everywhere = policy.recompute == "selective" or policy.selective_kept
    kept = host = transient = attention_on_gpu = 0.0
    inputs_offloaded = 0
    for i in range(s.layers):
        if whole[i] or policy.recompute == "except_attention":
            attention_kept = 0.0 if whole[i] else _core_kept_bytes(s, run, linear[i])
            if policy.attention_offload and attention_kept:  # on the host; about two layers' stay on the GPU
                host += attention_kept
                attention_on_gpu = max(attention_on_gpu, attention_kept)
                attention_kept = 0.0
            if policy.offload_activations:  # the layer input travels; attention's tensors bypass offload
                host += 2 * s.hidden
                inputs_offloaded += 1
                kept += attention_kept
            else:
                kept += 2 * s.hidden + attention_kept
            transient = max(transient, _layer_bytes(s, run, moe_layer[i], policy, selective_everywhere, True,
                                                    linear[i]))
        else:
            layer = _layer_bytes(s, run, moe_layer[i], policy, selective_everywhere, linear=linear[i])
            if policy.offload_activations:  # without recompute, every saved tensor goes to the host
                host += layer
            else:
                kept += layer
    kept += 2 * attention_on_gpu  # attention_offload: the layer being copied out and the one coming back
    # offload's backward holds the input being recomputed and the two it prefetches (offload.py, prefetch=2)
    kept += min(OFFLOAD_WINDOW, inputs_offloaded) * 2 * s.hidden
    host_gib = host * T / GIB
    kept_gib = kept * T / GIB
    if policy.offload_activations and policy.offload_max_gib > 0 and host_gib > policy.offload_max_gib:
        kept_gib += host_gib - policy.offload_max_gib  # past the cap, the rest stays on the GPU
        host_gib = policy.offload_max_gib
    tile = 0.0
    if policy.tiled_mlp and s.dense_layers:
        tile = min(policy.mlp_tile_tokens, T) * (6 if run.kernels == "fused" else 8) * s.intermediate
    return {"states": _state_bytes(s, run) / GIB, "kept": kept_gib, "transient": (transient * T + tile) / GIB,
            "host": host_gib}


def predict(shape: ModelShape, run: RunShape, policy: Policy, coef: Mapping[str, float]) -> Prediction:
    m = memory_features(shape, run, policy)
    parts = {
        "states": coef["state_scale"] * m["states"],
        "kept": coef["act_scale"] * m["kept"],
        "transient": coef["transient_scale"] * m["transient"],
        "const": coef["const_gib"],
    }
    peak = sum(parts.values())
    times = step_time_terms(shape, run, policy, coef)
    step = sum(times.values())
    parts.update({f"t_{k}": v for k, v in times.items()})
    return Prediction(peak_gib=peak, step_s=step, host_gib=m["host"],
                      tokens_per_s_per_gpu=run.local_tokens / step if step > 0 else 0.0, parts=parts)


def step_time_terms(s: ModelShape, run: RunShape, policy: Policy, coef: Mapping[str, float]) -> dict:
    """Seconds per term; each term is a feature (time_features) times its coefficient."""
    f = time_features(s, run, policy)
    return {k: f[k] * coef[f"time_{k}"] for k in f}


TIME_TERMS = ("dense", "experts", "attn_sdpa", "attn_fa4", "elem_eager", "elem_fused", "optimizer_fp32",
              "optimizer_bf16", "optimizer_zero0")


def time_features(s: ModelShape, run: RunShape, policy: Policy) -> dict:
    """The quantities each time coefficient multiplies (FLOPs in units of 1e12, elements in 1e9)."""
    T, S = run.local_tokens, run.seq_len
    whole = _whole_recomputed(s, policy)
    n_whole = sum(whole)
    n_moe_whole = sum(w for w, m in zip(whole, _is_moe_layer(s)) if m)
    # a recomputed layer's mixer projections: the mean over full and linear layers (which are recomputed is spread)
    mixer = (s.full_layers * s.attention_params() + s.linear_layers * s.linear_params()) / s.layers
    layer_dense = mixer + 3 * s.hidden * s.intermediate
    moe_dense = mixer + s.moe_other_params()
    # forward + backward of everything; recompute adds forwards
    lookup = 0 if s.tied else s.vocab * s.hidden  # the input embedding is a lookup, no matmul
    dense = 6 * T * (s.params(active=True) - lookup - s.moe_layers * s.expert_params(active=True))
    experts = 6 * T * s.moe_layers * s.expert_params(active=True)
    forwards_again = n_whole
    if policy.recompute == "except_attention":
        forwards_again = s.layers  # every layer's projections and MLP run again; attention only in `whole`
    moe_again = n_moe_whole if policy.recompute != "except_attention" else s.moe_layers
    dense_again = (forwards_again - moe_again) * layer_dense + moe_again * moe_dense
    if policy.tiled_mlp:  # each tile's MLP forward once more in its backward
        dense_again += s.dense_layers * 3 * s.hidden * s.intermediate
    dense += 2 * T * dense_again
    experts += 2 * T * moe_again * s.expert_params(active=True)
    if run.moe_recompute == "experts":  # the lean pass runs the first projection again, not the second
        experts += 2 * T * s.moe_layers * s.expert_params(active=True) * (2 / 3 if run.moe_lean else 1)
    # causal forward per layer, this GPU's heads: q.k^T over q/k's head dim, then p.v over v's
    attn_layer = 1.0 * (s.q + s.out_width) * S * S * run.micro_batch / run.cp
    linear = _is_linear_layer(s)
    n_whole_linear = sum(w for w, lin in zip(whole, linear) if lin)
    attn = attn_layer * (3 * s.full_layers + n_whole - n_whole_linear)
    # the linear layers' recurrence (forward, backward twice its forward, again where recomputed whole; except_attention
    # replays its core): costed at the dense matmul rate, an estimate, no calibration row has a linear layer
    dense += linear_layer_flops(s, T) * (3 * s.linear_layers + n_whole_linear)
    passes = 3 * s.layers + forwards_again + (s.layers if policy.recompute == "selective" or policy.selective_kept
                                              else 0)
    elem = passes * T * s.hidden
    fused = run.kernels == "fused"
    per_gpu_params = s.params() / (run.world if run.zero_stage == 3 else 1)
    fa4 = run.attn_backend == "fa4"
    zero0 = run.zero_stage == 0
    return {
        "dense": dense / 1e12, "experts": experts / 1e12,
        "attn_sdpa": 0.0 if fa4 else attn / 1e12, "attn_fa4": attn / 1e12 if fa4 else 0.0,
        "elem_eager": 0.0 if fused else elem / 1e9, "elem_fused": elem / 1e9 if fused else 0.0,
        # DeepSpeed's ZeRO optimizer phase, by master dtype; deepspeed=zero0's own step (engine/ds/clipping_adamw.py:
        # one Triton pass on the parameters, no flat buffers) has its own rate
        "optimizer_fp32": per_gpu_params / 1e9 if run.master_weights != "bf16" and not zero0 else 0.0,
        "optimizer_bf16": per_gpu_params / 1e9 if run.master_weights == "bf16" and not zero0 else 0.0,
        "optimizer_zero0": per_gpu_params / 1e9 if zero0 else 0.0,
    }


def load_calibration(path: Optional[Path] = None) -> dict:
    """{"coefficients": {...}, "rows": [...]} from planner_calibration.json."""
    return json.loads(Path(path or CALIBRATION_FILE).read_text())

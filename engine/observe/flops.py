"""Model FLOPs per step and the MFU they imply.

    FLOPs per step = 6 * N * T  +  6 * Hq * Dh * sum_over_layers(sum_over_sequences(S^2))

N: parameters a token uses (tied embeddings counted once; in an MoE layer, its top_k experts' weights, not all E
of them, whatever ep holds on this rank), T: tokens processed in the global batch, L: layers,
Hq: query heads, Dh: head dim, S: each sequence's length (the global, unsplit length). The second term
is causal attention: forward 2 * Hq * Dh * S^2 per layer (QK^T and PV, each S^2/2 * Dh * 2 per head; with MLA's
q/k dim Dqk and v dim Dv, Dh is their mean: S^2/2 * (Dqk + Dv) * 2),
backward twice the forward. Recompute is NOT counted (MFU convention), so memory policies that
recompute lower MFU honestly. Same formula as ../anchor-bench/model_bench.py, so numbers compare.

What attention really computes replaces S^2 where it is less: in a packed row each document is a sequence of
its own (sum of its documents' L^2, not the row's S^2), and a sliding-window layer of window w sees at most w
keys per query (2 S w - w^2 for S > w: the same causal-pairs convention). A linear-attention layer (Qwen3.5's
gated DeltaNet, Ling's KDA) has no S^2 term: its projections are in 6NT, and its chunked recurrence (about S * 64 *
head dims per head) is left out, so a hybrid's MFU errs low, never high. Counting a packed row as one causal
sequence would overstate the FLOPs, and a fast packed step would then trip the MFU-over-100% check.
"""
from __future__ import annotations

# dense bf16 tensor-core peaks per GPU (TFLOP/s), by substring of torch.cuda.get_device_name()
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "B200": 2250.0, "B300": 2250.0}


def count_params(model) -> int:
    """Parameters a token uses: dense ones once, and top_k experts' worth of each MoE layer."""
    from ds_ulysses_ext.moe import moe_blocks
    blocks = moe_blocks(model)
    seen = {id(p) for b in blocks for p in b.experts.parameters()}
    total = sum(b.spec.top_k * 3 * b.spec.intermediate_size * b.spec.expert_dim for b in blocks)
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.ds_numel if hasattr(p, "ds_numel") else p.numel()  # ZeRO-3 params are partitioned
    return total


def layer_windows(hf_config) -> list:
    """Each layer's sliding window (None: full attention; 0: a linear-attention layer, no quadratic term), as HF's
    attention reads it."""
    window = getattr(hf_config, "sliding_window", None)
    types = getattr(hf_config, "layer_types", None)
    if types:
        return [window if t == "sliding_attention" else 0 if t == "linear_attention" else None for t in types]
    on = window and getattr(hf_config, "use_sliding_window", True)
    return [window if on else None] * hf_config.num_hidden_layers


def attention_sq(lengths, windows) -> float:
    """sum over layers and sequences of the S^2 that the attention FLOPs scale with (see the module docstring)."""
    total = 0.0
    for w in set(windows):
        n = windows.count(w)
        total += n * sum(float(L) * L if w is None or L <= w else 2.0 * L * w - float(w) * w for L in lengths)
    return total


def step_flops(num_params: int, hf_config, num_seqs: int, seq_len: int, attn_sq: float = None) -> float:
    """attn_sq: attention_sq over the global batch's documents (packed rows); None: num_seqs rows of seq_len."""
    dense = 6.0 * num_params * num_seqs * seq_len
    if attn_sq is None:
        attn_sq = attention_sq([seq_len] * num_seqs, layer_windows(hf_config))
    return dense + 3.0 * hf_config.num_attention_heads * sum(attention_head_dims(hf_config)) * attn_sq


def attention_head_dims(hf_config) -> tuple:
    """(q/k head dim, v head dim). MLA (DeepSeek-V3, GLM-4-MoE-Lite): q/k = nope + rope parts, v its own, and HF's
    `head_dim` there is only the rope part; elsewhere both are head_dim."""
    nope, rope = getattr(hf_config, "qk_nope_head_dim", None), getattr(hf_config, "qk_rope_head_dim", None)
    if nope is not None and rope is not None and getattr(hf_config, "v_head_dim", None) is not None:
        return nope + rope, hf_config.v_head_dim
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    return head_dim, head_dim


def detect_peak_tflops(device) -> float:
    """bf16 dense peak of this GPU, or 0.0 when unknown (MFU is then not reported)."""
    if device.type != "cuda":
        return 0.0
    import torch
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), 0.0)

"""The GPU exactness matrix's cells (scripts/bench/gpu_matrix.py runs and judges them): the families at their real head
dims, and which cells each takes (kernels, packing, memory presets, MoE options, FA4, fla, FP8)."""
from __future__ import annotations


# family: (model preset, arch overrides): 2 layers, few experts, the real head dims
FAMILIES = {
    "llama_d64": ("llama3_2_1b", dict(num_hidden_layers=2)),
    "llama_d128": ("llama3_1_8b_shape", dict(num_hidden_layers=2, intermediate_size=8192)),
    "qwen3_d128": ("tiny_qwen3", dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=2,
                                      num_attention_heads=32, num_key_value_heads=8, head_dim=128)),
    "qwen3_moe": ("qwen3_30b_a3b_4l", dict(num_hidden_layers=2, num_experts=16)),
    "gpt_oss": ("tiny_gpt_oss", dict(vocab_size=32000, hidden_size=2880, intermediate_size=2880, num_local_experts=8,
                                     num_experts_per_tok=4, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                                     sliding_window=128)),
    "deepseek_v3_mla": ("deepseek_v3_2l", dict(vocab_size=32000, hidden_size=2048, intermediate_size=4096,
                                               moe_intermediate_size=512, n_routed_experts=16, n_group=1, topk_group=1,
                                               num_attention_heads=16, num_key_value_heads=16, q_lora_rank=768)),
    "glm4_moe_lite_mla": ("glm4_moe_lite_4l", dict(num_hidden_layers=2, mlp_layer_types=["dense", "sparse"],
                                                   n_routed_experts=16)),
    "glm4_moe": ("glm4_5_air_4l", dict(num_hidden_layers=2, hidden_size=2048, num_attention_heads=16,
                                       num_key_value_heads=4, n_routed_experts=16)),
    "latent_moe": ("tiny_latent_moe", dict(vocab_size=32000, hidden_size=2048, num_attention_heads=16,
                                           num_key_value_heads=4, head_dim=128, num_experts=16, moe_intermediate_size=256)),
    # Mistral4's MLA: q/k 64 + 64 (half of it rotary, yarn with Llama-4's query scale), v 128
    "mistral4_mla": ("tiny_mistral4", {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 4096,
                                       "moe_intermediate_size": 512, "n_routed_experts": 16, "num_experts_per_tok": 4,
                                       "n_group": 1, "topk_group": 1, "num_attention_heads": 16,
                                       "num_key_value_heads": 16, "q_lora_rank": 768, "kv_lora_rank": 256,
                                       "qk_nope_head_dim": 64, "qk_rope_head_dim": 64, "v_head_dim": 128,
                                       "rope_parameters.partial_rotary_factor": 0.5,
                                       "rope_parameters.original_max_position_embeddings": 1024}),
    # Cohere2-MoE: a sliding layer (window 512 of the 4k batch) and a global NoPE layer, head dim 128
    "cohere2_moe": ("tiny_cohere2_moe", dict(vocab_size=32000, hidden_size=2048, intermediate_size=1024, num_experts=16,
                                             num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                                             sliding_window=512)),
    # the Qwen3-VL language model on text (interleaved multimodal RoPE), head dim 128; the vision tower stays frozen
    "qwen3_vl_text": ("tiny_qwen3_vl", {"text_config.vocab_size": 32000, "text_config.hidden_size": 2048,
                                        "text_config.intermediate_size": 4096, "text_config.num_attention_heads": 16,
                                        "text_config.num_key_value_heads": 8, "text_config.head_dim": 128,
                                        "text_config.rope_parameters.mrope_section": [24, 20, 20],
                                        "vision_config.out_hidden_size": 2048}),
    # Qwen3.5-MoE's hybrid: a gated DeltaNet layer (16 key / 32 value heads of 128) and a gated full-attention layer
    # (head dim 256, a quarter rotary)
    "qwen3_5_moe": ("tiny_qwen3_5_moe", dict(vocab_size=32000, hidden_size=2048, num_hidden_layers=2,
                                             layer_types=["linear_attention", "full_attention"],
                                             num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                                             linear_num_key_heads=16, linear_num_value_heads=32,
                                             linear_key_head_dim=128, linear_value_head_dim=128, num_experts=16,
                                             num_experts_per_tok=8, moe_intermediate_size=512,
                                             shared_expert_intermediate_size=512)),
    "qwen3_5_dense": ("tiny_qwen3_5", dict(vocab_size=32000, hidden_size=2048, intermediate_size=6144,
                                           num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                                           num_attention_heads=16, num_key_value_heads=4, head_dim=256,
                                           linear_num_key_heads=16, linear_num_value_heads=32,
                                           linear_key_head_dim=128, linear_value_head_dim=128)),
}
# the hybrids: their linear layers' delta rule through fla's chunked kernels (model.linear_attn_kernel=fla, after
# .flaw's fla-core is installed: --fla) as well as through the torch path every other cell runs
HYBRID = ("qwen3_5_moe", "qwen3_5_dense")
# FP8 cells (--fp8): the dense families, whose MLPs fp8.recipe=delayed takes (gated SiLU, no biases). The MoE families'
# layers are all sparse here, and their experts stay bf16, so precision=fp8 refuses them with fp8.linears=mlp; under
# fp8.linears=all their attention projections run in FP8, with delayed scales on Qwen3-MoE's q/k/v groups and o_proj,
# and on DeepSeek-V3's first (dense) layer's MLP and its o_proj (MLA's other projections and the shared experts keep
# tensorwise's dynamic scales)
FP8_FAMILIES = ("llama_d64", "llama_d128", "qwen3_d128")
FP8_EAGER = ["precision=fp8", "fp8.recipe=tensorwise", "fp8.compile=false", "model.kernels=none", "memory=none"]
FP8_CELLS = {  # name: overrides (each with precision=fp8 and model.kernels=liger), packed
    "fp8 tensorwise": (["fp8.recipe=tensorwise"], False),
    "fp8 delayed": (["fp8.recipe=delayed"], False),
    "fp8 delayed all": (["fp8.recipe=delayed", "fp8.linears=all"], False),
    "fp8 delayed packed": (["fp8.recipe=delayed"], True),
    "fp8 delayed memory=selective": (["fp8.recipe=delayed", "memory=selective"], False),
    "fp8 delayed memory=full_recompute": (["fp8.recipe=delayed", "memory=full_recompute"], False),
}
FP8_MOE_CELLS = {  # family: its cells, as FP8_CELLS (the experts stay bf16)
    "qwen3_moe": {"fp8 tensorwise all": (["fp8.recipe=tensorwise", "fp8.linears=all"], False),
                  "fp8 delayed all": (["fp8.recipe=delayed", "fp8.linears=all"], False),
                  "fp8 delayed all packed": (["fp8.recipe=delayed", "fp8.linears=all"], True)},
    "deepseek_v3_mla": {"fp8 tensorwise all": (["fp8.recipe=tensorwise", "fp8.linears=all"], False),
                        "fp8 delayed all": (["fp8.recipe=delayed", "fp8.linears=all"], False)},
}
# FlashAttention-4 cells (--fa4, after the FA4 wheels are installed): head dims it takes, windows and sinks among them
FA4_FAMILIES = ("llama_d64", "llama_d128", "qwen3_moe", "gpt_oss", "cohere2_moe")
QUICK = {  # --quick (CPU): the harness on tiny shapes
    "llama_d64": ("tiny", {}), "deepseek_v3_mla": ("tiny_deepseek_v3", {}), "qwen3_moe": ("tiny_moe", {}),
}
# every preset memory=auto can choose (hydra_conf/memory, less auto and budget)
MEMORY = ("selective", "selective_tiled", "tiled", "except_attention", "except_attention_offload",
          "except_attention_offload_tiled", "block_recompute", "full_recompute", "offload", "except_attention_tiled",
          "long_context", "selective_block")

WHOLE_LAYERS = ("except_attention_tiled", "selective_block")  # presets that recompute memory.recompute_num_layers=4


def cells(families, quick: bool, fa4: bool = False, fla: bool = False, fp8: bool = False):
    """(family, name, overrides, packed) of every cell."""
    out = []
    for fam in families:
        for k in ("liger", "compile"):  # model.kernels=none with memory=none and zero0 is the eager path itself
            out.append((fam, f"kernels={k}", [f"model.kernels={k}"], False))
        out.append((fam, "kernels=liger zero3", ["model.kernels=liger", "deepspeed=zero3"], False))
        out.append((fam, "packed", ["model.kernels=liger"], True))
        if fam in HYBRID:
            out.append((fam, "linear_attn_kernel=torch", ["model.linear_attn_kernel=torch"], False))
            if fla:
                out.append((fam, "linear_attn_kernel=fla", ["model.linear_attn_kernel=fla"], False))
                out.append((fam, "linear_attn_kernel=fla packed", ["model.linear_attn_kernel=fla"], True))
    if fa4:  # FA4 against the same SDPA fp32 reference: its varlen (packed), window and sink paths on real shapes
        for fam in [f for f in FA4_FAMILIES if f in families]:
            out.append((fam, "attn=fa4", ["model.attn_backend=fa4"], False))
            out.append((fam, "attn=fa4 packed", ["model.attn_backend=fa4"], True))
    for fam in families:  # every family takes every preset memory=auto can choose
        for m in (MEMORY[:3] if quick else MEMORY):
            out.append((fam, f"memory={m}", [f"memory={m}"], False))
            if m in WHOLE_LAYERS:  # their 4 layers recomputed whole exceed the matrix's 2: the same policy at 1
                out.append((fam, f"memory={m} recompute_num_layers=1", [f"memory={m}", "memory.recompute_num_layers=1"],
                            False))
        if not quick:  # uneven MLP tiles: 4,096 tokens in 5 tiles, whose boundaries tile_sizes puts on multiples of 16
            out.append((fam, "memory=tiled mlp_tile_tokens=1000", ["memory=tiled", "memory.mlp_tile_tokens=1000"], False))
    for fam in [f for f in ("qwen3_moe", "deepseek_v3_mla") if f in families]:
        out.append((fam, "moe.recompute=experts", ["moe.recompute=experts"], False))
        out.append((fam, "moe.recompute=experts offload_inputs", ["moe.recompute=experts", "moe.offload_inputs=true"],
                    False))
    for fam in [f for f in ("llama_d64", "qwen3_moe", "gpt_oss") if f in families]:
        out.append((fam, "optimizer_in_backward", ["trainer.optimizer_in_backward=true"], False))
        out.append((fam, "packed except_attention_offload", ["memory=except_attention_offload"], True))
    if fp8:
        fp8_cells = {**{f: FP8_CELLS for f in FP8_FAMILIES}, **FP8_MOE_CELLS}
        for fam in [f for f in fp8_cells if f in families]:
            for name, (over, packed) in fp8_cells[fam].items():
                out.append((fam, name, ["precision=fp8", "model.kernels=liger", *over], packed))
    return out

"""LatentMoE as an HF model: `LatentMoeConfig` and `LatentMoeForCausalLM` (model_type "latent_moe").

A Qwen3-MoE decoder (attention, norms, RoPE unchanged) whose MoE layers are `MoEBlock`s with a latent size:
the router and a shared expert see the full hidden state; the routed experts work in a latent space of
`latent_size` (a multiple of 512) between `fc1_latent_proj` (hidden -> latent, before dispatch) and
`fc2_latent_proj` (latent -> hidden, after combine), as Megatron-Core's `moe_latent_size` does. The all-to-all
then moves latent_size / hidden_size of the bytes it would move at full width.

It round-trips through `save_pretrained` / `from_pretrained` once `register_latent_moe()` has run (the engine and
`enable_expert_parallel` run it): HF's Auto classes then know the type. `router_expert_bias=true` (the export writes
it when the routers carry moe.balance=bias's `expert_bias`) builds that buffer, so from_pretrained reads it too.
"""
from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeForCausalLM, Qwen3MoeSparseMoeBlock

from .experts import GroupedExperts
from .layer import MoEBlock, SwiGLU
from .router import TopKRouter

LATENT_ALIGN = 512  # DeepEP's strictest divisibility (UE8M0 scales per 512 channels) holds for every multiple


class LatentMoeConfig(Qwen3MoeConfig):
    model_type = "latent_moe"

    def __init__(self, latent_size: int = 512, shared_expert_intermediate_size: int = 0,
                 router_score: str = "softmax", router_expert_bias: bool = False, **kwargs):
        self.latent_size = latent_size
        self.router_expert_bias = router_expert_bias
        self.shared_expert_intermediate_size = shared_expert_intermediate_size
        self.router_score = router_score
        super().__init__(**kwargs)


class LatentMoeForCausalLM(Qwen3MoeForCausalLM):
    config_class = LatentMoeConfig

    def __init__(self, config: LatentMoeConfig):
        super().__init__(config)
        from .parallel import hf_moe_spec
        spec = hf_moe_spec(config, expert_bias=bool(config.router_expert_bias))
        for layer_id, layer in enumerate(self.model.layers):
            if isinstance(layer.mlp, Qwen3MoeSparseMoeBlock):
                layer.mlp = MoEBlock(spec, layer_id)
        self.post_init()
        # HF initialises the decoder through the inner Qwen3MoeModel's _init_weights, which does not know our
        # router and stacked experts: draw them here (HF's Linear init covers the latent projections and the shared
        # expert). A checkpoint's weights overwrite these in from_pretrained.
        with torch.no_grad():
            for block in self.model.modules():
                if isinstance(block, (GroupedExperts, TopKRouter)):
                    for p in block.parameters(recurse=False):
                        if p.numel() and not p.is_meta:
                            p.normal_(0.0, config.initializer_range)


def register_latent_moe() -> None:
    """Teach HF's Auto classes the latent_moe type (idempotent)."""
    try:
        AutoConfig.register(LatentMoeConfig.model_type, LatentMoeConfig)
    except ValueError:
        pass  # already registered
    try:
        AutoModelForCausalLM.register(LatentMoeConfig, LatentMoeForCausalLM)
    except ValueError:
        pass

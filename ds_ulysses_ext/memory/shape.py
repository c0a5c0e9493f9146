"""A model's shape as the memory planner reads it: the HF config keys that size memory and step time (hidden,
layers, heads, head dims, vocab, intermediate, experts, MLA latents, linear-attention layers) and the parameter
counts they give.

Apart from planner.py because it is the one part of the cost model that knows the families' config spellings (MoE
layouts, MLA, Ling-3.0's derived layer types) and depends on nothing else there: the per-layer bytes and FLOPs in
planner.py are built on it, never the other way. Pure Python, as planner.py: no torch import.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

QK_NORM_FAMILIES = ("qwen3", "qwen3_moe")
# full attention with Qwen3.5 / Qwen3-Next's output gate: q_proj makes q and a q-sized gate, sigmoid(gate) * out
GATED_ATTENTION_FAMILIES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
KDA_FAMILIES = ("bailing_hybrid",)  # linear layers with a decay per key channel (Kimi delta attention)


@dataclass(frozen=True)
class ModelShape:
    """What the cost model reads of a model: HF config keys (model.arch or a config.json)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = False
    experts: int = 0  # routed experts per MoE layer (0: dense)
    top_k: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0  # shared experts' total intermediate size
    moe_layers: int = 0
    qk_norm: bool = False  # RMSNorm over each query and key head (Qwen3, GLM-4-MoE with use_qk_norm)
    # MLA (DeepSeek-V3, GLM-4-MoE-Lite): v's head dim when it is not q/k's, the q and kv latent ranks (0: none) and
    # the rope part of q/k's head dim; the latents are per token, the heads come from their up-projections
    v_head_dim: int = 0  # 0: head_dim
    q_lora: int = 0
    kv_lora: int = 0
    rope_dim: int = 0
    attn_gate: bool = False  # GATED_ATTENTION_FAMILIES' output gate on the full-attention layers
    # linear-attention layers (config.layer_types "linear_attention"; linear_attention/): their indices, "gdn" (gated
    # DeltaNet: Qwen3.5 / 3.6, Qwen3-Next) or "kda" (Ling-3.0), key / value heads and dims, conv kernel
    linear_idx: tuple = ()
    linear_kind: str = ""
    lin_k_heads: int = 0
    lin_v_heads: int = 0
    lin_k_dim: int = 0
    lin_v_dim: int = 0
    lin_conv: int = 0

    @classmethod
    def from_arch(cls, arch: Mapping[str, Any], family: str = "") -> "ModelShape":
        a = dict(arch)
        layers = int(a["num_hidden_layers"])
        hidden = int(a["hidden_size"])
        heads = int(a["num_attention_heads"])
        head_dim = int(a.get("head_dim") or hidden // heads)
        if a.get("qk_nope_head_dim") is not None:  # MLA: q/k carry nope + rope dims
            head_dim = int(a["qk_nope_head_dim"]) + int(a.get("qk_rope_head_dim") or 0)
        experts = int(a.get("num_experts") or a.get("n_routed_experts") or a.get("num_local_experts") or 0)
        top_k = int(a.get("num_experts_per_tok") or 0) if experts else 0
        inter = int(a.get("intermediate_size") or 4 * hidden)
        expert_inter = int(a.get("moe_intermediate_size") or inter) if experts else 0
        shared = int(a.get("shared_expert_intermediate_size") or 0)
        if a.get("n_shared_experts"):
            shared = int(a["n_shared_experts"]) * expert_inter
        moe_layers = 0
        if experts and a.get("mlp_layer_types"):  # GLM-4-MoE-Lite spells its dense layers out: "dense" / "sparse"
            moe_layers = sum(1 for t in a["mlp_layer_types"][:layers] if t != "dense")
        elif experts:
            dense = set(a.get("mlp_only_layers") or [])
            dense |= set(range(int(a.get("first_k_dense_replace") or 0)))
            step = int(a.get("decoder_sparse_step") or 1)
            moe_layers = sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)
        linear = _linear_fields(a, family, layers, heads)
        return cls(layers=layers, hidden=hidden, intermediate=inter, heads=heads,
                   kv_heads=int(a.get("num_key_value_heads") or heads), head_dim=head_dim,
                   vocab=int(a["vocab_size"]), tied=bool(a.get("tie_word_embeddings", False)),
                   experts=experts, top_k=top_k, expert_intermediate=expert_inter, shared_intermediate=shared,
                   moe_layers=moe_layers,
                   qk_norm=bool(a.get("use_qk_norm", family in QK_NORM_FAMILIES)),
                   v_head_dim=int(a.get("v_head_dim") or 0), q_lora=int(a.get("q_lora_rank") or 0),
                   kv_lora=int(a.get("kv_lora_rank") or 0), rope_dim=int(a.get("qk_rope_head_dim") or 0),
                   attn_gate=family in GATED_ATTENTION_FAMILIES, **linear)

    # --- parameter counts
    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def v_dim(self) -> int:
        return self.v_head_dim or self.head_dim

    @property
    def v_width(self) -> int:
        return self.kv_heads * self.v_dim

    @property
    def out_width(self) -> int:
        """Attention's output per token: every query head's v-sized result (o_proj's input)."""
        return self.heads * self.v_dim

    @property
    def latent_width(self) -> int:
        """MLA's per-token latents: q's, kv's and the shared rope part of k (0 without MLA)."""
        return self.q_lora + self.kv_lora + self.rope_dim if self.kv_lora else 0

    @property
    def dense_layers(self) -> int:
        return self.layers - self.moe_layers

    @property
    def linear_layers(self) -> int:
        return len(self.linear_idx)

    @property
    def full_layers(self) -> int:
        """Softmax-attention layers (every layer but the linear ones)."""
        return self.layers - self.linear_layers

    @property
    def lin_conv_channels(self) -> int:
        """The linear layer's conv channels: q, k (key heads) and v (value heads)."""
        return 2 * self.lin_k_heads * self.lin_k_dim + self.lin_v_heads * self.lin_v_dim

    def linear_params(self) -> int:
        """One linear-attention layer: its projections, conv, gates' parameters and gated output norm."""
        if not self.linear_idx:
            return 0
        H, key, value, nv = self.hidden, self.lin_k_heads * self.lin_k_dim, self.lin_v_heads * self.lin_v_dim, \
            self.lin_v_heads
        conv = self.lin_conv_channels * self.lin_conv
        if self.linear_kind == "kda":
            # q, k, v, f (the forget gate), g (the output gate) [H, n d], b [H, n], o [n d, H]; A_log [n], dt_bias [n d]
            return 5 * H * value + H * nv + value * H + conv + nv + value + self.lin_v_dim
        # qkv [H, 2 key + value], z [H, value], a and b [H, nv], out [value, H]; A_log, dt_bias [nv]
        return H * (2 * key + value) + H * value + 2 * H * nv + value * H + conv + 2 * nv + self.lin_v_dim

    def attention_params(self) -> int:
        H, o = self.hidden, self.out_width * self.hidden
        if not self.kv_lora:
            return H * (self.q * (2 if self.attn_gate else 1) + self.kv + self.v_width) + o
        # MLA: q through its latent (or directly), k's nope part and v from the kv latent, k's rope part shared
        q = H * self.q_lora + self.q_lora * self.q if self.q_lora else H * self.q
        nope = self.head_dim - self.rope_dim
        kv = H * (self.kv_lora + self.rope_dim) + self.kv_lora * self.heads * (nope + self.v_dim)
        return q + kv + o

    def expert_params(self, active: bool) -> int:
        """Routed experts of one MoE layer (top_k of them when active)."""
        return (self.top_k if active else self.experts) * 3 * self.hidden * self.expert_intermediate

    def moe_other_params(self) -> int:
        return self.hidden * self.experts + 3 * self.hidden * self.shared_intermediate

    def params(self, active: bool = False) -> int:
        embed = self.vocab * self.hidden * (1 if self.tied else 2)
        dense_mlp = 3 * self.hidden * self.intermediate
        moe = self.expert_params(active) + self.moe_other_params()
        return (embed + self.full_layers * self.attention_params() + self.linear_layers * self.linear_params()
                + self.dense_layers * dense_mlp + self.moe_layers * moe)


def _linear_fields(a: Mapping[str, Any], family: str, layers: int, heads: int) -> dict:
    """ModelShape's linear-attention fields from the HF config keys: layer_types where the config has it, else
    Ling-3.0's rule (its config derives layer_types: every layer_group_size-th layer is full attention)."""
    types_ = list(a.get("layer_types") or [])
    if not types_ and family in KDA_FAMILIES:
        group = int(a.get("layer_group_size") or 6)
        types_ = ["full_attention" if (i + 1) % group == 0 else "linear_attention" for i in range(layers)]
    idx = tuple(i for i, t in enumerate(types_[:layers]) if t == "linear_attention")
    if not idx:
        return {}
    if family in KDA_FAMILIES:  # one head count and dim for q, k and v: the attention's (HF's config derives them)
        dim = int(a.get("linear_head_dim") or a.get("head_dim") or int(a["hidden_size"]) // heads)
        n = int(a.get("linear_num_heads") or heads)
        return dict(linear_idx=idx, linear_kind="kda", lin_k_heads=n, lin_v_heads=n, lin_k_dim=dim, lin_v_dim=dim,
                    lin_conv=int(a.get("linear_conv_kernel_dim") or a.get("short_conv_kernel_size") or 4))
    return dict(linear_idx=idx, linear_kind="gdn", lin_k_heads=int(a["linear_num_key_heads"]),
                lin_v_heads=int(a["linear_num_value_heads"]), lin_k_dim=int(a["linear_key_head_dim"]),
                lin_v_dim=int(a["linear_value_head_dim"]), lin_conv=int(a.get("linear_conv_kernel_dim") or 4))

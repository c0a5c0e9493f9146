"""MoEBlock: router -> (latent down-projection) -> dispatch -> local experts -> combine -> (up-projection)
-> + shared experts. One block replaces one HF sparse-MoE block, with HF's parameter names.

Legend: B batch, s local sequence (a CP chunk), H hidden, L latent size (LatentMoE; L = H otherwise), T = B*s.

    hidden [B, s, H] -> gate (router on the full hidden state) -> fc1_latent_proj [H -> L] -> dispatch over EP
    -> experts in L -> combine (fp32, weighted) -> fc2_latent_proj [L -> H] -> + shared_experts(hidden)

Parameter names follow HF's Qwen3-MoE (`gate.weight`, `experts.gate_up_proj`, `experts.down_proj`), so an HF
checkpoint's state dict loads as is and the export writes HF's layout. LatentMoE's projections follow
Megatron-Core's names (`fc1_latent_proj`, `fc2_latent_proj`); its shared expert is `shared_experts`.
GPT-OSS's block (`MoESpec.gpt_oss`, options of the same block) keeps HF's GptOssMLP names and layout:
`router.weight [E, H]`, `router.bias [E]`, `experts.gate_up_proj [E, H, 2I]` (+ `_bias [E, 2I]`),
`experts.down_proj [E, I, H]` (+ `_bias [E, H]`); its router takes the top-k of the logits and a softmax over
the k (router.py), its experts the clamped, alpha-scaled, interleaved SwiGLU (experts.py), and the block returns
(out, None) because HF's GptOssDecoderLayer unpacks (out, router_scores) and drops the scores.
DeepSeek-V3 / GLM-4-MoE(-Lite)'s block (`MoESpec.deepseek`) keeps HF's DeepseekV3MoE names: `gate.weight`,
`gate.e_score_correction_bias` (the selection bias, a persistent fp32 buffer), Qwen3's expert layout, and
`shared_experts.{gate,up,down}_proj`. Qwen3-Next's and Qwen3.5-MoE's (`MoESpec.qwen3_next`): Qwen3-MoE's names plus
`shared_expert.{gate,up,down}_proj` and `shared_expert_gate.weight` [1, H] (the shared output times its sigmoid).
Mistral4's (`MoESpec.mistral4`) and Cohere2-MoE's (`MoESpec.cohere2`) have the
same names without the selection bias; Cohere2-MoE averages the shared and routed outputs.

The block holds E / ep experts after `shard(ep_rank, ep)`. What it needs at run time (the EP dispatcher, the CP
group for the balance statistics, the token mask of the current batch, the collector) is one `MoEContext`
object per model, attached by `enable_expert_parallel`: no module globals.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from . import lean_pass
from .balance import imbalance, sequence_balance_terms, update_expert_bias
from .dispatch import sort_slots
from .experts import GroupedExperts
from .router import TopKRouter


SHARED_COMBINES = ("sum", "average")


@dataclass(frozen=True)
class MoESpec:
    """The shape of one MoE block (from the model's config)."""
    hidden_size: int
    num_experts: int
    top_k: int
    intermediate_size: int  # per expert
    score: str = "softmax"
    norm_topk_prob: bool = True
    latent_size: int = 0  # 0: experts work on the hidden state
    shared_intermediate_size: int = 0  # 0: no shared expert
    expert_bias: bool = False  # aux-loss-free balancing buffer
    # GPT-OSS's options (MoESpec.gpt_oss sets them all; the defaults are Qwen3-MoE's block)
    router_bias: bool = False  # a learned bias [E] on the router logits
    ffn_bias: bool = False  # expert biases gate_up_proj_bias [E, 2I], down_proj_bias [E, D]
    activation: str = "swiglu"  # swiglu | gpt_oss (clamped at swiglu_limit, alpha-scaled, gate/up interleaved)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    weight_layout: str = "qwen3"  # qwen3: gate_up [E, 2I, D] (x @ W^T) | gpt_oss: gate_up [E, D, 2I] (x @ W)
    router_name: str = "gate"  # the router's attribute and state-dict prefix: HF's Qwen3 `gate`, GPT-OSS `router`
    tuple_output: bool = False  # return (out, None): the decoder layer unpacks (out, router_scores)
    # DeepSeek-V3 / GLM-4-MoE(-Lite) routing (MoESpec.deepseek sets them; router.py): the selection bias under HF's
    # buffer name, group-limited selection, the routed scaling factor
    bias_name: str = "expert_bias"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # how the shared expert joins the routed output: sum, or Cohere2-MoE's average ((routed + shared) / 2)
    shared_combine: str = "sum"
    # Qwen3-Next / Qwen3.5-MoE: the shared expert is `shared_expert` (one), scaled per token by
    # sigmoid(shared_expert_gate x)
    shared_name: str = "shared_experts"
    shared_gate: bool = False

    def __post_init__(self):
        if self.router_name not in ("gate", "router"):
            raise ValueError(f"router_name={self.router_name!r} is not one of ('gate', 'router')")
        if self.shared_combine not in SHARED_COMBINES:
            raise ValueError(f"shared_combine={self.shared_combine!r} is not one of {SHARED_COMBINES}")

    @property
    def expert_dim(self) -> int:
        return self.latent_size or self.hidden_size

    @classmethod
    def deepseek(cls, config) -> "MoESpec":
        """HF's DeepseekV3MoE (and GLM-4-MoE(-Lite)'s, the same block): the sigmoid router with its selection bias
        `gate.e_score_correction_bias` (always there: a saved HF weight), groups, scaling; Qwen3's expert layout;
        n_shared_experts shared experts as one SwiGLU of n_shared_experts x moe_intermediate_size."""
        # Ling-3.0 (bailing_hybrid) runs the same block and names the routed experts num_local_experts
        experts = getattr(config, "n_routed_experts", None) or config.num_local_experts
        return cls(config.hidden_size, experts, config.num_experts_per_tok,
                   config.moe_intermediate_size, score="sigmoid", norm_topk_prob=bool(config.norm_topk_prob),
                   shared_intermediate_size=config.moe_intermediate_size * (config.n_shared_experts or 0),
                   expert_bias=True, bias_name="e_score_correction_bias", n_group=config.n_group or 1,
                   topk_group=config.topk_group or 1, routed_scaling_factor=float(config.routed_scaling_factor))

    @classmethod
    def mistral4(cls, config, expert_bias: bool = False) -> "MoESpec":
        """HF's Mistral4MoE: DeepSeek-V3's block with a softmax router (scores over all E, group-limited selection on
        them, no selection bias), norm_topk_prob and the routed scaling; n_shared_experts as one shared SwiGLU."""
        return cls(config.hidden_size, config.n_routed_experts, config.num_experts_per_tok,
                   config.moe_intermediate_size, score="softmax", norm_topk_prob=bool(config.norm_topk_prob),
                   shared_intermediate_size=config.moe_intermediate_size * (config.n_shared_experts or 0),
                   expert_bias=expert_bias, n_group=config.n_group or 1, topk_group=config.topk_group or 1,
                   routed_scaling_factor=float(config.routed_scaling_factor))

    @classmethod
    def cohere2(cls, config, expert_bias: bool = False) -> "MoESpec":
        """HF's Cohere2MoeSparseMoeBlock: top-k of the logits, then a softmax over the k (expert_selection_fn=softmax,
        as GPT-OSS's router) or their sigmoids, renormalised when norm_topk_prob; experts intermediate_size wide; the
        num_shared_experts shared experts as one SwiGLU, summed or averaged with the routed output."""
        sigmoid = config.expert_selection_fn == "sigmoid"
        return cls(config.hidden_size, config.num_experts, config.num_experts_per_tok, config.intermediate_size,
                   score="sigmoid" if sigmoid else "topk_softmax",
                   norm_topk_prob=sigmoid and bool(config.norm_topk_prob),
                   shared_intermediate_size=config.intermediate_size * (config.num_shared_experts or 0),
                   expert_bias=expert_bias, shared_combine=config.shared_expert_combination_strategy)

    @classmethod
    def qwen3_next(cls, config, expert_bias: bool = False) -> "MoESpec":
        """HF's Qwen3NextSparseMoeBlock (and Qwen3.5-MoE's, the same block): Qwen3-MoE's softmax router (top-k
        renormalised when norm_topk_prob; Qwen3.5-MoE always), plus one shared SwiGLU `shared_expert` of
        shared_expert_intermediate_size whose output is scaled by sigmoid(shared_expert_gate x) per token."""
        return cls(config.hidden_size, config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                   norm_topk_prob=bool(getattr(config, "norm_topk_prob", True)),
                   shared_intermediate_size=config.shared_expert_intermediate_size, expert_bias=expert_bias,
                   shared_name="shared_expert", shared_gate=True)

    @classmethod
    def gpt_oss(cls, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0, expert_bias: bool = False) -> "MoESpec":
        """HF's GptOssMLP: top-k of the biased logits then a softmax over the k, biased experts with GPT-OSS's
        SwiGLU, HF's names and x @ W layout, the (out, router_scores) tuple its decoder layer expects."""
        return cls(hidden_size, num_experts, top_k, intermediate_size, score="topk_softmax", norm_topk_prob=False,
                   expert_bias=expert_bias, router_bias=True, ffn_bias=True, activation="gpt_oss",
                   swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit, weight_layout="gpt_oss",
                   router_name="router", tuple_output=True)


class SwiGLU(torch.nn.Module):
    """The shared expert: a dense SwiGLU MLP on the full hidden state (HF's gate_proj/up_proj/down_proj names)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = torch.nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = torch.nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@dataclass
class MoEContext:
    """Run-time state shared by a model's MoE blocks: dispatcher, groups, the batch's token mask, collectors."""
    dispatcher: object
    cp_group: Optional[object] = None
    balance: str = "aux"  # aux | bias | none
    token_mask_Bs: Optional[torch.Tensor] = None  # 1 real token, 0 padding; None: every position is real
    _terms: Optional[list] = None  # open between begin() and end(): a recompute in backward adds nothing
    counts: dict = field(default_factory=dict)  # layer id -> routed slots per expert, summed over the step
    aux_sum: float = 0.0  # sum of this rank's detached balance terms over the step (for the metric)

    def begin(self, token_mask_Bs: Optional[torch.Tensor]) -> None:
        self.token_mask_Bs = token_mask_Bs
        self._terms = []

    def end(self) -> Optional[torch.Tensor]:
        """This forward's balance share (sum over layers of sum_b L_b's local part), or None without MoE/aux."""
        terms, self._terms = self._terms, None
        if not terms:
            return None
        total = torch.stack(terms).sum()
        self.aux_sum += float(total.detach())
        return total

    def record(self, layer_id: int, term: Optional[torch.Tensor], counts_E: torch.Tensor) -> None:
        if self._terms is None:
            return
        if term is not None:
            self._terms.append(term)
        prev = self.counts.get(layer_id)
        self.counts[layer_id] = counts_E.double() if prev is None else prev + counts_E.double()

    @property
    def collecting(self) -> bool:
        return self._terms is not None

    def finish_step(self, bias_update_rate: float = 0.0, blocks=()) -> dict:
        """After an optimizer step: the step's routed counts summed over every rank (collective over the world),
        the load-imbalance figure, and (moe.balance=bias) each router's bias update. Resets the step's counts."""
        import torch.distributed as dist
        if not self.counts:
            return {}
        layers = sorted(self.counts)
        counts_LE = torch.stack([self.counts[i] for i in layers])
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(counts_LE)
        self.counts = {}
        if self.balance == "bias":
            by_layer = dict(zip(layers, counts_LE))
            for block in blocks:
                bias = block.topk_router.expert_bias
                update_expert_bias(bias, by_layer[block.layer_id].to(bias.device), bias_update_rate)
        return {"moe_imbalance": imbalance(counts_LE)}


class MoEBlock(torch.nn.Module):
    def __init__(self, spec: MoESpec, layer_id: int = 0):
        super().__init__()
        self.spec, self.layer_id = spec, layer_id
        self.ep_rank, self.ep_size = 0, 1
        setattr(self, spec.router_name, TopKRouter(spec.hidden_size, spec.num_experts, spec.top_k, spec.score,
                                                   spec.norm_topk_prob, spec.expert_bias, bias=spec.router_bias,
                                                   bias_name=spec.bias_name, n_group=spec.n_group,
                                                   topk_group=spec.topk_group, scaling=spec.routed_scaling_factor))
        self.experts = GroupedExperts(spec.num_experts, spec.expert_dim, spec.intermediate_size,
                                      layout=spec.weight_layout, bias=spec.ffn_bias, activation=spec.activation,
                                      alpha=spec.swiglu_alpha, limit=spec.swiglu_limit)
        if spec.latent_size:
            self.fc1_latent_proj = torch.nn.Linear(spec.hidden_size, spec.latent_size, bias=False)
            self.fc2_latent_proj = torch.nn.Linear(spec.latent_size, spec.hidden_size, bias=False)
        if spec.shared_intermediate_size:
            setattr(self, spec.shared_name, SwiGLU(spec.hidden_size, spec.shared_intermediate_size))
        if spec.shared_gate:
            self.shared_expert_gate = torch.nn.Linear(spec.hidden_size, 1, bias=False)
        self._ctx = [None]  # a list, so the context is not a submodule nor in the state dict

    @property
    def context(self) -> Optional[MoEContext]:
        return self._ctx[0]

    @property
    def topk_router(self) -> TopKRouter:
        """The router, whatever HF calls it (`gate` in Qwen3-MoE, `router` in GPT-OSS)."""
        return getattr(self, self.spec.router_name)

    def forward(self, hidden_BsH: torch.Tensor):
        B, s, H = hidden_BsH.shape
        x_TH = hidden_BsH.reshape(B * s, H)
        weights_Tk, experts_Tk, probs_TE = self.topk_router(x_TH)
        ctx = self.context
        if ctx is None:
            from .dispatch import AllToAllDispatcher  # the single-process reference: every expert is local
            if self.ep_size != 1:
                raise RuntimeError("an expert-sharded MoEBlock needs enable_expert_parallel(model, topology)")
            dispatcher = AllToAllDispatcher(self.spec.num_experts)
        else:
            dispatcher = ctx.dispatcher
            if torch.is_grad_enabled():  # training forwards only, never an evaluation
                # computed in a recompute too (then not recorded): a checkpointed layer must save the same tensors
                # in its recomputation as in its forward
                self._balance(ctx, experts_Tk, probs_TE, B, s)
        x_TD = self.fc1_latent_proj(x_TH) if self.spec.latent_size else x_TH
        if lean_pass.applies(dispatcher, self.experts, x_TD):  # ep=1 on CUDA: one pass that keeps only h
            order_N, inverse_N, counts_E = sort_slots(experts_Tk, self.spec.num_experts)
            out_TD = self.experts(x_TD, counts_E, route=(weights_Tk, order_N, inverse_N))
        else:
            x_ND, handle = dispatcher.dispatch(x_TD, experts_Tk, weights_Tk)
            y_ND = self.experts(x_ND, handle.local_counts)
            out_TD = dispatcher.combine(y_ND, handle)
        out_TH = self.fc2_latent_proj(out_TD) if self.spec.latent_size else out_TD
        if self.spec.shared_intermediate_size:
            shared_TH = getattr(self, self.spec.shared_name)(x_TH)
            if self.spec.shared_gate:
                shared_TH = torch.sigmoid(self.shared_expert_gate(x_TH)) * shared_TH
            out_TH = out_TH + shared_TH
            if self.spec.shared_combine == "average":
                out_TH = out_TH / 2
        out_BsH = out_TH.reshape(B, s, H)
        # GPT-OSS: HF's decoder layer does `hidden, _ = self.mlp(hidden)`; nothing reads the router scores
        return (out_BsH, None) if self.spec.tuple_output else out_BsH

    def _balance(self, ctx: MoEContext, experts_Tk, probs_TE, B: int, s: int) -> None:
        mask = ctx.token_mask_Bs
        if mask is None:
            mask = torch.ones(B, s, device=probs_TE.device)
        if tuple(mask.shape) != (B, s):
            raise RuntimeError(f"MoE token mask has shape {tuple(mask.shape)}, the batch is {(B, s)}")
        term, counts_E = sequence_balance_terms(experts_Tk, probs_TE, mask.to(probs_TE.device), ctx.cp_group)
        ctx.record(self.layer_id, term if ctx.balance == "aux" else None, counts_E)

    @torch.no_grad()
    def shard(self, ep_rank: int, ep_size: int) -> None:
        """Keep only experts [ep_rank * El, (ep_rank + 1) * El) as fresh parameters (El = E / ep)."""
        E = self.spec.num_experts
        if E % ep_size:
            raise ValueError(f"{E} experts do not split over ep={ep_size}")
        El = E // ep_size
        old = self.experts
        new = GroupedExperts(El, old.dim, old.intermediate_size, old.recompute, old.group_size, old.offload_inputs,
                             **old.options)
        new.to(device=old.gate_up_proj.device, dtype=old.gate_up_proj.dtype)
        lo = ep_rank * El
        for name, param in new.named_parameters():  # weights and (GPT-OSS) biases go with their experts
            param.copy_(getattr(old, name)[lo:lo + El])
        self.experts, self.ep_rank, self.ep_size = new, ep_rank, ep_size


def moe_blocks(model: torch.nn.Module) -> list[MoEBlock]:
    return [m for m in model.modules() if isinstance(m, MoEBlock)]

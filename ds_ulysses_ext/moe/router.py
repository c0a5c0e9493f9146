"""TopKRouter: which experts each token goes to, and with what weight.

Legend: T tokens on this rank, H hidden, E experts (all of them: routing never depends on the layout), k top-k.

Scores are computed in fp32 from the logits (as HF's Qwen3-MoE router and Megatron's moe_router_dtype=fp32 do):
the top-k choice and the combine weights must not change with the model's dtype. Three score functions:
- softmax: probabilities over all E experts; top-k; optional renormalisation over the k (Qwen3 norm_topk_prob);
- sigmoid: independent scores; top-k; optional renormalisation over the k (DeepSeek-V3's norm_topk_prob);
- topk_softmax: top-k of the logits, then a softmax over the k chosen logits only (GPT-OSS's GptOssTopKRouter;
  no renormalisation step: the softmax over the k is already normalised).
`bias=True` gives the router linear a learned bias [E] (GPT-OSS's `router.bias`), part of the logits everywhere.
An `expert_bias` buffer (aux-loss-free balancing, balance.py) is added for the selection only, never to the
weights. `probs_TE` are what the balance loss sees: the softmax probabilities over all E (for topk_softmax too:
the same probabilities HF's pooled GPT-OSS loss uses), or the sigmoid scores normalised over E (DeepSeek-V3's
sequence-wise loss).

GPT-OSS in bf16: HF takes the top-k and the softmax in the model dtype; here the bf16 logits are upcast (exact)
before both, so the choice is HF's (up to exact ties) and the weights are the fp32 softmax of the same values.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

SCORE_FUNCTIONS = ("softmax", "sigmoid", "topk_softmax")


class TopKRouter(torch.nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, score: str = "softmax",
                 norm_topk_prob: bool = True, expert_bias: bool = False, bias: bool = False):
        super().__init__()
        if score not in SCORE_FUNCTIONS:
            raise ValueError(f"router score {score!r} is not one of {SCORE_FUNCTIONS}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        self.num_experts, self.top_k, self.score, self.norm_topk_prob = num_experts, top_k, score, norm_topk_prob
        self.weight = torch.nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.bias = torch.nn.Parameter(torch.zeros(num_experts)) if bias else None
        self.expert_bias = None
        if expert_bias:
            self.add_expert_bias()

    def add_expert_bias(self) -> None:
        # fp32 whatever the model dtype: updates of 1e-3 would vanish in bf16
        del self.expert_bias
        self.register_buffer("expert_bias", torch.zeros(self.num_experts, dtype=torch.float32,
                                                        device=self.weight.device), persistent=True)

    def forward(self, x_TH: torch.Tensor):
        """-> (weights_Tk fp32 combine weights, experts_Tk int64 global ids, probs_TE fp32 for the balance loss).

        A plain tuple: ZeRO-3 hooks the tensors of a module's output tuple to re-gather the weight for backward."""
        logits_TE = F.linear(x_TH, self.weight, self.bias).float()
        if self.score == "softmax":
            scores_TE = torch.softmax(logits_TE, dim=-1)
            probs_TE = scores_TE
        elif self.score == "sigmoid":
            scores_TE = torch.sigmoid(logits_TE)
            probs_TE = scores_TE / scores_TE.sum(dim=-1, keepdim=True)
        else:  # topk_softmax: the choice is on the logits (the same order as their softmax over E)
            scores_TE = logits_TE
            probs_TE = torch.softmax(logits_TE, dim=-1)
        select_TE = scores_TE if self.expert_bias is None else scores_TE + self.expert_bias
        with torch.no_grad():
            experts_Tk = torch.topk(select_TE, self.top_k, dim=-1).indices
        weights_Tk = scores_TE.gather(1, experts_Tk)
        if self.score == "topk_softmax":
            weights_Tk = torch.softmax(weights_Tk, dim=-1)  # over the k chosen logits only (HF's GptOssTopKRouter)
        elif self.norm_topk_prob:
            weights_Tk = weights_Tk / weights_Tk.sum(dim=-1, keepdim=True)
        return weights_Tk, experts_Tk, probs_TE

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

DeepSeek-V3 / GLM-4-MoE(-Lite) (HF's DeepseekV3TopkRouter): sigmoid scores; the selection sees scores + the fp32 bias
(HF's persistent buffer `e_score_correction_bias`, registered under that name, `bias_name`, so checkpoints load and
export as they are), limited to the `topk_group` best of `n_group` expert groups (a group's score: the sum of its two
best biased scores), then the top-k there; the weights are the UNBIASED scores of the chosen experts, renormalised
over the k when norm_topk_prob, times `routed_scaling_factor` (`scaling`). HF adds 1e-20 to the renormalising sum,
which changes no fp32 sum of k sigmoids short of logits below about -40.

GPT-OSS in bf16: HF takes the top-k and the softmax in the model dtype; here the bf16 logits are upcast (exact)
before both, so the choice is HF's (up to exact ties) and the weights are the fp32 softmax of the same values.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

SCORE_FUNCTIONS = ("softmax", "sigmoid", "topk_softmax")


class TopKRouter(torch.nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, score: str = "softmax",
                 norm_topk_prob: bool = True, expert_bias: bool = False, bias: bool = False, *,
                 bias_name: str = "expert_bias", n_group: int = 1, topk_group: int = 1, scaling: float = 1.0):
        super().__init__()
        if score not in SCORE_FUNCTIONS:
            raise ValueError(f"router score {score!r} is not one of {SCORE_FUNCTIONS}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        check_groups(num_experts, top_k, n_group, topk_group)
        self.num_experts, self.top_k, self.score, self.norm_topk_prob = num_experts, top_k, score, norm_topk_prob
        self.bias_name, self.n_group, self.topk_group, self.scaling = bias_name, n_group, topk_group, scaling
        self.weight = torch.nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.bias = torch.nn.Parameter(torch.zeros(num_experts)) if bias else None
        if bias_name == "expert_bias":
            self.expert_bias = None
        if expert_bias:
            self.add_expert_bias()

    def __getattr__(self, name):
        # `expert_bias` is what balance.py and the engine read, whatever HF names the buffer (bias_name)
        if name == "expert_bias" and self.__dict__.get("bias_name", name) != name:
            return self._buffers.get(self.bias_name)
        return super().__getattr__(name)

    def add_expert_bias(self) -> None:
        # fp32 whatever the model dtype: updates of 1e-3 would vanish in bf16
        self.__dict__.pop(self.bias_name, None)
        self.register_buffer(self.bias_name, torch.zeros(self.num_experts, dtype=torch.float32,
                                                         device=self.weight.device), persistent=True)

    def _apply(self, fn, *args, **kwargs):
        # a model cast (.to(bf16), .half()) leaves the selection bias in fp32, as HF's _keep_in_fp32_modules_strict
        name = self.__dict__.get("bias_name", "expert_bias")
        before = self._buffers.get(name)  # its fp32 values: a cast to bf16 and back would round them
        out = super()._apply(fn, *args, **kwargs)
        bias = self._buffers.get(name)
        if bias is not None and bias.is_floating_point() and bias.dtype != torch.float32:
            self._buffers[name] = before.to(bias.device)
        return out

    def _group_limited(self, select_TE: torch.Tensor) -> torch.Tensor:
        # keep the topk_group best groups (a group's score: its two best entries summed, as HF), the rest -inf
        T = select_TE.shape[0]
        per_group = select_TE.view(T, self.n_group, -1)
        group_score = per_group.topk(2, dim=-1).values.sum(-1)                      # [T, n_group]
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(self.topk_group, dim=-1).indices, True)
        return per_group.masked_fill(~keep[..., None], float("-inf")).view(T, -1)

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
        bias = self.expert_bias
        with torch.no_grad():
            select_TE = scores_TE if bias is None else scores_TE + bias
            if self.n_group > 1:
                select_TE = self._group_limited(select_TE)
            experts_Tk = torch.topk(select_TE, self.top_k, dim=-1).indices
        weights_Tk = scores_TE.gather(1, experts_Tk)
        if self.score == "topk_softmax":
            weights_Tk = torch.softmax(weights_Tk, dim=-1)  # over the k chosen logits only (HF's GptOssTopKRouter)
        elif self.norm_topk_prob:
            weights_Tk = weights_Tk / weights_Tk.sum(dim=-1, keepdim=True)
        if self.scaling != 1.0:
            weights_Tk = weights_Tk * self.scaling
        return weights_Tk, experts_Tk, probs_TE


def check_groups(num_experts: int, top_k: int, n_group: int, topk_group: int) -> None:
    """Group-limited routing as HF computes it: equal groups of at least 2 experts (a group scores by its best two),
    topk_group of them kept, holding at least top_k experts."""
    if n_group == 1:
        return
    if num_experts % n_group or num_experts // n_group < 2:
        raise ValueError(f"n_group={n_group} must split n_routed_experts={num_experts} into equal groups of >= 2 "
                         "experts (a group scores by its two best); set n_group to such a divisor")
    if not 1 <= topk_group <= n_group or topk_group * (num_experts // n_group) < top_k:
        raise ValueError(f"topk_group={topk_group} of n_group={n_group} keeps fewer than num_experts_per_tok={top_k} "
                         f"experts; set topk_group to at least {-(-top_k // (num_experts // n_group))}")

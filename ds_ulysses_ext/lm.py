"""CPCausalLM: an HF causal LM whose forward returns the local loss sum instead of logits.

Legend: B batch, s local sequence, H hidden, V vocab.

Wrapping (rather than calling model(...).loss) keeps HF's loss path out: it would shift labels a second
time and materialise [B, s, V] logits. DeepSpeed wraps this module, so ZeRO-3 hooks cover the decoder
and the head loss alike. The HF model stays reachable as `.hf` for export.
"""
from __future__ import annotations

import torch

from .errors import UnsupportedError
from .loss import chunk_tokens, chunked_lm_loss_sum, fusable, linear_cross_entropy_sum


class HeadLoss(torch.nn.Module):
    """lm_head + cross-entropy sum over chunks: fused (no recompute) when the head allows, else checkpointed.

    A module of its own, holding no parameters, so that ZeRO-3 can gather lm_head's weight (registered
    as an external parameter) for exactly this forward and backward.
    """

    def __init__(self, lm_head: torch.nn.Module, chunk_size: int, fused: bool, kernel=None, fused_rows: bool = True):
        super().__init__()
        self.fused = fused and fusable(lm_head)
        self.chunk_size = chunk_size
        self.kernel = kernel  # a fused head of ds_ulysses_ext.kernels (KernelReport.head), or None: loss.py's
        self.fused_rows = fused_rows  # loss.py's rows in its Triton kernel on CUDA; False: torch's everywhere
        self._lm_head = [lm_head]  # a list: not a submodule (it stays where HF put it, for export)
        if self.fused:
            # registered before deepspeed.initialize adds ZeRO-3's hooks, so it runs before their gather
            self.register_forward_pre_hook(self._register_zero3_weight)

    def _register_zero3_weight(self, module, args) -> None:
        weight = self._lm_head[0].weight
        if getattr(weight, "ds_id", None) is not None and id(weight) not in getattr(self, "_external_params", {}):
            # a ZeRO-3 parameter (deepspeed is loaded): gather it for this module's forward and backward
            from deepspeed.runtime.zero.partition_parameters import register_external_parameter
            register_external_parameter(self, weight)

    def forward(self, hidden_BsH: torch.Tensor, labels_Bs: torch.Tensor):
        lm_head = self._lm_head[0]
        if not self.fused:
            return chunked_lm_loss_sum(lm_head, hidden_BsH, labels_Bs, self.chunk_size)
        if lm_head.weight.numel() == 0:
            raise RuntimeError("the lm_head weight is partitioned (ZeRO-3) and was not gathered for the fused "
                               "loss; wrap the model in CPCausalLM before deepspeed.initialize, or pass "
                               "fused_loss=False")
        return linear_cross_entropy_sum(lm_head.weight, hidden_BsH, labels_Bs, self.chunk_size, self.kernel,
                                        self.fused_rows)


class CPCausalLM(torch.nn.Module):
    def __init__(self, hf_model, loss_chunk_size: int = 0, fused_loss: bool = True, head_kernel=None,
                 fused_rows: bool = True):
        """loss_chunk_size: tokens per chunk of the head's logits; 0 sizes it to the vocabulary (loss.chunk_tokens).
        head_kernel: a fused loss head (ds_ulysses_ext.kernels' KernelReport.head) for a fusable head.
        fused_rows: loss.py's head runs its rows in the Triton kernel on CUDA (model.kernels=none turns it off: the
        eager reference has no fused kernel anywhere)."""
        super().__init__()
        self.hf = hf_model
        head = hf_model.get_output_embeddings()
        vocab = getattr(head, "out_features", None) or hf_model.config.vocab_size
        self.head_loss = HeadLoss(head, chunk_tokens(loss_chunk_size, vocab), fused_loss, head_kernel, fused_rows)
        # Cohere's forward multiplies the logits by `logit_scale`; the head is linear without bias, so the hidden state
        # is scaled instead and every head (chunked, fused, a kernel's) sees it. Cohere2-MoE's 0.0625 is a power of 2:
        # the same bits either way
        self.logit_scale = float(getattr(hf_model, "logit_scale", 1.0))
        if self.logit_scale != 1.0 and getattr(head, "bias", None) is not None:
            raise UnsupportedError(f"{type(hf_model).__name__} scales its logits by logit_scale={self.logit_scale} "
                                   "and its lm_head has a bias, which scaling the hidden state would not scale; "
                                   "such a head is not supported")

    @property
    def config(self):
        return self.hf.config

    def forward(self, input_ids, labels, position_ids, **model_inputs):
        """input_ids, labels (shifted), position_ids: [B, s] -> (loss_sum fp32 scalar, token count).

        model_inputs: the other keys shard_batch returned (e.g. packed documents' cp_cu_seqlens), passed to
        the decoder as they are; the attention reads them.
        """
        # MoE models: the balance statistics count real tokens only (`moe_token_mask` [B, s], 1 real / 0 pad; all
        # positions when absent), and this forward's balance-loss share is left in `self.moe_aux_share` for the
        # caller's backward (a third output would break every (loss_sum, count) caller)
        token_mask = model_inputs.pop("moe_token_mask", None)
        moe = getattr(self.hf, "_moe_context", None)
        if moe is not None:
            moe.begin(token_mask)
        try:
            hidden_BsH = self.hf.get_decoder()(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                                               **model_inputs).last_hidden_state
        finally:
            self.moe_aux_share = moe.end() if moe is not None else None
        if self.logit_scale != 1.0:
            hidden_BsH = hidden_BsH * self.logit_scale
        return self.head_loss(hidden_BsH, labels)

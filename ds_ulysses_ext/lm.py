"""CPCausalLM: an HF causal LM whose forward returns the local loss sum instead of logits.

Legend: B batch, s local sequence, H hidden.

Wrapping (rather than calling model(...).loss) keeps HF's loss path out: it would shift labels a second
time and materialise [B, s, V] logits. DeepSpeed wraps this module, so ZeRO-3 hooks cover the decoder
and lm_head alike. The HF model stays reachable as `.hf` for export.
"""
from __future__ import annotations

import torch

from .loss import chunked_lm_loss_sum


class CPCausalLM(torch.nn.Module):
    def __init__(self, hf_model, loss_chunk_size: int = 4096):
        super().__init__()
        self.hf = hf_model
        self.loss_chunk_size = loss_chunk_size

    @property
    def config(self):
        return self.hf.config

    def forward(self, input_ids, labels, position_ids):
        """input_ids, labels (shifted), position_ids: [B, s] -> (loss_sum fp32 scalar, token count)."""
        hidden_BsH = self.hf.get_decoder()(input_ids=input_ids, position_ids=position_ids,
                                           use_cache=False).last_hidden_state
        return chunked_lm_loss_sum(self.hf.get_output_embeddings(), hidden_BsH, labels, self.loss_chunk_size)

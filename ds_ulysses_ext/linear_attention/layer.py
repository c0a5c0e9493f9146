"""A linear-attention layer (gated DeltaNet, KDA) under Ulysses: whole sequences per head, so the conv and the
recurrence run exactly as on one process.

Legend: B batch, s local sequence (this rank's chunk), S = s * cp whole sequence, H hidden, nk / nv key / value heads,
dk / dv their dims, hk / hv key / value heads on this rank (heads.py), rep key-head copies, C conv channels of this
rank's heads (2 * hk * dk + hv * dv), K conv kernel, cp the Ulysses degree.

    x [B s H] -> projections per token -> q, k [B s nk dk] (x rep), v [B s nv dv], decay/beta inputs [B s nv(,dk)]
      --one a2a (every tensor packed per destination rank)--> [B S C], [B S hv(,dk)], [B S hv]
      --per document (documents.py): causal conv over S on this rank's channels, act, decay, beta, delta rule-->
      o [B S hv dv] --a2a--> [B s nv dv] -> gated RMSNorm (the output gate stays local) -> out_proj -> [B s H]

Why it is exact: the conv mixes a channel with its own past only, and the recurrence a head with its own past only;
after the exchange a rank holds every position of the channels and heads it computes, so both see exactly what
they see unsplit. The channels a rank convolves are those of its heads (heads.py conv_channels), with their own
weights. Everything per token (the projections, the gates' pre-activations, the output norm and projection) stays
on the rank that holds the token. The decay and beta leave as pre-activations in the model dtype and are finished
after the exchange with the local heads' A_log / dt_bias, in fp32 as HF does: one all-to-all carries them all, and
nothing rounds g to the model dtype on the way. Two all-to-alls per layer forward, two in backward (their adjoints).

Packed documents: every document starts with a zero conv window and a zero state (documents.py lays each document
out as a row of its own). HF's own torch path does not reset them inside a packed row, so the reference for packed
rows is each document run alone (as for attention).

A cache (generate, decoding) is HF's business: at cp=1 the call goes to HF's own forward, which updates it; under
cp > 1 it is refused (generate() is refused there anyway).
The recurrence runs in delta_rule.py (the reference) or, on CUDA, through flash-linear-attention's chunked kernels
(fla_kernels.py, model.linear_attn_kernel): then the conv still runs per document row, and the delta rule in one flat
call whose cu_seqlens restart the state at each document. The conv stays torch's (causal-conv1d has no wheel here).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from ..attention.exchange import head_to_seq, seq_to_head
from ..attention.masks import CU_SEQLENS_KEY
from ..comm import group_size
from ..errors import UnsupportedError
from ..length_check import verify_length
from ..rope import ROPE_LENGTH_KEY
from .delta_rule import CHUNK, chunked_delta_rule
from .documents import per_document
from .families import Mixer
from .fla_kernels import DeltaRuleKernel
from .heads import conv_channels, key_replication

# kwargs the decoder layer hands every mixer that this one may ignore (integrate.py's list for attention): no cache
# under CP, RoPE is the full-attention layers' business
_IGNORABLE_KWARGS = frozenset({"position_ids", "position_embeddings", "use_cache", "output_router_logits",
                               ROPE_LENGTH_KEY})


@dataclass
class LinearBinding:
    """What the bound forward reads: the family's Mixer and the CP state integrate.py attaches to every mixer."""
    mixer: Mixer
    state: object  # integrate.CPState (topology, the per-forward length check)
    channels: torch.Tensor = None  # this rank's conv channels [C] int64, on the conv weight's device
    # model.linear_attn_kernel: one object for every linear layer of the model (one resolution, one check per layout);
    # None runs the torch delta rule
    kernel: DeltaRuleKernel = None


def linear_attention_forward(self, hidden_states: torch.Tensor, cache_params=None, attention_mask=None, **kwargs):
    """The forward bound on each linear-attention module (bind.py): HF's signature, HF's result, under Ulysses."""
    binding: LinearBinding = self.__dict__["_cp_linear"]
    topo = binding.state.topology
    if cache_params is not None:
        if topo.cp_size == 1:
            return type(self).forward(self, hidden_states, cache_params=cache_params, attention_mask=attention_mask,
                                      **kwargs)
        raise UnsupportedError("a cache reached a linear-attention layer under context parallelism: CP runs no "
                               "cache (decoding is sequential); call the model with use_cache=False, or decode "
                               "with a cp=1 copy of the model")
    cu_seqlens = kwargs.pop(CU_SEQLENS_KEY, None)
    unknown = sorted(set(kwargs) - _IGNORABLE_KWARGS)
    if unknown:
        raise UnsupportedError(
            f"the context-parallel linear attention was handed {unknown}, which it would ignore. Packed documents "
            "are given as position_ids restarting at 0 for each document: pass the dict shard_batch() returns to "
            "the model as is, or run with parallelism.cp=1")
    if attention_mask is not None:
        # HF zeroes the padded tokens' input (its 2D mask, this rank's chunk of it): per token, so it stays local
        hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
    mixer = binding.mixer
    p = mixer.project(self, hidden_states)

    def core():
        return _exchange_and_mix(self, binding, p, cu_seqlens)
    # a memory policy may own how the core runs, as for attention (memory/except_attention.py)
    wrapper = self.__dict__.get("core_attention_wrapper")
    o_BsVD = core() if wrapper is None else wrapper(core)
    return mixer.finish(self, o_BsVD, p.out_gate)


def _exchange_and_mix(m, binding: LinearBinding, p, cu_seqlens) -> torch.Tensor:
    topo = binding.state.topology
    group = topo.cp_group
    cp = group_size(group)
    nv, nk, dk, dv = binding.mixer.heads(m)
    rep = key_replication(nv, nk, cp, "linear heads")
    q, k = p.q, p.k
    if rep > 1:
        # [B s nk dk] -> [B s cp dk]: key head i is read by the value heads of ranks i*rep .. i*rep+rep-1
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    B, s = q.shape[:2]
    # [B s cp X_i] each: destination rank j's block of every tensor, so one all-to-all moves them all
    parts = [t.reshape(B, s, cp, -1) for t in (q, k, p.v, p.decay_in, p.beta_in)]
    sizes = [t.shape[-1] for t in parts]
    mixed = seq_to_head(torch.cat(parts, dim=-1), group)[:, :, 0]                  # [B S X]
    verify_length(binding.state, s)
    q, k, v, decay_in, beta_in = mixed.split(sizes, dim=-1)
    hv = nv // cp
    qkv = torch.cat([q, k, v], dim=-1)                                              # [B S C]: conv channel order
    kind = binding.mixer.kind
    if kind == "kda":  # one decay per key channel
        decay_in = decay_in.unflatten(-1, (hv, dk))
    heads = slice(topo.cp_rank * hv, (topo.cp_rank + 1) * hv)  # this rank's value heads: their A_log / dt_bias
    weight, bias = _conv_weights(m, binding, nv, nk, dk, dv, cp, topo.cp_rank)
    act = ACT2FN[m.activation]

    def conv(qkv_RLC):
        # rows of whole sequences or of single documents [R L C]: the causal conv and its activation
        L = qkv_RLC.shape[1]
        x = F.conv1d(qkv_RLC.transpose(1, 2).to(weight.dtype), weight, bias, padding=weight.shape[-1] - 1,
                     groups=weight.shape[0])[..., :L]
        return act(x).to(qkv_RLC.dtype).transpose(1, 2)                             # [R L C]

    def rule_inputs(x, decay_RLh, beta_RLh):
        # [R L C] conv output -> q, k [R L hv dk], v [R L hv dv], g [R L hv(, dk)], beta [R L hv]
        hk = (x.shape[-1] - hv * dv) // (2 * dk)
        qc, kc, vc = x.split([hk * dk, hk * dk, hv * dv], dim=-1)
        qc, kc = qc.unflatten(-1, (hk, dk)), kc.unflatten(-1, (hk, dk))
        if hv > hk:  # gated DeltaNet: each key head serves hv / hk consecutive value heads
            qc, kc = qc.repeat_interleave(hv // hk, dim=2), kc.repeat_interleave(hv // hk, dim=2)
        return qc, kc, vc.unflatten(-1, (hv, dv)), binding.mixer.decay(m, decay_RLh, heads), beta_RLh.sigmoid()

    def mix(qkv_RLC, decay_RLh, beta_RLh):
        return chunked_delta_rule(*rule_inputs(conv(qkv_RLC), decay_RLh, beta_RLh))  # [R L hv dv]

    kernel = binding.kernel
    if kernel is not None and kernel.uses_fla(qkv.device, qkv.dtype):
        # the conv per document row (its window restarts), the delta rule in one flat call (fla_kernels.py)
        B, S = qkv.shape[:2]
        x = per_document(conv, [qkv], cu_seqlens, CHUNK)
        o_BShD = kernel(kind, *rule_inputs(x, decay_in, beta_in), cu_seqlens, B, S)
    else:
        o_BShD = per_document(mix, [qkv, decay_in, beta_in], cu_seqlens, CHUNK)
    return head_to_seq(o_BShD, group)                                               # [B s nv dv]


def _conv_weights(m, binding: LinearBinding, nv, nk, dk, dv, cp, rank):
    """This rank's conv weight [C 1 K] and bias [C] (or None): the channels of its heads, HF's weights."""
    conv = m.conv1d
    if binding.channels is None or binding.channels.device != conv.weight.device:
        binding.channels = torch.tensor(conv_channels(nv, nk, dk, dv, cp, rank), device=conv.weight.device)
    idx = binding.channels
    weight = conv.weight.index_select(0, idx)
    return weight, (conv.bias.index_select(0, idx) if conv.bias is not None else None)

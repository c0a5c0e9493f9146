"""The HF linear-attention modules the Ulysses layer runs, and how each one lays out its projections and gates.

Legend: B batch, s local sequence (this rank's chunk), H hidden, nk / nv key / value heads, dk / dv their dims,
hv value heads on this rank after the exchange.

Each family's module is read through its own attributes (its parameters keep HF's names, so checkpoints load and
export as they are); what the Ulysses layer (layer.py) needs of it:
- project(module, x [B s H]) -> Projected: per token, before the exchange: the conv's input channels split by head
  (q, k [B s nk dk], v [B s nv dv]), the decay's and beta's pre-activations per value head, and the output gate;
- decay(module, pre, heads) -> g <= 0 for the value heads `heads` (a slice), after the exchange: from the
  pre-activation and those heads' A_log / dt_bias, in fp32 as HF computes it;
- finish(module, o [B s nv dv], out_gate) -> [B s H]: the gated norm and the output projection, per token.

Gated DeltaNet (Qwen3.5 / 3.6, Qwen3-Next): one decay per value head, g = -exp(A_log) * softplus(a + dt_bias),
beta = sigmoid(b), output RMSNorm gated by silu(z). Qwen3.5 projects q|k|v, z, b and a with separate linears;
Qwen3-Next packs q, k, v, z per key-head group in one linear and b, a in another (HF's fix_query_key_value_ordering
unpacks them, and is called as it is). KDA (Ling-3.0, `bailing_hybrid`): one decay per key channel from the forget
gate (f_proj + dt_bias, bounded by `kda_lower_bound * sigmoid(exp(A_log) x)` when kda_safe_gate, else
-exp(A_log) softplus(x)), cast to the model dtype as HF does, one head count for q, k and v, the output RMSNorm
gated by sigmoid(g_proj x).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F


class Projected(NamedTuple):
    q: torch.Tensor          # [B s nk dk]  the conv's q channels, before the conv
    k: torch.Tensor          # [B s nk dk]
    v: torch.Tensor          # [B s nv dv]
    decay_in: torch.Tensor   # [B s nv] (gated DeltaNet's a) or [B s nv dk] (KDA's f_proj output)
    beta_in: torch.Tensor    # [B s nv], before the sigmoid
    out_gate: torch.Tensor   # [B s nv dv]: z (gated DeltaNet) or g_proj's output (KDA)


class Mixer(NamedTuple):
    kind: str  # "gated_deltanet" | "kda"
    project: Callable
    decay: Callable
    finish: Callable
    heads: Callable  # module -> (nv, nk, dk, dv)


def _split_heads(x: torch.Tensor, d: int) -> torch.Tensor:
    return x.reshape(*x.shape[:2], -1, d)


def _project_qwen3_5(m, x) -> Projected:
    q, k, v = m.in_proj_qkv(x).split([m.key_dim, m.key_dim, m.value_dim], dim=-1)
    return Projected(_split_heads(q, m.head_k_dim), _split_heads(k, m.head_k_dim), _split_heads(v, m.head_v_dim),
                     m.in_proj_a(x), m.in_proj_b(x), _split_heads(m.in_proj_z(x), m.head_v_dim))


def _project_qwen3_next(m, x) -> Projected:
    q, k, v, z, b, a = m.fix_query_key_value_ordering(m.in_proj_qkvz(x), m.in_proj_ba(x))
    return Projected(q, k, v, a, b, z)


def _project_kda(m, x) -> Projected:
    d = m.head_dim
    return Projected(_split_heads(m.q_proj(x), d), _split_heads(m.k_proj(x), d), _split_heads(m.v_proj(x), d),
                     _split_heads(m.forget_gate.f_proj(x), d), m.b_proj(x), _split_heads(m.g_proj(x), d))


def _wide(x: torch.Tensor) -> torch.Tensor:
    # fp32 whatever the model dtype (HF: "if the model is loaded in fp16, without the .float() here, A might be -inf"),
    # fp64 kept (a float64 check of the reference)
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _gdn_decay(m, a: torch.Tensor, heads: slice) -> torch.Tensor:
    return -_wide(m.A_log[heads]).exp() * F.softplus(_wide(a) + m.dt_bias[heads])


def _kda_decay(m, f: torch.Tensor, heads: slice) -> torch.Tensor:
    gate = m.forget_gate
    x = _wide(f) + gate.dt_bias.view(gate.num_heads, gate.head_dim)[heads]
    rate = gate.A_log[heads].exp()[:, None]
    g = gate.lower_bound * torch.sigmoid(rate * x) if gate.safe_gate else -rate * F.softplus(x)
    return g.to(f.dtype)  # HF hands the kernel the decay in the model dtype


def _gdn_finish(m, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    B, s = o.shape[:2]
    return m.out_proj(m.norm(o.reshape(-1, m.head_v_dim), z.reshape(-1, m.head_v_dim)).reshape(B, s, -1))


def _kda_finish(m, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return m.o_proj(m.o_norm(o, gate).reshape(*o.shape[:2], -1))


def _gdn_heads(m):
    return m.num_v_heads, m.num_k_heads, m.head_k_dim, m.head_v_dim


def _kda_heads(m):
    return m.num_heads, m.num_heads, m.head_dim, m.head_dim


_QWEN3_5 = Mixer("gated_deltanet", _project_qwen3_5, _gdn_decay, _gdn_finish, _gdn_heads)

# HF class name -> how to run it; a linear layer of any other class is refused (bind.py)
MIXERS = {
    "Qwen3_5GatedDeltaNet": _QWEN3_5,
    "Qwen3_5MoeGatedDeltaNet": _QWEN3_5,
    "Qwen3NextGatedDeltaNet": Mixer("gated_deltanet", _project_qwen3_next, _gdn_decay, _gdn_finish, _gdn_heads),
    "BailingHybridDeltaAttention": Mixer("kda", _project_kda, _kda_decay, _kda_finish, _kda_heads),
}

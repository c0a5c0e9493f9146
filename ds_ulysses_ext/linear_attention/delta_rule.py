"""The delta rule of linear attention, in torch: exact, chunked, fp32. The reference the GPU kernels must match.

Legend: B batch (rows, or documents laid out as rows), S sequence (whole: after the Ulysses exchange), h heads on this
rank, dk key / query head dim, dv value head dim, C chunk length, n = S / C chunks.

Per head, a state M [dk, dv] starts at zero and each token t runs

    M <- diag(exp(g_t)) M                     decay, g_t <= 0: one value per head (gated DeltaNet: Qwen3.5, Qwen3-Next)
                                               or one per key channel (Kimi delta attention, KDA: Ling-3.0's layers)
    M <- M + beta_t k_t (v_t - M^T k_t)^T      the delta rule: write what the state mispredicts for k_t
    o_t = M^T q_t

with q and k L2-normalised per head and q scaled by dk^-1/2 first (both families do this inside the kernel).

The chunked form (the DeltaNet paper's WY representation) gives the same numbers with matrix products: inside a chunk
with cumulative log-decay G_i = g_1 + ... + g_i and start state M0,
    A_ij = beta_i k_i . (k_j * exp(G_i - G_j))            i > j   (a strictly lower [C, C] system)
    w    = (I + A)^-1 (beta v) - (I + A)^-1 (beta k exp(G)) M0      what each token writes
    o_i  = (q_i exp(G_i)) M0 + sum_{j <= i} q_i . (k_j exp(G_i - G_j)) w_j
    M_C  = exp(G_C) M0 + sum_j (k_j exp(G_C - G_j)) w_j^T
Every exponent is <= 0 (G decreases), so nothing overflows; pairs above the diagonal are masked to -inf before exp.
The chunks then run in order, each reading the state the previous one left. Documents are never mixed here: a
packed batch arrives as one row per document (documents.py), and padding after a document's end changes nothing
before it (the recurrence is causal).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64  # tokens per chunk, as the families' own torch references use


def l2_normalise(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # eps inside the root, as the kernels these models were trained with (FLA's l2norm), not F.normalize's max
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _pairwise(a: torch.Tensor, b: torch.Tensor, G: torch.Tensor, keep_diagonal: bool) -> torch.Tensor:
    """[.., C, dk] x2, G [.., C] or [.., C, dk] -> [.., C, C]: a_i . (b_j exp(G_i - G_j)) for i >= j (i > j), else 0."""
    C = a.shape[-2]
    above = torch.ones(C, C, dtype=torch.bool, device=a.device).triu(0 if not keep_diagonal else 1)
    if G.dim() == a.dim() - 1:  # one decay per head: the decay factors out of the dot product
        decay = (G[..., :, None] - G[..., None, :]).masked_fill(above, float("-inf")).exp()
        return (a @ b.transpose(-1, -2)) * decay
    # one decay per key channel: it does not factor out, so the [C, C, dk] exponents are formed (fine for the
    # reference path; the GPU kernels split chunks into sub-chunks for this)
    decay = (G[..., :, None, :] - G[..., None, :, :]).masked_fill(above[..., None], float("-inf")).exp()
    return torch.einsum("...ic,...jc,...ijc->...ij", a, b, decay)


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       chunk: int = CHUNK) -> torch.Tensor:
    """The delta rule over whole rows, from a zero state.

    Args:
        q, k: [B, S, h, dk]; v: [B, S, h, dv] (any float dtype; computed in fp32, or fp64 for fp64 inputs).
        g: [B, S, h] log-decay per head, or [B, S, h, dk] per key channel; every entry <= 0.
        beta: [B, S, h], the write strength (a sigmoid's output).
    Returns:
        [B, S, h, dv] in v's dtype.
    """
    dtype = v.dtype
    wide = torch.promote_types(dtype, torch.float32)  # the state accumulates over the whole sequence: never bf16
    S = q.shape[1]
    pad = (-S) % chunk
    # [B S h X] -> [B h S X], padded at the end: a zero key writes nothing and g = 0 keeps the state
    q, k, v = (F.pad(x.to(wide).transpose(1, 2), (0, 0, 0, pad)) for x in (q, k, v))
    per_channel = g.dim() == 4
    g = F.pad(g.to(wide).transpose(1, 2), (0, 0, 0, pad) if per_channel else (0, pad))
    beta = F.pad(beta.to(wide).transpose(1, 2), (0, pad))
    q = l2_normalise(q) * q.shape[-1] ** -0.5
    k = l2_normalise(k)
    B, h, Sp, dk = k.shape
    n = Sp // chunk
    # [B h n C X]
    q, k, v = (x.reshape(B, h, n, chunk, x.shape[-1]) for x in (q, k, v))
    beta = beta.reshape(B, h, n, chunk, 1)
    G = g.reshape(B, h, n, chunk, dk) if per_channel else g.reshape(B, h, n, chunk)
    G = G.cumsum(dim=3)
    eG = (G if per_channel else G[..., None]).exp()                            # [B h n C dk|1]
    system = _pairwise(beta * k, k, G, keep_diagonal=False)                    # A, strictly lower
    U = torch.linalg.solve_triangular(system, beta * v, upper=False, unitriangular=True)        # (I+A)^-1 beta v
    W = torch.linalg.solve_triangular(system, beta * k * eG, upper=False, unitriangular=True)   # (I+A)^-1 beta k e^G
    scores = _pairwise(q, k, G, keep_diagonal=True)                            # [B h n C C], causal incl. diagonal
    q_decayed = q * eG
    G_end = G[..., -1:, :] if per_channel else G[..., -1:, None]
    k_to_end = k * (G_end - (G if per_channel else G[..., None])).exp()        # k_j exp(G_C - G_j)
    end_decay = G_end.exp().transpose(-1, -2)                                  # [B h n dk|1 1]
    M = q.new_zeros(B, h, dk, v.shape[-1])
    out = []
    # unbind, not U[:, :, c]: each indexing op's backward writes a zero tensor of the whole [B h n C X] input around
    # its slice, so n chunks cost n whole-tensor writes (quadratic in S: the 128k step's backward measured 12.7x the
    # 32k one's on an H200); unbind's backward stacks the n slices' gradients once
    chunks = zip(*(x.unbind(2) for x in (U, W, q_decayed, scores, end_decay, k_to_end)))
    for U_c, W_c, q_c, scores_c, end_c, k_end_c in chunks:  # in order: each chunk starts from the state before it
        w = U_c - W_c @ M
        out.append(q_c @ M + scores_c @ w)
        M = end_c * M + k_end_c.transpose(-1, -2) @ w
    o = torch.stack(out, dim=2).reshape(B, h, Sp, -1)[:, :, :S]
    return o.transpose(1, 2).to(dtype)


def recurrent_delta_rule(q, k, v, g, beta) -> torch.Tensor:
    """The same rule token by token (the definition above, line for line): the check of the chunked form."""
    wide = torch.promote_types(v.dtype, torch.float32)
    q = l2_normalise(q.to(wide)) * q.shape[-1] ** -0.5
    k = l2_normalise(k.to(wide))
    v, g, beta = v.to(wide), g.to(wide), beta.to(wide)
    B, S, h, dk = k.shape
    M = q.new_zeros(B, h, dk, v.shape[-1])
    out = []
    for t in range(S):
        decay = g[:, t].exp()
        M = M * (decay[..., None] if decay.dim() == 3 else decay[..., None, None])
        delta = beta[:, t, :, None] * (v[:, t] - (M * k[:, t, :, :, None]).sum(-2))
        M = M + k[:, t, :, :, None] * delta[:, :, None, :]
        out.append((M * q[:, t, :, :, None]).sum(-2))
    return torch.stack(out, dim=1)

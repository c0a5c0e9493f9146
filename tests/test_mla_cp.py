"""MLA (DeepSeek-V3, GLM-4-MoE-Lite) and GLM-4-MoE attention under CP against the unsplit stock HF model (fp32, rel
1e-5): Ulysses at cp 2 and 4, the ring (pure, hybrid, and its fused block path through the CPU stand-in), and packed
documents. The models are tests/tiny_models.py's: q/k head dim 12 (nope 8 + rope 4) against v's 8, so a kernel that
took v's dim for k's (or the reverse), a scale from the wrong dim or a K|V split at the wrong place fails; their MoE
layers run HF's own blocks here (per token, so exact under CP as they are; our block: tests/test_moe_deepseek.py).
"""
import pytest
import torch

import ds_ulysses_ext.attention.ring_blocks as blocks_mod
from dist_harness import run_ranks
from test_hf_cp import _check as cp_check
from test_packing import _check_packed
from test_ring import _model_check as ring_check

FAMILIES = ["deepseek_v3", "glm4_moe_lite", "glm4_moe"]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_ulysses_matches_unsplit(family, world):
    run_ranks(cp_check, world, family, 3)


def _fused_ring(rank, world, family, ring):
    # the fused block kernels (CUDA's, here the CPU flash op standing in) take one head dim: v goes in padded
    blocks_mod.FUSED_ON_CPU = True
    ring_check(rank, world, family, ring, {})


@pytest.mark.parametrize("family,world,ring,fused", [("deepseek_v3", 2, 2, False), ("deepseek_v3", 4, 2, False),
                                                     ("deepseek_v3", 2, 2, True), ("glm4_moe_lite", 2, 2, False),
                                                     ("glm4_moe", 2, 2, False)])
def test_ring_matches_unsplit(family, world, ring, fused):
    run_ranks(_fused_ring if fused else ring_check, world, family, ring, *([] if fused else [{}]))


@pytest.mark.parametrize("world,ring", [(2, 1), (4, 1), (2, 2)])
def test_packed_documents_match_each_document_alone(world, ring):
    run_ranks(_check_packed, world, "deepseek_v3", {}, ring)


def test_ulysses_attention_with_a_narrower_v_on_every_local_path():
    """cp=1 local kernels with v's dim 8 < q/k's 12: plain SDPA, and the masks.py path (documents, a window) that
    gets v padded, against one SDPA call per document with an explicit mask (the reference)."""
    from ds_ulysses_ext.attention.backends import local_attention
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 10, 2, 12, generator=g) for _ in range(2))
    v = torch.randn(1, 10, 2, 8, generator=g)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    pos = torch.arange(10)
    doc = (pos >= 4).long()
    for window in (None, 3):
        keep = (pos[None] <= pos[:, None]) & (doc[None] == doc[:, None])
        if window is not None:
            keep &= pos[:, None] - pos[None] < window
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=keep, scale=0.3).transpose(1, 2)
        out = local_attention("sdpa", q, k, v, causal=True, softmax_scale=0.3, cu_seqlens=cu, max_seqlen=6,
                              window=window)
        assert out.shape == v.shape and torch.allclose(out, ref, atol=1e-6), window

"""Sliding windows and GPT-OSS's learned sinks under CP against the unsplit HF model (fp32, rel 1e-5).

The references are stock HF on one process: eager attention for GPT-OSS (HF has no SDPA path for its
sinks), SDPA with HF's own sliding-window mask for Qwen3 and Mistral. Windows (3, 4) are shorter than the
13-token rows, so a key outside the window exists for most queries; the sinks are drawn large and distinct
per head, so a rank using another rank's sinks (or none) moves the loss far past the tolerance.
"""
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, GptOssConfig

from cp_reference import cp_loss_and_grads, rel
from dist_harness import run_ranks
from ds_ulysses_ext import enable_context_parallel, init_topology
from ds_ulysses_ext.masks import masked_attention
from tiny_models import tiny_model

RTOL = 1e-5


def tiny_gpt_oss(seed=0, attn="eager"):
    cfg = GptOssConfig(vocab_size=96, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                       num_attention_heads=8, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                       num_experts_per_tok=2, sliding_window=4, max_position_embeddings=64,
                       layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(8, generator=torch.Generator().manual_seed(7)) * 2)
    return model.train()


def build(family, **overrides):
    if family == "gpt_oss":
        return tiny_gpt_oss()
    return tiny_model(family, **overrides)


def _batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 96, (2, 13), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100
    labels[1, 9] = -100
    return {"input_ids": ids, "labels": labels}


def _reference(family, overrides):
    model = build(family, **overrides)
    b = _batch()
    logits = model(input_ids=b["input_ids"], use_cache=False).logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), b["labels"][:, 1:].reshape(-1),
                           ignore_index=-100)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _check(rank, world, family, overrides):
    ref_loss, ref_grads = _reference(family, overrides)
    topo = init_topology(world)
    model = enable_context_parallel(build(family, **overrides), topo, backend="sdpa")
    loss, grads = cp_loss_and_grads(model, topo, _batch())
    assert rel(loss, ref_loss) < RTOL, (loss, ref_loss)
    for name, g in grads.items():
        assert rel(g, ref_grads[name]) < RTOL, (name, rel(g, ref_grads[name]))
    assert any("sinks" in n for n in grads) == (family == "gpt_oss")  # sinks' gradients were compared


WINDOWED = {
    "gpt_oss": {},
    "qwen3": {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 1},
    "mistral": {"sliding_window": 4},
}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("family", sorted(WINDOWED))
def test_windows_and_sinks_match_unsplit(world, family):
    run_ranks(_check, world, family, WINDOWED[family])


def test_gpt_oss_single_rank_path_matches_eager():
    _check(0, 1, "gpt_oss", {})


def _dense_reference(q, k, v, doc, window, sinks):
    # fp64, by definition: scores over all keys, the mask written out element by element, a sink column
    B, S, h, D = q.shape
    rep = h // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / D ** 0.5
    allowed = torch.zeros(B, 1, S, S, dtype=torch.bool)
    for b in range(B):
        for i in range(S):
            for j in range(S):
                allowed[b, 0, i, j] = j <= i and doc[b][i] == doc[b][j] and (window is None or i - j < window)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.view(1, h, 1, 1).expand(B, h, S, 1)], -1)
    p = torch.softmax(scores, -1)[..., :S]
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_blocked_torch_path_matches_the_dense_definition(window, with_sinks):
    # blocks of 4 queries over rows of 11: spans start at the window's reach and at documents' starts
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 11, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    doc = [[0] * 5 + [1] * 6, [0] * 2 + [1] * 7 + [2] * 2]
    cu = torch.tensor([0, 5, 11, 13, 20, 22], dtype=torch.int32)
    sinks = torch.randn(4, generator=g, dtype=torch.float64) if with_sinks else None
    got = masked_attention(q, k, v, cu_seqlens=cu, window=window, sinks=sinks, block=4)
    assert rel(got, _dense_reference(q, k, v, doc, window, sinks)) < 1e-12

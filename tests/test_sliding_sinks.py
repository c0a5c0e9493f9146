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
from ds_ulysses_ext.attention.masks import masked_attention
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


def _sink_case(dtype, h, hkv, D, packed, seed=5):
    # rows of 11 in blocks of 4; sinks large and distinct per head, so a sink lost or mis-scaled shows
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 11, n, D, generator=g, dtype=torch.float64) for n in (h, hkv, hkv))
    sinks = torch.randn(h, generator=g, dtype=torch.float64) * 2
    grad_out = torch.randn(2, 11, h, D, generator=g, dtype=torch.float64)
    if packed:
        doc = [[0] * 5 + [1] * 6, [0] * 2 + [1] * 7 + [2] * 2]
        cu = torch.tensor([0, 5, 11, 13, 20, 22], dtype=torch.int32)
    else:
        doc, cu = [[0] * 11, [0] * 11], None
    return [t.to(dtype) for t in (q, k, v, sinks)], grad_out.to(dtype), doc, cu


def _out_and_grads(fn, inputs, grad_out):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(grad_out)
    return [out.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("D", [7, 8])  # D + 1 a multiple of 8 (no zero padding) and not
@pytest.mark.parametrize("hkv", [2, 4])  # GQA (4 query heads over 2) and plain MHA
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_sinks_through_sdpa_match_the_dense_definition_with_gradients(dtype, tol, window, packed, hkv, D):
    # output, dq, dk, dv and dsinks of the torch path (sinks as an extra SDPA key) against the fp64 definition
    inputs, grad_out, doc, cu = _sink_case(dtype, 4, hkv, D, packed)
    got = _out_and_grads(lambda q, k, v, s: masked_attention(q, k, v, cu_seqlens=cu, window=window, sinks=s,
                                                             block=4), inputs, grad_out)
    ref = _out_and_grads(lambda q, k, v, s: _dense_reference(q, k, v, doc, window, s),
                         [t.double() for t in inputs], grad_out.double())
    assert got[0].dtype == dtype and got[4].dtype == dtype
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, ref):
        assert rel(a, b) < tol, (name, rel(a, b))
    # the sinks matter here: the same call without them is far from the reference
    assert rel(masked_attention(*inputs[:3], cu_seqlens=cu, window=window, block=4), ref[0]) > 1e-2


def test_sinks_path_is_one_gqa_sdpa_call_per_block_with_head_dim_a_multiple_of_8(monkeypatch):
    # K/V keep their hkv heads (enable_gqa, no repeat), the head dim is padded for the fused kernels, and the
    # sink column is the only extra key and is always visible
    calls, sdpa = [], F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        calls.append((q.shape, k.shape, v.shape, attn_mask, kw))
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    (q, k, v, sinks), _, _, _ = _sink_case(torch.float32, 4, 2, 8, packed=False)
    masked_attention(q, k, v, window=3, sinks=sinks, block=4)
    assert len(calls) == 3  # ceil(11 / 4) blocks
    for qs, ks, vs, mask, kw in calls:
        assert qs[1] == 4 and ks[1] == vs[1] == 2 and kw["enable_gqa"] is True
        assert qs[-1] == ks[-1] == vs[-1] == 16
        assert mask.shape[-1] == ks[2] and bool(mask[..., -1].all())


def test_sinks_in_bf16_with_fp32_sinks_stay_close_to_the_definition():
    # bf16 q/k/v with fp32 sinks (a master copy): the sink coordinate is rounded to bf16 like q is; output and
    # every gradient within bf16 tolerance of the fp64 definition on the same (rounded) inputs
    inputs, grad_out, doc, _ = _sink_case(torch.float64, 4, 2, 8, packed=False)
    inputs = [t.to(torch.bfloat16) for t in inputs[:3]] + [inputs[3].float()]
    got = _out_and_grads(lambda q, k, v, s: masked_attention(q, k, v, window=3, sinks=s, block=4), inputs,
                         grad_out.to(torch.bfloat16))
    ref = _out_and_grads(lambda q, k, v, s: _dense_reference(q, k, v, doc, 3, s), [t.double() for t in inputs],
                         grad_out.to(torch.bfloat16).double())
    assert got[0].dtype == torch.bfloat16 and got[4].dtype == torch.float32
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, ref):
        assert rel(a.double(), b) < 1e-2, (name, rel(a.double(), b))


def test_a_minus_inf_sink_is_no_sink():
    # -inf (what the ring tests' reference passes for "no sinks") must not turn the real logits into NaN
    # (-inf * 0 in the extra query coordinate); those heads' output and gradients are those without a sink
    inputs, grad_out, doc, cu = _sink_case(torch.float64, 4, 2, 8, packed=True)
    inputs[3][1::2] = -torch.inf
    got = _out_and_grads(lambda q, k, v, s: masked_attention(q, k, v, cu_seqlens=cu, window=3, sinks=s, block=4),
                         inputs, grad_out)
    ref = _out_and_grads(lambda q, k, v, s: _dense_reference(q, k, v, doc, 3, s), inputs, grad_out)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, ref):
        assert rel(a, b) < 1e-12, (name, rel(a, b))
    assert bool((got[4][1::2] == 0).all()) and bool((got[4][0::2] != 0).all())

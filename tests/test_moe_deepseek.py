"""DeepSeek-V3's MoE (and GLM-4-MoE(-Lite)'s, HF's same block) through our block (fp32, rel 1e-5): HF's DeepseekV3MoE,
whole tiny models of the three families under CP x EP against the unsplit stock HF model, and save / export round
trips. What the router must reproduce: sigmoid scores, the selection bias `e_score_correction_bias` (non-zero here,
tests/tiny_models.py: it changes which experts are chosen but never the weights), group-limited selection (n_group,
topk_group), norm_topk_prob and routed_scaling_factor; plus n_shared_experts and the dense first layers.
"""
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

from dist_harness import run_ranks
from moe_check import assert_moe_split_matches, moe_batch
from ds_ulysses_ext import enable_context_parallel, init_topology
from ds_ulysses_ext.moe import MoEBlock, moe_blocks
from ds_ulysses_ext.moe.parallel import MoESettings, enable_expert_parallel, hf_moe_spec, replace_hf_blocks
from tiny_models import DEEPSEEK_LIKE, tiny_model

RTOL = 1e-5
H, E = 16, 8
FAMILIES = list(DEEPSEEK_LIKE)


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _hf_block(seed=0, **kw):
    args = dict(hidden_size=H, moe_intermediate_size=12, n_routed_experts=E, num_experts_per_tok=2, n_group=4,
                topk_group=2, routed_scaling_factor=2.5, n_shared_experts=2, norm_topk_prob=True)
    hf = DeepseekV3MoE(DeepseekV3Config(**{**args, **kw})).float()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, t in sorted(hf.state_dict(keep_vars=True).items()):
            t.copy_(torch.randn(t.shape, generator=g) * 0.5)  # the selection bias too: as large as the scores' spread
    return hf


def _selection(router, x):
    return router(x)[1].sort(-1).values


@pytest.mark.parametrize("kw", [{}, {"norm_topk_prob": False, "routed_scaling_factor": 1.0},
                                {"n_group": 1, "topk_group": 1}])
def test_block_matches_hf_deepseek_moe(kw):
    hf = _hf_block(**kw)
    ours = MoEBlock(hf_moe_spec(hf.config))
    ours.load_state_dict(hf.state_dict(), strict=True)
    assert set(ours.state_dict()) == set(hf.state_dict())  # HF's names, the selection bias included
    x = torch.randn(3, 10, H, generator=torch.Generator().manual_seed(1), requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    out_hf, out = hf(x), ours(x2)
    assert _rel(out, out_hf) < RTOL
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (out_hf * g).sum().backward()
    (out * g).sum().backward()
    assert _rel(x2.grad, x.grad) < RTOL
    hf_params = dict(hf.named_parameters())
    for n, p in ours.named_parameters():
        assert _rel(p.grad, hf_params[n].grad) < RTOL, n
    # the premise: the bias and the groups change the choice (else this test could not see them lost)
    flat = x.detach().reshape(-1, H)
    with torch.no_grad():
        chosen = _selection(hf.gate, flat)
        bias = hf.gate.e_score_correction_bias.clone()
        hf.gate.e_score_correction_bias.zero_()
        assert not torch.equal(_selection(hf.gate, flat), chosen), "the bias must move some choice"
        hf.gate.e_score_correction_bias.copy_(bias)
        if hf.gate.num_group > 1:
            hf.gate.num_group = hf.gate.topk_group = 1
            assert not torch.equal(_selection(hf.gate, flat), chosen), "the groups must move some choice"


def test_the_selection_bias_stays_fp32_in_a_bf16_model():
    block = MoEBlock(hf_moe_spec(_hf_block().config)).to(torch.bfloat16)
    assert block.gate.e_score_correction_bias.dtype == torch.float32 and block.gate.weight.dtype == torch.bfloat16
    assert block.gate.expert_bias is block.gate.e_score_correction_bias  # what balance.py updates


# --- whole models at CP x EP against the unsplit stock HF model ------------------------------------------------

COEF = 0.1  # large, so the balance loss moves the router gradient far past the tolerance
K = 2


def _routers(model):
    return [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "experts")]


def _reference(family):
    """CE + COEF x the per-sequence balance loss, from HF's own routers: their logits and their choice (bias and
    groups included), P_e the sigmoid scores normalised over E on the sequence's real tokens."""
    model = tiny_model(family)
    seen = []
    hooks = [r.register_forward_hook(lambda m, i, o: seen.append((o[0], o[2]))) for r in _routers(model)]
    ids, labels, mask = moe_batch()
    logits = model(input_ids=ids, use_cache=False).logits
    for h in hooks:
        h.remove()
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, 96), labels[:, 1:].reshape(-1), ignore_index=-100)
    B, S = mask.shape
    aux = 0.0
    for router_logits, top in seen:
        scores = torch.sigmoid(router_logits.float()).view(B, S, E)
        probs = scores / scores.sum(-1, keepdim=True)
        top = top.view(B, S, K)
        for b in range(B):
            real = mask[b].bool()
            counts = torch.bincount(top[b][real].flatten(), minlength=E).float()
            aux = aux + (counts * E / (K * real.sum()) * probs[b][real].mean(0)).sum()
    aux = aux / B
    (ce + COEF * aux).backward()
    return ce.detach(), aux.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _model_case(rank, world, family, cp, ep, ring):
    ref = _reference(family)
    topo = init_topology(cp, ep_size=ep, ring_size=ring)
    model = enable_context_parallel(tiny_model(family), topo, backend="sdpa")
    bias = {n: b.clone() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}
    enable_expert_parallel(model, topo, MoESettings(dispatcher="alltoall", aux_loss_coef=COEF))
    assert len(moe_blocks(model)) == 1 and type(model.model.layers[0].mlp).__name__.endswith("MLP")  # dense first
    assert {n: b for n, b in model.named_buffers() if n in bias}.keys() == bias.keys()
    assert all(torch.equal(dict(model.named_buffers())[n], b) for n, b in bias.items())  # HF's bias, in place
    names = assert_moe_split_matches(model, topo, moe_batch(), COEF, *ref, E, RTOL)
    assert names == set(ref[2])


@pytest.mark.parametrize("family,world,cp,ep,ring", [
    ("deepseek_v3", 2, 2, 2, 1), ("deepseek_v3", 4, 2, 2, 1), ("deepseek_v3", 4, 4, 4, 1), ("deepseek_v3", 2, 2, 2, 2),
    ("glm4_moe_lite", 2, 2, 2, 1), ("glm4_moe_lite", 4, 4, 2, 1), ("glm4_moe", 2, 2, 2, 1), ("glm4_moe", 4, 4, 4, 1)])
def test_model_cp_ep_matches_unsplit_hf(family, world, cp, ep, ring):
    run_ranks(_model_case, world, family, cp, ep, ring)


@pytest.mark.parametrize("family", FAMILIES)
def test_saved_checkpoint_loads_into_ours_and_ours_saves_as_hf(tmp_path, family):
    """save_pretrained -> from_pretrained -> our blocks: HF's logits; our state saved as an HF folder loads into
    stock HF with equal tensors (e_score_correction_bias included) and equal logits."""
    tiny_model(family).save_pretrained(str(tmp_path / "hf"))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    ours = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    assert replace_hf_blocks(ours) == 1
    ids = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(1))
    a, b = hf(ids).logits, ours(ids).logits
    assert _rel(b, a) < 1e-6
    ours.save_pretrained(str(tmp_path / "ours"), state_dict=ours.state_dict())
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ours"), dtype=torch.float32)
    assert not isinstance(back.model.layers[1].mlp, MoEBlock)
    ref_state, back_state = hf.state_dict(), back.state_dict()
    assert ref_state.keys() == back_state.keys() and all(torch.equal(ref_state[k], back_state[k]) for k in ref_state)
    assert back_state["model.layers.1.mlp.gate.e_score_correction_bias"].abs().sum() > 0
    assert _rel(back(ids).logits, a) < 1e-6

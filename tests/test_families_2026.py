"""Issue 40's families under CP against the unsplit stock HF model (fp32; loss and every gradient within rel 1e-5):
Mistral4 (MLA with the Llama-4 query scale and a softmax router), Cohere2-MoE (sliding + NoPE global layers, parallel
attention + MLP, LayerNorm, logit_scale, averaged shared expert) and the Qwen3-VL(-MoE) language model on text
(multimodal RoPE, vision tower frozen). The tiny models are tests/tiny_models.py's FAMILIES_2026.

One launch per family and world runs every layout of that family: Ulysses (cp 2, 4) and the ring (2, and hybrid 2 x 2)
with HF's own MoE blocks (per token, so exact as they are), our MoE block at cp x ep (2 x 2, 4 x 2, 4 x 4) with the
per-sequence balance loss written out from HF's own routers' choice, and packed documents (against each document
alone). Feature by feature: tests/test_model_features.py.
"""
import pytest
import torch
import torch.nn.functional as F

from cp_reference import cp_loss_and_grads, grads_of, rel
from dist_harness import run_ranks
from moe_check import assert_moe_split_matches, hf_moe_reference, moe_batch
from ds_ulysses_ext import CPCausalLM, UnsupportedError, enable_context_parallel, init_topology, shard_batch
from ds_ulysses_ext.moe import MoEBlock, moe_blocks
from ds_ulysses_ext.moe.parallel import MoESettings, enable_expert_parallel, replace_hf_blocks
from test_hf_cp import _batch
from test_packing import _check_packed
from tiny_models import FAMILIES_2026, VL_FAMILIES, tiny_model

RTOL = 1e-5  # relative, on the loss and on every parameter's gradient (fp32)
COEF = 0.1  # the balance loss's weight: large, so a wrong router gradient shows far past RTOL
MOE = ["mistral4", "cohere2_moe", "qwen3_vl_moe"]


def _reference(family):
    """The unsplit stock HF model's mean CE and gradients (a VL model: its full forward on input_ids)."""
    model = tiny_model(family)
    ids, labels = _batch()
    logits = model(input_ids=ids, use_cache=False).logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)
    loss.backward()
    return loss.detach(), grads_of(model)


def _split(family, cp, ring):
    ref_loss, ref_grads = _reference(family)
    topo = init_topology(cp, ring_size=ring)
    model = enable_context_parallel(tiny_model(family), topo, backend="sdpa")
    ids, labels = _batch()
    loss, grads = cp_loss_and_grads(model, topo, {"input_ids": ids, "labels": labels})
    assert rel(loss, ref_loss) < RTOL, (family, cp, ring, loss, ref_loss)
    for name, g in grads.items():
        assert rel(g, ref_grads[name]) < RTOL if ref_grads[name].any() else not g.any(), (family, cp, ring, name)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == ({n for n in grads if n.startswith("model.visual.")} if family in VL_FAMILIES else set())
    assert all(ref_grads[n].any() for n in grads if n not in frozen), (family, "a parameter the text never reached")


def _moe(family, cp, ep):
    sigmoid = False  # every tiny family here routes on softmax probabilities (the sigmoid case: test_model_features)
    ref = hf_moe_reference(tiny_model(family), moe_batch(), COEF, sigmoid)
    topo = init_topology(cp, ep_size=ep)
    model = enable_context_parallel(tiny_model(family), topo, backend="sdpa")
    enable_expert_parallel(model, topo, MoESettings(dispatcher="alltoall", aux_loss_coef=COEF))
    assert len(moe_blocks(model)) == (1 if family == "mistral4" else 2)  # Mistral4's first layer is dense
    names = assert_moe_split_matches(model, topo, moe_batch(), COEF, *ref, 8, RTOL)
    assert names == set(ref[2])


# what each world runs, for every family: ("ulysses", cp) | ("ring", ring) | ("moe", cp, ep) (MoE families) |
# ("packed",) (Ulysses, documents restarting their positions)
LAYOUTS = {
    2: [("ulysses", 2), ("ring", 2), ("moe", 2, 2), ("packed",)],
    4: [("ulysses", 4), ("ring", 2), ("moe", 4, 2), ("moe", 4, 4)],
}


def _all_layouts(rank, world, family):
    for layout in LAYOUTS[world]:
        kind = layout[0]
        if kind == "ulysses":
            _split(family, layout[1], 1)
        elif kind == "ring":
            _split(family, world, layout[1])
        elif kind == "moe" and family in MOE:
            _moe(family, *layout[1:])
        elif kind == "packed":
            # documents restart their positions: the Llama-4 scale, the windows and mrope read in-document positions
            _check_packed(rank, world, family, {})


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("family", list(FAMILIES_2026))
def test_family_matches_unsplit_hf(family, world):
    run_ranks(_all_layouts, world, family)


# --- single process: the claims the layouts above rest on, and the export -----------------------------------------

def test_text_mrope_is_plain_rope_whatever_its_sections():
    """On text the three mrope streams are the token's position, so its sections and interleaving cannot matter: the
    logits are bitwise those of other sections (which is why each CP chunk may rotate at its global positions alone)."""
    ids = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(1))
    logits = []
    for section in ([2, 1, 1], [1, 2, 1], [4, 0, 0]):
        rope = {**FAMILIES_2026["qwen3_vl"]["rope_parameters"], "mrope_section": section}
        with torch.no_grad():
            logits.append(tiny_model("qwen3_vl", rope_parameters=rope)(input_ids=ids).logits)
    assert all(torch.equal(x, logits[0]) for x in logits[1:])


def test_images_and_3d_positions_are_refused_with_the_fix():
    topo = init_topology(1)
    model = enable_context_parallel(tiny_model("qwen3_vl"), topo, backend="sdpa")
    lm = CPCausalLM(model)
    ids, labels = _batch()
    local = shard_batch({"input_ids": ids, "labels": labels}, topo)
    with pytest.raises(UnsupportedError, match="pixel_values.*drop the images"):
        lm(**local, pixel_values=torch.zeros(4, 3 * 2 * 4 * 4))
    with pytest.raises(UnsupportedError, match=r"position_ids of shape \(3, 2, 13\).*\[B, s\]"):
        lm(**{**local, "position_ids": local["position_ids"][None].expand(3, -1, -1)})
    with pytest.raises(UnsupportedError, match="rope_type.*dynamic.*text_config.rope_parameters"):
        dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
        enable_context_parallel(tiny_model("qwen3_vl", rope_parameters=dynamic), topo)


def test_logit_scale_is_applied_by_the_loss_head():
    """Cohere's forward multiplies its logits by logit_scale; CPCausalLM calls the decoder and the head itself, so
    it must apply it too (a non-power-of-2 scale here: the exact 0.0625 would hide a rounding difference)."""
    model = tiny_model("cohere2_moe", logit_scale=0.3)
    ids, labels = _batch()
    logits = model(input_ids=ids, use_cache=False).logits
    ref = F.cross_entropy(logits[:, :-1].reshape(-1, 96), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum")
    topo = init_topology(1)
    for fused in (True, False):
        loss_sum, _ = CPCausalLM(enable_context_parallel(model, topo, backend="sdpa"), loss_chunk_size=5,
                                 fused_loss=fused)(**shard_batch({"input_ids": ids, "labels": labels}, topo))
        assert rel(loss_sum, ref) < RTOL, fused


@pytest.mark.parametrize("family", MOE + ["qwen3_vl"])
def test_export_loads_into_stock_hf(tmp_path, family):
    """Our model (our MoE blocks, the vision tower frozen) saved as an HF folder loads into the stock class, every
    tensor equal and the same logits: a VL run exports the whole VL checkpoint, its vision tower as loaded."""
    from transformers import AutoModelForImageTextToText
    hf = tiny_model(family)
    ours = enable_context_parallel(tiny_model(family), init_topology(1), backend="sdpa")
    if family in MOE:
        assert replace_hf_blocks(ours) >= 1 and moe_blocks(ours)
    ours.config._attn_implementation = "sdpa"  # what the engine's export writes (engine/checkpoints/export.py)
    ours.save_pretrained(str(tmp_path), state_dict=ours.state_dict())
    if family in VL_FAMILIES:  # a stock loader that knows the VL checkpoint without this package's registration
        back = AutoModelForImageTextToText.from_pretrained(str(tmp_path), dtype=torch.float32)
    else:
        back = type(hf).from_pretrained(str(tmp_path), dtype=torch.float32)
    assert not any(isinstance(m, MoEBlock) for m in back.modules())
    ref, got = hf.state_dict(), back.state_dict()
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
    ids = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert rel(back(input_ids=ids).logits, hf(input_ids=ids).logits) < 1e-6


# family, overrides, RMSNorms bound: Cohere2-MoE's LayerNorms none, its RMSNorms 2 layers + final; Mistral4 the MLA
# latent norms too; Qwen3-VL the q/k norms too (its vision tower's norms are torch LayerNorms)
@pytest.mark.parametrize("family,overrides,norms", [("cohere2_moe", {}, 0), ("cohere2_moe", {"rms_norm_eps": 1e-5}, 3),
                                                    ("mistral4", {}, 9), ("qwen3_vl", {}, 9)])
def test_fused_kernels_leave_the_logits_bitwise_hf(family, overrides, norms):
    """The per-token kernels bind by structure (kernels/bind.py); Cohere's mean-centred LayerNorm has the attributes
    of an RMSNorm and must stay HF's. The reference functions as a stand-in provider, in bf16
    (tests/test_kernels.py)."""
    from ds_ulysses_ext.kernels import apply_fused_kernels
    from ds_ulysses_ext.kernels.providers import Provider
    from test_kernels import _logits_and_grads
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    models = []
    for _ in range(2):
        model = tiny_model(family, **overrides).to(torch.bfloat16)
        with torch.no_grad():  # norms away from 1, so a dropped weight or a wrong formula shows
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)).to(p) * 0.3)
        models.append(model)
    report = apply_fused_kernels(models[1], "auto", torch.device("cpu"), provider=Provider(), projections=False)
    assert report.norms == norms, report
    (ref_logits, ref_grads), (logits, grads) = (_logits_and_grads(m, ids) for m in models)
    assert torch.equal(logits, ref_logits)
    assert grads.keys() == ref_grads.keys() and all(torch.equal(grads[n], ref_grads[n]) for n in grads)


def test_cohere2_moe_rope_scaling_is_inert():
    """transformers 5.22's Cohere2-MoE config keeps `rope_scaling` as a field that it never folds into rope_parameters
    (only rope_theta goes there): a dynamic scaling changes no logit, split or not (tests/test_model_features.py
    AUDIT)."""
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = tiny_model("cohere2_moe", max_position_embeddings=8)(input_ids=ids).logits
        scaled = tiny_model("cohere2_moe", max_position_embeddings=8,
                            rope_scaling={"rope_type": "dynamic", "factor": 4.0})(input_ids=ids).logits
    assert torch.equal(plain, scaled)


@pytest.mark.parametrize("family,overrides,match", [
    ("cohere2_moe", {"sliding_window": None}, "layer_types marks layers \\[0\\] sliding_attention but sliding_window"),
    ("cohere2_moe", {"expert_selection_fn": "relu"}, "expert_selection_fn='relu'.*set expert_selection_fn"),
    ("cohere2_moe", {"shared_expert_combination_strategy": "max"}, "shared_expert_combination_strategy='max'"),
    ("qwen3_vl_moe", {"norm_topk_prob": False}, "norm_topk_prob=false.*Remove norm_topk_prob from text_config"),
])
def test_what_hf_would_not_run_as_trained_is_refused_at_load(family, overrides, match):
    with pytest.raises(UnsupportedError, match=match):
        model = enable_context_parallel(tiny_model(family, **overrides), init_topology(1), backend="sdpa")
        enable_expert_parallel(model, init_topology(1), MoESettings(dispatcher="alltoall"))


def test_a_scaled_head_with_a_bias_is_refused():
    model = tiny_model("cohere2_moe")
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(96))
    with pytest.raises(UnsupportedError, match="logit_scale=0.0625 and its lm_head has a bias"):
        CPCausalLM(model)


@pytest.mark.parametrize("overrides,match", [
    (["model=tiny_qwen3_vl", "parallelism.cp=3", "parallelism.ring=1"], "model.arch.text_config.num_attention_heads=8"),
    (["model=tiny_qwen3_vl_moe", "parallelism.cp=1", "parallelism.ep=3"],
     "does not divide model.arch.text_config.num_experts=8"),
])
def test_a_vl_preset_is_validated_on_its_text_config(overrides, match):
    """The VL presets nest the decoder's shape under model.arch.text_config: heads and experts are still checked
    before any model is built, naming the nested key."""
    from configs import compose_config, validate
    from configs.errors import ConfigError
    with pytest.raises(ConfigError, match=match):
        validate(compose_config(overrides + ["device=cpu"]), 3)
    for preset in ("tiny_mistral4", "tiny_cohere2_moe", "tiny_qwen3_vl", "tiny_qwen3_vl_moe"):
        validate(compose_config([f"model={preset}", "device=cpu", "parallelism.cp=2"]), 2)  # each preset validates

"""precision=fp8's compiled casts (fp8.compile, ds_ulysses_ext/kernels/fp8.py): the whole-MLP and q/k/v regions, and
each linear alone, give the eager casts' values on CPU (dynamo's eager and aot_eager backends), under the memory
policies that wrap them; what the report says formed; what `auto` picks."""
import pytest
import torch

pytest.importorskip("torchao.float8", reason="torchao is a test dependency ([test] extra)")

from ds_ulysses_ext.kernels.fp8 import apply_fp8  # noqa: E402
from test_engine import _rel  # noqa: E402
from test_fp8 import _tiny  # noqa: E402


# --- where the casts compile (fp8.compile) -----------------------------------------------------------------------------
# dynamo with its eager backend: the regions are traced as on the GPU (the nested per-linear regions inlined into the
# MLP's), then run op by op, so the values are the uncompiled model's; inductor's code is the GPU's to check

def _eager_compile(calls, backend="eager"):
    def compile_fn(fn):
        calls.append(getattr(fn, "__qualname__", repr(fn)))
        return torch.compile(fn, backend=backend)
    return compile_fn


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    # the positions HF would make itself, given: a model with our attention bound asks for them
    out = model(input_ids=ids, labels=ids, position_ids=torch.arange(ids.shape[1]).unsqueeze(0))
    out.loss.backward()
    return float(out.loss.detach()), {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}


def _eager_and_regions(linears: str, backend: str, seed: int, compile_casts: str = "mlp", integrate: bool = False):
    """Two copies of the tiny model in tensorwise FP8: `ref` with eager casts, `got` with fp8.compile=`compile_casts`
    through `backend`; the compiled functions' names collect in `calls`. `integrate`: our attention bound first (as a
    run binds it; the except_attention policy records and replays it)."""
    from ds_ulysses_ext import enable_context_parallel, init_topology
    torch._dynamo.reset()
    ids = torch.randint(0, 128, (1, 64), generator=torch.Generator().manual_seed(seed))
    ref, got = _tiny(), _tiny()
    got.load_state_dict(ref.state_dict())
    if integrate:
        ref, got = (enable_context_parallel(m, init_topology(1), backend="sdpa") for m in (ref, got))
    apply_fp8(ref, "tensorwise", linears, compile_casts="false")
    calls = []
    report = apply_fp8(got, "tensorwise", linears, compile_casts=compile_casts,
                       compile_fn=_eager_compile(calls, backend))
    return ids, ref, got, calls, report


@pytest.mark.parametrize("policy, backend", [("none", "eager"), ("selective", "eager"), ("tiled", "eager"),
                                             ("none", "aot_eager"), ("offload", "aot_eager")])
def test_whole_mlp_regions_equal_eager_casts(policy, backend):
    # aot_eager: the region as one autograd.Function, as inductor's is; the offload policy's saved-tensor hooks then
    # pack what that function saves, at run time
    from ds_ulysses_ext.memory.offload import OffloadActivations
    from ds_ulysses_ext.memory.recompute import SelectiveRecompute
    from ds_ulysses_ext.memory.tiling import TiledMLP
    ids, ref, got, calls, report = _eager_and_regions("mlp", backend, seed=0)
    assert report.whole_mlps == 2 and report.as_dict()["compiled"] == "mlp", report
    assert "(down_proj x2, gate_proj x2, up_proj x2), casts compiled: 2 gated MLPs whole," in str(report)
    assert calls.count("LlamaMLP.forward") == 2 and len(calls) == 2 + 6, calls  # 2 MLP regions, 6 linears alone
    assert all(hasattr(layer.mlp.forward, "act_mul") for layer in got.model.layers)
    policies = {"selective": SelectiveRecompute, "tiled": lambda: TiledMLP(tile_tokens=16),
                "offload": lambda: OffloadActivations(min_bytes=0)}
    # the policies wrap the region's forward (the selective one rewrites it around act_mul)
    applied = [policies[policy]().apply(m) for m in (ref, got)] if policy != "none" else []
    loss_ref, grads_ref = _loss_and_grads(ref, ids)
    loss, grads = _loss_and_grads(got, ids)
    if policy == "offload":  # the hooks really moved saved tensors, the region's among them
        assert applied[1].stats["offloaded"] > 0, applied[1].stats
    assert loss == pytest.approx(loss_ref, rel=1e-6)
    assert grads.keys() == grads_ref.keys()
    for n in grads:
        assert _rel(grads[n].norm(), grads_ref[n].norm()) < 1e-5 and torch.equal(grads[n], grads_ref[n]), n


def test_whole_mlp_regions_beside_attention_linears_in_fp8():
    # fp8.linears=all with fp8.compile=mlp: each MLP one region, attention's four projections each compiled alone;
    # the values those of the eager casts
    ids, ref, got, calls, report = _eager_and_regions("all", "aot_eager", seed=1)
    assert report.whole_mlps == 2 and set(report.fp8) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                          "up_proj", "down_proj"}, report
    assert calls.count("LlamaMLP.forward") == 2 and len(calls) == 2 + 14, calls  # 2 regions, 7 linears x 2 layers
    loss_ref, grads_ref = _loss_and_grads(ref, ids)
    loss, grads = _loss_and_grads(got, ids)
    assert loss == pytest.approx(loss_ref, rel=1e-6)
    assert grads.keys() == grads_ref.keys() and all(torch.equal(grads[n], grads_ref[n]) for n in grads)


def test_regions_under_the_mlp_default_report_the_mlp_regions_only():
    # fp8.compile=regions (auto's choice for tensorwise) with fp8.linears=mlp: q/k/v stay bf16, so no q/k/v region
    # forms, and the log and metrics say `mlp`, what ran
    _, _, _, calls, report = _eager_and_regions("mlp", "eager", seed=4, compile_casts="regions")
    assert (report.whole_mlps, report.qkv_regions) == (2, 0) and "_qkv" not in calls, (report, calls)
    assert report.as_dict()["compiled"] == "mlp", report
    assert "q/k/v" not in str(report)


@pytest.mark.parametrize("policy", ["none", "except_attention"])
def test_qkv_regions_equal_eager_casts(policy):
    # fp8.compile=regions with fp8.linears=all: each attention's q/k/v one region, bound as a projection group (q's
    # call runs it, k and v take theirs), each MLP one region, o_proj alone. The values are the eager casts', also
    # through the except_attention replay, where the region computes the projections that the bf16 group skips
    from ds_ulysses_ext.memory import ExceptAttentionRecompute
    ids, ref, got, calls, report = _eager_and_regions("all", "aot_eager", seed=2, compile_casts="regions",
                                                      integrate=True)
    assert (report.whole_mlps, report.qkv_regions) == (2, 2) and report.as_dict()["compiled"] == "regions", report
    assert "2 gated MLPs whole, 2 q/k/v groups as one region each" in str(report)
    assert calls.count("_qkv") == 2 and calls.count("LlamaMLP.forward") == 2 and len(calls) == 4 + 14, calls
    if policy == "except_attention":
        for m in (ref, got):
            ExceptAttentionRecompute().apply(m)
    loss_ref, grads_ref = _loss_and_grads(ref, ids)
    loss, grads = _loss_and_grads(got, ids)
    groups = [layer.self_attn.q_proj.forward.__self__ for layer in got.model.layers]
    assert all(g.fused_calls >= 1 for g in groups), [g.fused_calls for g in groups]  # the regions ran
    assert loss == pytest.approx(loss_ref, rel=1e-6)
    assert grads.keys() == grads_ref.keys() and all(torch.equal(grads[n], grads_ref[n]) for n in grads)


def test_a_qkv_region_that_cannot_run_leaves_each_projection_in_fp8():
    # under autocast the group steps aside: each projection runs its own compiled FP8 forward, not a bf16 F.linear
    _, _, got, _, _ = _eager_and_regions("all", "eager", seed=3, compile_casts="regions")
    attn = got.model.layers[0].self_attn
    x = torch.randn(1, 32, 64, dtype=torch.bfloat16)
    fp8 = [type(m).forward(m, x) for m in (attn.q_proj, attn.k_proj, attn.v_proj)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got_outs = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]
    assert attn.q_proj.forward.__self__.fused_calls == 0
    assert all(torch.equal(g, f) for g, f in zip(got_outs, fp8))
    assert not torch.equal(fp8[0], torch.nn.functional.linear(x, attn.q_proj.weight))  # FP8 rounds differently


def test_whole_mlp_regions_stay_off_under_zero3_and_per_linear():
    # ZeRO-3's gather hooks sit on each linear's __call__: a region around the MLP would trace into them
    for kwargs in (dict(compile_casts="mlp", partitioned=True), dict(compile_casts="linear")):
        torch._dynamo.reset()
        model, calls = _tiny(), []
        report = apply_fp8(model, "tensorwise", "mlp", compile_fn=_eager_compile(calls), **kwargs)
        assert report.whole_mlps == 0 and len(calls) == 6, (kwargs, calls)
        assert report.as_dict()["compiled"] == "linear", report  # what formed, not the setting
        assert all("forward" not in layer.mlp.__dict__ for layer in model.model.layers)
        if kwargs.get("partitioned"):
            assert "ZeRO-3 partitions the weights" in str(report)
    report = apply_fp8(_tiny(), "tensorwise", "mlp", compile_casts="false")
    assert report.as_dict()["compiled"] == "false" and "casts eager" in str(report)


def test_auto_compile_follows_the_recipe_and_device():
    # the region measured faster than per-linear casts for tensorwise and slower for rowwise (one MLP, H200)
    from ds_ulysses_ext.kernels.fp8 import resolve_compile
    assert resolve_compile("auto", "tensorwise", "cuda") == "regions"
    assert resolve_compile("auto", "rowwise", "cuda") == "linear"
    assert resolve_compile("auto", "rowwise_with_gw_hp", "cuda") == "linear"
    assert resolve_compile("auto", "tensorwise", "cpu") == "false"
    assert resolve_compile("mlp", "rowwise", "cuda") == "mlp"  # a setting by name is kept
    assert resolve_compile("linear", "tensorwise", "cpu") == "linear"

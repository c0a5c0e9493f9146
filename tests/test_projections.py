"""kernels/projections.py: q/k/v and gate/up as one autograd node, and the except_attention replay that skips the
q/k/v GEMMs nothing reads. Every check is against autograd's own linears on the unbound model, fp32, rel 1e-5."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from ds_ulysses_ext import CPCausalLM, enable_context_parallel, init_topology, shard_batch
from ds_ulysses_ext.kernels.projections import ProjectionGroup, _SharedInputLinears, bind_projection_groups
from ds_ulysses_ext.memory import ExceptAttentionRecompute
from policy_helpers import RTOL, _assert_close_dicts, _batch, _rel, _run
from test_moe_gpt_oss import tiny_gpt_oss
from tiny_models import tiny_model


def test_shared_input_linears_equal_autograds_linears():
    """Outputs and every gradient, with a bias, a frozen weight, an output nothing uses, and the skip's NaN."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 8, generator=g, requires_grad=True)
    ws = [torch.randn(o, 8, generator=g, requires_grad=True) for o in (6, 3, 4)]
    ws[1].requires_grad_(False)
    b = torch.randn(6, generator=g, requires_grad=True)
    params = [ws[0], b, ws[1], None, ws[2], None]
    w_out = [torch.randn(2, 5, o, generator=g) for o in (6, 3)]

    outs = _SharedInputLinears.apply(x, (False, False, False), *params)
    (outs[0] * w_out[0]).sum().add((outs[1] * w_out[1]).sum()).backward()  # the third output is unused
    got = [x.grad, ws[0].grad, b.grad, ws[2].grad]
    x.grad = ws[0].grad = b.grad = None

    ref = [F.linear(x, ws[0], b), F.linear(x, ws[1]), F.linear(x, ws[2])]
    (ref[0] * w_out[0]).sum().add((ref[1] * w_out[1]).sum()).backward()
    for o, r in zip(outs, ref):
        assert _rel(o, r) < RTOL
    assert ws[2].grad is None and got[3] is None  # an unused output: no weight gradient at all, as autograd
    for a, r in zip(got[:3], [x.grad, ws[0].grad, b.grad]):
        assert _rel(a, r) < RTOL

    skipped = _SharedInputLinears.apply(x, (False, True, False), *params)
    assert torch.isnan(skipped[1]).all() and _rel(skipped[0], ref[0]) < RTOL


def _build(family, layers=2):
    hf = tiny_gpt_oss() if family == "gpt_oss" else tiny_model(family, num_hidden_layers=layers)
    return CPCausalLM(enable_context_parallel(hf, init_topology(1), backend="sdpa"), loss_chunk_size=5)


FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "glm4_moe", "gpt_oss"]
EXPECTED_GROUPS = {"llama": 4, "qwen2": 4, "qwen3": 4, "mistral": 4, "qwen3_moe": 2, "glm4_moe": 4, "gpt_oss": 2}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("policy", ["none", "except_attention"])
def test_bound_groups_give_the_unbound_gradients(family, policy):
    """Qwen2 / GLM's projection biases, Qwen3 / GLM's q/k norms (q and k then really computed in the replay), GPT-OSS's
    sinks and windows, the MoE families' dense and shared-expert MLPs: loss and every gradient as autograd's linears."""
    local = shard_batch(dict(zip(("input_ids", "labels"), _batch())), init_topology(1))
    lm = _build(family)
    ref_loss, ref_grads = _run(lm, local)
    assert bind_projection_groups(lm.hf) == EXPECTED_GROUPS[family]
    applied = ExceptAttentionRecompute().apply(lm.hf) if policy == "except_attention" else None
    loss, grads = _run(lm, local)
    if applied is not None:
        applied.remove()
    assert _rel(loss, ref_loss) < RTOL
    _assert_close_dicts(grads, ref_grads, (family, policy))


class _CountMM(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _backward_mms(lm, local):
    loss_sum, _ = lm(**local)
    with _CountMM() as mode:
        loss_sum.backward()
    return mode.count


@pytest.mark.parametrize("family, skipped_per_layer", [("llama", 3), ("qwen3", 1)])
def test_the_replay_skips_only_the_projections_nothing_reads(family, skipped_per_layer):
    """Backward's matrix products under except_attention: the replay of each layer runs q/k/v's GEMMs no more
    (Llama: all three; Qwen3: v only, its q/k norms save q and k); the backward's own products stay."""
    local = shard_batch(dict(zip(("input_ids", "labels"), _batch())), init_topology(1))
    counts = []
    for bind in (False, True):
        lm = _build(family, layers=3)
        if bind:
            bind_projection_groups(lm.hf)
        ExceptAttentionRecompute().apply(lm.hf)
        counts.append(_backward_mms(lm, local))
    assert counts[0] - counts[1] == 3 * skipped_per_layer, counts


def test_a_projection_marked_unused_wrongly_poisons_the_gradients():
    """The guard: were a member marked unused whose output something saves (here Qwen3's q, which q_norm saves),
    the replay's NaN reaches the gradients, which the run's non-finite check stops at, instead of a wrong model."""
    local = shard_batch(dict(zip(("input_ids", "labels"), _batch())), init_topology(1))
    lm = _build("qwen3")
    for layer in lm.hf.model.layers:
        a = layer.self_attn
        ProjectionGroup([a.q_proj, a.k_proj, a.v_proj], [True, True, True]).bind()
    ExceptAttentionRecompute().apply(lm.hf)
    _, grads = _run(lm, local)
    assert torch.isnan(grads["hf.model.layers.0.self_attn.q_proj.weight"]).any()


def test_partitioned_or_autocast_weights_run_the_plain_linears():
    """ZeRO-3 gathers each module's weight in its own hook (a sibling's may be a partition when the first runs), and
    autocast casts inside the linear: either way every member runs its own F.linear, with the same values."""
    torch.manual_seed(0)
    q, k = torch.nn.Linear(8, 4), torch.nn.Linear(8, 2)
    group = ProjectionGroup([q, k])
    group.bind()
    x = torch.randn(3, 8)
    q(x), k(x)
    assert group.fused_calls == 1
    k.weight.ds_id = 7  # what DeepSpeed's ZeRO-3 sets on a partitioned parameter
    assert _rel(q(x), F.linear(x, q.weight, q.bias)) < RTOL and _rel(k(x), F.linear(x, k.weight, k.bias)) < RTOL
    del k.weight.ds_id
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q(x), k(x)
    assert group.fused_calls == 1


def test_a_sibling_called_on_another_input_computes_its_own():
    torch.manual_seed(0)
    q, k = torch.nn.Linear(8, 4), torch.nn.Linear(8, 2)
    ProjectionGroup([q, k]).bind()
    x, y = torch.randn(3, 8), torch.randn(3, 8)
    q(x)
    assert _rel(k(y), F.linear(y, k.weight, k.bias)) < RTOL
    assert _rel(k(x), F.linear(x, k.weight, k.bias)) < RTOL  # not handed again: computed


def test_the_fused_kernels_bind_the_groups_and_report_them():
    from ds_ulysses_ext.kernels import apply_fused_kernels
    from ds_ulysses_ext.kernels.providers import Provider
    hf = tiny_model("llama")
    report = apply_fused_kernels(hf, "auto", torch.device("cpu"), provider=Provider())
    assert report.projection_groups == 4 and "4 projection groups" in str(report)
    assert "forward" in hf.model.layers[0].self_attn.k_proj.__dict__

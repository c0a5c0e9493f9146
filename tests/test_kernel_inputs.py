"""The fused kernels' first-use check sees the inputs the run really feeds (kernels/providers.Checked,
kernels/layout_sample.py), and the bound kernels compose with selective recompute; on CPU, with stand-in providers.

The defect this guards against: a kernel that reads a strided input (HF's MLA hands kv_a_layernorm a slice of
torch.split) as if it were contiguous computes a right forward and wrong gradients. A check on a contiguous randn
passed it. `_ReadsAsContiguous` is such a kernel: the check must stop it on the slice and let it through on a
contiguous input (where it is right). fp32; tolerance: the check's own (1e-4 relative).
"""
import pytest
import torch

from ds_ulysses_ext.kernels import apply_fused_kernels, reference
from ds_ulysses_ext.kernels.layout_sample import cut, same_layout
from ds_ulysses_ext.kernels.providers import Checked, Provider


class _ContiguousBackward(torch.autograd.Function):
    """y = rms_norm(x) * w, right; its backward reads x's storage as if x were contiguous (the bug)."""

    @staticmethod
    def forward(ctx, x, w, eps):
        ctx.save_for_backward(x, w)
        ctx.eps = eps
        return reference.rms_norm(x, w, eps, False)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        misread = x.as_strided(x.shape, torch.empty(x.shape).stride(), x.storage_offset()).detach()
        with torch.enable_grad():
            xl, wl = misread.requires_grad_(), w.detach().requires_grad_()
            dx, dw = torch.autograd.grad(reference.rms_norm(xl, wl, ctx.eps, False), (xl, wl), dy)
        return dx, dw, None


class _ReadsAsContiguous(Provider):
    name = "reads-as-contiguous"

    def rms_norm(self, x, weight, eps, weight_in_fp32):
        return _ContiguousBackward.apply(x, weight, eps)


def _mla_slice(T=40, r=24, d=8):
    # HF's MLA: compressed_kv [B, s, r + d] split into the latent [.., r] (normed) and the rope part [.., d]
    compressed = torch.randn(2, T, r + d, generator=torch.Generator().manual_seed(0))
    latent, _ = torch.split(compressed, [r, d], dim=-1)
    return latent


def test_the_check_runs_on_the_real_layout_and_stops_a_kernel_that_misreads_it():
    latent = _mla_slice()
    assert not latent.is_contiguous()
    w = 1 + 0.1 * torch.randn(latent.shape[-1])
    ok = Checked(_ReadsAsContiguous())
    y = ok.rms_norm(latent.contiguous(), w, 1e-6, False)  # contiguous: the kernel is right, and passes
    assert torch.allclose(y, reference.rms_norm(latent, w, 1e-6, False))
    with pytest.raises(RuntimeError, match=r"model.kernels=none.*|on the run's input"):
        ok.rms_norm(latent, w, 1e-6, False)  # a new layout: checked again, on it, and stopped
    with pytest.raises(RuntimeError, match="strides"):
        Checked(_ReadsAsContiguous()).rms_norm(latent, w, 1e-6, False)


def test_a_checked_layout_is_not_checked_again():
    calls = []

    class Counting(Provider):
        def rms_norm(self, x, weight, eps, weight_in_fp32):
            calls.append(x.shape)
            return super().rms_norm(x, weight, eps, weight_in_fp32)
    p, w = Checked(Counting()), torch.ones(24)
    for _ in range(3):
        p.rms_norm(_mla_slice(), w, 1e-6, False)
    assert len(calls) == 1 + 3  # one check (on a cut of the input), then three calls
    p.rms_norm(_mla_slice().contiguous(), w, 1e-6, False)
    assert len(calls) == 1 + 3 + 2  # a new layout: checked once more


@pytest.mark.parametrize("view", ["split", "transposed", "offset_rows", "batch_slice", "broadcast"])
def test_same_layout_keeps_strides_offset_alignment_and_values(view):
    base = torch.randn(3, 50, 40)
    t = {"split": base[..., 8:32], "transposed": base.transpose(1, 2), "offset_rows": base[1, 7:],
         "batch_slice": base[:, 5:45], "broadcast": base[:1, :, :16].expand(3, 50, 16)}[view]
    c = cut(t)
    storage, rebuilt = same_layout(c, torch.float64)
    assert rebuilt.stride() == c.stride() and rebuilt.shape == c.shape and rebuilt.dtype == torch.float64
    assert (rebuilt.storage_offset() % 64 == c.storage_offset() % 64
            and (rebuilt.storage_offset() == 0) == (c.storage_offset() == 0))
    assert torch.equal(rebuilt, c.double())
    assert c.shape[-2] == min(67, t.shape[-2]) and all(n <= 2 for n in c.shape[:-2])


def test_selective_recompute_takes_the_bound_mlp():
    """memory=selective (and memory=auto, which picks it at 16k-32k) with the fused kernels bound: the bound MLP's
    product is what is recomputed; before, the policy met a patched forward and stopped the run on the GPU. fp32,
    against the unbound model: loss and every gradient, relative 1e-5."""
    from ds_ulysses_ext import CPCausalLM, init_topology, shard_batch
    from ds_ulysses_ext.memory import SelectiveRecompute
    from tiny_models import tiny_model
    topo = init_topology(1)
    ids = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(3))
    local = shard_batch({"input_ids": ids, "labels": ids.clone()}, topo)
    calls = []

    class Counting(Provider):
        def silu_mul(self, gate, up):
            calls.append(1)
            return super().silu_mul(gate, up)

    def step(bind):
        torch.manual_seed(0)
        hf = tiny_model("llama", num_hidden_layers=2)
        if bind:
            apply_fused_kernels(hf, "auto", torch.device("cpu"), provider=Checked(Counting()))
        policy = SelectiveRecompute().apply(hf)
        lm = CPCausalLM(hf, loss_chunk_size=5)
        loss_sum, count = lm(**local)
        (loss_sum / count).backward()
        assert policy.num_mlps == 2
        return loss_sum.detach(), {n: p.grad for n, p in lm.named_parameters()}
    ref_loss, ref_grads = step(False)
    loss, grads = step(True)
    assert len(calls) == 1 + 2 + 2  # its check, two layers forward, two recomputed in backward
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=0)
    for name, g in grads.items():
        assert ((g - ref_grads[name]).norm() / ref_grads[name].norm()).item() < 1e-5, name


def test_kernels_asked_for_by_name_on_cpu_say_what_runs_instead(caplog):
    import logging

    from tiny_models import tiny_model
    with caplog.at_level(logging.WARNING):
        report = apply_fused_kernels(tiny_model("llama", num_hidden_layers=1), "liger", torch.device("cpu"),
                                     loss_head="liger")
    assert report.provider == "none" and report.head is None
    assert "HF's eager modules and loss.py's head run instead" in caplog.text



def test_a_module_shaped_like_an_rms_norm_that_computes_something_else_stays_eager():
    """A mean-centred LayerNorm with `weight` and `variance_epsilon` (Cohere's) and a gated norm taking a second
    argument (Qwen3.5's linear layers' output norm) look like RMSNorms; binding either as one changes the model. Each
    class is checked against its own forward before it is bound."""
    class MeanCentred(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight, self.variance_epsilon = torch.nn.Parameter(torch.ones(16)), 1e-5

        def forward(self, x):
            x = x - x.mean(-1, keepdim=True)
            return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)

    class Gated(MeanCentred):
        def forward(self, x, gate):
            return reference.rms_norm(x, self.weight, self.variance_epsilon, False) * gate

    class Plain(MeanCentred):
        def forward(self, x):
            return reference.rms_norm(x, self.weight, self.variance_epsilon, False)
    model = torch.nn.ModuleDict(dict(a=MeanCentred(), b=Gated(), c=Plain()))
    report = apply_fused_kernels(model, "auto", torch.device("cpu"), provider=Provider(), projections=False)
    assert report.norms == 1 and report.skipped_norms == ["MeanCentred"]
    assert "forward" in model["c"].__dict__ and "forward" not in model["a"].__dict__ and "forward" not in model["b"].__dict__

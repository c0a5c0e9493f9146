"""The loss head's GPU paths against exact references, in bf16 on a CUDA SM90 GPU (skipped elsewhere; run on the
device with `bash scripts/bench/bench_gpu.sh gpu_tests`): kernels/cross_entropy.py's rows against the fp64 formula, and
the heads loss.py and model.loss_head=liger run against HF's cross_entropy(logits.float()). Tolerances as
tests/test_gpu_paths.py's (2e-2 relative on bf16 gradients) unless a test says otherwise.
"""
import pytest
import torch

import test_gpu_paths
from test_gpu_paths import TOL, _rel

pytestmark = test_gpu_paths.pytestmark  # the same SM90 skip


@pytest.mark.parametrize("head", ["triton", "torch", "liger"])
def test_fused_loss_head_in_bf16_against_hf_formula(head):
    """The loss head on CUDA, at Llama-3's vocabulary, against HF's cross_entropy(logits.float()) on the same bf16
    tensors. triton: ds_ulysses_ext.loss as it runs on CUDA, each chunk's rows in kernels/cross_entropy.py (its
    first-use check must pass); torch: the same head with torch's rows, whose log-softmax reads the bf16 logits
    (dtype=fp32). Both add the weight gradient into their fp32 buffer by cuBLAS (the fast path must be the one
    running here), at the auto chunk. liger: the head model.loss_head=liger runs (Liger's fused linear
    cross-entropy, fp32 accumulation), through its first-use check."""
    import torch.nn.functional as F

    from ds_ulysses_ext.batch import IGNORE_INDEX
    from ds_ulysses_ext.kernels import providers
    from ds_ulysses_ext.loss import _fp32_epilogue_works, _triton_rows, chunk_tokens, linear_cross_entropy_sum
    dev = torch.device("cuda", torch.cuda.current_device())
    kernel = None
    if head in ("triton", "torch"):
        assert _fp32_epilogue_works(dev, torch.bfloat16), "see the log line that says why"
        assert head == "torch" or _triton_rows(dev, torch.bfloat16), "see the log line that says why"
    elif not providers.liger_available():
        pytest.skip("Liger-Kernel is not installed")
    else:
        provider = providers.provider_for("liger", dev)
        assert provider.fused_head
        kernel = provider.linear_cross_entropy_sum
    gen = torch.Generator(device="cuda").manual_seed(0)
    V, H, T = 128256, 2048, 6000
    weight = (torch.randn(V, H, device="cuda", generator=gen) * 0.02).bfloat16().requires_grad_()
    hidden = torch.randn(1, T, H, device="cuda", generator=gen).bfloat16().requires_grad_()
    labels = torch.randint(0, V, (1, T), device="cuda", generator=gen)
    labels[0, :500] = IGNORE_INDEX
    ref = F.cross_entropy((hidden @ weight.t()).float().reshape(-1, V), labels.reshape(-1), ignore_index=IGNORE_INDEX,
                          reduction="sum")
    ref_grads = torch.autograd.grad(ref / 5500, [hidden, weight])
    got, count = linear_cross_entropy_sum(weight, hidden, labels, chunk_size=chunk_tokens(0, V), kernel=kernel,
                                          fused_rows=head != "torch")
    grads = torch.autograd.grad(got / 5500, [hidden, weight])
    assert count.item() == 5500
    assert _rel(got, ref) < 1e-5, _rel(got, ref)
    for g, r in zip(grads, ref_grads):
        assert g.dtype == torch.bfloat16 and _rel(g, r) < TOL, _rel(g, r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_rows_kernel_against_torch(dtype):
    """kernels/cross_entropy.py's rows at Qwen3's vocabulary (no multiple of its block), against the fp64 formula:
    the losses to 1e-5 and the gradient written over the logits to one rounding of its dtype; ignored rows give 0
    and a zero gradient, a label out of range a NaN loss (never a read out of bounds)."""
    from ds_ulysses_ext.batch import IGNORE_INDEX
    from ds_ulysses_ext.kernels.cross_entropy import cross_entropy_rows_
    gen = torch.Generator(device="cuda").manual_seed(0)
    V = 151936
    logits = (3 * torch.randn(64, V, device="cuda", generator=gen)).to(dtype)
    labels = torch.randint(0, V, (64,), device="cuda", generator=gen)
    labels[::9] = IGNORE_INDEX
    logp = torch.log_softmax(logits.double(), dim=-1)
    valid = labels != IGNORE_INDEX
    y = labels.clamp_min(0)
    ref_loss = torch.where(valid, -logp.gather(1, y[:, None]).squeeze(1), 0.0)
    ref_grad = logp.exp()
    ref_grad[torch.arange(64, device="cuda"), y] -= 1
    ref_grad *= valid[:, None]
    got = logits.clone()
    loss = cross_entropy_rows_(got, labels, IGNORE_INDEX, grad=True)
    assert loss.dtype == torch.float32 and _rel(loss, ref_loss) < 1e-5, _rel(loss, ref_loss)
    assert torch.all(loss[~valid] == 0) and torch.all(got[~valid] == 0)
    # elementwise: within one rounding of a 16-bit dtype; in fp32 within 1e-5 relative (Triton's exp and log are
    # the GPU's approximate ones: on the H200 an entry was 1.4e-7 over one fp32 ulp + 1e-7)
    rtol = max(torch.finfo(dtype).eps, 1e-5)
    assert torch.all((got.double() - ref_grad).abs() <= rtol * ref_grad.abs() + 1e-9), \
        float(((got.double() - ref_grad).abs() - rtol * ref_grad.abs()).max())
    assert torch.equal(cross_entropy_rows_(logits.clone(), labels, IGNORE_INDEX, grad=False), loss)
    bad = labels.clone()
    bad[1] = V
    assert cross_entropy_rows_(logits.clone(), bad, IGNORE_INDEX, grad=False)[1].isnan()


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_scaled_cast_kernel_equals_torch_bitwise(out_dtype):
    """kernels/scale_cast.py: the head's weight-gradient scale, fp32 product rounded once, as torch.mul's: bitwise."""
    from ds_ulysses_ext.kernels import scale_cast
    device = torch.device("cuda", torch.cuda.current_device())
    assert scale_cast.kernel_ok(device, torch.float32, out_dtype)
    x = torch.randn(128256 * 64 + 5, device=device)
    scale = torch.tensor(1 / 12345, device=device)
    got = scale_cast.scaled_into(x, scale, torch.empty(x.shape, dtype=out_dtype, device=device))
    assert torch.equal(got, torch.mul(x, scale, out=torch.empty_like(got)))

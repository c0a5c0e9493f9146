"""The projection groups (kernels/projections.py) on a CUDA SM90 GPU, in bf16 against fp32 linears (skipped elsewhere;
the CPU tests in tests/test_projections.py cover the binding, the replay's skip and every family in fp32)."""
import torch

import test_gpu_paths
from test_gpu_paths import _rel

pytestmark = test_gpu_paths.pytestmark  # the same SM90 skip


def test_projection_group_in_bf16_against_fp32():
    """kernels/projections.py on the GPU: q/k/v of the 1B shape's widths (2048 -> 2048, 512, 512), bf16 with the
    input gradient summed by cuBLAS's addmm, against fp32 linears; bf16 rounding bounds the error (rel 1e-2)."""
    import torch.nn.functional as F
    from ds_ulysses_ext.kernels.projections import _SharedInputLinears
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, 1024, 2048, generator=g, device="cuda")
    ws = [torch.randn(o, 2048, generator=g, device="cuda") / 45 for o in (2048, 512, 512)]
    dys = [torch.randn(1, 1024, o, generator=g, device="cuda") for o in (2048, 512, 512)]

    def grads(dtype, fused):
        xx = x.to(dtype).detach().requires_grad_(True)  # a fresh leaf per call (fp32's .to is the tensor itself)
        ww = [w.to(dtype).detach().requires_grad_(True) for w in ws]
        if fused:
            outs = _SharedInputLinears.apply(xx, (False, False, False), ww[0], None, ww[1], None, ww[2], None)
        else:
            outs = [F.linear(xx, w) for w in ww]
        sum((o.float() * d).sum() for o, d in zip(outs, dys)).backward()
        return [o.float() for o in outs] + [xx.grad.float()] + [w.grad.float() for w in ww]
    ref = grads(torch.float32, False)
    for got, want in zip(grads(torch.bfloat16, True), ref):
        assert _rel(got, want) < 1e-2, _rel(got, want)

"""flash_varlen.py's algebra on CPU: documents, windows and sinks through one kernel call, against masks.py's exact
torch path in fp64 (relative 1e-10: both are exact in fp64; the GPU run of the real kernel is tests/test_gpu_paths.py).

The real kernel (torch's varlen flash attention) runs only on CUDA, so a stand-in with its contract takes its
place: dense fp64 math over the flat token axis, whose backward, like the kernel's, takes the saved output and
log-sum-exp and derives its row term rowsum(dout * out) from the output it is handed. That last part is what the
sink trick relies on (flash_varlen passes the rescaled output), so a stand-in that ignored `out` could not test it.
"""
import pytest
import torch

from ds_ulysses_ext.attention import backends, flash_varlen
from ds_ulysses_ext.attention.masks import cu_seqlens_of, masked_attention


def _reach_as_flash_takes_it(causal, left, right, max_q, max_k):
    # what flash-attention 2's entry points make of the arguments before the kernel runs (its flash_api.cpp): a
    # reach of at least max_seqlen_k means unbounded (-1), causal sets the right reach to 0, and one unbounded
    # side next to a bounded one becomes max_seqlen_k. The stand-in applies the same, so a caller that relies on a
    # reach being kept as given (which it is not past max_seqlen_k) fails here too
    if max_q == 1:
        causal = False
    if causal:
        right = 0
    left = -1 if left >= max_k else left
    right = -1 if right >= max_k else right
    if left < 0 and right >= 0:
        left = max_k
    if left >= 0 and right < 0:
        right = max_k
    return causal, left, right


def _visible(cu_q, cu_k, causal, left, right):
    # [Tq Tk] bool: the same segment, and the kernel's reach around each query's aligned key (a segment's queries
    # aligned with its last keys: flash's bottom-right convention), causal meaning no key after it
    Tq, Tk = int(cu_q[-1]), int(cu_k[-1])
    seg_q = torch.searchsorted(cu_q[1:].long(), torch.arange(Tq), right=True)
    seg_k = torch.searchsorted(cu_k[1:].long(), torch.arange(Tk), right=True)
    # each query's aligned key index within the flat key axis: its segment's key end - (its segment's query end - i)
    aligned = cu_k[1:].long()[seg_q] - (cu_q[1:].long()[seg_q] - torch.arange(Tq))
    rel = aligned[:, None] - torch.arange(Tk)[None, :]  # > 0: the key is before the aligned one
    vis = seg_q[:, None] == seg_k[None, :]
    if causal:
        vis &= rel >= 0
    if left >= 0:
        vis &= rel <= left
    if right >= 0:
        vis &= -rel <= right
    return vis


class DenseStandIn:
    """flash_varlen.KERNEL's contract in dense fp64 math: [Tq h D] q, [Tk hkv D] k|v -> out [Tq h D], lse [h Tq]
    (a query that sees no key: out 0, lse +inf, as flash writes it)."""

    @staticmethod
    def _operands(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, left, right):
        causal, left, right = _reach_as_flash_takes_it(causal, left, right, max_q, max_k)
        h, hkv = q.shape[1], k.shape[1]
        kh, vh = (t.transpose(0, 1).repeat_interleave(h // hkv, 0) for t in (k, v))  # [h Tk D]
        logits = q.transpose(0, 1) @ kh.transpose(-1, -2) * scale  # [h Tq Tk]
        return kh, vh, logits.masked_fill(~_visible(cu_q, cu_k, causal, left, right), float("-inf"))

    @staticmethod
    def forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, left, right):
        for cu, m in ((cu_q, max_q), (cu_k, max_k)):  # an upper bound of the segments' lengths, as flash needs
            assert m >= int((cu[1:] - cu[:-1]).max()) and cu.dtype == torch.int32
        _, vh, logits = DenseStandIn._operands(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, left, right)
        lse = torch.logsumexp(logits, -1)  # [h Tq]
        out = torch.exp(logits - lse.masked_fill(torch.isinf(lse), 0)[..., None]) @ vh
        return out.transpose(0, 1), lse.masked_fill(torch.isinf(lse), float("inf")), ()

    @staticmethod
    def backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, left, right, state=None):
        h, hkv = q.shape[1], k.shape[1]
        kh, vh, logits = DenseStandIn._operands(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, left, right)
        p = torch.exp(logits - lse[..., None])  # [h Tq Tk]; a row with lse inf: 0
        do = dout.transpose(0, 1)  # [h Tq D]
        delta = (do * out.transpose(0, 1)).sum(-1, keepdim=True)  # from the output handed in, as the kernel does
        ds = p * (do @ vh.transpose(-1, -2) - delta)
        dq = (ds @ kh * scale).transpose(0, 1)

        def fold(g):  # [h Tk D] -> [Tk hkv D]
            return g.reshape(hkv, h // hkv, *g.shape[1:]).sum(1).transpose(0, 1)
        return dq, fold(ds.transpose(-1, -2) @ q.transpose(0, 1) * scale), fold(p.transpose(-1, -2) @ do)


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setattr(flash_varlen, "KERNEL", DenseStandIn)


CASES = [  # (documents, causal, window, sinks)
    (True, True, None, False),
    (False, True, 5, False),
    (False, True, 5, True),
    (True, True, 4, True),
    (True, False, None, True),
    (True, True, None, True),
]


@pytest.mark.parametrize("documents,causal,window,with_sinks", CASES)
def test_one_call_equals_the_torch_path(stand_in, documents, causal, window, with_sinks):
    g = torch.Generator().manual_seed(0)
    B, S, h, hkv, D = 2, 23, 4, 2, 8
    q, dout = (torch.randn(B, S, h, D, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(B, S, hkv, D, generator=g, dtype=torch.float64) for _ in range(2))
    sinks = torch.randn(h, generator=g, dtype=torch.float64) * 2
    cu = None
    if documents:  # lengths not aligned with anything; the second row's documents start where the first ends
        pos = torch.cat([torch.arange(n) for n in (7, 1, 15, 10, 13)]).reshape(B, S)
        cu = cu_seqlens_of(pos)
    results = []
    for run in (flash_varlen.varlen_attention, None):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        kw = dict(causal=causal, cu_seqlens=cu, window=window, sinks=leaves[3] if with_sinks else None)
        if run is None:
            out = masked_attention(*leaves[:3], **kw)
        else:
            out = run(*leaves[:3], scale=D ** -0.5, max_seqlen=None, **kw)
        out.backward(dout)
        results.append([out] + [t.grad for t in leaves[:3]] + ([leaves[3].grad] if with_sinks else []))
    for name, got, want in zip(("out", "dq", "dk", "dv", "dsinks"), *results):
        rel = ((got - want).norm() / want.norm()).item()
        assert rel < 1e-10, (name, rel)


def test_local_attention_takes_the_kernel_where_it_is_usable(stand_in, monkeypatch):
    # documents, a window or sinks go to the one-call kernel when usable; plain causal attention does not
    calls = []
    real = flash_varlen.varlen_attention
    monkeypatch.setattr(flash_varlen, "varlen_attention", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    q = torch.randn(1, 12, 2, 8, dtype=torch.float64)
    ref = masked_attention(q, q, q, causal=True, window=3)
    out = backends.local_attention("sdpa", q, q, q, causal=True, window=3)
    assert len(calls) == 1 and calls[0]["window"] == 3
    assert ((out - ref).norm() / ref.norm()).item() < 1e-10
    backends.local_attention("sdpa", q, q, q, causal=True)
    assert len(calls) == 1


def test_the_kernel_is_not_used_on_cpu():
    # the real kernel is CUDA-only: on CPU (and in fp32 anywhere) masks.py's exact path runs
    assert not flash_varlen.usable(torch.zeros(1, 4, 2, 8, dtype=torch.bfloat16))
    assert not flash_varlen.usable(torch.zeros(1, 4, 2, 8))


@pytest.mark.parametrize("context", ["checkpoint", "no_grad", "inference_mode"])
def test_first_use_checks_run_inside_a_checkpointed_layer_or_an_eval(stand_in, context):
    """Both first-use checks (this kernel's, the ring's fused block kernel's) run at a kernel's first call, inside
    a layer's forward: under activation checkpointing the recompute (which finds the check cached) must save what
    the forward saved, and under no_grad / inference mode (an eval first) the check must still pass, or the kernel
    would be left out for the whole run. Seen failing before kernel_check.isolated (a CheckpointError; False)."""
    import ds_ulysses_ext.attention.ring_blocks as blocks
    from torch.utils.checkpoint import checkpoint
    cpu = torch.device("cpu")
    checks = [lambda: flash_varlen._checked(cpu, torch.float32, 8),
              lambda: blocks._checked(blocks._CpuFlash, cpu, torch.float32, 8)]
    for check in checks:
        flash_varlen._checked.cache_clear()
        blocks._checked.cache_clear()
        x = torch.randn(4, 8, requires_grad=True)

        def layer(t):
            assert check() is True
            return (t.tanh() * t).sum()
        if context == "checkpoint":
            checkpoint(layer, x, use_reentrant=False).backward()
            assert x.grad is not None
        else:
            with torch.no_grad() if context == "no_grad" else torch.inference_mode():
                layer(x)
    flash_varlen._checked.cache_clear()
    blocks._checked.cache_clear()


def test_a_window_without_causality_is_refused_as_on_the_torch_path(stand_in):
    q = torch.randn(1, 6, 2, 8, dtype=torch.float64)
    for run in (lambda: masked_attention(q, q, q, causal=False, window=3),
                lambda: flash_varlen.varlen_attention(q, q, q, causal=False, scale=1.0, cu_seqlens=None,
                                                      max_seqlen=None, window=3, sinks=None)):
        with pytest.raises(ValueError, match="causal attention only"):
            run()

"""CP loss pieces: chunked logits+loss and the autograd CP-group sum, against single-process references."""
import pytest
import torch
import torch.nn.functional as F

from autograd_graph import graph_ops
from dist_harness import run_ranks
from ds_ulysses_ext import IGNORE_INDEX, chunked_lm_loss_sum, cp_sum, init_topology
from ds_ulysses_ext.loss import linear_cross_entropy_sum

RTOL = 1e-5


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("chunk", [1, 3, 7, 100])
def test_chunked_loss_equals_full_logits_loss(chunk):
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(2, 9, 16, requires_grad=True)
    labels = torch.randint(0, 50, (2, 9))
    labels[0, :5] = IGNORE_INDEX
    ref = F.cross_entropy(head(hidden).reshape(-1, 50), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
    ref_grads = torch.autograd.grad(ref, [hidden, head.weight])
    got, count = chunked_lm_loss_sum(head, hidden, labels, chunk_size=chunk)
    grads = torch.autograd.grad(got, [hidden, head.weight])
    assert count == 13
    assert _rel(got, ref) < RTOL
    for g, r in zip(grads, ref_grads):
        assert _rel(g, r) < RTOL


def test_the_chunk_loop_backward_joins_the_chunks_once():
    # chunks sliced out of the whole [T, H] hidden states (SliceBackward: a zero [T, H] tensor per chunk in backward)
    # would make the backward quadratic in T; split's backward joins the 6 chunks' gradients once
    head = torch.nn.Linear(16, 50, bias=True)  # a head the fused loss does not take: this loop runs
    got, _ = chunked_lm_loss_sum(head, torch.randn(2, 9, 16, requires_grad=True), torch.randint(0, 50, (2, 9)),
                                 chunk_size=3)
    ops = graph_ops(got)
    assert ops.count("SliceBackward0") == 0 and ops.count("SplitBackward0") == 1, sorted(ops)


@pytest.mark.parametrize("chunk", [1, 4, 100])
@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_fused_loss_equals_full_logits_loss_under_any_scale(chunk, scale):
    # the gradients are computed in forward; a factor applied afterwards must still reach all of them
    torch.manual_seed(1)
    weight = torch.randn(50, 16, requires_grad=True)
    hidden = torch.randn(2, 9, 16, requires_grad=True)
    labels = torch.randint(0, 50, (2, 9))
    labels[1, 2:] = IGNORE_INDEX
    ref = F.cross_entropy((hidden @ weight.t()).reshape(-1, 50), labels.reshape(-1), ignore_index=IGNORE_INDEX,
                          reduction="sum")
    ref_grads = torch.autograd.grad(ref * scale, [hidden, weight])
    got, count = linear_cross_entropy_sum(weight, hidden, labels, chunk_size=chunk)
    grads = torch.autograd.grad(got * scale, [hidden, weight])
    assert count == 11
    assert _rel(got, ref) < RTOL
    for g, r in zip(grads, ref_grads):
        assert _rel(g, r) < RTOL


def test_fused_loss_in_bf16_rounds_as_hf_does():
    # bf16 weights: logits rounded to bf16 by the lm_head matmul, then an fp32 log-softmax, as HF's
    # cross_entropy(logits.float()) does. So the loss agrees to fp32 summation order (logits kept in fp32 would be
    # ~1e-4 off). The gradients pass through bf16 matmuls (HF's in one, ours chunk by chunk with an fp32 sum),
    # hence bf16's tolerance for them
    torch.manual_seed(0)
    weight = (torch.randn(3000, 64) * 0.5).bfloat16().requires_grad_()
    hidden = torch.randn(1, 700, 64).bfloat16().requires_grad_()
    labels = torch.randint(0, 3000, (1, 700))
    labels[0, :100] = IGNORE_INDEX
    ref = F.cross_entropy((hidden @ weight.t()).float().reshape(-1, 3000), labels.reshape(-1),
                          ignore_index=IGNORE_INDEX, reduction="sum")
    ref_grads = torch.autograd.grad(ref, [hidden, weight])
    got, _ = linear_cross_entropy_sum(weight, hidden, labels, chunk_size=256)
    grads = torch.autograd.grad(got, [hidden, weight])
    assert _rel(got, ref) < 1e-6
    for g, r in zip(grads, ref_grads):
        assert g.dtype == r.dtype and _rel(g.float(), r.float()) < 1e-2


def test_fused_loss_backward_makes_no_fp32_weight_sized_temporary():
    """The head's backward scales its saved fp32 [V, H] weight gradient straight into the 16-bit result: no second
    fp32 [V, H] tensor (1.16 GiB at Qwen3's vocabulary), and the same values as scaling in fp32 then rounding; the
    hidden gradient is scaled by the fp32 loss gradient (0-dim), not by a bf16 copy of it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Outputs(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.seen.append((str(func), t.dtype, t.numel()))
            return out
    torch.manual_seed(0)
    V, H = 3000, 64
    weight = (torch.randn(V, H) * 0.5).bfloat16().requires_grad_()
    hidden = torch.randn(1, 700, H).bfloat16().requires_grad_()
    labels = torch.randint(0, V, (1, 700))
    got, count = linear_cross_entropy_sum(weight, hidden, labels, chunk_size=256)
    saved_h, saved_w = got.grad_fn.saved_tensors  # the forward's gradients: hidden [T, H] 16-bit, weight fp32
    scale = 1 / count.float()  # 1/700: not exact in bf16
    mode = Outputs()
    with mode:
        g_h, g_w = torch.autograd.grad(got * scale, [hidden, weight])
    fp32_weight_sized = [op for op, dtype, n in mode.seen if dtype == torch.float32 and n == V * H]
    assert fp32_weight_sized == [], fp32_weight_sized
    assert g_w.dtype == torch.bfloat16 and torch.equal(g_w, (saved_w * scale).bfloat16())
    assert torch.equal(g_h.reshape(saved_h.shape), (saved_h.float() * scale).bfloat16())


def test_the_head_asks_for_the_triton_rows_unless_told_not_to(monkeypatch):
    """CPCausalLM's head consults loss._triton_rows (the CUDA kernel's gate) for each chunk, and with fused_rows=False
    (model.kernels=none: the eager reference) never does; the loss is the same either way on CPU."""
    from ds_ulysses_ext import CPCausalLM, init_topology, shard_batch
    from ds_ulysses_ext import loss as loss_mod
    from tiny_models import tiny_model
    asked = []
    monkeypatch.setattr(loss_mod, "_triton_rows", lambda device, dtype: asked.append(device) and False)
    topo = init_topology(1)
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(0))
    local = shard_batch({"input_ids": ids, "labels": ids.clone()}, topo)
    torch.manual_seed(0)
    hf = tiny_model("llama", num_hidden_layers=1)
    with_rows = CPCausalLM(hf, loss_chunk_size=5)(**local)[0]
    assert len(asked) == 3  # 12 tokens, chunks of 5 (the last label is shifted out but its row still runs)
    asked.clear()
    without = CPCausalLM(hf, loss_chunk_size=5, fused_rows=False)(**local)[0]
    assert asked == [] and torch.equal(with_rows, without)


def test_chunk_sized_to_the_vocabulary():
    from ds_ulysses_ext.loss import chunk_tokens
    # fp32 [C, V] block at most 1 GiB, C a power of two up to 4096: 2^30 / (4 * V) is 2093, 1766 and 8388 tokens
    assert chunk_tokens(0, 128256) == 2048  # Llama-3
    assert chunk_tokens(0, 151936) == 1024  # Qwen3
    assert chunk_tokens(0, 32000) == 4096  # capped
    assert chunk_tokens(0, 10**8) == 256  # floor
    assert chunk_tokens(7, 128256) == 7  # asked for


def test_fused_loss_without_grad_and_with_a_frozen_head():
    weight = torch.randn(7, 4)  # frozen (LoRA-style): only the hidden states get a gradient
    hidden = torch.randn(1, 5, 4, requires_grad=True)
    labels = torch.tensor([[1, 2, IGNORE_INDEX, 3, 6]])
    got, _ = linear_cross_entropy_sum(weight, hidden, labels, chunk_size=2)
    got.backward()
    ref_hidden = hidden.detach().clone().requires_grad_()
    F.cross_entropy(ref_hidden[0] @ weight.t(), labels[0], ignore_index=IGNORE_INDEX, reduction="sum").backward()
    assert _rel(hidden.grad, ref_hidden.grad) < RTOL
    with torch.no_grad():
        assert _rel(linear_cross_entropy_sum(weight, hidden, labels, chunk_size=3)[0], got.detach()) < RTOL
    total, count = linear_cross_entropy_sum(weight, hidden, torch.full((1, 5), IGNORE_INDEX), chunk_size=2)
    assert count == 0 and total.item() == 0.0


def test_fused_loss_under_no_grad_builds_no_gradients(monkeypatch):
    # evaluation runs the fused head under no_grad: the loss alone, not the chunk gradients it saves for training
    from ds_ulysses_ext import loss as loss_mod
    seen = []
    forward = loss_mod._LinearCrossEntropySum.forward
    monkeypatch.setattr(loss_mod._LinearCrossEntropySum, "forward",
                        staticmethod(lambda ctx, *a: seen.append(tuple(ctx.needs_input_grad[:2])) or forward(ctx, *a)))
    weight = torch.randn(7, 4, requires_grad=True)
    hidden = torch.randn(1, 5, 4, requires_grad=True)
    labels = torch.tensor([[1, 2, IGNORE_INDEX, 3, 6]])
    with torch.no_grad():
        got, _ = linear_cross_entropy_sum(weight, hidden, labels, chunk_size=2)
    ref = F.cross_entropy(hidden[0] @ weight.t(), labels[0], ignore_index=IGNORE_INDEX, reduction="sum")
    assert seen == [(False, False)] and _rel(got, ref.detach()) < RTOL


def test_fully_masked_chunk_gives_zero_not_nan():
    head = torch.nn.Linear(4, 5)
    total, count = chunked_lm_loss_sum(head, torch.randn(1, 3, 4), torch.full((1, 3), IGNORE_INDEX), chunk_size=2)
    assert count == 0 and total.item() == 0.0


def _seq_objective(per_token_logp_BS):
    # a sequence-level, non-linear objective (GRPO/DPO-like): sum over sequences of logp_seq^2
    return (per_token_logp_BS.sum(dim=1) ** 2).sum()


def _check_cp_sum(rank, world):
    topo = init_topology(world)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4 * world, generator=g, dtype=torch.float64).float()
    full = x.clone().requires_grad_()
    ref = _seq_objective(full)
    ref.backward()
    s = x.shape[1] // world
    local = x[:, rank * s:(rank + 1) * s].clone().requires_grad_()
    seq_sum = cp_sum(local.sum(dim=1), topo)                     # every rank: the full-sequence sums
    objective = (seq_sum ** 2).sum()
    assert _rel(objective.detach(), ref.detach()) < RTOL
    (objective / world).backward()                               # each rank backprops an equal share
    assert _rel(local.grad, full.grad[:, rank * s:(rank + 1) * s]) < RTOL


@pytest.mark.parametrize("world", [2, 4])
def test_cp_sum_gives_the_unsplit_gradient(world):
    run_ranks(_check_cp_sum, world)

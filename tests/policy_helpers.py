"""Shared by the memory-policy tests: a tiny CP-enabled Llama, its batch, one step, and byte counting."""
import torch

from ds_ulysses_ext import CPCausalLM, enable_context_parallel
from tiny_models import tiny_model

RTOL = 1e-5  # fp32; tiling only reorders the weight-gradient sums (observed ~3e-7)
LAYERS = 4


def _batch(seq_len=13):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 96, (2, seq_len), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100
    labels[1, seq_len // 2] = -100
    return ids, labels


def _lm(topo):
    hf = enable_context_parallel(tiny_model("llama", num_hidden_layers=LAYERS), topo, backend="sdpa")
    return CPCausalLM(hf, loss_chunk_size=5)


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _run(lm, local, normaliser=None):
    lm.zero_grad(set_to_none=True)
    loss_sum, count = lm(**local)
    loss = loss_sum / (count if normaliser is None else normaliser)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in lm.named_parameters()}


def _assert_close_dicts(got, want, what):
    for n, t in got.items():
        assert _rel(t, want[n]) < RTOL, (*what, n, _rel(t, want[n]))


_PACK = []  # the active _saved_bytes pack function, so tensors kept outside the checkpoint count as well


def _count_kept(t):
    return _PACK[-1](t) if _PACK else t


def _saved_bytes(lm, local, also=None):
    """Bytes of distinct storages the autograd graph keeps after forward (parameters excluded).

    also(pack): called after forward, to pass more kept tensors to the same count."""
    storages = {}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
        return t

    _PACK.append(pack)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss_sum, _ = lm(**local)
    finally:
        _PACK.pop()
    if also is not None:
        also(pack)
    loss_sum.backward()
    return sum(storages.values())

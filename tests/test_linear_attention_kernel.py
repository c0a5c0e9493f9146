"""model.linear_attn_kernel (ds_ulysses_ext/linear_attention/fla_kernels.py) on CPU: the key's refusals, auto = the
torch path here (bit for bit), the cu_seqlens handed to fla, the layer's fla branch through an injected kernel, and
the first-use check stopping a wrong kernel (forward, or backward only). tests/test_gpu_linear_attention.py runs fla
itself on a GPU.
"""
import logging

import pytest
import torch

from cp_reference import cp_loss_and_grads, rel
from test_packing import DOCS, packed_batch
from tiny_models import tiny_model
from configs import ConfigError, compose_config, validate
from ds_ulysses_ext import Topology, UnsupportedError, enable_context_parallel
from ds_ulysses_ext.attention.masks import cu_seqlens_of
from ds_ulysses_ext.linear_attention import linear_mixers as fla_linear_mixers, set_linear_attn_kernel
from ds_ulysses_ext.linear_attention import fla_kernels
from ds_ulysses_ext.linear_attention.delta_rule import recurrent_delta_rule
from ds_ulysses_ext.linear_attention.fla_kernels import check_cut, check_kernel, kernel_cu_seqlens, resolve

ONE = Topology(1, 0, 1, 1)


# --- the key at config time ---------------------------------------------------------------------------------------

def test_fla_on_cpu_is_refused_with_the_fix():
    cfg = compose_config(["model=tiny_qwen3_5", "model.linear_attn_kernel=fla", "device=cpu"])
    with pytest.raises(ConfigError, match=r"model\.linear_attn_kernel=fla .*CUDA only.*set "
                                          r"model\.linear_attn_kernel=torch"):
        validate(cfg, world_size=2)


def test_fla_without_the_package_is_refused_with_the_fix(monkeypatch):
    import configs.linear_attention as rules
    monkeypatch.setattr(rules, "fla_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine without fla
    cfg = compose_config(["model=tiny_qwen3_5", "model.linear_attn_kernel=fla"])
    with pytest.raises(ConfigError, match=r"model\.linear_attn_kernel=fla needs flash-linear-attention.*"
                                          r"fla-core==0\.6\.0.*set model\.linear_attn_kernel=torch"):
        validate(cfg, world_size=2)


@pytest.mark.parametrize("value", ["torch", "fla"])
def test_set_on_a_model_without_linear_layers_is_refused(value):
    cfg = compose_config([f"model.linear_attn_kernel={value}"])  # model=tiny: a Llama
    with pytest.raises(ConfigError, match=rf"^model\.linear_attn_kernel={value} is read only with model\.family in "
                                          r"\{qwen3_5_text, .*bailing_hybrid\}.*drop the override"):
        validate(cfg, world_size=2)


def test_values_on_a_hybrid_model():
    for value in ("auto", "torch"):
        assert validate(compose_config(["model=tiny_qwen3_5", f"model.linear_attn_kernel={value}"]), 2).unread == ()
    with pytest.raises(ConfigError, match=r"model\.linear_attn_kernel=triton is not one of \{auto, fla, torch\}"):
        validate(compose_config(["model=tiny_qwen3_5", "model.linear_attn_kernel=triton"]), world_size=2)


# --- resolution and the run on CPU --------------------------------------------------------------------------------

def test_resolution_on_cpu():
    cpu = torch.device("cpu")
    assert resolve("auto", cpu, torch.bfloat16)[0] is False
    assert resolve("torch", cpu, torch.bfloat16)[0] is False
    with pytest.raises(UnsupportedError, match=r"linear_attn_kernel=fla needs CUDA.*linear_attn_kernel=torch"):
        resolve("fla", cpu, torch.bfloat16)


def _packed_run(kernel=None, fla_kernel=None, family="qwen3_5_text"):
    model = enable_context_parallel(tiny_model(family), ONE, backend="sdpa")
    if kernel is not None:
        assert set_linear_attn_kernel(model, kernel, fla_kernel) == 2  # layers linear, full, linear
    return cp_loss_and_grads(model, ONE, packed_batch())


def test_auto_is_the_torch_path_on_cpu(caplog):
    """The default (auto, through enable_context_parallel) and model.linear_attn_kernel=torch: the same loss and
    gradients, bit for bit, on packed rows; the log says which path runs and why."""
    with caplog.at_level(logging.INFO, logger=fla_kernels.__name__):
        loss, grads = _packed_run()
    assert "linear attention: the torch delta rule (model.linear_attn_kernel=auto on cpu" in caplog.text
    ref_loss, ref_grads = _packed_run("torch")
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(g, ref_grads[n]) for n, g in grads.items())


def test_fla_asked_for_on_cpu_through_the_python_api_is_refused():
    with pytest.raises(UnsupportedError, match=r"model\.linear_attn_kernel=fla needs CUDA"):
        _packed_run("fla")


def test_a_model_without_linear_layers_takes_auto_only():
    model = enable_context_parallel(tiny_model("llama"), ONE, backend="sdpa")
    assert set_linear_attn_kernel(model, "auto") == 0
    with pytest.raises(UnsupportedError, match=r"linear_attn_kernel=torch: .* no linear-attention layers"):
        set_linear_attn_kernel(model, "torch")


# --- the cu_seqlens fla gets --------------------------------------------------------------------------------------

def test_kernel_cu_seqlens_are_the_document_starts():
    pos = packed_batch()["position_ids"]
    B, S = pos.shape
    device, host = kernel_cu_seqlens(cu_seqlens_of(pos), B, S, torch.device("cpu"))
    starts = [row * S + sum(lengths[:i]) for row, lengths in enumerate(DOCS) for i in range(len(lengths))]
    assert host.tolist() == starts + [B * S] and host.dtype == torch.long and torch.equal(device, host)
    # no documents: one per row; an empty document has no start of its own
    assert kernel_cu_seqlens(None, 2, 13, "cpu")[1].tolist() == [0, 13, 26]
    assert kernel_cu_seqlens(torch.tensor([0, 5, 5, 13], dtype=torch.int32), 1, 13, "cpu")[1].tolist() == [0, 5, 13]
    with pytest.raises(ValueError, match="cu_seqlens must run from 0"):
        kernel_cu_seqlens(torch.tensor([0, 5, 12], dtype=torch.int32), 1, 13, "cpu")


def test_the_check_cut_keeps_a_document_start():
    """A first document longer than the cut: a window around the next start is added, and its starts are the cut's."""
    idx, starts = check_cut(torch.tensor([0, 1000, 1500, 2000]), 2000)
    assert idx.tolist() == list(range(320)) + list(range(904, 1096))
    assert starts.tolist() == [0, 320, 416, 512]
    idx, starts = check_cut(torch.tensor([0, 40, 100, 200]), 200)  # short documents: the whole batch
    assert idx.tolist() == list(range(200)) and starts.tolist() == [0, 40, 100, 200]


# --- the layer's fla branch and the first-use check, with injected kernels ------------------------------------------

# The gated DeltaNet's per-head decay parameters: each gradient is 4 numbers (one per head here), a sum over every
# token with terms of both signs, so it is small against its terms. The same fp32 rounding of a reordered sum is
# then a larger share of it: 1.26e-5 relative for dt_bias on an AVX-512 machine (2026-12-06) where the other
# parameters stayed under 4e-6. They get 10x the others' bound (still 10x under a 1e-3 error).
PER_HEAD_DECAY = ("dt_bias", "A_log")


def _grad_bound(name: str, bound: float) -> float:
    return 10 * bound if name.endswith(PER_HEAD_DECAY) else bound


def _per_document_recurrence(q, k, v, g, beta, cu, cu_host):
    """A stand-in for fla: the token-by-token definition (delta_rule.py) on each document of the flat batch."""
    b = cu_host.tolist()
    return torch.cat([recurrent_delta_rule(*(t[:, x:y] for t in (q, k, v, g, beta))) for x, y in zip(b, b[1:])],
                     dim=1).to(v.dtype)


def _ignores_documents(q, k, v, g, beta, cu, cu_host):
    return recurrent_delta_rule(q, k, v, g, beta).to(v.dtype)  # the state runs on across document starts


class _WrongBackward(torch.autograd.Function):
    """The right output; beta's gradient 1.5x what it is."""

    @staticmethod
    def forward(ctx, beta):
        return beta.view_as(beta)

    @staticmethod
    def backward(ctx, grad):
        return 1.5 * grad


def _wrong_backward(q, k, v, g, beta, cu, cu_host):
    return _per_document_recurrence(q, k, v, g, _WrongBackward.apply(beta), cu, cu_host)


@pytest.mark.parametrize("family", ["qwen3_5_text", "bailing_hybrid"])
def test_the_fla_branch_with_a_right_kernel_matches_the_torch_path(family):
    """The layer's fla branch (conv per document row, one flat call with the document starts), the kernel swapped for
    the recurrence on each document: loss and gradients equal the torch path's to fp32 rounding."""
    calls = []

    def kernel_for(kind):
        assert kind == ("kda" if family == "bailing_hybrid" else "gated_deltanet")
        return lambda *a: calls.append(a[5].tolist()) or _per_document_recurrence(*a)
    loss, grads = _packed_run("fla", kernel_for, family)
    ref_loss, ref_grads = _packed_run("torch", family=family)
    starts = [row * 13 + sum(lengths[:i]) for row, lengths in enumerate(DOCS) for i in range(len(lengths))] + [26]
    assert calls and calls[-1] == starts  # the run's own call; the check's cut (the whole 26 tokens here) first
    assert rel(loss, ref_loss) < 1e-6
    for name, g in grads.items():
        assert rel(g, ref_grads[name]) < _grad_bound(name, 1e-5), name


@pytest.mark.parametrize("wrong,what", [(_ignores_documents, "output"), (_wrong_backward, "beta's gradient")])
def test_the_first_use_check_stops_a_wrong_kernel(wrong, what):
    with pytest.raises(RuntimeError, match=rf"disagrees with the torch delta rule.*; {what}: .*set "
                                           r"model\.linear_attn_kernel=torch"):
        _packed_run("fla", lambda kind: wrong)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_check_on_its_own(dtype):
    """Random inputs over two documents in fp32 and bf16: the right kernel passes, one that carries the state over the
    document start does not."""
    g = torch.Generator().manual_seed(0)
    T, h, dk, dv = 150, 2, 16, 8
    q, k = (torch.randn(1, T, h, dk, generator=g).to(dtype) for _ in range(2))
    v = torch.randn(1, T, h, dv, generator=g).to(dtype)
    decay = -torch.rand(1, T, h, generator=g) * 0.1  # gated DeltaNet: fp32 decay, slow: the state lives long
    beta = torch.rand(1, T, h, generator=g).to(dtype)
    cu = torch.tensor([0, 70, T])
    check_kernel("gated_deltanet", _per_document_recurrence, q, k, v, decay, beta, cu)
    with pytest.raises(RuntimeError, match="output: relative error"):
        check_kernel("gated_deltanet", _ignores_documents, q, k, v, decay, beta, cu)


def _cannot_run(*args):
    raise RuntimeError("Triton refuses this GPU")  # as fla 0.6 refuses its gated backward on Hopper, Triton < 3.7.1


def test_a_kernel_that_cannot_run_leaves_auto_on_torch_and_stops_fla(caplog):
    """auto: the torch path and a warning that says why; fla by name: an error naming the fix. The call whose check
    failed runs the delta rule on the conv's output gathered back to tokens, so its gradients sum in another order
    (fp32 rounding); the layers after it run the torch path itself."""
    with caplog.at_level(logging.WARNING, logger=fla_kernels.__name__):
        loss, grads = _packed_run("auto", lambda kind: _cannot_run)
    assert "the torch delta rule (model.linear_attn_kernel=auto: fla's gated_deltanet kernel fails" in caplog.text
    ref_loss, ref_grads = _packed_run("torch")
    assert rel(loss, ref_loss) < 1e-7 and all(rel(g, ref_grads[n]) < _grad_bound(n, 1e-6) for n, g in grads.items())
    with pytest.raises(RuntimeError, match=r"fails on the run's input .*Triton refuses this GPU.*set "
                                           r"model\.linear_attn_kernel=torch"):
        _packed_run("fla", lambda kind: _cannot_run)


# --- the key through the engine's build -----------------------------------------------------------------------------

def test_the_key_reaches_every_linear_layer_of_a_run(tmp_path, monkeypatch):
    """scripts/train.py at world 1 on tiny_qwen3_5: engine/ds/build.py hands model.linear_attn_kernel to every bound
    linear layer (a key validate accepts and the build drops would be a silent no-op). The forked rank inherits the
    recorder and writes what the model held after the call."""
    import engine.ds.build as build
    from test_engine import train
    record = tmp_path / "kernels.txt"
    real = build.set_linear_attn_kernel

    def recorded(hf, kernel, *args):
        count = real(hf, kernel, *args)
        held = {m.__dict__["_cp_linear"].kernel.choice for m in fla_linear_mixers(hf).values()}
        record.write_text(f"{kernel} {count} {sorted(held)}")
        return count

    monkeypatch.setattr(build, "set_linear_attn_kernel", recorded)
    train(tmp_path, "run", 1, ["model=tiny_qwen3_5", "model.linear_attn_kernel=torch", "trainer.max_steps=1",
                                  "parallelism.cp=1"])
    kernel, count, held = record.read_text().split(" ", 2)
    assert kernel == "torch" and int(count) > 0 and held == "['torch']", record.read_text()

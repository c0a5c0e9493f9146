"""DeepEP is an optional GPU extra: without the package or without CUDA every DeepEP path is refused loudly, with
the fix, before anything runs; the module imports without deep_ep; the low-latency dispatcher's shape limits are
refused before any kernel; at ep=1 the low-latency dispatcher's slot matching and autograd equal the all-to-all's
against a stand-in Buffer. (On an H200 the real kernels gave bitwise-equal outputs and gradients: docs/benchmarks.md
section L.)"""
import importlib.util
import subprocess
import sys

import pytest
import torch

from configs import ConfigError, compose_config, validate
from ds_ulysses_ext.errors import UnsupportedError
from ds_ulysses_ext.moe import deepep
from ds_ulysses_ext.moe.parallel import MoESettings, enable_expert_parallel
from ds_ulysses_ext.topology import Topology

MOE = ["model=tiny_moe", "trainer.global_batch_size=8", "moe.dispatcher=deepep"]


@pytest.fixture
def fake_cuda_no_package(monkeypatch):
    """A machine with CUDA where `import deep_ep` fails (sys.modules[name] = None makes import raise)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "deep_ep", None)


@pytest.fixture
def fake_package(monkeypatch):
    """validate() only asks whether the package is findable: pretend it is."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "deep_ep" else real(name, *a))


def test_module_imports_without_deep_ep():
    code = ("import sys; sys.modules['deep_ep'] = None\n"
            "import ds_ulysses_ext.moe.deepep, ds_ulysses_ext.moe.parallel\n"
            "print('deep_ep' in sys.modules and sys.modules['deep_ep'] is not None)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_validate_refuses_deepep_without_package_or_cuda(fake_package, device, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # device=auto resolves to the CPU, also on a GPU
    with pytest.raises(ConfigError, match=rf"moe.dispatcher=deepep needs CUDA.*\(device={device}\); use moe.dispatcher=alltoall"):
        validate(compose_config(MOE + ["parallelism.ep=2", f"device={device}"]), world_size=2)


LL = MOE + ["parallelism.ep=1", "parallelism.cp=2", "device=cuda", "precision=bf16", "data.seq_len=120",
            "trainer.micro_batch_size=2", "model.arch.hidden_size=2048"]


def test_deepep_at_ep_1_is_the_low_latency_mode_and_its_limits_are_refused_before_the_build(fake_package):
    validate(compose_config(LL), world_size=2)  # 2 rows x 60 local tokens: inside the buffer
    with pytest.raises(ConfigError, match=r"low-latency mode\) moves bf16 tokens only; set precision=bf16"):
        validate(compose_config(LL + ["precision=fp32"]), world_size=2)
    with pytest.raises(ConfigError, match=r"1028 tokens per rank.*exceed DeepEP's low-latency buffer.*not long "
                                          r"context.*larger parallelism.cp"):
        validate(compose_config(LL + ["data.seq_len=1028"]), world_size=2)
    with pytest.raises(ConfigError, match=r"token widths .* only \(got 64\)"):
        validate(compose_config(LL + ["model.arch.hidden_size=64"]), world_size=2)
    with pytest.raises(ConfigError, match=r"parallelism.ep=3: DeepEP's normal mode runs on 2, 4 or 8 ranks of one "
                                          r"node, its low-latency mode here at ep=1"):
        validate(compose_config(LL + ["parallelism.ep=3", "parallelism.cp=1", "model.arch.num_experts=6"]),
                 world_size=3)


def test_deepep_tokens_per_rank_bounds_every_layout_s_local_rows():
    from configs.moe import deepep_tokens_per_rank
    # seq 100 at cp 2: Ulysses pads to 100 (50 a rank), the zigzag layout to 4 chunks of 25 -> 50; x 3 rows = 150,
    # and DeepEP wants a multiple of 4
    cfg = compose_config(MOE + ["data.seq_len=100", "parallelism.cp=2", "trainer.micro_batch_size=3"])
    assert deepep_tokens_per_rank(cfg) == 152
    # seq 30 at cp 4: zigzag pads to 32 (8 chunks of 4): 8 a rank
    cfg = compose_config(MOE + ["data.seq_len=30", "parallelism.cp=4", "trainer.micro_batch_size=1"])
    assert deepep_tokens_per_rank(cfg) == 8


class _StandInBuffer:
    """DeepEP V1's low-latency Buffer as its API documents it, at one rank, in torch: dispatch puts each expert's
    tokens in the first count[e] rows of its [M * R, H] block in a RANDOM order (the kernels' atomics), with garbage
    in the rest; src_info names each row's source token; layout_range packs (rows from rank r, first row) per rank;
    combine sums w[t, j] * x[e, row of t] over the k choices (-1: skipped). Not DeepEP's code: a model of its contract,
    so the suite checks our slot matching and autograd; the real kernels were checked on an H200 (section L)."""

    @staticmethod
    def get_low_latency_rdma_size_hint(M, H, R, E):
        return 0

    def __init__(self, group, nvl_bytes, rdma_bytes, low_latency_mode=False, num_qps_per_rank=1,
                 explicitly_destroy=False):
        assert low_latency_mode and explicitly_destroy

    def low_latency_dispatch(self, x, idx, M, E, use_fp8=True):
        assert not use_fp8 and x.dtype == torch.bfloat16 and x.shape[0] <= M
        recv = torch.randn(E, M, x.shape[1]).to(torch.bfloat16)
        src = torch.randint(0, 99, (E, M), dtype=torch.int32)
        count = torch.zeros(E, dtype=torch.int32)
        for e in range(E):
            toks = (idx == e).any(1).nonzero().view(-1)
            toks = toks[torch.randperm(toks.numel())]
            count[e] = toks.numel()
            recv[e, :toks.numel()] = x[toks]
            src[e, :toks.numel()] = toks.int()
        layout = count.long().view(E, 1)  # rank 0's rows start at row 0
        return recv, count, (src, layout, M), None, None

    def low_latency_combine(self, x, idx, w, handle):
        src, layout, M = handle
        out = torch.zeros(idx.shape[0], x.shape[-1])
        for t, j in (idx >= 0).nonzero().tolist():
            e = int(idx[t, j])
            row = int(((src[e] == t) & (torch.arange(M) < layout[e, 0])).nonzero().view(-1)[0])
            out[t] += w[t, j] * x[e, row].float()
        return out.to(torch.bfloat16), None, None

    def destroy(self):
        pass


def _ll_against_all_to_all(rank, world):
    import types
    from ds_ulysses_ext.moe.dispatch import AllToAllDispatcher
    from ds_ulysses_ext.moe.layer import MoEBlock, MoEContext, MoESpec
    sys.modules["deep_ep"] = types.SimpleNamespace(Buffer=_StandInBuffer)
    torch.cuda.is_available = lambda: True

    def run(block, disp, x, g):
        block._ctx[0] = MoEContext(dispatcher=disp, balance="none")
        block.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_()
        (block(xx).float() * g.float()).sum().backward()
        return [xx.grad] + [p.grad for p in block.parameters()], block(x)

    T, H, E, k = 12, 2048, 8, 3
    torch.manual_seed(0)
    block = MoEBlock(MoESpec(hidden_size=H, num_experts=E, top_k=k, intermediate_size=16)).to(torch.bfloat16)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    x, g = (torch.randn(1, T, H).to(torch.bfloat16) for _ in range(2))
    ref_grads, ref_out = run(block, AllToAllDispatcher(E), x, g)
    ll = deepep.DeepEPLowLatencyDispatcher(E, H, None, max_tokens_per_rank=T)
    got_grads, got_out = run(block, ll, x, g)
    assert torch.equal(got_out, ref_out)
    assert len(got_grads) == len(ref_grads) >= 4
    for a, b in zip(got_grads, ref_grads):
        assert torch.equal(a, b)
    with pytest.raises(UnsupportedError, match=r"13 tokens on this rank exceed DeepEP's low-latency buffer"):
        block(torch.randn(1, T + 1, H).to(torch.bfloat16))


def test_low_latency_dispatcher_equals_the_all_to_all_against_a_stand_in_buffer():
    from dist_harness import run_ranks
    run_ranks(_ll_against_all_to_all, 1)


def test_deepep_at_ep_1_needs_the_buffer_size(monkeypatch):
    import types
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "deep_ep", types.SimpleNamespace(Buffer=_StandInBuffer))
    topo = Topology(world_size=1, rank=0, cp_size=1, dp_size=1)
    with pytest.raises(UnsupportedError, match=r"sized up front: set MoESettings.max_tokens_per_rank"):
        enable_expert_parallel(_tiny_qwen3_moe(), topo, MoESettings(dispatcher="deepep"))


def test_validate_refuses_deepep_without_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_ep", None)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deep_ep" else real(name, *a))
    with pytest.raises(ConfigError, match=r"needs the optional deep_ep package.*use moe.dispatcher=alltoall"):
        validate(compose_config(MOE + ["parallelism.ep=2", "device=cuda"]), world_size=2)


def _tiny_qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    cfg = Qwen3MoeConfig(vocab_size=32, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[])
    return Qwen3MoeForCausalLM(cfg)


def test_enable_expert_parallel_refuses_deepep_on_cpu():
    topo = Topology(world_size=1, rank=0, cp_size=1, dp_size=1)
    with pytest.raises(UnsupportedError, match=r"moe.dispatcher=deepep: no CUDA device; use moe.dispatcher=alltoall"):
        enable_expert_parallel(_tiny_qwen3_moe(), topo, MoESettings(dispatcher="deepep"))


def test_enable_expert_parallel_refuses_deepep_without_package(fake_cuda_no_package):
    topo = Topology(world_size=2, rank=0, cp_size=1, dp_size=2, ep_size=2)
    with pytest.raises(UnsupportedError, match=r"deep_ep package does not import.*use moe.dispatcher=alltoall"):
        enable_expert_parallel(_tiny_qwen3_moe(), topo, MoESettings(dispatcher="deepep"))


def test_low_latency_dispatcher_refused_without_cuda_or_package(monkeypatch):
    with pytest.raises(UnsupportedError, match=r"low-latency dispatcher: no CUDA device; use moe.dispatcher=alltoall"):
        deepep.DeepEPLowLatencyDispatcher(8, 2048)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "deep_ep", None)
    with pytest.raises(UnsupportedError, match=r"deep_ep package does not import"):
        deepep.DeepEPLowLatencyDispatcher(8, 2048)


@pytest.mark.parametrize("kw,match", [
    (dict(num_tokens=129), r"129 tokens on this rank exceed DeepEP's low-latency buffer \(128 tokens per rank; at "
                           r"most 511\).*not long context.*moe.dispatcher=alltoall"),
    (dict(hidden=1024), r"token widths .* only \(got 1024\)"),
    (dict(top_k=12), r"top-k <= 11 \(got 12\)"),
    (dict(dtype=torch.float32), r"bf16 tokens only \(got torch.float32\)"),
    (dict(max_tokens_per_rank=512, num_tokens=1), r"max_tokens_per_rank=512: .* <= 511"),
    (dict(max_tokens_per_rank=2, num_tokens=1), r"multiple of 4"),
])
def test_low_latency_shape_refusals(kw, match):
    args = dict(num_tokens=128, hidden=2048, top_k=8, num_experts=128, ep=1, max_tokens_per_rank=128,
                dtype=torch.bfloat16)
    deepep.check_low_latency(**args)  # the Qwen3-30B-A3B-like shape at its limit passes
    with pytest.raises(UnsupportedError, match=match):
        deepep.check_low_latency(**{**args, **kw})

"""DeepEP is an optional GPU extra: without the package or without CUDA every DeepEP path is refused loudly, with
the fix, before anything runs; the module imports without deep_ep; the low-latency dispatcher's shape limits are
refused before any kernel. (Its numbers against the all-to-all on a GPU are docs/benchmarks.md section L.)"""
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


def test_validate_refuses_deepep_without_package_or_cuda(fake_package):
    with pytest.raises(ConfigError, match=r"moe.dispatcher=deepep needs CUDA; use moe.dispatcher=alltoall"):
        validate(compose_config(MOE + ["parallelism.ep=2", "device=cpu"]), world_size=2)
    with pytest.raises(ConfigError, match=r"parallelism.ep=1: DeepEP's normal mode runs on 2, 4 or 8 ranks"):
        validate(compose_config(MOE + ["parallelism.ep=1", "parallelism.cp=1", "device=cuda"]), world_size=1)


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

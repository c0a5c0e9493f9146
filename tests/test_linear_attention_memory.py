"""Memory policies on hybrid linear-attention models (issue 40): the planner's model of a linear layer against what
autograd saves, memory=auto and scripts/plan.py on them, memory.recompute=except_attention keeping the linear layers'
cores (cp 1 and 2), and model.kernels leaving the gated output norms eager. All on CPU, fp32 where loss and gradients
are compared (relative 1e-5)."""
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from configs import compose_config, validate
from cp_check import RTOL, rel
from cp_reference import cp_loss_and_grads
from dist_harness import run_ranks
from test_linear_attention_cp import _batch as cp_batch
from ds_ulysses_ext import enable_context_parallel, init_topology
from ds_ulysses_ext.kernels.bind import apply_fused_kernels
from ds_ulysses_ext.kernels.providers import Provider
from ds_ulysses_ext.memory import ExceptAttentionRecompute
from ds_ulysses_ext.memory.planner import (Policy, RunShape, _layer_bytes, linear_layer_flops, memory_features,
                                           time_features)
from engine.run.auto_memory import FIT_FRACTION, model_shape, plan_memory
from tiny_models import tiny_model

ROOT = Path(__file__).resolve().parent.parent
HYBRID_PRESETS = ["tiny_qwen3_5", "tiny_qwen3_5_moe", "tiny_qwen3_next", "tiny_bailing_hybrid"]
# The planner counts the linear layer by kind of tensor (docs in planner._linear_core_bytes): which of the recurrence's
# [C, d] tensors have dk and which dv is an estimate, so are the generic decoder norms (6H each; Qwen's zero-centred norm
# keeps its fp32 normalised value too, 10H) and a few per-row scalars; measured 3% off for gated DeltaNet, 8% for KDA.
# 25% leaves room for those estimates on other shapes while a missed tensor family (the [C, C] matrices, the conv's
# three copies, the fp32 gated norm) moves it by more
BYTES_TOLERANCE = 0.25


def _cfg(preset, *extra):
    return compose_config([f"model={preset}", "data=synthetic", "device=cpu", *extra])


def _hf_model(preset, dtype=torch.float32):
    cfg = _cfg(preset)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.model.family, **dict(cfg.model.arch)),
                                            attn_implementation="sdpa", dtype=dtype)


@pytest.mark.parametrize("preset", HYBRID_PRESETS)
def test_the_planner_counts_a_hybrids_parameters(preset):
    """Full attention (with Qwen's output gate), linear layers (their projections, conv, gates, gated norm) and MoE:
    exact, but for what the planner leaves out for every family, a few H a layer: the decoder's RMSNorm weights, the
    shared expert's sigmoid gate [1, H], and Ling-3.0's MLA per-head output gate [heads, H] on its full layers."""
    model = _hf_model(preset)
    shape = model_shape(_cfg(preset))
    full = tuple(f"layers.{i}.self_attn.g_proj.weight" for i in range(shape.layers) if i not in shape.linear_idx)
    left_out = sum(p.numel() for n, p in model.named_parameters()
                   if (n.endswith("norm.weight") and not n.endswith(("linear_attn.norm.weight", "o_norm.weight")))
                   or n.endswith("shared_expert_gate.weight") or n.endswith(full))
    assert shape.params() == sum(p.numel() for p in model.parameters()) - left_out


def _saved_bytes_of_one_layer(preset, index, seq_len):
    """Bytes autograd saves in one decoder layer's forward (bf16, our bound forward at cp=1), parameters left out,
    tensors sharing a storage counted once."""
    model = enable_context_parallel(_hf_model(preset, torch.bfloat16), init_topology(1), backend="sdpa")
    layer = model.get_decoder().layers[index]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    hidden = model.config.hidden_size
    x = torch.randn(1, seq_len, hidden, dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(seq_len)[None]
    rotary = model.get_decoder().rotary_emb(x, positions)
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, position_embeddings=rotary, position_ids=positions)
    return sum(seen.values())


@pytest.mark.parametrize("preset", ["tiny_qwen3_5", "tiny_bailing_hybrid"])
def test_the_planner_counts_a_linear_layers_saved_tensors(preset):
    """memory=none: a linear decoder layer's bytes per token (norms, mixer, MLP) within BYTES_TOLERANCE of what autograd
    saves, at two lengths: per token the same (the chunk's C x C and the state are per chunk, no S x S term)."""
    shape = model_shape(_cfg(preset))
    layer = shape.linear_idx[0]
    assert layer not in range(shape.dense_layers, shape.layers) or not shape.moe_layers  # a dense-MLP layer
    predicted = _layer_bytes(shape, RunShape(seq_len=1024), False, Policy(), False, linear=True)
    per_token = {S: _saved_bytes_of_one_layer(preset, layer, S) / S for S in (256, 1024)}
    for S, measured in per_token.items():
        assert abs(predicted / measured - 1) < BYTES_TOLERANCE, (preset, S, predicted, measured)
    assert per_token[1024] == pytest.approx(per_token[256], rel=0.02)


def test_a_linear_layer_costs_no_s_squared():
    """The plan's memory per token does not grow with S on a hybrid, and a linear layer's recurrence costs fewer FLOPs
    than a full-attention layer's causal attention at long S (which grows with S x S)."""
    shape = model_shape(_cfg("tiny_qwen3_5"))
    S = 262144
    attention = 3 * (shape.q + shape.out_width) * S * S  # forward + backward of one causal layer (planner's count)
    assert linear_layer_flops(shape, S) * 3 < attention / 100
    assert linear_layer_flops(shape, 2 * S) == pytest.approx(2 * linear_layer_flops(shape, S))
    kept = [memory_features(shape, RunShape(seq_len=n), Policy())["kept"] / n for n in (4096, 262144)]
    assert kept[1] == pytest.approx(kept[0])
    # the full layers alone carry the S x S attention term: the same model with every layer linear has none
    plain = model_shape(_cfg("tiny_qwen3_5", "model.arch.layer_types=[full_attention,full_attention,"
                                             "full_attention,full_attention]"))
    run = RunShape(seq_len=S)
    assert time_features(shape, run, Policy())["attn_sdpa"] == pytest.approx(
        time_features(plain, run, Policy())["attn_sdpa"] / 2)


BASE = ["data=synthetic", "data.seq_len=64", "data.num_samples=8", "precision=fp32", "device=cpu",
        "parallelism.cp=1", "trainer.max_steps=1", "trainer.warmup_steps=0", "trainer.global_batch_size=1",
        "trainer.save_at_end=false", "trainer.export_hf=false", "logging.progress_bar=false"]


def _train(rank, world, overrides, log_file):
    logger = logging.getLogger("engine.run.auto_memory")
    logger.addHandler(logging.FileHandler(log_file))
    logger.setLevel(logging.INFO)
    sys.path.insert(0, str(ROOT / "scripts"))
    import train as entry
    entry.run(compose_config(overrides))


def _metrics(out):
    return json.loads((out / "metrics.jsonl").read_text().splitlines()[0])


@pytest.mark.parametrize("preset", ["tiny_qwen3_5", "tiny_qwen3_5_moe"])
def test_memory_auto_on_a_hybrid_chooses_a_preset_that_runs_as_none(tmp_path, preset):
    """scripts/train.py with memory=auto and a GPU size that rules out memory=none: the choice passes validate, takes a
    step, and its loss and gradient norm equal memory=none's."""
    base = [f"model={preset}", *BASE]
    cfg = compose_config(base + ["memory=auto", "memory.auto_gpu_gib=1000", "memory.auto_host_gib=64"])
    validate(cfg, 1)
    peaks = {c.name: c.prediction.peak_gib for c in plan_memory(cfg, 1, 1000.0, 64.0, on_gpu=False).candidates}
    gpu_gib = (peaks["none"] + max(v for v in peaks.values() if v < peaks["none"])) / 2 / FIT_FRACTION
    expected = plan_memory(cfg, 1, gpu_gib, 64.0, on_gpu=False).choice
    assert expected not in (None, "none")
    auto_out, none_out, log_file = tmp_path / "auto", tmp_path / "none", tmp_path / "auto.log"
    run_ranks(_train, 1, base + ["memory=auto", "memory.auto_host_gib=64", f"memory.auto_gpu_gib={gpu_gib}",
                                 f"run.out_dir={auto_out}"], str(log_file))
    assert f"memory=auto chose memory={expected}:" in log_file.read_text()
    run_ranks(_train, 1, base + ["memory=none", f"run.out_dir={none_out}"], str(log_file))
    auto, none = _metrics(auto_out), _metrics(none_out)
    assert auto["step"] == 1
    assert rel(torch.tensor(auto["loss"]), torch.tensor(none["loss"])) < RTOL, (auto, none)
    assert rel(torch.tensor(auto["grad_norm"]), torch.tensor(none["grad_norm"])) < RTOL, (auto, none)


def test_plan_script_plans_a_hybrid():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "scripts" / "plan.py"), "model=tiny_qwen3_5", "data=synthetic",
           "precision=bf16", "data.seq_len=4096", "parallelism.cp=1", "plan.gpus=1", "plan.gpu_gib=80",
           "plan.host_gib=256"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[1].split()[:2] == ["preset", "peak"]
    rows = [line for line in lines[2:] if line.split() and line.split()[0] in ("none", "except_attention",
                                                                               "full_recompute")]
    assert len(rows) == 3 and "refused" not in "".join(rows), out.stdout
    assert lines[-1].startswith("memory=auto would choose memory=")
    # the step times are not calibrated for linear layers, and the output says so, naming how many
    notes = [line for line in lines if line.startswith("note: ")]
    assert len(notes) == 1 and "this model's 2 linear-attention layers have no calibration row" in notes[0], notes


# --- memory.recompute=except_attention keeps the linear layers' cores

def _batch():
    ids, labels = cp_batch()  # the CP tests' batch: 13 tokens, masked labels up front and a hole
    return {"input_ids": ids, "labels": labels}


def _except_attention_case(family, cp):
    topo = init_topology(cp)
    model = enable_context_parallel(tiny_model(family), topo, backend="sdpa")
    ref_loss, ref_grads = cp_loss_and_grads(model, topo, _batch())
    model.zero_grad(set_to_none=True)
    policy = ExceptAttentionRecompute().apply(model)
    linear = [layer.linear_attn for layer in model.get_decoder().layers if hasattr(layer, "linear_attn")]
    assert linear and all("core_attention_wrapper" in m.__dict__ for m in linear)  # the linear cores are kept
    loss, grads = cp_loss_and_grads(model, topo, _batch())
    policy.remove()
    assert rel(loss, ref_loss) < RTOL, (family, cp, loss, ref_loss)
    for name, g in grads.items():
        assert rel(g, ref_grads[name]) < RTOL, (family, cp, name, rel(g, ref_grads[name]))


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_5_moe_text"])
def test_except_attention_on_a_hybrid_is_exact_at_cp_1(family):
    _except_attention_case(family, 1)


def _cp2_ranks(rank, world):
    for family in ("qwen3_5_text", "qwen3_5_moe_text"):
        _except_attention_case(family, 2)


def test_except_attention_on_a_hybrid_is_exact_at_cp_2():
    run_ranks(_cp2_ranks, 2)


def test_except_attention_never_reruns_a_kept_linear_core(monkeypatch):
    import ds_ulysses_ext.linear_attention.layer as layer_mod
    calls = [0]
    real = layer_mod._exchange_and_mix

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)
    monkeypatch.setattr(layer_mod, "_exchange_and_mix", counting)
    topo = init_topology(1)
    model = enable_context_parallel(tiny_model("qwen3_5_text"), topo, backend="sdpa")
    policy = ExceptAttentionRecompute().apply(model)
    cp_loss_and_grads(model, topo, _batch())
    policy.remove()
    assert calls[0] == 2  # the two linear layers' forwards; backward replays their records


def test_except_attention_refuses_hf_linear_forward():
    model = tiny_model("qwen3_5_text")
    model.config._attn_implementation = "ds_ulysses"  # as if bound, but the linear layers run HF's forward
    with pytest.raises(ValueError, match="enable_context_parallel"):
        ExceptAttentionRecompute().apply(model)


# --- model.kernels: the fused RMSNorm binding leaves the gated output norms eager

@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "bailing_hybrid"])
def test_kernels_leave_the_gated_norms_eager_and_match_none(family):
    """kernels/bind.py's decision, on CPU with the reference provider in the fused kernels' place (the CUDA providers
    compute the same functions, and their first use is checked against it on the run's own inputs): a gated norm
    (forward(hidden_states, gate)) is never bound, Qwen's zero-centred (1 + weight) norms are not taken for RMSNorms,
    Ling-3.0's plain ones are; loss and every gradient equal model.kernels=none's."""
    topo = init_topology(1)
    ref = enable_context_parallel(tiny_model(family), topo, backend="sdpa")
    ref_loss, ref_grads = cp_loss_and_grads(ref, topo, _batch())
    model = enable_context_parallel(tiny_model(family), topo, backend="sdpa")
    report = apply_fused_kernels(model, "compile", torch.device("cpu"), provider=Provider())
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    gated = [m for m in model.modules() if type(m).__name__.endswith("RMSNormGated")]
    assert gated and not any("forward" in m.__dict__ for m in gated)
    assert all(type(m).__name__ not in report.skipped_norms for m in gated)
    bound = [m for m in norms if "forward" in m.__dict__]
    assert len(bound) == report.norms
    assert len(bound) == (len(norms) if family == "bailing_hybrid" else 0), (family, report)
    loss, grads = cp_loss_and_grads(model, topo, _batch())
    assert rel(loss, ref_loss) < RTOL
    for name, g in grads.items():
        assert rel(g, ref_grads[name]) < RTOL, (family, name, rel(g, ref_grads[name]))

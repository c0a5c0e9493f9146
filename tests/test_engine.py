"""scripts/train.py end to end on CPU/gloo: exactness across layouts, resume, HF export, launchers.

The single-process run (world 1) is the reference; every other layout must give the same loss and
grad_norm at every step (fp32, rel 1e-5) on the same global batch. World 1 itself is checked against one step
of stock HF + torch AdamW (tests/hf_reference.py), on ZeRO-2 and on ZeRO-3. The tiny model's sequences (30
tokens) are not a multiple of cp=4, and the synthetic data masks 30% of labels plus a leading 60% of
every 4th sample, so chunks that hold only masked targets occur.
"""
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dist_harness import run_ranks
from engine.checkpoints.export import export_hf_from_checkpoint

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

RTOL = 1e-5
BASE = ["model=tiny", "data=synthetic", "data.seq_len=30", "data.masked_fraction=0.3", "data.num_samples=64",
        "precision=fp32", "device=cpu", "trainer.max_steps=5", "trainer.global_batch_size=4",
        "trainer.warmup_steps=1", "trainer.lr=3e-3", "trainer.save_at_end=false", "trainer.export_hf=false",
        "logging.progress_bar=false", "deepspeed.stage3_param_persistence_threshold=0",
        "deepspeed.reduce_bucket_size=2000", "trainer.loss_chunk_size=7"]


def _run(rank, world, overrides):
    from configs import compose_config
    import train as entry
    entry.run(compose_config(overrides))


def base_for(extra) -> list:
    """BASE, less its synthetic-data keys when `extra` picks another data source: validate refuses a key the run
    would not read (configs/conditional.py)."""
    other = any(o.startswith(("data=", "data.source=")) and not o.endswith("synthetic") for o in extra)
    return [o for o in BASE if not (other and o.startswith(("data.masked_fraction=", "data.num_samples=")))]


def train(tmp_path, name, world, extra):
    out = tmp_path / name
    run_ranks(_run, world, base_for(extra) + [f"run.out_dir={out}"] + extra)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


def assert_same_trajectory(got, ref, what):
    assert [r["step"] for r in got] == [r["step"] for r in ref]
    for g, r in zip(got, ref):
        for key in ("loss", "grad_norm"):
            assert _rel(g[key], r[key]) < RTOL, (what, g["step"], key, g[key], r[key])
        assert g["tokens"] == r["tokens"], (what, g["step"])


LAYOUTS = {  # name: (world, overrides)
    "w2_cp2": (2, ["parallelism.cp=2"]),
    "w4_cp4": (4, ["parallelism.cp=4"]),
    "w4_cp2_dp2": (4, ["parallelism.cp=2"]),
    "w2_cp2_gas2": (2, ["parallelism.cp=2", "trainer.micro_batch_size=2"]),
    # the long-context policy, with one layer recomputed whole, through the whole engine
    "w4_cp2_dp2_gas2_except_attention": (4, ["parallelism.cp=2", "trainer.micro_batch_size=1",
                                             "memory=except_attention", "memory.recompute_num_layers=1"]),
}


# world 1 runs ZeRO-3 as ZeRO-2 unless its parameters are offloaded (engine/ds/config.py effective_zero_stage)
WORLD_1 = {"zero3": ["deepspeed.offload_param=true"], "zero2": []}
# Against stock HF + AdamW, measured on the first step (ZeRO-2 / ZeRO-3): loss 7e-8 / 7e-8 and grad_norm 1.1e-7 /
# 2e-8 relative. Adam's first update is lr * g / (|g| + eps): it divides each gradient element by its own size,
# so an element near eps (1e-8) turns a 1e-10 rounding difference of its gradient into up to 1.2e-2 of lr. So the
# weights are compared where |g| > 1e-6 (measured 1.5e-5 of lr) and over each whole tensor (norm of the
# difference over the norm of the update, measured 1.3e-4)
ANCHOR = {"loss": 1e-6, "grad_norm": 1e-6, "element_over_lr": 1e-4, "tensor": 1e-3}


def assert_matches_stock_hf(out, row1, overrides):
    """A world-1 run's first step against stock HF + torch AdamW (tests/hf_reference.py), on the loss, the
    gradient norm (Adam's first update hardly depends on the gradient's scale, so a wrong normaliser shows
    here) and the updated weights, read back through DeepSpeed's own consolidation of the step-1 checkpoint."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from hf_reference import first_step
    ref = first_step(BASE + [f"run.out_dir={out}"] + overrides)
    for key in ("loss", "grad_norm"):
        assert _rel(row1[key], ref[key]) < ANCHOR[key], (key, row1[key], ref[key])
    state = get_fp32_state_dict_from_zero_checkpoint(str(out / "checkpoints"), tag="step_00000001")
    state = {k.removeprefix("hf."): v.detach() for k, v in state.items()}
    assert state.keys() >= ref["weights"].keys()
    for name, want in ref["weights"].items():
        moved = want - ref["init"][name]
        diff = (state[name] - ref["init"][name] - moved).abs()
        assert float(diff.norm() / moved.norm()) < ANCHOR["tensor"], (name, float(diff.norm() / moved.norm()))
        clear = ref["grads"][name].abs() > 1e-6
        assert float((diff * clear).max()) / ref["lr"] < ANCHOR["element_over_lr"], name


# 3 steps, not BASE's 5: step 1 compares the forward and backward, steps 2 and 3 the updates after them (Adam's
# first step, then one that reads its moments), so a layout that diverges anywhere shows by step 3. Each step at
# world 4 is 1.3-2.6 s of the test's ~55 s on 2 cores
LAYOUT_STEPS = 3


@pytest.mark.parametrize("zero", ["zero3", "zero2"])
def test_layouts_match_single_process(tmp_path, zero):
    steps = [f"trainer.max_steps={LAYOUT_STEPS}"]
    world_1 = ["parallelism.cp=1", f"deepspeed={zero}", "deepspeed.stage3_param_persistence_threshold=0",
               "trainer.save_every=1"] + WORLD_1[zero] + steps
    ref = train(tmp_path, "w1", 1, world_1)
    assert len({r["loss"] for r in ref}) == len(ref) == LAYOUT_STEPS  # the model trains: losses change every step
    assert_matches_stock_hf(tmp_path / "w1", ref[0], world_1)
    for name, (world, extra) in LAYOUTS.items():
        got = train(tmp_path, name, world,
                    extra + [f"deepspeed={zero}", "deepspeed.stage3_param_persistence_threshold=0"] + steps)
        assert_same_trajectory(got, ref, f"{zero}/{name}")


def _run_and_check_tied(rank, world, overrides, report):
    """scripts/train.py, then on every rank: is lm_head still the embedding's parameter, with the same values?"""
    import deepspeed
    import engine.run.train as loop
    build, kept = loop.build, {}

    def build_and_keep(*args, **kwargs):
        built = build(*args, **kwargs)
        kept["hf"] = built[1]
        return built
    loop.build = build_and_keep  # this forked rank only
    _run(rank, world, overrides)
    hf = kept["hf"]
    out_w, in_w = hf.get_output_embeddings().weight, hf.get_input_embeddings().weight
    values = []
    for param in (out_w, in_w):  # gathered one at a time: two copies, if ZeRO had untied them
        with deepspeed.zero.GatheredParameters([param]) if hasattr(param, "ds_id") else torch.no_grad():
            values.append(param.detach().clone())
    torch.save({"same_parameter": out_w is in_w, "same_values": torch.equal(*values)}, f"{report}.{rank}")


def train_checking_tied(tmp_path, name, world, extra):
    out, report = tmp_path / name, tmp_path / f"{name}.tied"
    run_ranks(_run_and_check_tied, world, BASE + [f"run.out_dir={out}"] + extra, str(report))
    for rank in range(world):
        assert torch.load(f"{report}.{rank}") == {"same_parameter": True, "same_values": True}, (name, rank)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


TIED_LAYOUTS = ("w2_cp2", "w4_cp2_dp2")  # cp alone, and cp x dp, which partitions the tied weight over 4


@pytest.mark.parametrize("zero", ["zero3", "zero2"])
def test_tied_model_stays_tied_and_its_layouts_match_single_process(tmp_path, zero):
    tied = ["model=tiny_tied", f"deepspeed={zero}", "trainer.max_steps=3"]
    world_1 = tied + ["parallelism.cp=1", "trainer.save_every=1"] + WORLD_1[zero]
    ref = train_checking_tied(tmp_path, "w1", 1, world_1)
    assert_matches_stock_hf(tmp_path / "w1", ref[0], world_1)
    for name in TIED_LAYOUTS:
        world, extra = LAYOUTS[name]
        assert_same_trajectory(train_checking_tied(tmp_path, name, world, extra + tied), ref, f"{zero}/tied/{name}")


def test_tied_embeddings_and_both_loss_paths_match_single_process(tmp_path):
    # Llama-3.2-1B ties lm_head to the embedding: under ZeRO-3 the fused loss reads that shared, partitioned
    # weight as an external parameter; the checkpointed loss path must give the same trajectory
    tied = ["model.arch.tie_word_embeddings=true", "deepspeed=zero3", "deepspeed.stage3_param_persistence_threshold=0"]
    ref = train(tmp_path, "w1_tied", 1, tied + ["parallelism.cp=1", "trainer.fused_loss=false"])
    assert len({r["loss"] for r in ref}) == 5
    got = train(tmp_path, "w2_cp2_tied", 2, tied + ["parallelism.cp=2"])
    assert_same_trajectory(got, ref, "tied, fused at cp2 vs checkpointed at world 1")


def test_resume_continues_the_same_trajectory(tmp_path):
    extra = ["parallelism.cp=2"]
    full = train(tmp_path, "full", 2, extra)
    resumed_dir = tmp_path / "resumed"
    first = train(tmp_path, "resumed", 2, extra + ["trainer.save_every=3", "trainer.stop_after_steps=3"])
    assert [r["step"] for r in first] == [1, 2, 3]
    assert (resumed_dir / "checkpoints" / "latest").read_text().strip() == "step_00000003"
    both = train(tmp_path, "resumed", 2, extra)
    assert [r["step"] for r in both] == [1, 2, 3, 4, 5]
    for got, ref in zip(both[3:], full[3:]):
        assert got["loss"] == ref["loss"] and got["grad_norm"] == ref["grad_norm"], (got, ref)


def test_the_wall_time_limit_ends_the_run_as_a_last_step_would(tmp_path):
    # 1e-6 minutes: over after the first step; the run still evaluates, checkpoints and exports at that step
    extra = ["parallelism.cp=2", "trainer.max_minutes=1e-6", "trainer.eval_every=10", "data.eval_samples=4",
             "trainer.save_at_end=true", "trainer.export_hf=true"]
    got = train(tmp_path, "timed", 2, extra)
    assert [r["step"] for r in got] == [1] and "eval_loss" in got[0]
    assert (tmp_path / "timed" / "checkpoints" / "latest").read_text().strip() == "step_00000001"
    assert (tmp_path / "timed" / "hf_export" / "config.json").exists()


def test_keep_checkpoints_keeps_the_newest_and_the_run_resumes_from_them(tmp_path):
    extra = ["parallelism.cp=2", "trainer.save_every=1", "trainer.keep_checkpoints=2"]
    first = train(tmp_path, "kept", 2, extra + ["trainer.stop_after_steps=4"])
    root = tmp_path / "kept" / "checkpoints"
    assert [r["step"] for r in first] == [1, 2, 3, 4]
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000003", "step_00000004"]
    both = train(tmp_path, "kept", 2, extra)
    assert [r["step"] for r in both] == [1, 2, 3, 4, 5]
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000004", "step_00000005"]
    assert (root / "latest").read_text().strip() == "step_00000005"


def test_resume_on_other_ranks_is_exact_or_refused_before_the_build(tmp_path):
    # 4 steps, saved at 2: step 3 reads the loaded weights, step 4 the loaded optimizer (Adam's moments and step)
    steps = ["trainer.max_steps=4"]
    ref = train(tmp_path, "ref", 2, ["parallelism.cp=2"] + steps)
    extra = ["parallelism.cp=2", "trainer.save_every=2", "trainer.stop_after_steps=2"] + steps
    # the three resumes below start from the same 2-rank run: trained once, its run folder copied (the checkpoint
    # holds no path of its folder; run.out_dir is not in the resume fingerprint)
    train(tmp_path, "moved", 2, extra)
    for name in ("grown", "shrunk"):
        shutil.copytree(tmp_path / "moved", tmp_path / name)
    train(tmp_path, "from_one", 1, ["parallelism.cp=1", "trainer.save_every=2", "trainer.stop_after_steps=2"] + steps)
    # the same 2 ranks at cp=1 x dp=2: DeepSpeed's state loads as saved, and the math does not depend on the layout
    moved = train(tmp_path, "moved", 2, ["parallelism.cp=1"] + steps)
    assert_same_trajectory(moved, ref, "resumed at cp=1")
    # 4 ranks, ZeRO-3 on both sides: re-partitioned through DeepSpeed's universal checkpoint, then exact
    grown = train(tmp_path, "grown", 4, ["parallelism.cp=2", "trainer.save_every=4"] + steps)
    assert_same_trajectory(grown, ref, "resumed on 4 ranks")
    root = tmp_path / "grown" / "checkpoints"
    assert not (root / "universal").exists()  # the converted copy is deleted once loaded
    assert json.loads((root / "step_00000004" / "optimizer_layout.json").read_text())["world_size"] == 4
    # a 1-rank run (ZeRO-2) onto 2 ranks (ZeRO-3): the same, through a ZeRO-2 -> ZeRO-3 universal folder
    from_one = train(tmp_path, "from_one", 2, ["parallelism.cp=2"] + steps)
    assert_same_trajectory(from_one, ref, "resumed from 1 rank on 2")
    # 1 rank runs ZeRO-2, which DeepSpeed's universal format does not load into: refused, before the build
    with pytest.raises(Exception, match=r"partitioned over 2 rank\(s\); this run has 1 rank\(s\) at ZeRO-2"):
        train(tmp_path, "shrunk", 1, ["parallelism.cp=1"] + steps)
    # the fix the refusal names: one rank with its parameters offloaded stays on ZeRO-3
    shrunk = train(tmp_path, "shrunk", 1, ["parallelism.cp=1", "deepspeed.offload_param=true"] + steps)
    assert_same_trajectory(shrunk, ref, "resumed on 1 rank, ZeRO-3 with offloaded parameters")


def test_timed_checkpoints_are_taken_by_every_rank_after_the_same_steps(tmp_path):
    # an interval shorter than any step: every step ends past it, on rank 0's clock, for all ranks together
    train(tmp_path, "timed", 2, ["parallelism.cp=2", "trainer.save_every_minutes=0.000001"])
    root = tmp_path / "timed" / "checkpoints"
    assert sorted(p.name for p in root.glob("step_*")) == [f"step_{s:08d}" for s in range(1, 6)]
    assert all(len(list((root / f"step_{s:08d}").glob("rng_rank*.pt"))) == 2 for s in range(1, 6))


def test_resume_refuses_a_checkpoint_of_another_run(tmp_path):
    extra = ["parallelism.cp=2", "trainer.max_steps=2", "trainer.save_at_end=true"]
    train(tmp_path, "other", 2, extra)
    with pytest.raises(Exception, match="written by a different run .*trainer.global_batch_size: checkpoint 4 vs now 8"):
        train(tmp_path, "other", 2, extra + ["trainer.max_steps=4", "trainer.global_batch_size=8"])


def _run_signalled_after_step_2(rank, world, overrides):
    import os
    import signal
    import engine.run.train as loop
    real_step = loop.train_step
    calls = []

    def step_then_signal(*args, **kwargs):
        result = real_step(*args, **kwargs)
        calls.append(1)
        if len(calls) == 2 and rank == world - 1:  # only one rank is signalled; all must stop together
            os.kill(os.getpid(), signal.SIGTERM)
        return result
    loop.train_step = step_then_signal
    _run(rank, world, overrides)


def test_sigterm_checkpoints_and_stops_all_ranks_at_the_same_step(tmp_path):
    out = tmp_path / "preempted"
    run_ranks(_run_signalled_after_step_2, 2, BASE + [f"run.out_dir={out}", "parallelism.cp=2"])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000002"


def test_hf_export_reloads_with_the_trained_weights(tmp_path):
    train(tmp_path, "export", 2, ["parallelism.cp=2", "trainer.max_steps=2", "trainer.export_hf=true",
                                  "trainer.save_at_end=true", "trainer.save_every=1"])
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForCausalLM
    out = tmp_path / "export"
    exported = AutoModelForCausalLM.from_pretrained(out / "hf_export", attn_implementation="sdpa").eval()
    # an independent path to the trained weights: DeepSpeed's own consolidation of the ZeRO-3 shards
    state = get_fp32_state_dict_from_zero_checkpoint(str(out / "checkpoints"), tag="step_00000002")
    state = {k.removeprefix("hf."): v for k, v in state.items()}
    reference = AutoModelForCausalLM.from_pretrained(out / "hf_export", attn_implementation="sdpa").eval()
    missing, unexpected = reference.load_state_dict(state, strict=True)
    init = AutoModelForCausalLM.from_config(reference.config)
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, ref = exported(input_ids=ids).logits, reference(input_ids=ids).logits
        assert not torch.allclose(init(input_ids=ids).logits, ref)  # the weights really moved away from init
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)

    # scripts/export_hf.py, from the checkpoints alone: the final one equals the run's own export (fp32)
    from export_hf import main as export_main
    export_main([str(out), "--out", str(tmp_path / "from_ckpt")])
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "from_ckpt", attn_implementation="sdpa").eval()
    step1 = AutoModelForCausalLM.from_pretrained(
        export_hf_from_checkpoint(out, "step_00000001"), attn_implementation="sdpa").eval()
    with torch.no_grad():
        torch.testing.assert_close(final(input_ids=ids).logits, got, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(step1(input_ids=ids).logits, got)  # the mid-run checkpoint is another model


@pytest.mark.parametrize("name,world,extra", [
    ("tied_zero2", 1, ["parallelism.cp=1", "model.arch.tie_word_embeddings=true"]),
    # the checkpoint's "fp32" partitions are bf16 here; the run's export rounds the same masters to bf16
    ("bf16_masters_zero3", 2, ["parallelism.cp=2", "precision=bf16", "deepspeed.master_weights=bf16"]),
    # GPT-OSS: HF builds it with eager attention only, and its experts are our MoE blocks in HF's layout
    ("gpt_oss_zero3", 2, ["model=tiny_gpt_oss", "parallelism.cp=2"]),
])
def test_export_of_a_checkpoint_equals_the_run_export(tmp_path, name, world, extra):
    train(tmp_path, name, world, extra + ["trainer.max_steps=1", "trainer.export_hf=true", "trainer.save_at_end=true"])
    from transformers import AutoModelForCausalLM
    out = tmp_path / name
    run_export = AutoModelForCausalLM.from_pretrained(out / "hf_export").state_dict()
    from_ckpt = AutoModelForCausalLM.from_pretrained(export_hf_from_checkpoint(out)).state_dict()
    assert run_export.keys() == from_ckpt.keys()
    for key, value in run_export.items():
        assert from_ckpt[key].dtype == value.dtype and torch.equal(from_ckpt[key], value), key


def _free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


LAUNCHERS = {
    "deepspeed": lambda port: [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--no_local_rank",
                               "--master_port", str(port)],
    # plain deepspeed appends --local_rank=N; the entry point must drop it before Hydra parses argv
    "deepspeed_local_rank": lambda port: [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2",
                                          "--master_port", str(port)],
    "torchrun": lambda port: [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                              "--master_port", str(port)],
}


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_real_launcher_smoke(tmp_path, launcher):
    out = tmp_path / launcher
    cmd = LAUNCHERS[launcher](_free_port()) + [str(ROOT / "scripts" / "train.py"), f"run.out_dir={out}",
                                               "trainer.max_steps=2", "logging.progress_bar=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert (out / "hf_export" / "model.safetensors").exists() and (out / "loss.png").exists()
    assert f"hf_export: {out / 'hf_export'}" in proc.stdout
    # transformers imports torchao wherever it is installed, and the pinned torchao's import logs a deprecation of
    # torch's per rank: nothing for the user to act on, and the first lines the README's demo printed
    assert "register_constant()" not in proc.stderr, proc.stderr[-2000:]


def test_profile_step_writes_a_trace_and_a_table_for_that_step_only(tmp_path):
    rows = train(tmp_path, "prof", 2, ["parallelism.cp=2", "trainer.max_steps=3", "logging.profile_step=2"])
    out = tmp_path / "prof"
    assert sorted(p.name for p in out.glob("profile_*")) == [
        "profile_step2_rank0.json", "profile_step2_rank0.txt", "profile_step2_rank1.json", "profile_step2_rank1.txt"]
    trace = json.loads((out / "profile_step2_rank1.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"phase.forward", "phase.backward", "phase.optimizer"} <= names
    assert "aten::mm" in (out / "profile_step2_rank0.txt").read_text()
    assert [r.get("profiled", False) for r in rows] == [False, True, False]

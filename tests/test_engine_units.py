"""Engine pieces that must fail loudly: MFU over 100%, W&B without credentials, the gradient-reduction path check,
out of memory; plus the LR schedule, the W&B offline mode and DeepSpeed's settings. Checkpoints:
tests/test_checkpoint_units.py."""
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from configs import Plan
from dist_harness import run_ranks
from engine.ds.distributed import Runtime, check_gloo_on_cuda, cp_placement_warning, read_runtime
from engine.ds.grad_reduction import loss_scale
from engine.ds.hf_config import position_warning
from engine.run.schedule import build_scheduler, lr_factor
from engine.run.step import StepResult
from engine.observe.tracking import Tracker
from engine.run.train import _metrics
from tiny_models import tiny_config

PLAN = Plan(world_size=4, cp=2, dp=2, ep=1, grad_accum=2, micro_batch_size=1, global_batch_size=4, seq_len=1024,
            zero_stage=3, precision="bf16")


def test_mfu_above_100_percent_aborts():
    rt = Runtime(rank=0, local_rank=0, world_size=4, device=torch.device("cpu"))
    result = StepResult(loss=1.0, grad_norm=1.0, tokens=4000, input_tokens=4096)
    cfg = tiny_config("llama")
    ok = _metrics(1, result, 1e-3, 1.0, rt, PLAN, 1_000_000, cfg, peak_tflops=989.0)
    assert 0 < ok["mfu"] < 1
    with pytest.raises(RuntimeError, match="MFU .* exceeds 100%: the token count or context parallelism is broken"):
        _metrics(1, result, 1e-3, 1e-12, rt, PLAN, 1_000_000, cfg, peak_tflops=989.0)


def test_attention_flops_count_documents_and_windows_not_the_row():
    from types import SimpleNamespace
    from engine.observe.flops import step_flops
    from engine.run.train import packed_attention_sq
    cfg = SimpleNamespace(head_dim=8, hidden_size=32, num_attention_heads=4, num_hidden_layers=3,
                          sliding_window=None, layer_types=None)
    per_sq = 6.0 * 4 * 8  # FLOPs per unit of S^2 per layer
    # two rows of 10: documents 4 + 6 and 10 (restarting position_ids), no cp, no process group
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5], list(range(10))])
    topo = SimpleNamespace(cp_size=1)
    sq = packed_attention_sq([{"position_ids": pos}], cfg, topo, torch.device("cpu"))
    assert sq == 3 * (16 + 36 + 100)
    assert step_flops(0, cfg, 2, 10, sq) == per_sq * 3 * (16 + 36 + 100)
    assert step_flops(0, cfg, 2, 10) == per_sq * 3 * 200  # unpacked: two causal rows of 10
    assert packed_attention_sq([{"input_ids": pos}], cfg, topo, torch.device("cpu")) is None
    # one sliding layer of window 4 among three: a row of 10 counts 2 * 10 * 4 - 16 = 64 there, 100 elsewhere
    cfg.layer_types, cfg.sliding_window = ["full_attention", "sliding_attention", "full_attention"], 4
    assert step_flops(0, cfg, 1, 10) == per_sq * (100 + 64 + 100)
    assert step_flops(0, cfg, 1, 3) == per_sq * 3 * 9  # shorter than the window: the window changes nothing
    # a hybrid (Qwen3.5): linear-attention layers add no S^2 term, only the full-attention layer does
    cfg.layer_types = ["linear_attention", "linear_attention", "full_attention"]
    assert step_flops(0, cfg, 1, 10) == per_sq * 100
    # MLA: QK^T over the q/k dim (nope 12 + rope 4), PV over v's (8); HF's head_dim is the rope part there
    mla = SimpleNamespace(head_dim=4, qk_nope_head_dim=12, qk_rope_head_dim=4, v_head_dim=8, hidden_size=32,
                          num_attention_heads=4, num_hidden_layers=1, sliding_window=None, layer_types=None)
    assert step_flops(0, mla, 1, 10) == 100 * 3 * 4 * ((12 + 4) + 8)


def test_loss_scale_per_reduction_path():
    # the measured DeepSpeed conventions (engine/ds/grad_reduction.py), written out by hand
    assert loss_scale(3, True, PLAN) == 4.0     # mean over dp*cp
    assert loss_scale(3, False, PLAN) == 2.0    # sum over cp, mean over dp
    assert loss_scale(2, True, PLAN) == 2.0
    with pytest.raises(ValueError, match="no verified gradient-reduction scale; use zero2 or zero3"):
        loss_scale(1, True, PLAN)


def test_lr_schedule_warmup_then_cosine_to_the_floor():
    # 10 steps (0-based 0..9): the last one runs at the floor, as README says ("at trainer.max_steps")
    f = [lr_factor(s, warmup_steps=2, max_steps=10, min_lr_ratio=0.1) for s in range(10)]
    assert f[:2] == [0.5, 1.0]
    assert f[2] == pytest.approx(1.0) and f[9] == pytest.approx(0.1)
    assert all(a > b for a, b in zip(f[2:], f[3:]))
    # no decay step between warmup and the last step: the last step is still the floor's
    assert lr_factor(3, warmup_steps=3, max_steps=4, min_lr_ratio=0.1) == pytest.approx(0.1)


def test_lr_schedule_linear_and_constant_decay():
    linear = [lr_factor(s, warmup_steps=2, max_steps=10, min_lr_ratio=0.1, decay="linear") for s in range(10)]
    # after warmup, steps 2..9 go from 1.0 to 0.1 in 7 equal decrements, by hand
    assert linear[:2] == [0.5, 1.0]
    assert linear[2:] == pytest.approx([1.0 - 0.9 / 7 * i for i in range(8)])
    constant = [lr_factor(s, warmup_steps=2, max_steps=10, min_lr_ratio=0.1, decay="constant") for s in range(10)]
    assert constant == [0.5] + [1.0] * 9
    # the scheduler the engine hands DeepSpeed follows trainer.lr_decay, and its last step is at the floor
    trainer = SimpleNamespace(warmup_steps=2, max_steps=10, min_lr_ratio=0.1, lr_decay="linear")
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=2.0)
    scheduler, lrs = build_scheduler(trainer)(optimizer), []
    for _ in range(10):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx([2.0 * f for f in linear]) and lrs[-1] == pytest.approx(2.0 * 0.1)


def _wandb_cfg(mode):
    return SimpleNamespace(progress_bar=False, log_every=1,
                           wandb=SimpleNamespace(mode=mode, project="t", entity=None, name="t", dir=None))


def test_wandb_online_without_key_is_an_error_not_a_prompt(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    with pytest.raises(RuntimeError, match="needs WANDB_API_KEY.*logging.wandb.mode=offline"):
        Tracker(tmp_path, _wandb_cfg("online"), True, 3, 0, {})


def test_wandb_offline_writes_a_local_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("HOME", str(tmp_path))  # no credentials anywhere
    tracker = Tracker(tmp_path, _wandb_cfg("offline"), True, 3, 0, {"x": 1})
    tracker.log({"step": 1, "loss": 2.0, "tokens_per_sec_per_gpu": 1.0, "mfu": None})
    tracker.close()
    first = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(first) == 1
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1
    run_id = first[0].name.rsplit("-", 1)[1]
    # resumed at step 1: the same W&B run goes on (offline: a second folder with the same id, which
    # `wandb sync` appends to that run); a fresh run in the same folder starts a new one
    for start, same in ((1, True), (0, False)):
        tracker = Tracker(tmp_path, _wandb_cfg("offline"), True, 3, start, {"x": 1})
        tracker.log({"step": start + 1, "loss": 2.0, "tokens_per_sec_per_gpu": 1.0, "mfu": None})
        tracker.close()
        assert (tracker.wandb_run.id == run_id) == same


def _rows(n):
    return "".join(json.dumps({"step": i, "loss": float(i)}) + "\n" for i in range(1, n + 1))


def test_metrics_file_holds_one_trajectory(tmp_path):
    # resumed from step 3 after a run that got to step 5 before dying: steps 4-5 run again, so their rows go
    (tmp_path / "metrics.jsonl").write_text(_rows(5) + '{"step": 6, "lo')  # the last line torn by the crash
    Tracker(tmp_path, _wandb_cfg("disabled"), True, 6, 3, {}).close()
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    # a fresh run in the same directory starts an empty file; the old one is kept aside
    Tracker(tmp_path, _wandb_cfg("disabled"), True, 6, 0, {}).close()
    assert not (tmp_path / "metrics.jsonl").exists()
    assert (tmp_path / "metrics.prev.jsonl").read_text() == _rows(3)


def _node_spans(rank, world, cp, ranks_per_node, out_dir):
    import socket
    from engine.ds.distributed import cp_group_node_spans
    socket.gethostname = lambda: f"node{rank // ranks_per_node}"  # this rank's process only
    spans = cp_group_node_spans(world, cp)
    if rank == 0:
        (Path(out_dir) / f"spans_{cp}_{ranks_per_node}.json").write_text(json.dumps(spans))


@pytest.mark.parametrize("cp,ranks_per_node,spans", [(2, 2, [1, 1]), (4, 2, [2]), (2, 4, [1, 1]), (1, 1, [1] * 4),
                                                     (2, 3, [1, 2])])  # 3 + 1 ranks: the second group straddles
def test_cp_groups_that_cross_nodes_are_named(tmp_path, cp, ranks_per_node, spans):
    run_ranks(_node_spans, 4, cp, ranks_per_node, str(tmp_path))
    got = json.loads((tmp_path / f"spans_{cp}_{ranks_per_node}.json").read_text())
    assert got == spans
    warning = cp_placement_warning(got, cp)
    assert (warning is None) == (max(spans) == 1)
    if warning:
        assert f"1 of {len(spans)} CP groups (parallelism.cp={cp}," in warning and "up to 2" in warning


def test_a_pretrained_model_trained_past_its_positions_is_warned_about():
    config = SimpleNamespace(max_position_embeddings=1000)
    assert position_warning(config, seq_len=1000, cp=4, ring=1) is None
    warning = position_warning(config, seq_len=1001, cp=4, ring=1)  # padded to 1004
    assert "data.seq_len=1001 (padded to 1004 for cp) exceeds the model's max_position_embeddings=1000" in warning
    assert position_warning(SimpleNamespace(), seq_len=10**6, cp=1, ring=1) is None  # a config without the key
    # a ring pads to a multiple of 2 x cp: 997 tokens at cp=2 take 998 positions under Ulysses, 1000 with ring 2
    config = SimpleNamespace(max_position_embeddings=999)
    assert position_warning(config, seq_len=997, cp=2, ring=1) is None
    warning = position_warning(config, seq_len=997, cp=2, ring=2)
    assert "data.seq_len=997 (padded to 1000 for cp) exceeds the model's max_position_embeddings=999" in warning


def test_timed_checkpoint_is_due_after_the_interval_and_on_rank_0s_clock(monkeypatch):
    import engine.checkpoints.preemption as pre
    now = [1000.0]
    monkeypatch.setattr(pre.time, "monotonic", lambda: now[0])
    clock = pre.Preemption(save_every_minutes=2)
    try:
        cpu = torch.device("cpu")
        now[0] += 119
        assert clock.agreed(cpu, is_main=True) == (False, False, False)
        now[0] += 1
        assert clock.agreed(cpu, is_main=True) == (False, True, False)
        assert clock.agreed(cpu, is_main=False) == (False, False, False)  # others get rank 0's, by all-reduce
        clock.saved()
        assert clock.agreed(cpu, is_main=True) == (False, False, False)
        clock.requested = True
        assert clock.agreed(cpu, is_main=True) == (True, False, False)
    finally:
        clock.restore()
    off = pre.Preemption(save_every_minutes=0)
    now[0] += 10**6
    assert off.agreed(torch.device("cpu"), is_main=True) == (False, False, False)
    off.restore()


def test_the_wall_time_limit_counts_from_the_start_on_rank_0s_clock(monkeypatch):
    import engine.checkpoints.preemption as pre
    now = [50.0]
    monkeypatch.setattr(pre.time, "monotonic", lambda: now[0])
    clock = pre.Preemption(save_every_minutes=1, max_minutes=3)
    try:
        cpu = torch.device("cpu")
        now[0] += 179
        clock.saved()  # a checkpoint does not restart the run's clock
        assert clock.agreed(cpu, is_main=True)[2] is False
        now[0] += 1
        assert clock.agreed(cpu, is_main=True) == (False, False, True)
        assert clock.agreed(cpu, is_main=False)[2] is False
    finally:
        clock.restore()


def test_attention_benchmark_script_runs_on_cpu():
    # a smoke test of the benchmark's code path; it times nothing that is asserted
    import subprocess
    import sys
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, str(root / "scripts" / "bench" / "bench_attention.py"), "--device", "cpu",
                           "--seqs", "64", "--hq", "4", "--hkv", "2", "--head-dim", "8", "--reps", "1"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "MASTER_PORT": "29547"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert '"overhead_pct"' in proc.stdout


def test_zero3_on_one_rank_runs_as_zero2_unless_params_are_offloaded():
    from configs import compose_config, validate
    from engine.ds.config import to_deepspeed_dict
    cfg = compose_config(["parallelism=cp1", "deepspeed=zero3"])
    assert to_deepspeed_dict(cfg, validate(cfg, 1))["zero_optimization"]["stage"] == 2
    cfg = compose_config(["parallelism=cp1", "deepspeed=zero3_offload"])
    assert to_deepspeed_dict(cfg, validate(cfg, 1))["zero_optimization"]["stage"] == 3
    cfg = compose_config(["deepspeed=zero3"])
    assert to_deepspeed_dict(cfg, validate(cfg, 2))["zero_optimization"]["stage"] == 3


def test_reduce_buckets_are_sized_to_the_run():
    """One rank reduces nothing: DeepSpeed's 5e8-element buckets (2 GB in bf16 with overlap) would hold copies only."""
    from configs import compose_config, validate
    from engine.ds.config import to_deepspeed_dict
    cfg = compose_config(["parallelism=cp1", "deepspeed=zero3"])
    zero = to_deepspeed_dict(cfg, validate(cfg, 1))["zero_optimization"]
    assert zero["reduce_bucket_size"] == 20_000_000 and zero["overlap_comm"] is False
    cfg = compose_config(["deepspeed=zero3"])
    zero = to_deepspeed_dict(cfg, validate(cfg, 2))["zero_optimization"]
    assert zero["reduce_bucket_size"] == 500_000_000 and zero["overlap_comm"] is True
    cfg = compose_config(["parallelism=cp1", "deepspeed.reduce_bucket_size=1234"])
    assert to_deepspeed_dict(cfg, validate(cfg, 1))["zero_optimization"]["reduce_bucket_size"] == 1234


def _ds_dict(overrides, world=1):
    from configs import compose_config, validate
    from engine.ds.config import to_deepspeed_dict
    cfg = compose_config([f"parallelism.cp={world}"] + overrides)
    return to_deepspeed_dict(cfg, validate(cfg, world))


def test_master_weights_map_to_deepspeed_bf16_keys():
    fp32 = _ds_dict(["precision=bf16"])
    assert fp32["bf16"] == {"enabled": True, "check_grad_overflow": False}
    assert _ds_dict([])["bf16"] == {"enabled": False, "check_grad_overflow": False}
    bf16 = _ds_dict(["precision=bf16", "deepspeed.master_weights=bf16"])
    assert bf16["bf16"] == {"enabled": True, "check_grad_overflow": False, "bf16_master_weights_and_grads": True,
                            "bf16_optimizer_states": True}
    assert {k: v for k, v in bf16.items() if k != "bf16"} == {k: v for k, v in fp32.items() if k != "bf16"}
    # offload: DeepSpeed builds its CPU Adam from this section, with bf16 moments because of the keys above
    offload = _ds_dict(["precision=bf16", "deepspeed=zero3_offload", "deepspeed.master_weights=bf16"])
    assert offload["optimizer"]["type"] == "AdamW" and offload["bf16"] == bf16["bf16"]


def test_deepspeed_overflow_check_runs_only_when_steps_are_skipped():
    # DeepSpeed's own default is on; under abort the loop checks the grad norm instead (engine/run/train.py)
    assert _ds_dict(["precision=bf16"])["bf16"]["check_grad_overflow"] is False
    skip = _ds_dict(["precision=bf16", "deepspeed=zero2", "trainer.on_nonfinite=skip"])
    assert skip["bf16"]["check_grad_overflow"] is True


def _init_weights_by_stage(rank, world, out):
    import deepspeed
    from configs import compose_config, validate
    from engine.ds.build import build_hf_model
    from engine.ds.config import to_deepspeed_dict
    from engine.ds.patches import skip_deepspeed_shm_build
    skip_deepspeed_shm_build()
    weights = {}
    for stage in ("zero3", "zero2"):
        cfg = compose_config([f"deepspeed={stage}", "deepspeed.stage3_param_persistence_threshold=0",
                              f"parallelism.cp={world}"])
        model = build_hf_model(cfg, to_deepspeed_dict(cfg, validate(cfg, world)))
        weights[stage] = {}
        for name, p in model.named_parameters():
            with deepspeed.zero.GatheredParameters([p]) if hasattr(p, "ds_id") else torch.no_grad():
                weights[stage][name] = p.detach().clone()
    if rank == 0:
        torch.save(weights, out)


def test_random_init_is_the_same_for_every_stage_and_world_size(tmp_path):
    run_ranks(_init_weights_by_stage, 2, str(tmp_path / "w2.pt"))
    run_ranks(_init_weights_by_stage, 1, str(tmp_path / "w1.pt"))  # world 1 runs zero3 as ZeRO-2
    w2, w1 = torch.load(tmp_path / "w2.pt"), torch.load(tmp_path / "w1.pt")
    ref = w1["zero2"]
    for weights in (w2["zero3"], w2["zero2"], w1["zero3"]):
        assert weights.keys() == ref.keys()
        assert all(torch.equal(weights[n], ref[n]) for n in ref)
    q = ref["model.layers.0.self_attn.q_proj.weight"]
    assert abs(q.std().item() - 0.02) < 0.002 and torch.equal(ref["model.norm.weight"], torch.ones_like(ref["model.norm.weight"]))


def _oom_run(rank, world, out):
    from configs import compose_config
    import engine.run.train
    import train as entry

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
    engine.run.train.train_step = out_of_memory  # this forked rank only
    entry.run(compose_config(["model=tiny", "data=synthetic", "data.seq_len=64", "parallelism.cp=2",
                              "memory=except_attention", "trainer.max_steps=2", "logging.progress_bar=false",
                              f"run.out_dir={out}"]))


def test_out_of_memory_names_the_layout_and_the_leaner_policies(tmp_path):
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    with pytest.raises(Exception) as info:
        run_ranks(_oom_run, 2, str(tmp_path / "run"))
    message = str(info.value)
    assert "OutOfMemoryError: out of device memory in step 1: data.seq_len=64, cp=2, so 32 tokens per rank" in message
    assert "memory.recompute=except_attention, recompute_num_layers=0" in message
    # already on except_attention: the advice starts at the next leaner policy, then cp
    assert "memory=except_attention (" not in message
    assert message.index("memory=except_attention_tiled") < message.index("memory=except_attention_offload_tiled") \
        < message.index("memory=long_context") < message.index("raise parallelism.cp (now 2") \
        < message.index("memory=auto picks")
    assert "Tried to allocate 20.00 GiB" in message  # CUDA's own message stays in the chain


def _device_count_after_init(rank, world, report):
    import subprocess
    from deepspeed.accelerator import get_accelerator
    from engine.ds.distributed import init_distributed, read_runtime
    os.environ.pop("LOCAL_SIZE", None)  # as under torchrun, which sets LOCAL_WORLD_SIZE only
    init_distributed(read_runtime("cpu"))

    def no_subprocess(*args, **kwargs):
        raise AssertionError(f"DeepSpeed ran a subprocess: {args}")
    subprocess.check_output = no_subprocess  # this forked rank only
    report.put((rank, os.environ["LOCAL_SIZE"], get_accelerator().device_count()))


def test_deepspeed_cpu_device_count_runs_no_subprocess_after_init():
    # DeepSpeed's CPU accelerator runs `numactl --hardware` on every device_count() without LOCAL_SIZE, and ZeRO-3
    # asks on every gradient reduce-scatter; init_distributed sets it as DeepSpeed's own launcher does
    import multiprocessing
    report = multiprocessing.get_context("fork").SimpleQueue()
    run_ranks(_device_count_after_init, 2, report)
    rows = []
    while not report.empty():
        rows.append(report.get())
    # run_ranks starts the ranks again after gloo's transport set-up flake (tests/dist_harness.py): a rank of the
    # failed attempt may have reported already, so every row counts, and each rank must have reported
    assert rows and all(row in [(0, "2", 2), (1, "2", 2)] for row in rows), rows
    assert {row[0] for row in rows} == {0, 1}, rows


def _shutdown_in_a_fresh_process(store, report):
    import torch.distributed as dist
    from engine.ds.distributed import shutdown_distributed
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    dist.new_group([0])  # a subgroup too, as DeepSpeed and the CP topology make
    shutdown_distributed()
    report.put(dist.is_initialized())


def test_exit_after_success_skips_finalisation_but_keeps_every_output(tmp_path):
    # scripts/train.py and eval_retrieval.py end with it: finalisation can abort on gloo's leftover threads
    # (engine/ds/distributed.py exit_after_success). What the process printed and logged must still arrive, and
    # its exit code must say success; an atexit handler stands for finalisation's work, which must not run
    import subprocess
    import sys
    code = f"""
import atexit, logging, pathlib
atexit.register(lambda: pathlib.Path({str(tmp_path / 'finalised')!r}).write_text('ran'))
logging.basicConfig(filename={str(tmp_path / 'run.log')!r}, level=logging.INFO)
logging.getLogger('run').info('logged before the exit')
print('printed before the exit')  # block-buffered: stdout is a pipe
from engine.ds.distributed import exit_after_success
exit_after_success()
raise SystemExit(3)  # never reached
"""
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120,
                          env={**{k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"},
                               "PYTHONPATH": str(root)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().endswith("printed before the exit")
    assert "logged before the exit" in (tmp_path / "run.log").read_text()
    assert not (tmp_path / "finalised").exists()


def test_shutdown_destroys_the_process_groups(tmp_path):
    # scripts/train.py and eval_retrieval.py end with it: gloo's threads left to the interpreter's exit can abort the
    # process after a successful run (engine/ds/distributed.py shutdown_distributed)
    import multiprocessing
    ctx = multiprocessing.get_context("fork")
    report = ctx.SimpleQueue()
    child = ctx.Process(target=_shutdown_in_a_fresh_process, args=(tmp_path / "store", report))
    child.start()
    child.join(60)
    assert child.exitcode == 0 and report.get() is False


def _fake_gpus(monkeypatch, count: int, local_rank: int, local_world: int):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
    monkeypatch.setenv("RANK", str(local_rank))
    monkeypatch.setenv("WORLD_SIZE", str(local_world))


def test_ranks_share_a_gpu_only_over_gloo(monkeypatch):
    from configs import ConfigError
    _fake_gpus(monkeypatch, count=1, local_rank=1, local_world=2)
    rt = read_runtime("auto", "gloo")
    assert (rt.device, rt.backend, rt.shares_gpu) == (torch.device("cuda", 0), "gloo", True)
    with pytest.raises(ConfigError, match=r"2 ranks on this host and 1 GPU\(s\) visible: launch at most 1 rank\(s\) "
                                          r"per host, or set dist_backend=gloo"):
        read_runtime("auto", "auto")
    _fake_gpus(monkeypatch, count=1, local_rank=0, local_world=2)  # rank 0 has a GPU, and still refuses: all ranks say it
    with pytest.raises(ConfigError, match="dist_backend=gloo"):
        read_runtime("cuda", "nccl")
    with pytest.raises(ConfigError, match=r"memory=auto sizes each rank's preset for a GPU of its own"):
        check_gloo_on_cuda(read_runtime("auto", "gloo"), memory_auto=True)
    _fake_gpus(monkeypatch, count=2, local_rank=1, local_world=2)  # a GPU each: NCCL, nothing shared
    rt = read_runtime("auto", "auto")
    assert (rt.device, rt.backend, rt.shares_gpu) == (torch.device("cuda", 1), "nccl", False)
    check_gloo_on_cuda(rt, memory_auto=True)
    rt = read_runtime("auto", "gloo")  # gloo with a GPU each: memory=auto sizes a GPU of its own, as it assumes
    assert (rt.device, rt.shares_gpu) == (torch.device("cuda", 1), False)
    check_gloo_on_cuda(rt, memory_auto=True)


def test_gloo_on_cuda_starts_an_unbound_default_group_before_deepspeed(monkeypatch):
    """DeepSpeed binds the default group to cuda:LOCAL_RANK on CUDA, and torch then splits every later group from it,
    which gloo cannot (seen on an H100: "ProcessGroupGloo has no attribute perform_nocolor_split"); under
    dist_backend=gloo the group exists, unbound, before deepspeed.init_distributed runs."""
    import deepspeed
    from engine.ds.distributed import init_distributed
    calls, started = [], []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: bool(started))
    monkeypatch.setattr(torch.distributed, "init_process_group",
                        lambda backend, **kw: (calls.append(("torch", backend, kw)), started.append(1)))
    monkeypatch.setattr(deepspeed, "init_distributed", lambda dist_backend: calls.append(("deepspeed", dist_backend)))
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    monkeypatch.setattr(os, "environ", env)  # what init_distributed sets stays in this copy
    init_distributed(Runtime(rank=1, local_rank=1, world_size=2, device=torch.device("cuda", 0), backend="gloo",
                             shares_gpu=True))
    assert calls == [("torch", "gloo", {}), ("deepspeed", "gloo")]
    assert os.environ["LOCAL_RANK"] == "0"  # DeepSpeed's engine and ZeRO-3 place tensors on cuda:$LOCAL_RANK
    calls.clear(), started.clear()
    init_distributed(Runtime(rank=0, local_rank=0, world_size=2, device=torch.device("cuda", 0), backend="nccl"))
    assert calls == [("deepspeed", "nccl")]  # NCCL: DeepSpeed's own, device-bound group

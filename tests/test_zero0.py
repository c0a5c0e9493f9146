"""deepspeed=zero0: one rank, no ZeRO, torch's fused AdamW on the parameters (engine/ds/clipping_adamw.py).

Its reference is the ZeRO-2 run of the same config at world 1 (itself checked against stock HF + torch AdamW in
tests/test_engine.py): loss and grad_norm at every step agree to fp32 rel 1e-5, so the updates do too. The optimizer
alone is checked against torch's own clip_grad_norm_ + AdamW."""
import pytest
import torch

from configs import ConfigError, compose_config, validate
from engine.ds.clipping_adamw import ClippingAdamW
from test_engine import BASE, assert_same_trajectory, train

RTOL = 1e-5
W1 = ["parallelism.cp=1"]


@pytest.mark.parametrize("extra", [
    ["trainer.grad_clip=0.3"],  # the norm is ~2.2: the clip divides every update's gradient
    ["trainer.grad_clip=0", "trainer.micro_batch_size=2"],  # no clip; two micro-batches accumulate in .grad
    ["model.arch.tie_word_embeddings=true", "trainer.micro_batch_size=1"],  # one tensor, two uses, four micro-batches
], ids=["clipped", "unclipped_gas2", "tied_gas4"])
def test_zero0_follows_the_zero2_trajectory_at_world_1(tmp_path, extra):
    ref = train(tmp_path, "zero2", 1, W1 + ["deepspeed=zero2"] + extra)
    assert len({r["loss"] for r in ref}) == 5  # the model trains: losses change every step
    got = train(tmp_path, "zero0", 1, W1 + ["deepspeed=zero0"] + extra)
    assert_same_trajectory(got, ref, f"zero0 {extra}")


def test_zero0_resumes_the_same_trajectory_and_exports_its_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM
    from engine.checkpoints.export import export_hf_from_checkpoint
    extra = W1 + ["deepspeed=zero0"]
    full = train(tmp_path, "full", 1, extra + ["trainer.export_hf=true", "trainer.save_at_end=true"])
    first = train(tmp_path, "resumed", 1, extra + ["trainer.save_every=3", "trainer.stop_after_steps=3"])
    assert [r["step"] for r in first] == [1, 2, 3]
    both = train(tmp_path, "resumed", 1, extra)
    assert [r["step"] for r in both] == [1, 2, 3, 4, 5]
    for got, ref in zip(both[3:], full[3:]):  # Adam's moments and step count came back with the weights
        assert got["loss"] == ref["loss"] and got["grad_norm"] == ref["grad_norm"], (got, ref)
    run_export = AutoModelForCausalLM.from_pretrained(tmp_path / "full" / "hf_export").state_dict()
    from_ckpt = AutoModelForCausalLM.from_pretrained(export_hf_from_checkpoint(tmp_path / "full")).state_dict()
    assert run_export.keys() == from_ckpt.keys()
    for key, value in run_export.items():
        assert torch.equal(from_ckpt[key], value), key


def _params(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in ((7, 5), (5,), (3, 4, 2))]


@pytest.mark.parametrize("clip", [0.0, 0.5, 100.0])
def test_clipping_adamw_is_torch_clip_then_adamw(clip):
    ours, ref = _params(0), _params(0)
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt, ref_opt = ClippingAdamW(ours, clip, **kw), torch.optim.AdamW(ref, **kw)
    for step in range(3):
        g = torch.Generator().manual_seed(10 + step)
        for p, q in zip(ours, ref):
            p.grad = torch.randn(p.shape, generator=g) * 3
            q.grad = p.grad.clone()
        want_norm = torch.linalg.vector_norm(torch.stack([q.grad.norm() for q in ref]))
        if clip:
            torch.nn.utils.clip_grad_norm_(ref, clip)  # the same max(1, (norm + 1e-6) / clip) as DeepSpeed
        opt.step()
        ref_opt.step()
        assert float(opt._global_grad_norm) == pytest.approx(float(want_norm), rel=1e-6)
        for p, q in zip(ours, ref):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_a_non_finite_gradient_shows_in_the_norm():
    params = _params(1)
    opt = ClippingAdamW(params, 1.0, lr=1e-3)
    for p in params:
        p.grad = torch.ones_like(p)
    params[1].grad[0] = float("nan")
    opt.step()
    assert not torch.isfinite(opt._global_grad_norm)  # the loop's on_nonfinite=abort reads this norm


@pytest.mark.parametrize("extra,world,match", [
    ([], 2, r"deepspeed=zero0 runs on one rank only \(got a world of 2\)"),
    (["precision=bf16"], 1, r"master weights are the model's bf16 .* set deepspeed.master_weights=bf16"),
    (["deepspeed.offload_optimizer=true"], 1, r"deepspeed=zero0 keeps everything on the device"),
])
def test_zero0_refusals_name_the_fix(extra, world, match):
    cfg = compose_config(BASE + ["parallelism.cp=1", "deepspeed=zero0"] + extra)
    with pytest.raises(ConfigError, match=match):
        validate(cfg, world)
    if extra == ["precision=bf16"]:  # with the master weights it names, the same run validates
        validate(compose_config(BASE + ["parallelism.cp=1", "deepspeed=zero0", "precision=bf16",
                                        "deepspeed.master_weights=bf16"]), 1)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_zero0_checkpoint_resumes_on_two_ranks_exactly(tmp_path, tied):
    """1 rank (zero0) -> 2 ranks (ZeRO-3, cp=2): the module state and the torch optimizer's moments become
    DeepSpeed's universal folder (engine/checkpoints/reshard.py), and the trajectory continues the uninterrupted
    2-rank run's. A tied weight has one optimizer entry under two state names."""
    extra = ["model.arch.tie_word_embeddings=true"] if tied else []
    ref = train(tmp_path, "ref", 2, ["parallelism.cp=2"] + extra)
    train(tmp_path, "one", 1, W1 + extra + ["deepspeed=zero0", "trainer.save_every=2", "trainer.stop_after_steps=2"])
    got = train(tmp_path, "one", 2, ["parallelism.cp=2"] + extra)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5]
    assert_same_trajectory(got, ref, f"zero0 on 1 rank, resumed on 2 (tied={tied})")
    assert not (tmp_path / "one" / "checkpoints" / "universal").exists()  # the converted copy is deleted


def test_a_zero0_checkpoint_under_zero2_is_refused_before_the_build_with_the_export_route(tmp_path):
    train(tmp_path, "one", 1, W1 + ["deepspeed=zero0", "trainer.save_every=2", "trainer.stop_after_steps=2"])
    with pytest.raises(Exception, match=r"holds deepspeed=zero0 optimizer state .*this run has 1 rank\(s\) at "
                                        r"ZeRO-2.* scripts/export_hf.py"):
        train(tmp_path, "one", 1, W1 + ["deepspeed=zero2"])  # DeepSpeed's universal format loads into ZeRO-3 only


def test_the_readme_one_gpu_zero0_line_validates_at_world_1():
    from pathlib import Path
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    start = text.index("deepspeed --num_gpus 1 --no_local_rank scripts/train.py")
    line = text[start:text.index("\n\n", start)].replace("\\\n", " ").split("#")[0]  # less its `# GPU` mark
    overrides = line.split("scripts/train.py", 1)[1].split()
    assert "deepspeed=zero0" in overrides
    plan = validate(compose_config(overrides), world_size=1)
    assert (plan.zero_stage, plan.cp, plan.seq_len) == (0, 1, 32768)


def test_skip_nonfinite_leaves_weights_moments_and_step_count_and_tells_deepspeed():
    params = _params(2)
    opt = ClippingAdamW(params, 1.0, skip_nonfinite=True, lr=1e-2)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    assert opt.overflow is False
    before = [p.detach().clone() for p in params]
    state = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
    params[2].grad[0, 0, 0] = float("inf")
    opt.step()
    assert opt.overflow is True  # DeepSpeed's engine then counts a skipped step and holds the lr schedule
    for p, b, st in zip(params, before, state):
        assert torch.equal(p, b)
        for k, v in st.items():
            assert torch.equal(opt.state[p][k], v), k
    params[2].grad[0, 0, 0] = 1.0
    opt.step()
    assert opt.overflow is False and not torch.equal(params[0], before[0])


@pytest.mark.parametrize("balance", ["aux", "bias"])
def test_zero0_follows_zero2_on_an_moe_model(tmp_path, balance):
    """The balance statistics, the aux loss (balance=aux) and the router-bias update after each step (balance=bias)
    are the model's: ZeRO-0 must leave them as ZeRO-2 does."""
    from test_moe_engine import assert_same, train as train_moe
    extra = W1 + ["model=tiny_moe", f"moe.balance={balance}"]
    if balance == "bias":  # BASE's aux coefficient back to the default: balance=bias never reads it
        extra += ["moe.bias_update_rate=0.01", "moe.aux_loss_coef=1e-3"]
    ref = train_moe(tmp_path, "zero2", 1, extra + ["deepspeed=zero2"])
    got = train_moe(tmp_path, "zero0", 1, extra + ["deepspeed=zero0"])
    assert len({r["loss"] for r in ref}) == 5
    keys = ("loss", "grad_norm", "moe_imbalance") + (("moe_aux_loss",) if balance == "aux" else ())
    assert_same(got, ref, f"zero0 vs zero2, MoE balance={balance}", keys=keys)



def test_an_moe_zero0_checkpoint_resumes_on_two_ranks_with_its_router_bias(tmp_path):
    """The routers' bias is a buffer (moe.balance=bias): not an optimizer entry, restored from the model state."""
    from test_moe_engine import assert_same, train as train_moe
    extra = ["model=tiny_moe", "moe.balance=bias", "moe.bias_update_rate=0.01", "moe.aux_loss_coef=1e-3"]
    ref = train_moe(tmp_path, "ref", 2, extra + ["parallelism.cp=2"])
    train_moe(tmp_path, "one", 1,
              extra + W1 + ["deepspeed=zero0", "trainer.save_every=2", "trainer.stop_after_steps=2"])
    got = train_moe(tmp_path, "one", 2, extra + ["parallelism.cp=2"])
    assert_same(got, ref, "MoE zero0 on 1 rank, resumed on 2", keys=("loss", "grad_norm", "moe_imbalance"))



def _clip_and_skip_in_bf16(device):
    from engine.ds.clipping_adamw import ClippingAdamW
    g = torch.Generator(device=device).manual_seed(0)
    shapes = ((256, 128), (128,), (64, 32, 8))
    # small weights: their bf16 spacing (~4e-5) is far under the updates (lr 1e-2), which are what is compared
    ours = [torch.nn.Parameter((torch.randn(s, generator=g, device=device) * 0.01).bfloat16()) for s in shapes]
    ref = [torch.nn.Parameter(p.detach().float().clone()) for p in ours]
    start = [q.detach().clone() for q in ref]
    # eps near the clipped gradients' size (~2e-3): Adam's update is then not scale-free, so a missing clip shows
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-3, weight_decay=0.1)
    opt, ref_opt = ClippingAdamW(ours, 0.5, skip_nonfinite=True, **kw), torch.optim.AdamW(ref, **kw)
    for step in range(3):
        for p, q in zip(ours, ref):
            p.grad = (torch.randn(p.shape, generator=g, device=device) * 3).bfloat16()
            q.grad = p.grad.float()
        norm = torch.nn.utils.clip_grad_norm_(ref, 0.5)
        opt.step()
        assert float(opt._global_grad_norm) == pytest.approx(float(norm), rel=1e-5)
        ref_opt.step()
        assert opt.overflow is False
        for p, q, q0 in zip(ours, ref, start):  # bf16 weights and moments against fp32 ones: bf16 tolerance
            moved = (q.detach() - q0).norm()
            assert float((p.detach().float() - q.detach()).norm() / moved) < 2e-2, step  # measured 3e-3
    before = [p.detach().clone() for p in ours]
    ours[0].grad[0, 0] = float("nan")
    opt.step()
    assert opt.overflow is True and all(torch.equal(p, b) for p, b in zip(ours, before))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA only: the device's build of the fused kernel"))])
def test_zero0_optimizer_clips_and_skips_in_bf16(device):
    """deepspeed=zero0's ClippingAdamW on bf16 parameters, as a bf16 run uses it: the clip as a device scalar inside
    torch's fused kernel against torch's clip_grad_norm_ + AdamW on fp32 copies, and a non-finite norm skipping."""
    _clip_and_skip_in_bf16(device)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only: a Triton kernel")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_adamw_step_matches_torch_fused_adamw(dtype):
    """engine/ds/adamw_kernel.py's AdamW step against torch's fused AdamW, each step from the same state (a rounding
    flip compounds over a trajectory: bf16 Adam states part by ~7 ulps in 10 steps between two fp32-math
    implementations), with weight decay, several tensor sizes, and one step with a gradient scale. Both do the math in
    fp32 (torch's partly in double) and round at the store, so they agree to `ulps` of the value's dtype (one
    rounding flip in bf16) on all but a few elements. The state's step counts advance as torch's do."""
    from engine.ds.adamw_kernel import adamw_step
    from engine.ds.clipping_adamw import adopt_state, ulps
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(3, 5000), (7,), (128, 64, 33)]  # sizes that end inside a block, and one of several blocks
    ref = [torch.nn.Parameter(torch.randn(s, generator=gen, device="cuda", dtype=dtype)) for s in shapes]
    ours = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    kw = dict(lr=1e-2, weight_decay=0.1, betas=(0.8, 0.95), eps=1e-6)
    ref_opt, our_opt = torch.optim.AdamW(ref, fused=True, **kw), torch.optim.AdamW(ours, **kw)
    eps = torch.finfo(dtype).eps * ulps(dtype)
    for step in range(1, 7):
        scale = torch.tensor(4.0, device="cuda") if step == 5 else None
        for r, o in zip(ref, ours):
            g = torch.randn(r.shape, generator=gen, device="cuda", dtype=dtype)
            r.grad, o.grad = g.clone(), g.clone()
        ref_opt.grad_scale = scale
        ref_opt.step()
        adamw_step(our_opt, grad_scale=scale)
        for r, o in zip(ref, ours):
            a, b = r.detach().float(), o.detach().float()
            diff = (a - b).abs() / a.abs().clamp_min(1e-2)
            assert float(diff.max()) <= eps, (step, float(diff.max()) / eps)
            if dtype == torch.bfloat16:  # fp32 values differ in their last bits widely (24% measured), bf16 rarely
                assert float((diff > 0).float().mean()) < 0.05, step
            for key in ("exp_avg", "exp_avg_sq"):  # at the tensor's scale: a moment that nearly cancels keeps the
                m, n = ref_opt.state[r][key].float(), our_opt.state[o][key].float()  # rounding of its terms
                assert float((m - n).abs().max() / m.abs().max()) <= eps, (step, key)
            assert float(our_opt.state[o]["step"]) == step
            adopt_state(our_opt, o, ref_opt, r)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only: a Triton kernel")
def test_clipping_adamw_takes_the_triton_step_on_cuda(monkeypatch):
    """ClippingAdamW on CUDA runs the Triton step (its first-use check passes on this GPU) and not torch's."""
    from engine.ds import clipping_adamw
    assert clipping_adamw.triton_step_ok(torch.device("cuda", torch.cuda.current_device()), torch.bfloat16)
    calls = []
    real = clipping_adamw.adamw_step  # the name ClippingAdamW.step calls (imported once, at module level)
    monkeypatch.setattr(clipping_adamw, "adamw_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda *a, **k: pytest.fail("torch's AdamW step ran"))
    p = torch.nn.Parameter(torch.randn(1000, device="cuda", dtype=torch.bfloat16))
    p.grad = torch.randn_like(p)
    before = p.detach().clone()
    ClippingAdamW([p], 1.0, lr=1e-2).step()
    assert calls == [1] and not torch.equal(p.detach(), before)


def test_triton_step_counts_on_the_host_and_reads_the_device_once(monkeypatch):
    """The Triton step's bias corrections come from a host copy of each step count: read from the state tensor once
    (a new tensor, e.g. after load_state_dict) and counted on the host after that, with no further device read (the
    first version's WeakKeyDictionary compared keys with tensor ==, a host sync per lookup)."""
    from engine.ds.adamw_kernel import _host_step
    reads = []
    real_item = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda self: reads.append(1) or real_item(self))
    step = torch.tensor(5.0)  # a loaded state at step 5, just advanced to 6 by the step's device add
    step += 1
    assert _host_step(step) == 6 and len(reads) == 1
    for expected in (7, 8, 9):
        step += 1
        assert _host_step(step) == expected
    assert len(reads) == 1
    loaded = step.clone()  # load_state_dict brings new tensors: read again
    loaded += 1
    assert _host_step(loaded) == 10 and len(reads) == 2


# trainer.optimizer_in_backward: each parameter steps inside backward as its gradient completes. The reference is
# the same zero0 run stepping after backward: the same AdamW kernel on the same gradient gives the same weights, so
# the losses agree to fp32 rel 1e-5 (to the bit on CPU in practice); the logged norm sums the same squares in
# another order.
IN_BWD = W1 + ["deepspeed=zero0", "trainer.grad_clip=0", "trainer.micro_batch_size=4"]


@pytest.mark.parametrize("extra", [[], ["model.arch.tie_word_embeddings=true"], ["model=tiny_moe"]],
                         ids=["untied", "tied", "moe"])
def test_optimizer_in_backward_follows_the_step_after_backward(tmp_path, extra):
    if extra == ["model=tiny_moe"]:
        from test_moe_engine import train as run
    else:
        run = train
    ref = run(tmp_path, "after", 1, IN_BWD + extra)
    assert len({r["loss"] for r in ref}) == 5
    got = run(tmp_path, "inside", 1, IN_BWD + extra + ["trainer.optimizer_in_backward=true"])
    assert_same_trajectory(got, ref, f"optimizer in backward {extra}")


@pytest.mark.parametrize("device,dtype", [("cpu", torch.float32), pytest.param("cuda", torch.bfloat16, marks=(
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only: the Triton step inside backward")))])
def test_optimizer_in_backward_steps_each_tensor_once_and_frees_its_gradient(device, dtype):
    """The module-level contract on a tied toy model: the weights after three steps equal the step-after-backward
    ones bit for bit (on CUDA both through the Triton step), at most one gradient is alive whenever a hook steps (so
    backward never holds them all), and the shared weight (two uses) steps once per backward."""
    def model(seed):
        torch.manual_seed(seed)
        emb = torch.nn.Embedding(11, 64).to(device, dtype)
        mid = torch.nn.Linear(64, 64).to(device, dtype)
        return emb, mid

    def loss_of(emb, mid, ids):
        h = torch.tanh(mid(emb(ids)))
        return (h @ emb.weight.t()).logsumexp(-1).sum()  # the embedding used again as the head: tied

    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ref_mods, our_mods = model(0), model(0)
    ref_params = [p for m in ref_mods for p in m.parameters()]
    our_params = [p for m in our_mods for p in m.parameters()]
    ref_opt, our_opt = ClippingAdamW(ref_params, 0.0, **kw), ClippingAdamW(our_params, 0.0, **kw)
    alive = []  # hooks run in the order registered: these see each gradient just before ours steps it
    for p in our_params:
        p.register_post_accumulate_grad_hook(lambda _: alive.append(sum(q.grad is not None for q in our_params)))
    our_opt.step_in_backward()
    for step in range(3):
        ids = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(step)).to(device)
        loss_of(*ref_mods, ids).backward()
        ref_norm = torch.nn.utils.get_total_norm([p.grad.float() for p in ref_params])
        ref_opt.step()
        ref_opt.zero_grad()
        loss_of(*our_mods, ids).backward()
        assert all(p.grad is None for p in our_params)
        our_opt.step()
        torch.testing.assert_close(our_opt._global_grad_norm.float(), ref_norm.float(), rtol=1e-5, atol=0)
        for p, q in zip(our_params, ref_params):
            assert torch.equal(p, q)
    assert alive == [1] * (3 * len(our_params)), alive  # one gradient at a time, each tensor once per backward
    assert [float(our_opt.state[p]["step"]) for p in our_params] == [3.0] * len(our_params)


@pytest.mark.parametrize("extra,match", [
    (["deepspeed=zero2"], r"needs deepspeed=zero0 \(got deepspeed.zero_stage=2"),
    (["trainer.grad_clip=1.0"], r"cannot clip by it \(got trainer.grad_clip=1.0\)"),
    (["trainer.micro_batch_size=2"], r"one micro-batch per optimizer step \(got 2"),
    (["trainer.on_nonfinite=skip"], r"trainer.on_nonfinite=skip could not leave the step undone"),
])
def test_optimizer_in_backward_refusals_name_the_fix(extra, match):
    ok = BASE + IN_BWD + ["trainer.optimizer_in_backward=true"]
    validate(compose_config(ok), 1)
    with pytest.raises(ConfigError, match=match):
        validate(compose_config(ok + extra), 1)


def test_optimizer_in_backward_resumes_the_same_trajectory(tmp_path):
    """A checkpoint of a run stepping in backward holds torch's AdamW state as the step after backward does: the
    resumed run's hooks step from the loaded moments and counts, and its steps 4-5 equal the uninterrupted run's."""
    extra = IN_BWD + ["trainer.optimizer_in_backward=true"]
    full = train(tmp_path, "full", 1, extra)
    first = train(tmp_path, "resumed", 1, extra + ["trainer.save_every=3", "trainer.stop_after_steps=3"])
    assert [r["step"] for r in first] == [1, 2, 3]
    both = train(tmp_path, "resumed", 1, extra)
    assert [r["step"] for r in both] == [1, 2, 3, 4, 5]
    for got, ref in zip(both[3:], full[3:]):
        assert got["loss"] == ref["loss"] and got["grad_norm"] == ref["grad_norm"], (got, ref)


def test_in_backward_norm_slots_sum_to_the_norm_and_never_go_stale(monkeypatch):
    """The Triton step's norm bookkeeping, on CPU: a stand-in for the kernel writes each block's squared sum into the
    slots ClippingAdamW hands it (as engine/ds/adamw_kernel.py's does on CUDA). The logged norm is the gradients'
    norm; the slots are zeroed at each step, so a parameter that gets no gradient in the next backward adds nothing
    stale; each parameter has its own slots, of norm_slots(numel) blocks."""
    from engine.ds import adamw_kernel, clipping_adamw
    monkeypatch.setattr(clipping_adamw, "triton_step_ok", lambda device, dtype: True)
    handed = {}

    def kernel_stand_in(opt, grad_scale=None, sq_out=None):
        (p,) = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
        (slots,) = sq_out
        blocks = adamw_kernel.norm_slots(p.numel())
        assert slots.numel() == blocks and slots.dtype == torch.float32
        padded = torch.zeros(blocks * adamw_kernel.BLOCK)
        padded[:p.numel()] = p.grad.reshape(-1).float()
        slots.copy_(padded.view(blocks, -1).pow(2).sum(1))
        handed[id(p)] = slots.data_ptr()
        p.data.add_(p.grad, alpha=-0.01)
    monkeypatch.setattr(clipping_adamw, "adamw_step", kernel_stand_in)
    torch.manual_seed(0)
    big = torch.nn.Parameter(torch.randn(3 * adamw_kernel.BLOCK + 5))  # four blocks, the last one partial
    small = torch.nn.Parameter(torch.randn(7))
    opt = ClippingAdamW([big, small], 0.0, lr=1e-2)
    opt.step_in_backward()
    expected = torch.cat([big.detach(), 3 * small.detach() ** 2]).norm()  # the gradients of the loss below
    ((big * big.detach()).sum() + (small ** 3).sum()).backward()  # both get a gradient
    opt.step()
    assert len(set(handed.values())) == 2  # each parameter its own slots
    torch.testing.assert_close(opt._global_grad_norm, expected, rtol=1e-5, atol=0)
    assert float(opt._sq_slots.abs().sum()) == 0.0
    small_grad = 3 * small.detach() ** 2
    (small ** 3).sum().backward()  # `big` gets no gradient this time: its slots must not count the last step's
    opt.step()
    torch.testing.assert_close(opt._global_grad_norm, small_grad.norm(), rtol=1e-5, atol=0)

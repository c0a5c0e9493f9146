"""State an MoE model holds besides its parameters survives every path that loads it back (issue 24, items 1-2).

The only such state a `moe.*` setting leaves is `moe.balance=bias`'s router `expert_bias` (a persistent fp32
buffer, used for the top-k selection only). The trained model's logits (world 1, 3 steps at rate 0.5, so the
bias moves far) are the reference: the run's export loaded by our `model.source=pretrained` build (with
balance=bias, and with balance=aux as scripts/eval_retrieval.py builds it) and by `LatentMoeForCausalLM
.from_pretrained` must give them within fp32 rel 1e-5; stock HF Qwen3-MoE / GPT-OSS classes have no such buffer,
so the export says so (config.json note, a warning at export) and stock HF reports the keys as unexpected.
`balance=aux` leaves no state: its export is stock HF's model exactly. Resharding MoE runs: tests/test_moe_engine.py.
"""
import json
import logging

import pytest
import torch

from dist_harness import run_ranks
from test_engine import _run
from test_moe_engine import BASE as MOE_BASE

BASE = [o for o in MOE_BASE if not o.startswith("moe.aux_loss_coef")]  # read under balance=aux only

RTOL = 1e-5
IDS = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
POSITIONS = torch.arange(24).expand(2, 24)  # our CP forward asks for them, even at cp=1
ROUTER = {"tiny_moe": "gate", "tiny_gpt_oss": "router", "tiny_latent_moe": "gate"}
LAYERS = {"tiny_moe": 4, "tiny_gpt_oss": 2, "tiny_latent_moe": 2}


def _logits(hf) -> torch.Tensor:
    with torch.no_grad():
        return hf.eval()(input_ids=IDS, position_ids=POSITIONS).logits.float()


def _train_keeping_logits(rank, world, overrides, path):
    import engine.run.train as loop
    build, kept = loop.build, {}

    def build_and_keep(*args, **kwargs):
        built = build(*args, **kwargs)
        kept["hf"] = built[1]
        return built
    loop.build = build_and_keep
    _run(rank, world, overrides)
    torch.save(_logits(kept["hf"]), path)


def _build_keeping_logits(rank, world, overrides, path):
    """Our loader as a run uses it (engine/ds/build.py), without training."""
    from configs import compose_config, validate
    from ds_ulysses_ext import init_topology
    from engine.ds.build import build
    from engine.ds.distributed import init_distributed, read_runtime
    cfg = compose_config(overrides)
    plan = validate(cfg, world)
    init_distributed(read_runtime("cpu"))
    _, hf, _ = build(cfg, plan, init_topology(plan.cp, plan.ep, plan.ring), torch.device("cpu"))
    torch.save(_logits(hf), path)


def _rel(got, ref) -> float:
    return float((got - ref).norm() / ref.norm())


def _bias_keys(model):
    return {f"model.layers.{i}.mlp.{ROUTER[model]}.expert_bias" for i in range(LAYERS[model])}


@pytest.mark.parametrize("model", ["tiny_moe", "tiny_gpt_oss", "tiny_latent_moe"])
def test_the_router_bias_survives_the_export(tmp_path, model, caplog):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from ds_ulysses_ext.moe.latent_model import LatentMoeForCausalLM, register_latent_moe
    from engine.checkpoints.export import export_hf_from_checkpoint
    out = tmp_path / "run"
    common = [f"model={model}", "parallelism.cp=1", "trainer.max_steps=3"]
    run_ranks(_train_keeping_logits, 1, BASE + common + [
        f"run.out_dir={out}", "moe.balance=bias", "moe.bias_update_rate=0.5", "trainer.export_hf=true",
        "trainer.save_at_end=true"], str(tmp_path / "trained.pt"))
    trained = torch.load(tmp_path / "trained.pt")
    export = out / "hf_export"
    state = load_file(str(export / "model.safetensors"))
    assert all(state[k].abs().max() > 0.4 for k in _bias_keys(model)), "the bias must have moved far"

    # our loader: a run from the export, asking for balance=bias, or not asking (eval_retrieval's default aux)
    for balance in ("bias", "aux"):
        run_ranks(_build_keeping_logits, 1, BASE + common + [
            f"run.out_dir={tmp_path / balance}", "model.source=pretrained", f"model.path={export}",
            f"moe.balance={balance}"], str(tmp_path / f"{balance}.pt"))
        got = torch.load(tmp_path / f"{balance}.pt")
        assert _rel(got, trained) < RTOL, (balance, _rel(got, trained))

    # scripts/export_hf.py, from the checkpoint: the same folder, with the same warning
    with caplog.at_level(logging.WARNING):
        again = export_hf_from_checkpoint(out, export_dir=tmp_path / "from_ckpt")
    assert load_file(str(again / "model.safetensors")).keys() == state.keys()

    register_latent_moe()
    hf, info = AutoModelForCausalLM.from_pretrained(export, output_loading_info=True, dtype=torch.float32)
    note = json.loads((export / "config.json").read_text()).get("ds_ulysses_ext_note", "")
    if model == "tiny_latent_moe":  # our own class: it reads the bias itself
        assert isinstance(hf, LatentMoeForCausalLM) and not info["unexpected_keys"] and not note
        assert _rel(_logits(hf), trained) < RTOL
        assert "expert_bias" not in caplog.text
    else:  # stock HF has no such buffer: the export says so, and HF reports the keys
        assert info["unexpected_keys"] == _bias_keys(model)
        assert "expert_bias" in note and "model.source=pretrained" in note
        assert "expert_bias" in caplog.text and "stock" in caplog.text
        assert _rel(_logits(hf), trained) > 1e-3  # routing without the bias: another model


@pytest.mark.parametrize("model", ["tiny_moe", "tiny_gpt_oss"])
def test_an_export_without_state_is_stock_hf_exactly(tmp_path, model):
    from transformers import AutoModelForCausalLM
    out = tmp_path / "run"
    run_ranks(_train_keeping_logits, 1, BASE + [f"model={model}", "parallelism.cp=1", "trainer.max_steps=2",
                                                f"run.out_dir={out}", "trainer.export_hf=true"],
              str(tmp_path / "trained.pt"))
    hf, info = AutoModelForCausalLM.from_pretrained(out / "hf_export", output_loading_info=True, dtype=torch.float32)
    assert not any(info.values())
    assert "ds_ulysses_ext_note" not in json.loads((out / "hf_export" / "config.json").read_text())
    assert _rel(_logits(hf), torch.load(tmp_path / "trained.pt")) < RTOL


def test_an_unknown_key_in_an_export_is_refused(tmp_path):
    """A tensor our model does not take must not be dropped in silence."""
    from safetensors.torch import load_file, save_file
    out = tmp_path / "run"
    run_ranks(_train_keeping_logits, 1, BASE + ["model=tiny_moe", "parallelism.cp=1", "trainer.max_steps=1",
                                                f"run.out_dir={out}", "trainer.export_hf=true"],
              str(tmp_path / "trained.pt"))
    path = out / "hf_export" / "model.safetensors"
    state = load_file(str(path))
    state["model.layers.0.mlp.gate.some_state"] = torch.ones(8)
    save_file(state, str(path), metadata={"format": "pt"})
    with pytest.raises(Exception, match=r"model.layers.0.mlp.gate.some_state"):
        run_ranks(_build_keeping_logits, 1, BASE + ["model=tiny_moe", "parallelism.cp=1", f"run.out_dir={out}",
                                                    "model.source=pretrained", f"model.path={out / 'hf_export'}"],
                  str(tmp_path / "x.pt"))


def test_the_expert_bias_stays_fp32_in_a_bf16_model():
    """Updates of 1e-3 vanish in bf16; our block replacement casts the block to the model's dtype."""
    from tiny_models import tiny_model
    from ds_ulysses_ext.moe import moe_blocks
    from ds_ulysses_ext.moe.parallel import replace_hf_blocks
    model = tiny_model("qwen3_moe").to(torch.bfloat16)
    replace_hf_blocks(model, expert_bias=True)
    for block in moe_blocks(model):
        block.topk_router.expert_bias.fill_(1.0 + 2 ** -20)
    model.to(torch.float32).to(torch.bfloat16)
    assert all(b.topk_router.expert_bias.dtype == torch.float32 and
               b.topk_router.expert_bias[0].item() == 1.0 + 2 ** -20 for b in moe_blocks(model))


def test_a_reshard_restores_every_buffer_or_names_the_one_it_cannot(tmp_path):
    """Unit: engine/checkpoints/buffers.py against a model-states file as DeepSpeed writes it (module state + the
    names of its persistent buffers). The end-to-end reshard runs are in tests/test_moe_engine.py."""
    from tiny_models import tiny_model
    from ds_ulysses_ext.moe.parallel import replace_hf_blocks
    from engine.checkpoints.buffers import persistent_buffers, restore_from_checkpoint
    saved_model = tiny_model("qwen3_moe")
    replace_hf_blocks(saved_model, expert_bias=True)
    for i, buf in enumerate(persistent_buffers(saved_model).values()):
        buf.normal_(generator=torch.Generator().manual_seed(i))
    torch.save({"module": saved_model.state_dict(), "buffer_names": list(persistent_buffers(saved_model))},
               tmp_path / "mp_rank_00_model_states.pt")
    model = tiny_model("qwen3_moe")
    replace_hf_blocks(model, expert_bias=True)
    assert restore_from_checkpoint(model, tmp_path) == sorted(persistent_buffers(saved_model))
    for name, buf in persistent_buffers(model).items():
        assert torch.equal(buf, persistent_buffers(saved_model)[name]), name
    plain = tiny_model("qwen3_moe")
    replace_hf_blocks(plain)
    with pytest.raises(RuntimeError, match=r"model.layers.0.mlp.gate.expert_bias.* no place for"):
        restore_from_checkpoint(plain, tmp_path)  # a run without balance=bias would drop the saved bias
    torch.save({"module": plain.state_dict(), "buffer_names": []}, tmp_path / "mp_rank_00_model_states.pt")
    with pytest.raises(RuntimeError, match=r"no value for the model's buffer.*model.layers.0.mlp.gate.expert_bias"):
        restore_from_checkpoint(model, tmp_path)

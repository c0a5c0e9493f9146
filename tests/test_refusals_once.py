"""Unknown keys and refusals at the command line (issue 43): every config path of the tree refuses a key it has no
field for, given with Hydra's `+` or not, naming the field meant; a refusal is said once, without a traceback, by
scripts/train.py under torchrun and by scripts/plan.py."""
import dataclasses
import os
import subprocess
import sys

import pytest

from configs import ConfigError, TrainConfig, compose_config
from configs.compose import check_overrides
from configs.retrieval import RetrievalEvalConfig
from test_engine import ROOT, _free_port

sys.path.insert(0, str(ROOT / "scripts"))


def _nodes(schema, prefix=""):
    """Every dataclass node of the tree: "" (the top level), "trainer", "data.passkey", ..."""
    yield prefix
    for f in dataclasses.fields(schema):
        if dataclasses.is_dataclass(f.type):
            yield from _nodes(f.type, f"{prefix}{f.name}.")


NODES = sorted(_nodes(TrainConfig))  # "", "data.", "data.passkey.", ..., "logging.wandb.", ..., "trainer."


@pytest.mark.parametrize("node", NODES)
def test_every_node_refuses_an_unknown_key_with_or_without_plus(node):
    key = f"{node}no_such_key"
    with pytest.raises(ConfigError, match=rf"unknown key {key}: .* has no such field"):
        compose_config([f"+{key}=1"])  # Hydra adds it unchecked; the schema walk refuses it
    for given in (f"{key}=1", f"++{key}=1"):  # what scripts/train.py checks first, before Hydra composes
        with pytest.raises(ConfigError, match=rf"unknown key {key}:"):
            check_overrides([given])


def test_a_misspelt_key_names_the_field_meant_and_free_dicts_stay_free():
    fix = r"did you mean trainer\.max_steps\? Use trainer\.max_steps=5"
    for given in ("+trainer.max_step=5", "trainer.max_step=5"):
        with pytest.raises(ConfigError, match=fix):
            check_overrides([given])
    with pytest.raises(ConfigError, match=fix):
        compose_config(["+trainer.max_step=5"])
    with pytest.raises(ConfigError, match=r"data\.passkey\.key_length=3"):
        compose_config(["data=passkey", "+data.passkey.keylength=3"])
    # model.arch takes any HF config kwarg; presets, hydra.* and deletions are Hydra's to judge
    assert compose_config(["+model.arch.rope_theta=20000.0"]).model.arch["rope_theta"] == 20000.0
    check_overrides(["model=tiny", "experiment=cpu_moe", "hydra.run.dir=x", "~model.arch.head_dim", "--cfg", "job"])


def test_the_eval_script_refuses_unknown_keys_too():
    import eval_retrieval
    with pytest.raises(ConfigError, match=r"unknown key samples_per_cel: .*did you mean samples_per_cell"):
        eval_retrieval.compose(["+samples_per_cel=2"])
    with pytest.raises(ConfigError, match=r"did you mean samples_per_cell"):
        check_overrides(["samples_per_cel=2"], RetrievalEvalConfig)


def _said(cmd, tmp_path, **extra_env):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", **extra_env}
    env.pop("HYDRA_FULL_ERROR", None)
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


def test_hydras_own_refusal_is_said_once_under_torchrun(tmp_path):
    # ours are said by rank 0 alone (tests/test_run_folder.py); Hydra's too (a preset that does not exist)
    code, said = _said([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        str(_free_port()), str(ROOT / "scripts" / "train.py"), f"run.out_dir={tmp_path / 'run'}",
                        "model=no_such_preset"], tmp_path)
    assert code != 0 and said.count("Could not find 'model/no_such_preset'") == 1, said
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("rank, started, waits", [("1", False, True), ("1", True, False), ("0", False, False)])
def test_other_ranks_wait_for_rank0_when_hydra_refuses(rank, started, waits):
    # a rank that exits first makes the launcher stop rank 0 before it prints Hydra's error (seen under load: the
    # user got only the launcher's ChildFailedError); other ranks wait for rank 0 when Hydra exits before our main
    code = ("import atexit, sys, time; t = time.time(); "
            "atexit.register(lambda: sys.__stdout__.write(f'{time.time() - t:.2f}')); "  # runs last (LIFO)
            "from engine.run import refusal; refusal.RANK0_GRACE_S = 1.0; refusal.hush_other_ranks(); "
            f"{'refusal.hydra_started(); ' if started else ''}sys.exit(1)")
    env = {**os.environ, "RANK": rank}
    env.pop("HYDRA_FULL_ERROR", None)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert (float(proc.stdout) >= 1.0) == waits, (proc.stdout, proc.stderr)


def test_plan_says_a_wrong_preset_or_key_without_a_traceback(capsys):
    import plan
    for given, message in (("model=no_such_preset", "Could not find 'model/no_such_preset'"),
                           ("+trainer.max_step=5", "did you mean trainer.max_steps")):
        assert plan.main([given]) == 2
        said = capsys.readouterr().err
        assert message in said and "Traceback" not in said, said

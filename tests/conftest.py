import os
import sys
from pathlib import Path

# tests import the repo's packages and the harness without installing anything extra
ROOT = Path(__file__).resolve().parent.parent
for p in (str(ROOT), str(ROOT / "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("WANDB_MODE", "disabled")

# The files whose tests take longest in all (multi-rank training trajectories; from pytest --durations=0 on 2 cores)
# run first, longest first. pytest-xdist hands tests out in collection order, so a long test collected last leaves
# the other worker idle at the end; longest first is the usual fix for that. Only the order changes: every test
# still runs, and each is independent.
LONGEST_FIRST = ("test_moe_engine.py", "test_engine.py", "test_zero0.py", "test_moe_deepseek_train.py",
                 "test_passkey.py", "test_ring_engine.py", "test_passkey_learns.py", "test_damaged_checkpoints.py",
                 "test_eval.py", "test_bf16_training.py", "test_engine_packing.py", "test_configs.py",
                 "test_config_refusals.py", "test_moe_gpt_oss.py", "test_moe_state.py", "test_memory.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the order within a file is kept

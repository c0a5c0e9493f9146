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

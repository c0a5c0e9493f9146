"""scripts/trace_phases.py on a hand-made trace: per-phase host ops (nested ops counted once), GPU busy/idle."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from trace_phases import report  # noqa: E402


def _x(cat, name, ts, dur, tid=1):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}


def test_phase_breakdown():
    events = [
        _x("user_annotation", "phase.optimizer", 100, 50),
        _x("cpu_op", "aten::isfinite", 105, 10),
        _x("cpu_op", "aten::amax", 107, 2),        # nested in isfinite: not a top-level op
        _x("cpu_op", "aten::isfinite", 120, 10),
        _x("cpu_op", "aten::add_", 140, 20),       # ends after the phase: outside
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 110, "dur": 1, "pid": 1, "tid": 1},
        _x("gpu_user_annotation", "phase.optimizer", 1000, 40, tid=7),
        _x("kernel", "adam", 1005, 10, tid=7),
        _x("kernel", "adam", 1020, 5, tid=7),
        _x("gpu_memcpy", "copy", 1030, 5, tid=7),
        _x("kernel", "late", 1050, 5, tid=7),      # after the phase: outside
    ]
    text = report(events, top=5)
    assert "phase.optimizer host: span 0.05 ms, 2 top-level ops, 1 kernel launches" in text
    assert "0.02 ms  x2     aten::isfinite" in text and "amax" not in text and "add_" not in text
    assert "phase.optimizer GPU: span 0.04 ms, busy 0.02 ms, idle 0.02 ms, 3 kernels/copies" in text
    assert "late" not in text

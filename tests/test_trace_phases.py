"""scripts/bench/trace_phases.py on a hand-made trace: per-phase host ops (nested ops counted once), GPU busy/idle."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts" / "bench"))

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


def test_device_work_by_launch_and_kind():
    # backward's kernels are launched from autograd's thread (tid 2), outside the main thread's GPU range: they
    # belong to the phase whose host span holds their launch, matched by correlation id
    def launch(ts, corr, tid, cat="cuda_runtime"):
        return {"ph": "X", "cat": cat, "name": "cudaLaunchKernel", "ts": ts, "dur": 1, "pid": 1,
                "tid": tid, "args": {"correlation": corr}}

    def kernel(name, ts, dur, corr):
        return dict(_x("kernel", name, ts, dur, tid=7), args={"correlation": corr})

    events = [
        _x("user_annotation", "phase.backward", 100, 100),
        launch(110, 1, 2, "cuda_driver"), launch(120, 2, 2), launch(130, 3, 2),  # cuBLAS: the driver API
        launch(250, 4, 1),                                   # after the phase: its kernel is not backward's
        _x("gpu_user_annotation", "phase.backward", 1000, 2, tid=7),
        kernel("nvjet_sm90_tst_256x128", 1010, 30, 1),
        kernel("flash_bwd_kernel", 1040, 50, 2),
        kernel("_rms_norm_backward_kernel", 1090, 4, 3),
        kernel("void at::native::vectorized_elementwise_kernel<8, add>", 1095, 2, 3),
        kernel("nvjet_late", 1200, 9, 4),
    ]
    text = report(events, top=5)
    assert ("phase.backward GPU by launch: busy 0.09 ms in 4 kernels/copies: attention 0.05, gemm 0.03, "
            "Triton and other 0.00, torch elementwise / reduce 0.00") in text
    assert "phase.backward host: span 0.10 ms, 0 top-level ops, 3 kernel launches" in text  # cuBLAS's counted too
    assert "nvjet_late" not in text


def test_span_and_idle_of_device_work_by_launch_and_of_the_step():
    # forward launches on the main thread, backward on autograd's; a side-stream copy overlaps a kernel (counted
    # once), and the GPU waits 2 ms between the phases and 1 ms inside backward
    def launch(ts, corr, tid):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1, "pid": 1,
                "tid": tid, "args": {"correlation": corr}}

    def dev(cat, name, ts, dur, corr, tid=7):
        return dict(_x(cat, name, ts, dur, tid=tid), args={"correlation": corr})

    events = [
        _x("cpu_op", "aten::to", -500, 100),                            # the step's first host op: the GPU
        _x("cpu_op", "aten::item", 300, 18000),                         # waits 1.5 ms; the host ends 0.3 ms late
        _x("user_annotation", "phase.forward", 0, 100), launch(10, 1, 1), launch(20, 2, 1),
        _x("gpu_user_annotation", "phase.forward", 1000, 6000, tid=7),
        _x("user_annotation", "phase.backward", 200, 100), launch(210, 3, 2), launch(220, 4, 2), launch(230, 5, 2),
        dev("kernel", "nvjet_fwd", 1000, 4000, 1),
        dev("gpu_memcpy", "Memcpy DtoH", 3000, 3000, 2, tid=8),        # 1 ms past the kernel: busy 5 ms, span 5
        dev("kernel", "flash_bwd", 8000, 5000, 3),                      # 2 ms after the forward's last work
        dev("kernel", "nvjet_bwd", 14000, 3000, 4),                     # 1 ms idle before it
        dev("kernel", "_adamw", 17000, 1000, 5),
    ]
    text = report(events, top=5)
    assert "phase.forward GPU by launch: span 5.00 ms from its first kernel to its last, idle 0.00 ms" in text
    assert "phase.forward GPU: span 6.00 ms, busy 5.00 ms, idle 1.00 ms, 2 kernels/copies" in text
    assert "phase.backward GPU by launch: span 10.00 ms from its first kernel to its last, idle 1.00 ms" in text
    assert "step GPU (every phase's work by launch): span 17.00 ms, busy 14.00 ms, idle 3.00 ms" in text
    assert ("step ends: the GPU's first work started 1.50 ms after the first host op, its last ended 0.30 ms before "
            "the last host op ended") in text

"""engine.observe.memory_snapshot: the live set at a step's allocation peak, replayed from a CUDA allocator trace.

The replay is pure Python over the snapshot's dict, so it is checked here on hand-written traces whose peak and live
set are known by construction; the recorder itself needs CUDA and is refused elsewhere before the run starts."""
import pytest
import torch

from engine.observe.memory_snapshot import check_device, live_at_peak, report_text

MIB = 2 ** 20


def _frames(*sites):
    """Innermost first, as torch records them; torch's own frames come first and must be skipped."""
    return [{"filename": "/x/lib/python3.12/site-packages/torch/nn/functional.py", "line": 1, "name": "linear"}] + [
        {"filename": f, "line": line, "name": n} for f, line, n in sites]


MLP = _frames(("/x/lib/python3.12/site-packages/transformers/models/llama/modeling_llama.py", 150, "forward"))
HEAD = _frames(("/repo/ds_ulysses_ext/loss.py", 99, "forward"))


def _trace(*events):
    return {"device_traces": [[], [dict(zip(("action", "addr", "size", "frames"), e)) for e in events]]}


def test_the_live_set_is_taken_at_the_peak_not_at_the_end():
    trace = _trace(
        ("alloc", 1, 100 * MIB, MLP), ("alloc", 2, 50 * MIB, MLP), ("alloc", 3, 30 * MIB, HEAD),  # 180 MiB: the peak
        ("free_requested", 1, 100 * MIB, MLP), ("free_completed", 1, 100 * MIB, MLP),  # one free, counted once
        ("alloc", 4, 60 * MIB, HEAD),  # 140 MiB: below the peak
        ("segment_alloc", 9, 500 * MIB, HEAD),  # the allocator's reservations are not allocations
    )
    got = live_at_peak(trace, device=1, baseline_bytes=1000 * MIB)
    assert got["peak_bytes"] == 1180 * MIB and got["baseline_bytes"] == 1000 * MIB
    assert got["sites"] == [
        {"site": "transformers/models/llama/modeling_llama.py:150 forward", "tensors": 2, "bytes": 150 * MIB},
        {"site": "loss.py:99 forward", "tensors": 1, "bytes": 30 * MIB},
    ]
    text = report_text(got, step=2)
    assert "peak allocated 1.15 GiB" in text and "alive at the peak 0.18 GiB" in text
    assert text.index("modeling_llama.py:150") < text.index("loss.py:99")


def test_a_block_of_before_the_recording_lowers_the_count_once_when_freed():
    # the previous step's last activation (10 MiB), freed in this step: requested and completed, one block
    trace = _trace(("free_requested", 7, 10 * MIB, MLP), ("free_completed", 7, 10 * MIB, MLP),
                   ("alloc", 1, 5 * MIB, HEAD), ("alloc", 2, 6 * MIB, HEAD))
    got = live_at_peak(trace, device=1, baseline_bytes=100 * MIB)
    assert got["peak_bytes"] == 101 * MIB and [r["bytes"] for r in got["sites"]] == [11 * MIB]


def test_memory_snapshot_off_cuda_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"logging.memory_snapshot_step=2 .* set logging.memory_snapshot_step=0"):
        check_device(2, torch.device("cpu"))
    check_device(0, torch.device("cpu"))  # off: nothing to refuse


def test_a_cpu_run_asking_for_a_memory_snapshot_stops_before_the_build(tmp_path, monkeypatch):
    """Through scripts/train.py: the refusal comes before the model is built (build is never reached)."""
    import engine.run.train as loop
    from dist_harness import run_ranks
    from test_engine import BASE, _run

    def never(*args, **kwargs):
        raise AssertionError("the model was built")
    monkeypatch.setattr(loop, "build", never)  # the forked rank inherits the patch
    with pytest.raises(Exception, match=r"logging.memory_snapshot_step=1 records the CUDA allocator's history"):
        run_ranks(_run, 1, BASE + [f"run.out_dir={tmp_path}", "parallelism.cp=1", "logging.memory_snapshot_step=1"])


def test_a_block_freed_in_the_step_counts_once_so_a_later_peak_is_seen():
    # torch logs free_requested then free_completed for the same block: counted twice, the count would drop to
    # -100 MiB and the later 150 MiB block would look like no peak at all (a real step read 7.7 GiB for 12.2)
    trace = _trace(("alloc", 1, 100 * MIB, MLP), ("free_requested", 1, 100 * MIB, MLP),
                   ("free_completed", 1, 100 * MIB, MLP), ("alloc", 2, 150 * MIB, HEAD),
                   ("free_requested", 2, 150 * MIB, HEAD), ("alloc", 1, 120 * MIB, MLP),  # address 1 reused
                   ("free_completed", 2, 150 * MIB, HEAD), ("alloc", 3, 140 * MIB, MLP))  # 260 MiB: the peak
    got = live_at_peak(trace, device=1, baseline_bytes=0)
    assert got["peak_bytes"] == 260 * MIB
    assert got["sites"] == [{"site": "transformers/models/llama/modeling_llama.py:150 forward", "tensors": 2,
                             "bytes": 260 * MIB}]

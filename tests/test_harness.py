"""The multi-rank harness retries only gloo's mesh set-up failure, once; anything else fails the test."""
import os

import pytest
import torch.multiprocessing as mp

from dist_harness import run_ranks


def _flaky_once(rank, world, marker):
    if rank == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        raise RuntimeError("Gloo connectFullMesh failed with [pair.cc] Connection closed by peer")


def _always(rank, world, message):
    if rank == 1:
        raise RuntimeError(message)


def test_mesh_setup_failure_is_retried_once(tmp_path):
    marker = str(tmp_path / "failed_once")
    run_ranks(_flaky_once, 2, marker)
    assert os.path.exists(marker)


@pytest.mark.parametrize("message", ["Gloo connectFullMesh failed again", "a real bug"])
def test_other_or_repeated_failures_fail(message):
    with pytest.raises(mp.ProcessRaisedException, match=message):
        run_ranks(_always, 2, message)

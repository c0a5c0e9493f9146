"""A refused run, said once and short: the message (it names the key and the fix), on rank 0, and an exit status.

Every rank of a run reaches the same refusal (the config, the checkpoint's verdict and the folder are checked on
all of them, or decided together), so printing it on each, with a traceback, and Hydra's banner, repeats one
sentence world-size times inside 75-270 lines. HYDRA_FULL_ERROR=1 brings the tracebacks back, on every rank (it is
Hydra's own switch for the same thing).
"""
from __future__ import annotations

import atexit
import contextlib
import io
import os
import sys
import time

REFUSED_EXIT = 2  # the run did not start (or resume), as configured
STOPPED_EXIT = 1  # it started and stopped loudly (a non-finite step)
# how long a rank other than 0 waits before it exits with a refusal rank 0 is saying: the launcher stops every rank
# once one exits, so an early exit can cut rank 0 off before it prints (seen on a loaded 2-core machine: the user
# got only the launcher's ChildFailedError). Once rank 0 has said it and exited, the launcher ends the wait at once
RANK0_GRACE_S = 20.0
_hydra_started = False


class Refused(RuntimeError):
    """A run that must not start or resume as configured. The message names the key or file and the fix.

    `rank_local`: raised by one rank alone (a file that failed to read there), so that rank says it too."""

    rank_local = False


def rank_of_env() -> int:
    return int(os.environ.get("RANK", "0"))


def full_errors() -> bool:
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


@contextlib.contextmanager
def reported(rank: int | None = None):
    """Refusals and loud stops end the process with their message alone (rank 0, or the rank that raised it alone)."""
    from configs.errors import ConfigError
    from engine.data.errors import DataError
    from engine.observe.nonfinite import NonFiniteStep
    rank = rank_of_env() if rank is None else rank
    try:
        yield
    except (ConfigError, DataError, Refused, NonFiniteStep) as err:
        if full_errors():
            raise
        stopped = isinstance(err, NonFiniteStep)
        if rank == 0 or getattr(err, "rank_local", False):
            where = f"[rank{rank}] " if rank else ""
            print(f"{where}{'stopped' if stopped else 'refused'}: {err}\n(HYDRA_FULL_ERROR=1 shows the traceback of "
                  "each rank)", file=sys.stderr, flush=True)
        else:
            time.sleep(RANK0_GRACE_S)
        sys.exit(STOPPED_EXIT if stopped else REFUSED_EXIT)


def hush_other_ranks() -> None:
    """Before Hydra composes: its error for a bad command line (a preset that does not exist, a malformed
    override) is the same on every rank, and only rank 0's copy is shown. `hydra_started()` undoes it."""
    if rank_of_env() != 0 and not full_errors():
        sys.stderr = io.StringIO()
        atexit.register(_wait_for_rank0_if_hydra_refused)


def _wait_for_rank0_if_hydra_refused() -> None:
    if not _hydra_started:  # Hydra exited before our main: rank 0 is printing the same error
        time.sleep(RANK0_GRACE_S)


def hydra_started() -> None:
    global _hydra_started
    _hydra_started = True
    sys.stderr = sys.__stderr__

"""The per-forward check that CP is really active: each attention or linear-attention layer, after its exchange,
compares the tokens it sees with the batch's length the input check recorded (integrate.CPState).

Its own module, below both users: integrate.py (attention) imports linear_attention/, whose layers run the same
check, so it cannot live in integrate.py without a circle.
"""
from __future__ import annotations

import logging

# integrate.py's logger: the "context parallel active" line keeps the name it has always been logged under
log = logging.getLogger("ds_ulysses_ext.integrate")


def verify_length(state, local_len: int) -> None:
    exchanged = local_len * state.topology.cp_size
    if state.expected_global_len and exchanged != state.expected_global_len:
        raise RuntimeError(f"context parallelism is not active: attention saw {exchanged} tokens after "
                           f"the exchange, the batch holds {state.expected_global_len}")
    state.expected_global_len = 0
    if not state.logged and state.topology.rank == 0:
        log.info("context parallel active: cp=%d, local length %d, global length %d after the exchange",
                 state.topology.cp_size, local_len, exchanged)
    state.logged = True

"""Pure shape math for Ulysses: head splits, GQA KV replication, sequence padding. No process groups.

Legend: B batch, S global sequence, s local sequence (S / cp), Hq query heads, Hkv key/value heads,
hq = Hq / cp and hkv local heads after the exchange, D head dim, cp the context-parallel degree.
"""
from __future__ import annotations

from ..errors import UnsupportedError


def kv_replication(num_q_heads: int, num_kv_heads: int, cp: int) -> int:
    """How many copies of each KV head to send so that every rank gets whole KV heads.

    - Hkv % cp == 0: 1 (native GQA, each rank gets Hkv/cp KV heads and no repeat_kv).
    - cp % Hkv == 0: cp / Hkv, so each rank receives exactly one KV head: the one its hq query heads use.
      That is the least replication that keeps whole heads on each rank, and it lets cp grow up to Hq.
    Anything else cannot be split exactly and is refused with the valid cp values.
    """
    if num_q_heads % num_kv_heads:
        raise UnsupportedError(f"query heads {num_q_heads} are not a multiple of KV heads {num_kv_heads}")
    if num_q_heads % cp:
        raise UnsupportedError(
            f"cp={cp} does not divide the {num_q_heads} query heads: Ulysses gives each rank whole heads. "
            f"Choose cp in {valid_cp_values(num_q_heads, num_kv_heads)} (parallelism.cp)")
    if num_kv_heads % cp == 0:
        return 1
    if cp % num_kv_heads == 0:
        return cp // num_kv_heads
    raise UnsupportedError(
        f"cp={cp} and {num_kv_heads} KV heads: cp must divide the KV heads or be a multiple of them. "
        f"Choose cp in {valid_cp_values(num_q_heads, num_kv_heads)} (parallelism.cp)")


def valid_cp_values(num_q_heads: int, num_kv_heads: int) -> list[int]:
    return [cp for cp in range(1, num_q_heads + 1)
            if num_q_heads % cp == 0 and (num_kv_heads % cp == 0 or cp % num_kv_heads == 0)]


def padded_length(seq_len: int, cp: int) -> int:
    """Smallest multiple of cp that holds seq_len tokens."""
    return -(-seq_len // cp) * cp


def chunk_bounds(seq_len: int, cp: int, cp_rank: int) -> tuple[int, int]:
    """[start, end) of rank cp_rank's contiguous chunk of a sequence already padded to a multiple of cp."""
    if seq_len % cp:
        raise ValueError(f"sequence length {seq_len} is not a multiple of cp={cp}; pad it first")
    local = seq_len // cp
    return cp_rank * local, (cp_rank + 1) * local

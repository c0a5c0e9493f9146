"""Which linear-attention heads, and which conv channels, each CP rank holds after the exchange. Shape math only.

Legend: nk key heads (q and k have them), nv value heads (v, the decay, beta and the output have them; nv is a
multiple of nk and v head i reads key head i // (nv / nk)), dk / dv their head dims, cp the Ulysses degree,
hk = nk * rep / cp and hv = nv / cp heads per rank, rep the key-head replication.

The rule is the attention's GQA rule (attention/layout.py) with value heads in the role of query heads: rank j gets
value heads [j*hv, (j+1)*hv) and the key heads they read. When cp divides nk each rank gets nk / cp key heads and
nothing is copied; when cp is a multiple of nk every key head is sent rep = cp / nk times, so each rank receives the
one its value heads read (Qwen3.5's DeltaNet has half as many key heads as value heads, so this is what lets cp
reach nv). KDA (Ling-3.0) has one head count for all.

The conv runs per channel, and its channels are the mixed projection's [q heads | k heads | v heads] (nk*dk, nk*dk,
nv*dv): a rank convolves exactly the channels of the heads it holds, with those channels' weights.
"""
from __future__ import annotations

from ..errors import UnsupportedError


def linear_head_fields(config) -> tuple[int, int, str]:
    """(value heads, key heads, the config fields that set them) of a hybrid config's linear layers."""
    if hasattr(config, "linear_num_value_heads"):  # gated DeltaNet (Qwen3.5 / 3.6, Qwen3-Next)
        return (config.linear_num_value_heads, config.linear_num_key_heads,
                "linear_num_value_heads / linear_num_key_heads")
    heads = getattr(config, "linear_num_heads", None) or config.num_attention_heads  # KDA: one count for all
    return heads, heads, "num_attention_heads (its linear layers' heads too)"


def valid_linear_cp(num_v: int, num_k: int) -> list[int]:
    return [cp for cp in range(1, num_v + 1) if num_v % cp == 0 and (num_k % cp == 0 or cp % num_k == 0)]


def key_replication(num_v: int, num_k: int, cp: int, fields: str = "linear heads") -> int:
    """Copies of each key head to send (1, or cp / nk); refuses a cp that cannot give every rank whole heads."""
    if num_k < 1 or num_v % num_k:
        raise UnsupportedError(f"{fields} = {num_v} / {num_k}: the value heads must be a multiple of the key heads "
                               "(each value head reads one key head)")
    if num_v % cp == 0 and num_k % cp == 0:
        return 1
    if num_v % cp == 0 and cp % num_k == 0:
        return cp // num_k
    raise UnsupportedError(
        f"parallelism.cp={cp} cannot split the linear-attention heads ({fields} = {num_v} / {num_k}): Ulysses gives "
        "each rank whole value heads, and the key heads must split over cp or be copied to it (cp a multiple of "
        f"them). Choose parallelism.cp in {valid_linear_cp(num_v, num_k)}")


def local_heads(num_v: int, num_k: int, cp: int, rank: int) -> tuple[list[int], list[int]]:
    """(key heads, value heads) rank `rank` holds after the exchange, as global head indices."""
    rep = key_replication(num_v, num_k, cp)
    hk, hv = num_k * rep // cp, num_v // cp
    return [(rank * hk + i) // rep for i in range(hk)], [rank * hv + i for i in range(hv)]


def conv_channels(num_v: int, num_k: int, dk: int, dv: int, cp: int, rank: int) -> list[int]:
    """The conv channels (of nk*dk q | nk*dk k | nv*dv v) of the heads rank `rank` holds, in its exchanged order."""
    keys, values = local_heads(num_v, num_k, cp, rank)
    q = [h * dk + c for h in keys for c in range(dk)]
    k = [num_k * dk + i for i in q]
    v = [2 * num_k * dk + h * dv + c for h in values for c in range(dv)]
    return q + k + v

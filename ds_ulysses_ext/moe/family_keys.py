"""Which families' HF classes read the MoE config keys that our block reads beyond the keys every family has.

hf_moe_spec (parallel.py) reads these keys from any MoE config. HF's config classes keep an unknown key as a plain
attribute that their modeling never reads, so on a family whose HF class lacks the key we would train a model other
than HF's: `router_score=sigmoid` on qwen3_moe routes by sigmoid here and by softmax in HF, and the export of the
trained model then routes differently. Each key is therefore accepted only for the families listed on its line, and
refused on any other, at validate (configs/model.py) and at model load (hf_moe_spec). A family whose HF class reads
one of these keys adds itself to the key's line; a new key our block reads gets a line.
"""
from __future__ import annotations

from typing import Iterable

from ..errors import UnsupportedError

FAMILY_KEYS: dict[str, tuple[str, ...]] = {
    "router_score": ("latent_moe",),  # softmax | sigmoid (router.py)
    "latent_size": ("latent_moe",),
    "shared_expert_intermediate_size": ("latent_moe", "qwen3_next", "qwen3_5_moe_text"),
    # Megatron-Core's name for latent_size: no family here reads it
    "moe_latent_size": (),
}


def unread_keys(family: str, keys: Iterable[str]) -> list[str]:
    """The keys among `keys` that our block would read but `family`'s HF class does not."""
    return [k for k in keys if k in FAMILY_KEYS and family not in FAMILY_KEYS[k]]


def readers(key: str) -> str:
    return ", ".join(FAMILY_KEYS[key]) or "no supported family"


def check_family_keys(config) -> None:
    """At model load (config.json or arch): refuse a key the family's HF class would ignore and our block read."""
    family = getattr(config, "model_type", None)
    unread = unread_keys(family, [k for k in FAMILY_KEYS if hasattr(config, k)])
    if unread:
        key = unread[0]
        raise UnsupportedError(
            f"{key}={getattr(config, key)!r} in the {family} config: HF's {family} model never reads it (read by: "
            f"{readers(key)}), so the trained model would not be the HF model its export loads as. Remove {key} "
            "from the config (model.arch or config.json)")

"""Mixture-of-experts with expert parallelism next to context parallelism (docs/moe.md)."""
from .balance import imbalance, sequence_balance_terms, update_expert_bias
from .dispatch import AllToAllDispatcher
from .experts import RECOMPUTE_MODES, GroupedExperts
from .layer import MoEBlock, MoEContext, MoESpec, moe_blocks
from .router import SCORE_FUNCTIONS, TopKRouter

__all__ = ["MoEBlock", "MoEContext", "MoESpec", "moe_blocks", "GroupedExperts", "TopKRouter",
           "AllToAllDispatcher", "sequence_balance_terms", "update_expert_bias", "imbalance",
           "RECOMPUTE_MODES", "SCORE_FUNCTIONS"]

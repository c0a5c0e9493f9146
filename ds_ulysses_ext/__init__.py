"""ds_ulysses_ext: exact Ulysses context parallelism for HF models under DeepSpeed.

Public API (docs/design.md §2): init_topology, ulysses_attention, enable_context_parallel, shard_batch,
plus the CP loss helpers. Importing this package has no side effects.
"""
from .attention.ulysses import ulysses_attention
from .batch import IGNORE_INDEX, shard_batch, shift_labels
from .errors import UnsupportedError
from .integrate import enable_context_parallel
from .lm import CPCausalLM
from .loss import chunked_lm_loss_sum, cp_sum
from .models import SUPPORTED, check_model_config
from .topology import Topology, init_topology

__all__ = ["Topology", "init_topology", "ulysses_attention", "enable_context_parallel", "shard_batch",
           "shift_labels", "IGNORE_INDEX", "CPCausalLM", "chunked_lm_loss_sum", "cp_sum",
           "SUPPORTED", "check_model_config", "UnsupportedError"]

"""Linear-attention layers under context parallelism, in models that interleave them with full attention: Qwen3.5 /
3.6 and Qwen3-Next (gated DeltaNet), Ling-3.0 (`bailing_hybrid`, Kimi delta attention). ("Hybrid" here means that mix
of layer kinds, not the ring x Ulysses layout of attention/ring.py.) docs/linear_attention.md has the design.

Who calls whom (each module imports only those below it):
    bind.py        finds the linear layers, binds layer.py's forward on each instance (called by integrate.py), and
                   sets model.linear_attn_kernel on them
    checks.py      what such a model refuses: head splits, a ring, an mRoPE rotary with a length-dependent RoPE
    layer.py       one linear layer under Ulysses: the exchange, the conv and the recurrence on whole sequences
    families.py    how each HF linear-attention class projects, gates and finishes
    fla_kernels.py flash-linear-attention's chunked delta rules on CUDA (lazy import), checked at first use
    documents.py   packed documents as rows of their own (zero conv window and state at each start)
    delta_rule.py  the (gated) delta rule in torch, chunked: the exact reference
    heads.py       which heads and conv channels a rank holds
"""
from .bind import bind_linear_attention, linear_mixers, set_linear_attn_kernel
from .checks import check_linear_layers, linear_model_cp_values, refuse_ring

__all__ = ["bind_linear_attention", "linear_mixers", "set_linear_attn_kernel", "check_linear_layers",
           "linear_model_cp_values", "refuse_ring"]

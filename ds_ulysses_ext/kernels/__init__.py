"""Fused per-token kernels for the body of a decoder layer: RMSNorm (the layer norms and Qwen3's q/k norms) and the
SwiGLU product of dense MLPs, bound to the model INSTANCE (each module's `forward`), never to HF's classes.

Shapes: every op is per token. x [..., H] -> RMSNorm -> [..., H]; gate, up [..., I] -> silu(gate) * up -> [..., I].

`model.kernels` picks the provider: `none` keeps HF's eager modules (the exactness reference, what CPU runs);
`liger` Liger-Kernel's Triton kernels (RMSNorm's backward our own, kernels/rms_norm.py); `compile` torch.compile of
the reference functions (kernels.reference), each compiled once per shape; `auto` Liger where it is installed, else
compile, on CUDA only. Each provider is checked at first use against the reference in fp32 (kernels/providers.py).
Memory policies wrap these forwards afterwards, so a tiled MLP runs the fused product per tile. A provider may also
have a fused loss head (Liger's fused linear cross-entropy): under model.loss_head=liger the report's `head`, which
CPCausalLM's head runs in place of ds_ulysses_ext/loss.py's. loss.py's own head runs its chunks' softmax rows in
kernels/cross_entropy.py on CUDA.
"""
from .bind import KernelReport, apply_fused_kernels
from .providers import KERNEL_MODES, LOSS_HEADS

__all__ = ["apply_fused_kernels", "KernelReport", "KERNEL_MODES", "LOSS_HEADS"]

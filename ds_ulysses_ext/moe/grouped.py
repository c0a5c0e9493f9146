"""What both expert paths share: the SwiGLU product in torch and the gate for torch._grouped_mm.

Its own module, below both users: experts.py (the three-function path) builds on lean_pass.py (the lean pass at
ep=1), and the lean pass needs these two; here neither has to import the other's module for them. Both call
`grouped._grouped_mm_ok` through this module, so one switch (a test's monkeypatch) turns both paths together.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _swiglu(h_N2I: torch.Tensor) -> torch.Tensor:
    gate, up = h_N2I.chunk(2, dim=-1)
    return F.silu(gate) * up


def _grouped_mm_ok(x_ND: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    # torch._grouped_mm: CUDA (SM90 for bf16), 16-byte aligned rows (every matrix dim a multiple of 8 in bf16);
    # the loop is the exact fallback elsewhere
    return (x_ND.is_cuda and x_ND.dtype == torch.bfloat16 and gate_up.dtype == torch.bfloat16
            and down.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm") and x_ND.shape[-1] % 8 == 0
            and all(d % 8 == 0 for w in (gate_up, down) for d in w.shape[-2:])
            and torch.cuda.get_device_capability(x_ND.device)[0] >= 9)

"""Tensorwise FP8 linears whose forward casts each operand once and saves the float8 copies for the backward.

Shapes: x [..., H_in] bf16 -> x8 [..., H_in] float8 (one fp32 scale); W [H_out, H_in] bf16 -> W8 [H_out, H_in]
float8 (one scale); y = x8 W8^T [..., H_out] bf16. Backward, from the saved x8 and W8: dx = dy8 W8 (W8's bytes
transposed), dW = dy8^T x8 (x8's bytes transposed), dy8 the one cast of dy.

Why our own forward around torchao's matmul: torchao 0.18's Float8Linear saves its bf16 input and weight, and its
backward casts each again: an amax pass and a cast pass over every element, the weight's into the transposed layout
the FP8 GEMM needs. Under tensorwise scaling the backward's amax is the forward's (the same tensor, one scale for
all of it), so those casts give the forward's scales and float8 values. Handing torchao's matmul the float8 tensors
(its own Float8TrainingTensor, the form its FSDP float8 all-gather passes in) makes its backward use them as they
are: it transposes float8 bytes instead of reading bf16 twice. The three GEMMs see the same operands in the same
layouts, so every output and gradient equals Float8Linear's bit for bit (tests/test_fp8.py). Rowwise scales differ
between the forward and the backward (each GEMM scales along its own reduction), so the rowwise recipes keep
torchao's forward.

Memory: x is saved in float8 (one byte an element) instead of bf16; the weight's float8 copy is held from the forward
to the backward (one byte a parameter of each FP8 linear). ZeRO-3 on several ranks must not hold a copy of a gathered
weight past the forward, so there the weight is cast in each pass as torchao does (`weight=False`).
"""
from __future__ import annotations

import functools

import torch


def cast_once_forward(linear: torch.nn.Module, x: torch.Tensor, weight: bool = True) -> torch.Tensor:
    """Float8Linear.forward for the tensorwise recipe, with x (and, with `weight`, W) cast here rather than inside
    torchao's matmul, so that its backward reuses them."""
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole
    c, mm = linear.config, linear.linear_mm_config
    if torch.is_autocast_enabled():  # as Float8Linear.forward: the output takes autocast's dtype
        x = x.to(torch.get_autocast_gpu_dtype())
    x8 = hp_tensor_to_float8_dynamic(x, c.cast_config_input.target_dtype, mm, gemm_input_role=GemmInputRole.INPUT,
                                     round_scales_to_power_of_2=c.round_scales_to_power_of_2)
    w = linear.weight
    if weight:
        w = hp_tensor_to_float8_dynamic(w, c.cast_config_weight.target_dtype, mm, gemm_input_role=GemmInputRole.WEIGHT,
                                        round_scales_to_power_of_2=c.round_scales_to_power_of_2)
    y = matmul_with_hp_or_float8_args.apply(x8, w.t(), mm, c)
    if linear.bias is not None:
        y = y + linear.bias.to(y.dtype)
    return y


def bind_cast_once(linear: torch.nn.Module, weight: bool = True) -> None:
    """The instance's forward becomes cast_once_forward (its class, torchao's Float8Linear, stays untouched)."""
    from torchao.float8.config import ScalingGranularity, ScalingType
    c = linear.config
    tensorwise = all(cast.scaling_type is ScalingType.DYNAMIC and cast.scaling_granularity is ScalingGranularity.TENSORWISE
                     for cast in (c.cast_config_input, c.cast_config_weight, c.cast_config_grad_output,
                                  c.cast_config_input_for_grad_weight, c.cast_config_weight_for_grad_input))
    if not (tensorwise and c.cast_config_input == c.cast_config_input_for_grad_weight
            and c.cast_config_weight == c.cast_config_weight_for_grad_input):
        raise ValueError("cast_once_forward reuses the forward's casts in the backward, which needs the same tensorwise "
                         f"cast of x and of W in both passes; this linear's config: {c}")
    linear.forward = functools.partial(cast_once_forward, linear, weight=weight)

"""Random initialisation that depends only on (seed, parameter name): the same weights for every world size,
CP layout and ZeRO stage.

Why not HF's own init: under ZeRO-3, transformers builds the model inside zero.Init, which consumes the
RNG in a different order than a plain build, so the same seed gave different weights under ZeRO-2 and
ZeRO-3 (measured: grad_norm 2.99 vs 2.32 at step 1 on the tiny model). Layout-exactness tests, and users who
compare a 1-GPU debug run with an 8-GPU run, need one init. The distribution is HF's for the supported
families (Llama/Qwen/Mistral `_init_weights`): matrices ~ N(0, initializer_range), norm weights 1, biases 0.
"""
from __future__ import annotations

import math
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from typing import Iterator, Optional

import torch
import torch.distributed as dist


def _rule(name: str, shape: torch.Size, zero_centred: frozenset = frozenset()) -> str:
    if name.endswith(".bias") or name.endswith("_proj_bias"):  # GPT-OSS's stacked expert biases: zeros, as HF's
        return "zeros"
    if len(shape) == 1 and name in zero_centred:  # a norm that scales by (1 + weight): HF starts it at 0
        return "zeros"
    if len(shape) == 1 and "norm" in name:
        return "ones"
    if len(shape) == 1 and name.endswith(".sinks"):  # GPT-OSS's per-head sink logits: normal, as HF's
        return "normal"
    # linear-attention layers (Qwen3.5 / Qwen3-Next gated DeltaNet, Ling-3.0 KDA), as HF's _init_weights draws them:
    # per-head decay rates log(A), A ~ U(1, 16) (Qwen draws U(0.01, 16), Ling U(1, 16)); the decay's time-step bias
    # ones (Qwen), or for KDA's per-channel forget gate softplus^-1(dt), dt log-uniform in [1e-3, 1e-1]
    if len(shape) == 1 and name.endswith(".A_log"):
        return "a_log"
    if len(shape) == 1 and name.endswith("forget_gate.dt_bias"):
        return "dt_bias_kda"
    if len(shape) == 1 and name.endswith(".dt_bias"):
        return "ones"
    if len(shape) >= 2:
        return "normal"
    raise ValueError(f"no random-init rule for parameter {name!r} of shape {tuple(shape)}; "
                     "load weights with model.source=pretrained or extend engine/ds/init.py")


def _value(name: str, shape: torch.Size, std: float, generator: torch.Generator,
           zero_centred: frozenset = frozenset()) -> torch.Tensor:
    rule = _rule(name, shape, zero_centred)
    if rule == "zeros":
        return torch.zeros(shape)
    if rule == "ones":
        return torch.ones(shape)
    if rule == "a_log":
        return torch.empty(shape).uniform_(1.0, 16.0, generator=generator).log_()
    if rule == "dt_bias_kda":
        dt = torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=generator).exp_().clamp_min_(1e-4)
        return dt + torch.log(-torch.expm1(-dt))
    return torch.randn(shape, generator=generator).mul_(std)  # in place: no second fp32 copy to fault in


def _draw(name: str, shape: torch.Size, dtype: torch.dtype, seed: int, std: float,
          zero_centred: frozenset = frozenset()) -> torch.Tensor:
    # drawn in fp32 on the CPU whatever the parameter's dtype and device: the values are the same everywhere
    generator = torch.Generator().manual_seed((seed << 32) ^ zlib.crc32(name.encode()))
    return _value(name, shape, std, generator, zero_centred).to(dtype)


def zero_centred_norms(model: torch.nn.Module) -> frozenset:
    """Names of the weights of norms that scale by (1 + weight) (Qwen3.5 / Qwen3-Next's RMSNorms): with the weight
    at 0 such a norm still passes its input on, a plain one gives 0. Found by running each norm-like module (a 1-D
    weight, no children, a forward of the input alone) on a small CPU input with its weight at 0, so no class list
    goes stale. Setting them to 1, as for a plain norm, doubled their scale at random init."""
    out = set()
    for prefix, module in model.named_modules():
        weight = module._parameters.get("weight")
        if weight is None or list(module.children()) or "norm" not in prefix.rsplit(".", 1)[-1].lower():
            continue
        shape = getattr(weight, "ds_shape", weight.shape)
        if len(shape) != 1:
            continue
        try:
            with torch.no_grad():
                # every parameter at 0 (a bias too): a parameter not yet written holds whatever memory it was given
                zeros = {n: torch.zeros(getattr(p, "ds_shape", p.shape)) for n, p in module._parameters.items()
                         if p is not None}
                y = torch.func.functional_call(module, zeros, (torch.randn(2, shape[0]),))
        except Exception:  # a gated norm (two inputs) or one that cannot run on the CPU: a plain norm's rule
            continue
        if isinstance(y, torch.Tensor) and y.abs().max() > 0:
            out.add(f"{prefix}.weight")
    return frozenset(out)


def _draws(wanted: list, seed: int, std: float,
           zero_centred: frozenset = frozenset()) -> Iterator[Optional[torch.Tensor]]:
    """The values of each wanted (name, shape, dtype) in order (None for a None entry), drawn in threads.

    One generator's randn is a serial loop (10 s for the Llama-3.2-1B shape on one core). Each parameter has
    its own generator and randn releases the GIL, so threads give the same values in less time. At most
    2 x threads draws are ahead of the consumer, so host memory holds a few parameters, not the model."""
    workers = max(1, torch.get_num_threads())
    with ThreadPoolExecutor(max_workers=workers) as pool:
        ahead: deque = deque()
        for item in wanted:
            ahead.append(None if item is None else pool.submit(_draw, *item, seed, std, zero_centred))
            if len(ahead) > 2 * workers:
                yield _result(ahead.popleft())
        while ahead:
            yield _result(ahead.popleft())


def _result(future) -> Optional[torch.Tensor]:
    return None if future is None else future.result()  # re-raises an unknown parameter's ValueError


def _write(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    with torch.no_grad():
        param.data.copy_(value)


def init_random_weights(model: torch.nn.Module, seed: int, std: float) -> None:
    """Overwrite every parameter in place; collective under ZeRO-3 (each parameter is gathered once, in the
    same order on every rank, and rank 0's values are broadcast).

    The copies into the parameters stay on this thread, the draws run in worker threads: a worker touching
    a GPU tensor could open a CUDA context on the thread's default device (GPU 0) from every rank."""
    params = list(model.named_parameters())  # tied weights appear once
    zero_centred = zero_centred_norms(model)
    rank = dist.get_rank() if dist.is_initialized() else 0
    # a ZeRO-3 partitioned parameter's own shape is empty outside a gather; ds_shape is the full one
    shapes = [getattr(p, "ds_shape", p.shape) for _, p in params]
    for (name, _), shape in zip(params, shapes):
        # on every rank before the first gather: a refusal on rank 0 alone would hang the rest
        _rule(name, shape, zero_centred)
    wanted = [None if hasattr(p, "ds_id") and rank != 0 else (name, shape, p.dtype)
              for (name, p), shape in zip(params, shapes)]
    with closing(_draws(wanted, seed, std, zero_centred)) as values:
        for (_, param), value in zip(params, values):
            if not hasattr(param, "ds_id"):
                _write(param, value)
                continue
            import deepspeed
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                if rank == 0:
                    _write(param, value)

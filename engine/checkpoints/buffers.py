"""Module state that is not a parameter: persistent buffers (moe.balance=bias's router `expert_bias`, an fp32 vector
used for the top-k selection only; HF DeepSeek-V3's `e_score_correction_bias`; any other).

Two loaders see parameters only, and each would start such a buffer from its initial value without a word:
- DeepSpeed's universal checkpoint (a resume on other ranks, reshard.py) restores the parameters from per-parameter
  files and never reads the module state dict, which holds the buffers. `restore_from_checkpoint` copies every
  persistent buffer from the checkpoint's own model-states file, and refuses one it does not find there;
- HF's from_pretrained builds the stock class, which lacks the buffers our MoE blocks add: it reports their keys
  as unexpected and drops them. `restore_from_export`, once our blocks are in, reads those keys from the folder; a
  key that is still no buffer of the model is refused, never dropped.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)

MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")  # ZeRO-2 / ZeRO-3


def persistent_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every buffer `module.state_dict()` holds, by its state-dict key."""
    found = {}
    for prefix, mod in module.named_modules():
        for name, buf in mod._buffers.items():
            if buf is not None and name not in mod._non_persistent_buffers_set:
                found[f"{prefix}.{name}" if prefix else name] = buf
    return found


def restore_from_checkpoint(module: torch.nn.Module, folder: Path) -> list[str]:
    """Copy every persistent buffer of `module` (the engine's module) from checkpoint `folder`; returns their names."""
    buffers = persistent_buffers(module)
    path = next((folder / n for n in MODEL_STATES if (folder / n).exists()), None)
    if path is None:
        raise FileNotFoundError(f"checkpoint {folder} has none of {MODEL_STATES}, where the model's buffers are")
    saved = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    state = saved["module"]
    names = set(saved.get("buffer_names", buffers))
    missing = sorted(n for n in buffers if n not in names or n not in state)
    unused = sorted(names - buffers.keys())
    if missing or unused:
        what = (f"holds no value for the model's buffer(s) {missing[:4]} (re-partitioning would restart them from "
                "their initial values)" if missing else
                f"holds buffer(s) {unused[:4]} this model has no place for (they would be dropped)")
        raise RuntimeError(f"checkpoint {folder} {what}. Resume with the settings that wrote it (e.g. the same "
                           "moe.balance)")
    with torch.no_grad():
        for name, buf in buffers.items():
            buf.copy_(state[name].to(dtype=buf.dtype))
    return sorted(buffers)


def keep_expert_biases(model: torch.nn.Module, keys) -> list[str]:
    """Give each MoE router whose `expert_bias` the export holds (`keys`: what from_pretrained did not take) that
    buffer, so the model routes as it was trained whatever moe.balance asks now; returns the keys."""
    from ds_ulysses_ext.moe import MoEBlock
    added = []
    for name, block in model.named_modules():
        if isinstance(block, MoEBlock):
            key = f"{name}.{block.spec.router_name}.expert_bias"
            if key in keys and block.topk_router.expert_bias is None:
                block.topk_router.add_expert_bias()
                added.append(key)
    return added


def restore_from_export(model: torch.nn.Module, path, unexpected) -> list[str]:
    """After our MoE blocks are installed: copy into the model every tensor of the HF folder `path` that
    from_pretrained reported as unexpected (`unexpected`); refuse any that is no persistent buffer of the model."""
    unexpected = set(unexpected)
    if not unexpected:
        return []
    added = keep_expert_biases(model, unexpected)
    settings = getattr(model, "_moe_settings", None)
    if added and (settings is None or settings.balance != "bias"):
        log.warning("%s holds the routers' expert_bias (moe.balance=bias, %d layers): kept, so the model routes as "
                    "trained, and fixed: moe.balance=%s does not update it", path, len(added),
                    getattr(settings, "balance", "aux"))
    buffers = persistent_buffers(model)
    unused = sorted(unexpected - buffers.keys())
    if unused:
        raise RuntimeError(
            f"{path} holds {len(unused)} tensor(s) this {type(model).__name__} has no place for: {unused[:4]}"
            f"{' ...' if len(unused) > 4 else ''}. Dropping them would make it another model than the one saved: "
            "load it with the settings or the model family that wrote it")
    tensors = _read(Path(path), sorted(unexpected))
    with torch.no_grad():
        for key in unexpected:
            buffers[key].copy_(tensors[key].to(dtype=buffers[key].dtype))
    return sorted(unexpected)


def _read(folder: Path, keys: list[str]) -> dict[str, torch.Tensor]:
    """The named tensors of an HF folder (model.safetensors, or the shards its index names)."""
    from safetensors import safe_open
    index = folder / "model.safetensors.index.json"
    if index.exists():
        where = json.loads(index.read_text())["weight_map"]
    elif (folder / "model.safetensors").exists():
        where = dict.fromkeys(keys, "model.safetensors")
    else:
        raise FileNotFoundError(f"{folder} is not a local folder of safetensors weights: {keys[:4]} cannot be read "
                                "back from it; save a local copy and set model.path to it")
    out = {}
    for file in sorted({where[k] for k in keys}):
        with safe_open(str(folder / file), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in keys if where[k] == file})
    return out

"""Registry of HF model families that context parallelism supports, and the checks each one needs.

A family is supported when its attention goes through transformers' attention interface with RoPE
applied inside the attention module (so the local chunk uses its global position_ids) and a causal mask.
Sliding windows and attention sinks reach the CP attention as the `sliding_window` and `s_aux` kwargs that
these families' attention modules pass, and run exactly there (masks.py); every family below passes them.

SUPPORTED is the one list of families: configs/model.py reads it, so `validate` and the model build cannot
disagree. Adding a family is one `Family(...)` line here; `moe` marks families with expert layers (the config
layer allows parallelism.ep only for them); `notes`, when given, says how the family runs under CP and is
logged when CP is enabled on a model of it; `hf_attn` is the attention HF builds it with (the engine's build).

Every config field of these families that changes the forward is either checked against the unsplit model at
cp > 1 (tests/test_model_features.py lists the fields and the tests that cover each) or refused here, before
training: HF's router loss (output_router_logits), attention dropout, an explicit `is_causal` (false asks HF for
bidirectional attention, which CP never runs), sliding layers without a window (HF refuses them, CP would run them
full), and the RoPE types rope.py does not know.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from .attention.layout import kv_replication
from .errors import UnsupportedError
from .rope import check_rope

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Family:
    model_type: str
    moe: bool = False
    notes: str = ""
    # the attn_implementation HF builds the model with before enable_context_parallel installs ours; GPT-OSS: HF
    # refuses "sdpa" for it (its sinks have no SDPA path), and eager is only ever the stand-in
    hf_attn: str = "sdpa"
    # multi-head latent attention (DeepSeek-V3's MLA): k and v come out of a per-token latent with one head per query
    # head (num_key_value_heads is not what the attention gets), q/k of nope + rope dims, v of its own (Dv != D)
    mla: bool = False


SUPPORTED = {f.model_type: f for f in (
    Family("llama"),
    Family("qwen2"),
    Family("qwen3"),
    Family("mistral"),
    Family("qwen3_moe", moe=True),
    Family("gpt_oss", moe=True, hf_attn="eager",
           notes="sliding windows and sinks run in the CP attention; its MoE runs as our block (experts over ep)"),
    Family("latent_moe", moe=True, notes="ours (ds_ulysses_ext/moe/latent_model.py): experts in a latent space"),
    Family("deepseek_v3", moe=True, mla=True,
           notes="MLA: k/v up-projected per token before the exchange, q/k head dim nope + rope != v's"),
    Family("glm4_moe_lite", moe=True, mla=True,
           notes="MLA as DeepSeek-V3: k/v up-projected per token before the exchange"),
    Family("glm4_moe", moe=True, notes="GQA with partial RoPE, rotated on each chunk's global positions"),
)}


# families whose attention modules read `layer_types`: a "sliding_attention" layer takes config.sliding_window
LAYER_TYPE_FAMILIES = ("qwen2", "qwen3", "gpt_oss")


def check_attention_config(config) -> None:
    """Refuse, before training, attention settings the CP attention cannot run as the unsplit model does (at any cp:
    the engine installs the CP attention at cp=1 too). Each message names the field, its value and the fix.

    Dropout and an explicit is_causal were refused before only at the first forward, by the attention function (the
    latter with a message about packed documents); sliding layers without a window ran full attention silently."""
    dropout = getattr(config, "attention_dropout", 0.0) or 0.0
    if dropout:
        # the kernels after the exchange (masks.py, flash, the ring) take no dropout, and a dropout mask drawn on each
        # rank's share is another random stream than the unsplit model's: no such run can be checked against it
        raise UnsupportedError(
            f"attention_dropout={dropout}: the context-parallel attention applies no dropout, and a dropout mask drawn "
            "on each rank's share could never be checked against the unsplit model. Set attention_dropout=0 "
            "(model.arch.attention_dropout=0, or in the checkpoint's config.json)")
    if hasattr(config, "is_causal"):
        # transformers builds no mask for a custom attention (masking_utils), so only the kwarg would carry it
        what = ("asks transformers for bidirectional attention, and the context-parallel attention is causal only"
                if not config.is_causal else "is the default, but set explicitly transformers hands is_causal to "
                "every attention call, which the context-parallel attention does not take")
        raise UnsupportedError(
            f"is_causal={config.is_causal} in the model config {what}. Remove is_causal from the config "
            "(model.arch, or the checkpoint's config.json): these families train causal")
    model_type = getattr(config, "model_type", None)
    if model_type in LAYER_TYPE_FAMILIES and getattr(config, "sliding_window", None) is None:
        sliding = [i for i, t in enumerate(getattr(config, "layer_types", None) or []) if t == "sliding_attention"]
        if sliding:
            why = (" (use_sliding_window=false sets it to None)"
                   if hasattr(config, "use_sliding_window") and not config.use_sliding_window else "")
            raise UnsupportedError(
                f"layer_types marks layers {sliding} sliding_attention but sliding_window is None{why}: transformers' "
                "own mask builder refuses this config, and under context parallelism those layers would run full "
                "attention. Set sliding_window=<tokens>" + (" and use_sliding_window=true" if why else "")
                + ", or mark those layers full_attention")


def check_model_config(config, cp: int) -> None:
    """Refuse a model config that CP cannot run exactly, naming the problem and the fix."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED:
        raise UnsupportedError(
            f"model family {model_type!r} is not supported under context parallelism; supported: "
            f"{sorted(SUPPORTED)}. Use one of those or run with parallelism.cp=1")
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedError("encoder-decoder models are not supported under context parallelism")
    if getattr(config, "output_router_logits", False):
        # CPCausalLM calls the decoder and computes the loss itself: HF's router loss would be dropped silently
        raise UnsupportedError(
            "output_router_logits=true asks for HF's load-balancing loss, which CPCausalLM does not compute (and which "
            "pools the batch and every layer, so it would change with the cp split). Set output_router_logits=false; "
            "for a balance loss use enable_expert_parallel (moe.balance=aux), whose per-sequence loss is exact under cp")
    check_attention_config(config)
    check_rope(config, cp)
    num_q = config.num_attention_heads
    num_kv = getattr(config, "num_key_value_heads", None) or num_q
    if SUPPORTED[model_type].mla:
        num_kv = num_q  # kv_b_proj makes one k and one v per query head, whatever num_key_value_heads says
    kv_replication(num_q, num_kv, cp)  # raises with the valid cp values
    if SUPPORTED[model_type].notes:
        log.info("%s under context parallelism (cp=%d): %s", model_type, cp, SUPPORTED[model_type].notes)


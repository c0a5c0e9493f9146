"""Registry of HF model families that context parallelism supports, and the checks each one needs.

A family is supported when its attention goes through transformers' attention interface with RoPE
applied inside the attention module (so the local chunk uses its global position_ids) and a causal mask.
Sliding windows and attention sinks reach the CP attention as the `sliding_window` and `s_aux` kwargs that
these families' attention modules pass, and run exactly there (masks.py); every family below passes them.
A family with linear-attention layers (`linear`: Qwen3.5 / 3.6, Qwen3-Next, Ling-3.0) runs those under Ulysses too,
bound per instance by ds_ulysses_ext/linear_attention (whole sequences per head after the exchange; no ring).

SUPPORTED is the one list of families: configs/model.py reads it, so `validate` and the model build cannot
disagree. Adding a family is one `Family(...)` line here; `moe` marks families with expert layers (the config
layer allows parallelism.ep only for them); `notes`, when given, says how the family runs under CP and is
logged when CP is enabled on a model of it; `hf_attn` is the attention HF builds it with (the engine's build).

Every config field of these families that changes the forward is either checked against the unsplit model at
cp > 1 (tests/test_model_features.py lists the fields and the tests that cover each) or refused here, before
training: HF's router loss (output_router_logits), attention dropout, an explicit `is_causal` (false asks HF for
bidirectional attention, which CP never runs), sliding layers without a window (HF refuses them, CP would run them
full), and the RoPE types rope.py does not know.

A vision-language family (`vision`: Qwen3-VL) is checked on its text config (`text_config_of`), the decoder CP splits;
its length-dependent RoPE types are refused (the global-length rotary takes [B, s] positions, the multimodal one
[3, B, s]).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from .attention.layout import kv_replication
from .errors import UnsupportedError
from .linear_attention.checks import check_linear_layers
from .rope import check_rope, depends_on_length, rope_parameters_of, rope_types

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
    # a vision-language checkpoint whose language model trains on text: the model is HF's whole ForConditionalGeneration
    # (hf_classes.py), its text config holds the decoder's shape, and the vision tower, which text never runs, is frozen
    vision: bool = False
    # the kind of a family's linear-attention layers ("gated_deltanet" | "kda"; "" for none), interleaved with its full
    # attention: run under Ulysses by ds_ulysses_ext/linear_attention (whole sequences per head after the exchange)
    linear: str = ""


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
    Family("mistral4", moe=True, mla=True,
           notes="MLA as DeepSeek-V3; the Llama-4 query scale reads each token's global position; its softmax "
                 "group-limited router runs in our block"),
    Family("cohere2_moe", moe=True,
           notes="sliding layers (interleaved RoPE) run their window in the CP attention, global layers no RoPE; "
                 "parallel attention + MLP; logit_scale applied in the loss head"),
    Family("qwen3_vl", vision=True,
           notes="the language model of the VL checkpoint on text: its three mrope position streams are the text "
                 "positions, so each chunk rotates at its global positions; vision tower frozen, images refused"),
    Family("qwen3_vl_moe", moe=True, vision=True,
           notes="as qwen3_vl, with the Qwen3-MoE block (softmax top-k, always renormalised) as our block"),
    # linear attention interleaved with gated full attention (ds_ulysses_ext/linear_attention, docs/linear_attention.md)
    Family("qwen3_5_text", linear="gated_deltanet",
           notes="Qwen3.5 / 3.6 text: gated DeltaNet layers exchanged per head (conv + delta rule on whole sequences, "
                 "reset at each packed document), gated full attention with partial RoPE and q/k norms; no ring"),
    Family("qwen3_5_moe_text", moe=True, linear="gated_deltanet",
           notes="as qwen3_5_text, with its MoE (softmax top-k renormalised, a sigmoid-gated shared expert) as our "
                 "block"),
    Family("qwen3_next", moe=True, linear="gated_deltanet",
           notes="gated DeltaNet (q/k/v/z packed per key-head group) as qwen3_5_text; MoE with a sigmoid-gated shared "
                 "expert as our block; no ring"),
    Family("bailing_hybrid", moe=True, mla=True, linear="kda",
           notes="Ling-3.0: Kimi delta attention layers (a decay per key channel) exchanged per head, MLA full "
                 "attention with a per-head output gate; its DeepSeek-style MoE as our block; no ring"),
)}


# families whose attention modules read `layer_types`: a "sliding_attention" layer takes config.sliding_window
LAYER_TYPE_FAMILIES = ("qwen2", "qwen3", "gpt_oss", "cohere2_moe")


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


def text_config_of(config):
    """The config of the decoder CP splits: a VL model's text config, any other model's own."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def check_model_config(config, cp: int) -> None:
    """Refuse a model config that CP cannot run exactly, naming the problem and the fix."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED:
        raise UnsupportedError(
            f"model family {model_type!r} is not supported under context parallelism; supported: "
            f"{sorted(SUPPORTED)}. Use one of those; scripts/train.py builds only these, at any cp (in a loop of "
            "your own, train other models without enable_context_parallel)")
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedError("encoder-decoder models are not supported under context parallelism")
    text = text_config_of(config)  # a VL family's decoder shape, attention and RoPE are its text config's
    if getattr(text, "output_router_logits", False):
        # CPCausalLM calls the decoder and computes the loss itself: HF's router loss would be dropped silently
        raise UnsupportedError(
            "output_router_logits=true asks for HF's load-balancing loss, which CPCausalLM does not compute (and which "
            "pools the batch and every layer, so it would change with the cp split). Set output_router_logits=false; "
            "for a balance loss use enable_expert_parallel (moe.balance=aux), whose per-sequence loss is exact under cp")
    if SUPPORTED[model_type].vision and depends_on_length(rope_parameters_of(text)):
        # the global-length rotary (rope.py) takes [B, s] positions; the multimodal rotary is handed [3, B, s]
        raise UnsupportedError(
            f"{model_type} with rope_type {rope_types(rope_parameters_of(text))}: a length-dependent RoPE under the "
            "multimodal rotary is not checked under context parallelism. Set text_config.rope_parameters.rope_type "
            "to default (what the Qwen3-VL checkpoints ship); the check holds at any cp, cp=1 included")
    check_attention_config(text)
    check_rope(text, cp)
    num_q = text.num_attention_heads
    num_kv = getattr(text, "num_key_value_heads", None) or num_q
    if SUPPORTED[model_type].mla:
        num_kv = num_q  # kv_b_proj makes one k and one v per query head, whatever num_key_value_heads says
    kv_replication(num_q, num_kv, cp)  # raises with the valid cp values
    if SUPPORTED[model_type].linear:
        check_linear_layers(text, cp)  # the linear layers' heads split too (linear_attention/heads.py)
    if SUPPORTED[model_type].notes:
        log.info("%s under context parallelism (cp=%d): %s", model_type, cp, SUPPORTED[model_type].notes)


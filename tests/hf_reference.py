"""One optimizer step of stock HF transformers + torch.optim.AdamW, in this process, without DeepSpeed or any
of the project's training code: the independent anchor for the engine's world-1 runs (tests/test_engine.py).

Shared with the engine only what must be the same for the comparison to mean anything: the config, the
random init (engine/ds/init.py; tests/test_engine_units.py checks it is the same for every layout) and the
samples of step 1 (a function of seed and step). The loss is written out here: the sum of token
cross-entropies over the global batch, shifted HF-style, over the number of non-masked targets.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def first_step(overrides: list[str]) -> dict:
    """{"loss", "grad_norm" (before clipping), "lr", and name -> tensor: "grads" (after clipping), "init" and
    "weights" (after the step)}."""
    from configs import compose_config, validate
    from engine.ds.build import build_hf_model
    from engine.data import GlobalBatchSampler, build_dataset, collate, pad_id_of
    from engine.ds.config import to_deepspeed_dict
    from engine.ds.hf_config import hf_config_of

    forced = ["parallelism.cp=1", "deepspeed=zero2", "deepspeed.offload_param=false"]
    keys = {o.split("=")[0] for o in forced}
    cfg = compose_config([o for o in overrides if o.split("=")[0] not in keys] + forced)
    model = build_hf_model(cfg, to_deepspeed_dict(cfg, validate(cfg, 1)))  # the plain module: ZeRO-2 builds no
    init = {n: p.detach().clone() for n, p in model.named_parameters()}   # zero.Init
    vocab = hf_config_of(cfg.model).get_text_config().vocab_size  # a VL checkpoint's: its text config's
    dataset, _, tokenizer = build_dataset(cfg.data, seed=cfg.run.seed, vocab_size=vocab)
    t = cfg.trainer
    indices = GlobalBatchSampler(len(dataset), t.global_batch_size, cfg.run.seed).indices_for_step(0)
    batch = collate([dataset[i] for i in indices], cfg.data.seq_len, pad_id_of(tokenizer))

    logits = model(input_ids=batch["input_ids"]).logits.float()  # right padding: causal attention never sees it
    targets = batch["labels"][:, 1:]
    token_loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                 ignore_index=-100, reduction="sum")
    loss = token_loss / (targets != -100).sum()
    loss.backward()
    params = [p for p in model.parameters()]  # tied weights appear once
    grad_norm = torch.nn.utils.clip_grad_norm_(params, t.grad_clip) if t.grad_clip else \
        torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
    # the schedule's factor at step 0 is 1 / warmup_steps during a warmup, else 1 (the decay starts after it)
    lr = t.lr * (1.0 / t.warmup_steps if t.warmup_steps > 0 else 1.0)
    opt = torch.optim.AdamW(params, lr=lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
                            weight_decay=t.weight_decay)
    # a VL model's vision tower gets none (text never runs it), and AdamW leaves it as it is
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    opt.step()
    return {"loss": float(loss.detach()), "grad_norm": float(grad_norm), "lr": lr, "grads": grads, "init": init,
            "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}

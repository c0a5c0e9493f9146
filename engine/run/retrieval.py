"""Retrieval score of the passkey task under CP: teacher-forced exact match per (length, depth) cell.

Legend: B batch, s local sequence, H hidden, V vocab, n answer positions held by this rank.

A sample counts as retrieved when the argmax at every answer position is the answer's token (teacher-forced:
the true prefix is fed, so one forward pass scores the whole answer, at any length training runs at, under
CP; greedy generate() gives the same verdict, the test of this module checks). Each CP rank holds a
contiguous chunk of the sequence and with it the logits of the answer positions inside the chunk: it runs
lm_head on those n rows only ([n, V], never [B, s, V]) and counts its hits per row; the counts are summed
over the CP group, and a row is right when its hits equal its answer tokens. dp ranks take different
samples (the held-out loss's split, engine/run/evaluate.py): every rank runs the same forwards, as ZeRO-3's
collective gathers need, padded with a fully masked sample that counts nowhere.

Grid samples come from their own stream (engine/data/passkey.py grid_sample), never from training indices.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

from ds_ulysses_ext import IGNORE_INDEX, Topology, shard_batch

from ..data import collate
from ..data.passkey import PasskeyTask, grid_sample
from .evaluate import local_eval_batches


@torch.no_grad()
def answer_hits(lm, shard: dict, topo: Topology) -> tuple[torch.Tensor, torch.Tensor]:
    """(hits [B], answer tokens [B]) summed over the CP group, for one sharded micro-batch."""
    hf = lm.hf
    inputs = {k: v for k, v in shard.items() if k != "labels"}  # every other key shard_batch gives (rope.py's length)
    hidden_BsH = hf.get_decoder()(**inputs, use_cache=False).last_hidden_state
    labels_Bs = shard["labels"]  # already shifted: position i's target
    mask_Bs = labels_Bs != IGNORE_INDEX
    # every rank calls lm_head, with n = 0 rows where its chunk holds no answer: ZeRO-3 gathers collectively
    logits_nV = hf.get_output_embeddings()(hidden_BsH[mask_Bs])
    right_n = (logits_nV.argmax(-1) == labels_Bs[mask_Bs]).long()
    rows_n = mask_Bs.nonzero()[:, 0]
    B = labels_Bs.shape[0]
    counts_2B = torch.stack([torch.zeros(B, dtype=torch.long, device=labels_Bs.device).index_add_(0, rows_n, right_n),
                             mask_Bs.sum(1)])
    if topo.cp_size > 1:
        dist.all_reduce(counts_2B, group=topo.cp_group)
    return counts_2B[0], counts_2B[1]


def grid(lengths: Sequence[int], depths: Sequence[float]) -> list[tuple[int, float]]:
    return [(int(L), float(d)) for L in lengths for d in depths]


@torch.no_grad()
def score_retrieval(model, task: PasskeyTask, seed: int, lengths: Sequence[int], depths: Sequence[float],
                    per_cell: int, topo: Topology, dp: int, micro_batch_size: int, pad_id: int,
                    device: torch.device) -> dict:
    """{"cells": [{"length", "depth", "accuracy", "token_accuracy", "samples"}, ...], "mean_accuracy",
    "mean_token_accuracy"}, the same on every rank.

    `model` is a DeepSpeed engine around a CPCausalLM, or the CPCausalLM itself."""
    cells = grid(lengths, depths)
    # per cell: samples retrieved whole, and answer tokens right / counted (the token accuracy shows a copy that
    # is forming before whole answers come out right)
    sums = torch.zeros(3, len(cells), dtype=torch.float64, device=device)
    right, tokens_right, tokens = sums  # views: one all-reduce sums all three
    lm = getattr(model, "module", model)
    model.eval()
    try:
        for L in dict.fromkeys(int(x) for x in lengths):  # one width per batch: collate pads to L
            items = [(c, j) for c, (cl, _) in enumerate(cells) if cl == L for j in range(per_cell)]

            def make(item, L=L):  # built where it is scored: each rank makes only its own samples
                return grid_sample(task, seed, L, cells[item[0]][1], item[1]).as_item()

            filler = make(items[0])
            filler["labels"] = torch.full_like(filler["labels"], IGNORE_INDEX)
            for idx in local_eval_batches(items, topo.dp_rank, dp, micro_batch_size):
                batch = collate([make(i) if i is not None else filler for i in idx], L, pad_id)
                shard = {k: v.to(device) for k, v in shard_batch(batch, topo, pad_id).items()}
                hits, counts = answer_hits(lm, shard, topo)
                ok = ((hits == counts) & (counts > 0)).double()
                if topo.cp_rank == 0:  # the CP group agrees already: one of its ranks reports
                    for row, it in enumerate(idx):
                        if it is not None:
                            right[it[0]] += ok[row]
                            tokens_right[it[0]] += hits[row]
                            tokens[it[0]] += counts[row]
    finally:
        model.train()
    dist.all_reduce(sums)
    acc = (sums[0] / per_cell).tolist()
    tok = (sums[1] / sums[2].clamp_min(1)).tolist()
    out = [{"length": L, "depth": d, "accuracy": a, "token_accuracy": t, "samples": per_cell}
           for (L, d), a, t in zip(cells, acc, tok)]
    return {"cells": out, "mean_accuracy": sum(acc) / len(acc), "mean_token_accuracy": sum(tok) / len(tok)}


def write_retrieval(result: dict, out_dir: Path, title: str = "") -> tuple[Path, Path]:
    """retrieval.json and retrieval.png (the length x depth heatmap) in `out_dir`; rank 0 calls it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "retrieval.json"
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    png_path = plot_heatmap(result, out_dir / "retrieval.png", title)
    return json_path, png_path


def plot_heatmap(result: dict, png_path: Path, title: str = "") -> Path:
    import matplotlib.pyplot as plt
    figure = heatmap_figure(result, title)
    figure.savefig(png_path, dpi=120)
    plt.close(figure)
    return png_path


def heatmap_figure(result: dict, title: str = ""):
    """Depth (rows, 0 at the top) by length (columns), red 0 to green 1, as needle tests are drawn."""
    import matplotlib
    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt
    lengths = sorted({c["length"] for c in result["cells"]})
    depths = sorted({c["depth"] for c in result["cells"]})
    acc = [[float("nan")] * len(lengths) for _ in depths]
    for c in result["cells"]:
        acc[depths.index(c["depth"])][lengths.index(c["length"])] = c["accuracy"]
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(lengths), 1.2 + 0.5 * len(depths)))
    im = ax.imshow(acc, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    for i, row in enumerate(acc):
        for j, a in enumerate(row):
            ax.text(j, i, f"{a:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(lengths)), [_tokens(L) for L in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(title or f"passkey retrieval, mean {result['mean_accuracy']:.2f}", fontsize=9)
    fig.colorbar(im, ax=ax, label="exact match")
    fig.tight_layout()
    return fig


def _tokens(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def eval_grid_of(data_cfg) -> tuple[list[int], list[float], int]:
    """The in-training grid (data.passkey.eval_*): its lengths default to the longest training length."""
    p = data_cfg.passkey
    lengths = list(p.eval_lengths) or [max(list(p.lengths) or [data_cfg.seq_len])]
    return lengths, [float(d) for d in p.eval_depths], p.eval_samples_per_cell


def log_retrieval(engine, tokenizer, cfg, plan, topo: Topology, pad_id: int, rt, tracker, step: int) -> dict:
    """trainer.eval_every on data=passkey: score the grid, write retrieval.json + .png (overwritten at each
    evaluation, so the run ends with its last step's), and send the heatmap to W&B when it is on."""
    task = PasskeyTask(cfg.data.passkey, tokenizer, cfg.data.path)  # the training task's own settings
    lengths, depths, per_cell = eval_grid_of(cfg.data)
    result = score_retrieval(engine, task, cfg.run.seed, lengths, depths, per_cell, topo, plan.dp,
                             plan.micro_batch_size, pad_id, rt.device)
    result["step"] = step
    if rt.is_main:
        write_retrieval(result, Path(cfg.run.out_dir), f"passkey retrieval at step {step}, "
                        f"mean {result['mean_accuracy']:.2f}")
        if tracker.wandb_run is not None:
            import matplotlib.pyplot as plt
            import wandb
            fig = heatmap_figure(result, f"step {step}")
            tracker.wandb_run.log({"retrieval_heatmap": wandb.Image(fig)}, step=step)
            plt.close(fig)
    return result

"""A provider's fused loss head (Liger's fused linear cross-entropy under model.kernels=liger on CUDA) through the
whole engine under ZeRO-3: it must read lm_head's gathered weight, not the rank's empty partition, and hand DeepSpeed
its gradient. On CPU no provider is chosen, so each rank is given a stand-in whose head is the reference formula
(kernels.reference, fp32, exact at this size) and runs scripts/train.py at w2 cp2 (ZeRO-3); its loss and grad_norm
per step must equal the world-1 run with loss.py's own head (fp32, relative 1e-5). A head that read the partition
would fail (the engine refuses an empty weight), one whose weight gradient were lost would move grad_norm."""
import json

import torch

from dist_harness import run_ranks
from test_engine import BASE, _run, assert_same_trajectory


def _run_with_head(rank, world, overrides, report):
    from ds_ulysses_ext.kernels import bind, providers
    seen = []

    class ReferenceHead(providers.Provider):
        name = "reference-head"
        fused_head = True

        def linear_cross_entropy_sum(self, hidden, weight, labels):
            seen.append(tuple(weight.shape))
            return super().linear_cross_entropy_sum(hidden, weight, labels)
    bind.provider_for = lambda mode, device: providers.Checked(ReferenceHead())  # this forked rank only
    _run(rank, world, overrides)
    torch.save(seen, f"{report}.{rank}")


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_fused_head_under_zero3_sees_the_gathered_weight_and_matches_world_1(tmp_path):
    ref_out, out = tmp_path / "w1", tmp_path / "w2"
    run_ranks(_run, 1, BASE + [f"run.out_dir={ref_out}", "parallelism.cp=1"])
    # Liger's head chunks the tokens itself: trainer.loss_chunk_size would be refused as unread (configs/conditional.py)
    no_chunk = [o for o in BASE if not o.startswith("trainer.loss_chunk_size=")]
    run_ranks(_run_with_head, 2, no_chunk + [f"run.out_dir={out}", "parallelism.cp=2", "deepspeed=zero3",
                                             "model.loss_head=liger"],
              str(tmp_path / "seen"))
    ref, got = _rows(ref_out), _rows(out)
    assert len({r["loss"] for r in ref}) == 5  # it trains
    assert_same_trajectory(got, ref, "w2 cp2 ZeRO-3, fused head")
    from configs import compose_config
    vocab, hidden = (compose_config(["model=tiny"]).model.arch[k] for k in ("vocab_size", "hidden_size"))
    for rank in (0, 1):
        seen = torch.load(tmp_path / f"seen.{rank}")
        # the first-use check on rows cut from the real weight (at most 1000: kernels/layout_sample.py) first, then
        # every micro-batch of the 5 steps with the whole weight
        assert seen[0] == (min(vocab, 1000), hidden) and len(seen) >= 6 and set(seen[1:]) == {(vocab, hidden)}, seen

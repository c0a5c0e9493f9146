"""The check every CP model test ends with: backprop this rank's share of the loss and compare the CP-summed loss and
gradients with the unsplit reference (rel RTOL)."""
import torch.distributed as dist

RTOL = 1e-5


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def assert_share_matches_unsplit(model, loss_sum, count, topo, ref_loss, ref_grads, what=""):
    """loss_sum, count: this rank's CPCausalLM outputs; the exact gradient is the sum of every rank's
    loss_sum / global_count gradient (how the engine combines shares, engine/ds/grad_reduction.py)."""
    global_count = count.clone()
    dist.all_reduce(global_count, group=topo.cp_group)
    share = loss_sum / global_count
    share.backward()
    total = share.detach().clone()
    dist.all_reduce(total, group=topo.cp_group)
    assert rel(total, ref_loss) < RTOL, (what, total, ref_loss)
    for name, p in model.named_parameters():
        if not p.requires_grad:  # a VL model's frozen vision tower (integrate.py): no reference gradient either
            assert name not in ref_grads or not ref_grads[name].any(), (what, name)
            continue
        grad = p.grad.clone()
        dist.all_reduce(grad, group=topo.cp_group)
        assert rel(grad, ref_grads[name]) < RTOL, (what, name, rel(grad, ref_grads[name]))
    return count

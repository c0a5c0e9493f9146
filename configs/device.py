"""The `device` and `dist_backend` settings' values, and where a run's device resolves to (the config groups'
checks and the process start-up ask alike), and the check of dist_backend against the device and the ring."""
from configs.errors import require

DEVICES = ("auto", "cuda", "cpu")
DIST_BACKENDS = ("auto", "nccl", "gloo")


def runs_on_cuda(device: str) -> bool:
    """The `device` setting resolved: cuda, or auto where a GPU is visible."""
    import torch  # here, not at the top: composing a config does not load torch
    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


def check_dist_backend(cfg, ring: int) -> None:
    """dist_backend against the device and the ring. Called by validate() once the ring is resolved."""
    on_cuda = runs_on_cuda(cfg.device)
    require(on_cuda or cfg.dist_backend != "nccl",
            f"dist_backend=nccl needs CUDA, and this run is on the CPU (device={cfg.device}); set dist_backend=auto "
            "(gloo on CPU) or device=cuda")
    # gloo's send/recv hand the tensor's pointer to a host transport, unlike its collectives, which stage CUDA
    # tensors through pinned host copies (torch's ProcessGroupGloo): a ring's K/V hop would read device memory as
    # host memory
    require(not (on_cuda and cfg.dist_backend == "gloo" and ring > 1),
            f"dist_backend=gloo on CUDA cannot run the ring (parallelism.ring={ring}): gloo's point-to-point sends "
            "take host memory only; set parallelism.ring=1 with a cp that splits the heads, or dist_backend=auto")

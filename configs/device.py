"""The `device` and `dist_backend` settings' values, and where a run's device resolves to (the config groups'
checks and the process start-up ask alike)."""

DEVICES = ("auto", "cuda", "cpu")
DIST_BACKENDS = ("auto", "nccl", "gloo")


def runs_on_cuda(device: str) -> bool:
    """The `device` setting resolved: cuda, or auto where a GPU is visible."""
    import torch  # here, not at the top: composing a config does not load torch
    return device == "cuda" or (device == "auto" and torch.cuda.is_available())

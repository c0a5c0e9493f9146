"""The training run: model + DeepSpeed engine, data, the loop, checkpoints, metrics and tracking."""

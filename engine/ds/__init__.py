"""DeepSpeed: process start-up, the model and engine build, the JSON config, the patches, the exact gradient scale."""

"""The run: the loop (train.py), one optimizer step, the lr schedule, held-out evaluation and retrieval scoring."""

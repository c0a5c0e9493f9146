"""Checkpoints: save and resume, the manifest that guards them, resharding onto other ranks, HF exports, preemption."""

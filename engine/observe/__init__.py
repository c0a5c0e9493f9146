"""Observability: metrics and tracking, FLOPs and MFU, profiles, plots, OOM and host-memory reports, inf/NaN steps."""

"""The data layer's user error: `DataError`, a `ValueError` whose message names the config field and the fix."""

from __future__ import annotations


class DataError(ValueError):
    """A problem with the user's data or data config (bad file, bad line, tokenizer mismatch)."""

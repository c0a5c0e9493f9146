"""The exception types users see when a request cannot be honoured exactly.

Each error says what is wrong and how to fix it. They derive from ValueError so callers that already
catch configuration errors keep working.
"""


class UnsupportedError(ValueError):
    """A model, input or layout that context parallelism cannot run exactly."""

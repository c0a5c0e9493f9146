"""The one exception type for a refused configuration."""


class ConfigError(ValueError):
    """A config that cannot run. The message names the field(s) and the fix.

    A subclass of ValueError (torchtitan's habit for user errors), so callers that catch ValueError still do.
    """

"""The one exception type for a refused configuration, and the helpers every group's checks build it with."""

from typing import Any, Iterable, Sequence


class ConfigError(ValueError):
    """A config that cannot run. The message names the field(s) and the fix.

    A subclass of ValueError (torchtitan's habit for user errors), so callers that catch ValueError still do.
    """


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def fmt(values: Iterable[Any]) -> str:
    return "{" + ", ".join(str(v) for v in values) + "}"


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def one_of(field: str, value: Any, choices: Sequence[Any], hint: str = "") -> None:
    require(value in choices, f"{field}={value} is not one of {fmt(choices)}; set {field} to one of them{hint}")

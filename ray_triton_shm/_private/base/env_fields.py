"""Config fields whose default comes from a ``RAY_TRITON_SHM_*`` environment variable.

:func:`env_field` makes a dataclass field that, when not given explicitly,
reads its variable, then falls back to its default (explicit > environment >
default); the parsers turn a variable's text into the field's type. The config
dataclasses of :mod:`ray_triton_shm.config` and of the layers above are built of
such fields.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import field
from typing import Any, TypeVar

from ray_triton_shm.errors import ConfigError

T = TypeVar("T")
ENV_PREFIX = "RAY_TRITON_SHM_"


def _parse_bool(text: str) -> bool:
    """``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off``, in any case.

    Raises:
        ValueError: Anything else.
    """
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def parse_optional_str(text: str) -> str | None:
    """The text, or ``None`` for an empty one."""
    return text or None


def parse_optional_bool(text: str) -> bool | None:
    """A boolean, or ``None`` for an empty text or ``auto``."""
    return None if text.strip().lower() in ("", "auto") else _parse_bool(text)


def parse_int_tuple(text: str) -> tuple[int, ...]:
    """Comma-separated integers (empty parts skipped)."""
    return tuple(int(part) for part in text.split(",") if part.strip())


def parse_str_tuple(text: str) -> tuple[str, ...]:
    """Comma-separated names, stripped (empty parts skipped)."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


_PARSERS: dict[Any, Callable[[str], Any]] = {
    int: int,
    float: float,
    str: str,
    bool: _parse_bool,
    "str | None": parse_optional_str,
    "tuple[int, ...]": parse_int_tuple,
    "tuple[str, ...]": parse_str_tuple,
}


def env_field(
    suffix: str,
    default: T,
    parse: Callable[[str], T] | Any = None,
    *,
    flag: str | tuple[str, ...] | None = None,
) -> Any:
    """A dataclass field whose default comes from ``RAY_TRITON_SHM_<suffix>`` if set.

    Args:
        suffix: Environment variable name after the ``RAY_TRITON_SHM_`` prefix.
        default: Value used when the variable is unset.
        parse: Turns the variable's text into a value; by default chosen from
            the type of ``default``.
        flag: The ``tritonserver`` command-line flag (or flags) this field sets.

    Returns:
        A ``dataclasses.field``.
    """
    name = ENV_PREFIX + suffix
    parser = parse if parse is not None else _PARSERS[type(default)]

    def factory() -> T:
        raw = os.environ.get(name)
        if raw is None:
            return default
        try:
            return parser(raw)
        except ValueError as e:
            raise ConfigError(f"environment variable {name}={raw!r} is invalid: {e}") from e

    return field(default_factory=factory, metadata={"env": name, "flag": flag})

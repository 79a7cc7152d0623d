"""Checks of config values, raising :class:`~ray_triton_shm.errors.ConfigError`.

The config dataclasses' ``__post_init__`` validate their fields with these:
a condition with its message, a field's type (a bool is not an int unless
asked for), a sequence of strings made a tuple.
"""

from __future__ import annotations

from ray_triton_shm.errors import ConfigError


def require(condition: bool, message: str) -> None:
    """Raise :class:`ConfigError` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(message)


def require_type(owner: object, name: str, kinds: type | tuple[type, ...]) -> None:
    """Raise :class:`ConfigError` unless ``owner.name`` is of ``kinds`` (a bool only if ``bool`` is one)."""
    value = getattr(owner, name)
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise ConfigError(f"{type(owner).__name__}.{name} must not be a bool, got {value!r}")
    if not isinstance(value, kinds):
        raise ConfigError(f"{type(owner).__name__}.{name} has the wrong type: {type(value).__name__}")


def string_tuple(owner: object, name: str) -> tuple[str, ...]:
    """``owner.name`` as a tuple of strings.

    Raises:
        ConfigError: It is a single string, or holds something other than strings.
    """
    value = getattr(owner, name)
    if isinstance(value, str) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{type(owner).__name__}.{name} must be a sequence of strings, got {value!r}")
    return tuple(value)

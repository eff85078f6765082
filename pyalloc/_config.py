"""Turning keyword and string configuration into the one string the core parses.

The C++ core owns the keys, their defaults and the parser (csrc/core/config.cpp), so
the rules live in one place; this module only joins a base string and keyword
overrides and checks the Python types.
"""
from __future__ import annotations

import operator
from typing import Mapping, Optional, Union

from . import _C

Size = Union[int, str]

#: The valid configuration keys, from the core.
CONFIG_KEYS = tuple(_C.config_keys())

#: Keys whose values are words, not sizes.
STRING_KEYS = ("strategy",)

MAX_SIZE = 2**64 - 1


def as_size(value: object, what: str) -> int:
    """A byte count from an int or a size string ('512MiB'); ValueError if bad."""
    if isinstance(value, str):
        try:
            return _C.parse_size(value)
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from None
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{what} must be an int number of bytes, got {type(value).__name__}")
    n = operator.index(value)
    if n < 0:
        raise ValueError(f"{what} must not be negative, got {n}")
    if n > MAX_SIZE:
        raise ValueError(f"{what} is impossibly large: {n} bytes")
    return n


def conf_string(conf: Optional[str] = None, overrides: Optional[Mapping[str, Size]] = None) -> str:
    """Joins a 'key:value,...' string and keyword overrides (which win)."""
    if conf is not None and not isinstance(conf, str):
        raise TypeError(f"conf must be a 'key:value,...' string, got {type(conf).__name__}")
    parts = [conf] if conf else []
    for key, value in (overrides or {}).items():
        if key not in CONFIG_KEYS:
            raise ValueError(
                f"unknown config key '{key}'; valid keys: {', '.join(CONFIG_KEYS)}"
            )
        if key in STRING_KEYS:
            if not isinstance(value, str):
                raise TypeError(f"{key} must be a string, got {type(value).__name__}")
            parts.append(f"{key}:{value}")
        else:
            parts.append(f"{key}:{as_size(value, key)}")
    text = ",".join(parts)
    parse_config(text)  # raises ValueError naming the bad key or value
    return text


def parse_config(text: str) -> dict:
    """Parses 'key:value,...' into {key: value} (bytes, or a word for strategy)."""
    return _C.parse_config(text)

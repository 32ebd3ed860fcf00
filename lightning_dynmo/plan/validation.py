"""One place for the argument checks every layer shares, with messages that name the fix."""
from __future__ import annotations

from enum import Enum
from typing import Any, TypeVar

E = TypeVar("E", bound=Enum)


def positive_int(name: str, value: Any, allow: tuple[object, ...] = ()) -> Any:
    """``value`` if it is a positive int (bools refused) or one of ``allow``; else a ValueError."""
    if any(value is a or (type(value) is type(a) and value == a) for a in allow):
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        extra = f" or one of {list(allow)}" if allow else ""
        raise ValueError(f"{name} must be a positive integer{extra}, got {value!r}")
    return value


def non_negative_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def enum_value(name: str, enum: type[E], value: Any) -> E:
    """``value`` (a member or its string) as a member of the str-valued ``enum``; else a ValueError
    listing the valid strings."""
    try:
        return enum(value)
    except ValueError:
        raise ValueError(f"{name} must be one of {', '.join(m.value for m in enum)}, got {value!r}") from None

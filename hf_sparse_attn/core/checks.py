"""Argument validation that names the argument, the value and what is allowed."""

from __future__ import annotations

from typing import Any


def check_range(
    name: str, value: Any, low: float, high: float, *, low_open: bool = False, high_open: bool = False
) -> None:
    """Raise ``ValueError`` naming ``name`` and ``value`` unless ``value`` lies in the stated interval."""
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = is_number and (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ValueError(f"{name}={value!r} is out of range; allowed: a number in {interval}")


def check_choice(name: str, value: Any, choices: tuple) -> None:
    """Raise ``ValueError`` naming ``name`` and ``value`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not allowed; allowed values: {list(choices)}")


def check_int(name: str, value: Any, low: int, high: int) -> None:
    """Raise ``ValueError`` naming ``name`` and ``value`` unless ``value`` is an integer (not a bool) in
    ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}={value!r} is not allowed; allowed: an integer in [{low}, {high}]")
    check_range(name, value, low, high)


def check_bool(name: str, value: Any) -> None:
    """Raise ``ValueError`` naming ``name`` and ``value`` unless ``value`` is ``True`` or ``False``."""
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} is not allowed; allowed values: [True, False]")

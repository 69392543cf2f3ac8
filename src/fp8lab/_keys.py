"""Checks for plain-data configuration: unknown keys and values outside their choices are errors
that name them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["check_choice", "check_keys"]


def check_keys(d: Mapping[str, Any], known: Iterable[str], what: str) -> None:
    """Raise ``ValueError`` naming ``what`` and the keys of ``d`` outside ``known`` (sorted),
    with the known keys listed; ``d`` must be a mapping."""
    if not isinstance(d, Mapping):
        raise TypeError(f"{what} must be a table/dict, got {type(d).__name__}")
    known = set(known)
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"unknown {what} keys: {unknown} (known: {sorted(known)})")


def check_choice(value: Any, choices: Iterable[Any], what: str) -> None:
    """``ValueError`` "``what`` must be one of ``choices``, got ``value``" unless it is one."""
    if value not in choices:
        raise ValueError(f"{what} must be one of {choices}, got {value!r}")

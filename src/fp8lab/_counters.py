"""Process-wide event counters (kernel dispatches, re-tilings): read, and optionally reset."""

from __future__ import annotations


def read_counts(counts: dict[str, int], reset: bool = False) -> dict[str, int]:
    """A copy of ``counts``; with ``reset`` every counter is zeroed after the copy."""
    out = dict(counts)
    if reset:
        for k in counts:
            counts[k] = 0
    return out

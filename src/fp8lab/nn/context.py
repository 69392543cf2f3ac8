"""The per-thread recipe context of :func:`autocast` (which recipe converted modules run under,
and the forward-role scaling updates deferred to the outermost ``autocast`` exit)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Protocol

import torch

from fp8lab.recipe import Recipe, get_recipe

__all__ = ["active_recipe", "autocast", "defer_forward_update", "in_autocast"]


class ForwardScaling(Protocol):
    """What :func:`autocast` updates at its exit: a module's forward-role delayed scaling."""

    def update_forward(self) -> None: ...

    def discard_forward(self) -> None: ...


class _AutocastState(threading.local):
    def __init__(self) -> None:
        self.stack: list[Recipe | None] = []  # None: an autocast() that keeps module recipes
        self.pending: list[ForwardScaling] = []  # forward-role updates awaiting the exit


_STATE = _AutocastState()


def active_recipe(default: Recipe | None = None) -> Recipe | None:
    """Recipe of the innermost active :func:`autocast` that names one, else ``default``.

    A converted module runs under ``active_recipe(module.recipe)``."""
    for r in reversed(_STATE.stack):
        if r is not None:
            return r
    return default


def in_autocast() -> bool:
    """Whether an :func:`autocast` block (with or without a recipe) is active on this thread."""
    return bool(_STATE.stack)


def defer_forward_update(owner: ForwardScaling) -> None:
    """Update ``owner``'s forward-role scaling once, at the outermost :func:`autocast` exit."""
    if all(m is not owner for m in _STATE.pending):
        _STATE.pending.append(owner)


@contextlib.contextmanager
def autocast(recipe: Recipe | str | None = None, enabled: bool = True) -> Iterator[Recipe | None]:
    """Run converted modules under ``recipe`` (default: each module's own) inside the block.

    As in Transformer Engine, delayed-scaling amaxes of the forward roles (input, weight)
    accumulate (max) over all forwards inside the outermost ``autocast`` (micro-batches) and the
    scales are updated once when it exits (only if grad mode is enabled); outside ``autocast`` they
    update after each forward. ``enabled=False`` runs converted modules in plain fp32.
    Nested contexts are allowed; the innermost recipe wins.
    """
    if not enabled:
        rec: Recipe | None = get_recipe("fp32")
    elif recipe is None:
        rec = None
    else:
        rec = get_recipe(recipe) if isinstance(recipe, str) else recipe
        if not isinstance(rec, Recipe):
            raise TypeError(f"recipe must be a Recipe or preset name, got {type(recipe).__name__}")
    outermost = not _STATE.stack
    grad_enabled = torch.is_grad_enabled()
    _STATE.stack.append(rec)
    try:
        yield rec
    finally:
        _STATE.stack.pop()
        if outermost:
            pending, _STATE.pending = _STATE.pending, []
            for m in pending:
                m.update_forward() if grad_enabled else m.discard_forward()

"""Swap ``torch.nn.Linear`` layers for :class:`fp8lab.nn.Linear`, and the ``autocast`` context.

Selection (``convert(model, recipe, include=None, exclude=None)``):

* names are the qualified module names of ``model.named_modules()`` (``"blocks.0.attn.q"``);
* a ``str`` pattern is a shell glob matched against the whole name (``fnmatch``, case-sensitive:
  ``"blocks.*.mlp.*"``, ``"*.attn.q"``); a ``re.Pattern`` is a regex searched anywhere in the name
  (anchor it with ``^...$`` for a full match); a sequence mixes both;
* ``include=None`` selects every ``torch.nn.Linear``; otherwise only Linear layers matching
  ``include``. A pattern that matches no module, or an exact name that is not a Linear, is an error;
* ``exclude`` patterns are removed from the selection;
* default exclusions (``default_exclude=True``), after DeepSeek-V3, which keeps "the embedding
  module, the output head" in high precision: any name matching :data:`DEFAULT_EXCLUDE`
  (embedding / output-head names), any Linear whose weight is shared with an ``nn.Embedding``
  (tied head), and the *last* Linear of the model in registration order (the output head of most
  models). Pass ``default_exclude=False`` to quantize those too.
"""

from __future__ import annotations

import contextlib
import fnmatch
import re
import threading
from collections.abc import Iterator, Sequence

import torch

from fp8lab.recipe import Recipe, get_recipe

Pattern = str | re.Pattern
Patterns = Pattern | Sequence[Pattern] | None

#: Name globs excluded by default (embedding and output-head names of common models).
DEFAULT_EXCLUDE: tuple[str, ...] = (
    "*embed*",
    "*emb",
    "*emb.*",
    "*wte",
    "*wpe",
    "lm_head",
    "*.lm_head",
    "head",
    "*.head",
    "output",
    "*.output",
    "classifier",
    "*.classifier",
)


def _as_list(patterns: Patterns, what: str) -> list[Pattern]:
    if patterns is None:
        return []
    if isinstance(patterns, (str, re.Pattern)):
        return [patterns]
    out = list(patterns)
    for p in out:
        if not isinstance(p, (str, re.Pattern)):
            raise TypeError(
                f"{what} patterns must be str (glob) or re.Pattern, got {type(p).__name__}"
            )
    return out


def _match(name: str, pattern: Pattern) -> bool:
    if isinstance(pattern, re.Pattern):
        return pattern.search(name) is not None
    return fnmatch.fnmatchcase(name, pattern)


def _is_plain_linear(m: torch.nn.Module) -> bool:
    from fp8lab.nn.modules import Linear

    return isinstance(m, torch.nn.Linear) and not isinstance(m, Linear)


def select_linears(
    model: torch.nn.Module,
    include: Patterns = None,
    exclude: Patterns = None,
    *,
    default_exclude: bool = True,
) -> list[str]:
    """Qualified names of the Linear layers ``convert`` would swap (see the module docstring)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    inc, exc = _as_list(include, "include"), _as_list(exclude, "exclude")
    modules = dict(model.named_modules())
    linears = [n for n, m in modules.items() if isinstance(m, torch.nn.Linear) and n]
    for p in inc:
        hits = [n for n in modules if n and _match(n, p)]
        if not hits:
            raise ValueError(
                f"include pattern {p!r} matches no module; Linear layers are: {linears}"
            )
        if not any(n in linears for n in hits):
            kinds = {n: type(modules[n]).__name__ for n in hits[:5]}
            raise ValueError(
                f"include pattern {p!r} matches only non-Linear modules {kinds}; "
                f"Linear layers are: {linears}"
            )
    for p in exc:
        if not any(_match(n, p) for n in modules if n):
            raise ValueError(f"exclude pattern {p!r} matches no module")
    chosen = [n for n in linears if not inc or any(_match(n, p) for p in inc)]
    chosen = [n for n in chosen if not any(_match(n, p) for p in exc)]
    if default_exclude:
        dropped = {n for n in linears if any(_match(n, p) for p in DEFAULT_EXCLUDE)}
        emb_weights = {id(m.weight) for m in modules.values() if isinstance(m, torch.nn.Embedding)}
        dropped |= {n for n in linears if id(modules[n].weight) in emb_weights}
        if linears:
            dropped.add(linears[-1])
        chosen = [n for n in chosen if n not in dropped]
    return chosen


def convert(
    model: torch.nn.Module,
    recipe: Recipe | str,
    include: Patterns = None,
    exclude: Patterns = None,
    *,
    default_exclude: bool = True,
) -> torch.nn.Module:
    """Replace selected ``torch.nn.Linear`` layers of ``model`` in place; returns ``model``.

    The new :class:`fp8lab.nn.Linear` modules share the original ``Parameter`` objects, so an
    optimizer built before the conversion keeps working, and carry their qualified name (used by
    :func:`fp8lab.nn.collect_operands`). Layers already converted are re-targeted to ``recipe``.
    """
    from fp8lab.nn.modules import Linear

    rec = get_recipe(recipe) if isinstance(recipe, str) else recipe
    if not isinstance(rec, Recipe):
        raise TypeError(f"recipe must be a Recipe or a preset name, got {type(recipe).__name__}")
    names = select_linears(model, include, exclude, default_exclude=default_exclude)
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, attr)
        if isinstance(old, Linear):
            old.set_recipe(rec)
            old.name = name
        elif _is_plain_linear(old):
            setattr(parent, attr, Linear.from_linear(old, rec, name=name))
    return model


def converted(model: torch.nn.Module) -> list[str]:
    """Qualified names of the :class:`fp8lab.nn.Linear` layers inside ``model``."""
    from fp8lab.nn.modules import Linear

    return [n for n, m in model.named_modules() if isinstance(m, Linear)]


# --------------------------------------------------------------------------- autocast
class _AutocastState(threading.local):
    def __init__(self) -> None:
        self.stack: list[Recipe] = []
        self.pending: list = []  # modules whose forward-role delayed scaling awaits the exit


_STATE = _AutocastState()


def active_recipe() -> Recipe | None:
    """Recipe of the innermost active :func:`autocast` that names one, or None."""
    for r in reversed(_STATE.stack):
        if r is not _NO_OVERRIDE:
            return r  # type: ignore[return-value]
    return None


def in_autocast() -> bool:
    return bool(_STATE.stack)


def _defer_forward_update(module: object) -> None:
    if all(m is not module for m in _STATE.pending):
        _STATE.pending.append(module)


@contextlib.contextmanager
def autocast(recipe: Recipe | str | None = None, enabled: bool = True) -> Iterator[Recipe | None]:
    """Run converted modules under ``recipe`` (default: each module's own) inside the block.

    As in Transformer Engine, delayed-scaling amaxes of the forward roles (input, weight)
    accumulate (max) over all forwards inside the outermost ``autocast`` (micro-batches) and the
    scales are updated once when it exits (only if grad mode is enabled); outside ``autocast`` they
    update after each forward. ``enabled=False`` runs converted modules in plain fp32.
    Nested contexts are allowed; the innermost recipe wins.
    """
    if recipe is None and enabled:
        rec = None
    elif not enabled:
        rec = get_recipe("fp32")
    else:
        rec = get_recipe(recipe) if isinstance(recipe, str) else recipe
        if not isinstance(rec, Recipe):
            raise TypeError(f"recipe must be a Recipe or preset name, got {type(recipe).__name__}")
    outermost = not _STATE.stack
    grad_enabled = torch.is_grad_enabled()
    _STATE.stack.append(rec if rec is not None else _NO_OVERRIDE)
    try:
        yield rec
    finally:
        _STATE.stack.pop()
        if outermost:
            pending, _STATE.pending = _STATE.pending, []
            if grad_enabled:
                for m in pending:
                    m._update_forward_scaling()
            else:
                for m in pending:
                    m._discard_forward_amax()


class _NoOverride:
    """Marker on the autocast stack: an ``autocast()`` without a recipe (keep module recipes)."""

    def __repr__(self) -> str:
        return "<module recipe>"


_NO_OVERRIDE = _NoOverride()


def effective_recipe(own: Recipe) -> Recipe:
    """The recipe a module runs under: the innermost autocast override, else its own."""
    for r in reversed(_STATE.stack):
        if r is not _NO_OVERRIDE:
            return r  # type: ignore[return-value]
    return own

"""Layer names as the user's model has them and as the lab has them.

The lab wraps a factory's model (``--model MODULE:FACTORY``, ``file.py:FACTORY``, ``hf:...``)
in `fp8lab.lab.models.CausalLM`, so its layers are named ``model.<the user's name>``
(:func:`lab_prefix`). Recipe files cross that boundary both ways:

* into the debugger (:func:`to_lab_names`): a recipe whose ``[[layer]]`` rules name the user's
  layers (the file the user converted their model with) gets each pattern prefixed as well, so
  the lab's model matches it; a recipe already written in the lab's names is left as it is;
* out of it (:func:`with_user_names`): the exact layer names of ``fix.toml``'s rules get the
  user's name beside the lab's (a rule's ``match`` is a list), so the one file converts the
  user's model with `fp8lab.nn.convert` and the lab's model with ``fp8lab compare --recipes``.

Neither changes what any layer runs: each checks that every layer resolves as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fp8lab.lab.models import CausalLM
from fp8lab.recipe import Recipe
from fp8lab.recipe.layers import LayerRule

_GLOB = set("*?[")


def lab_prefix(model: torch.nn.Module) -> str:
    """What the lab puts before a user model's names: ``"model."`` for a wrapped factory
    model (`fp8lab.lab.models.CausalLM`), ``""`` for the built-in GPT."""
    return "model." if isinstance(model, CausalLM) else ""


def _same(a: Recipe, b: Recipe, names: Sequence[str]) -> bool:
    return all(a.for_layer(n).fingerprint() == b.for_layer(n).fingerprint() for n in names)


def _with_match(rule: LayerRule, extra: Sequence[str]) -> LayerRule:
    match = tuple(dict.fromkeys((*rule.match, *extra)))
    return rule if match == rule.match else rule.replace(match=match)


def to_lab_names(recipe: Recipe, prefix: str, lab_layers: Sequence[str]) -> Recipe:
    """``recipe`` with each ``[[layer]]`` pattern also prefixed by ``prefix``, when some rule
    matches none of ``lab_layers`` (a file in the user's names); else ``recipe`` itself."""
    if not prefix or all(any(r.matches(n) for n in lab_layers) for r in recipe.layers):
        return recipe
    rules = tuple(_with_match(r, [prefix + p for p in r.match]) for r in recipe.layers)
    return recipe.replace(layers=rules)


def with_user_names(remedy: Recipe, recipe: Recipe, prefix: str) -> Recipe:
    """``remedy`` (``recipe`` plus the debugger's rules, exact lab names) with each of its own
    rules' exact names also written as the user's model names the layer (``prefix`` removed).
    Unchanged when there is no prefix or the aliases would change any layer's numerics."""
    if not prefix:
        return remedy
    own = set(recipe.layers)
    rules, names = [], []
    for r in remedy.layers:
        if r in own:
            rules.append(r)
            continue
        alias = [p[len(prefix) :] for p in r.match
                 if p.startswith(prefix) and not _GLOB & set(p)]  # fmt: skip
        names += [p for p in r.match if not _GLOB & set(p)]
        match = tuple(dict.fromkeys((*alias, *r.match)))  # the user's names first
        rules.append(r if match == r.match else r.replace(match=match))
    out = remedy.replace(layers=tuple(rules))
    return out if _same(out, remedy, names) else remedy

"""Per-layer recipes: `LayerRule` (``[[layer]]`` tables of a recipe file) and the plain-data merge.

A recipe may carry rules, applied to each converted layer in order (last match wins)::

    base = "te-delayed"                  # inherit a preset, override only what is written

    [[layer]]
    match = "blocks.1.mlp.*"             # shell glob(s) on the module's qualified name
    [layer.dgrad.high_precision_roles]
    grad_output = "bf16"                 # one (GEMM, role) cell in high precision

    [[layer]]
    match = ["blocks.0.*", "blocks.3.attn.*"]
    base = "bf16"                        # these layers restart from the bf16 preset

A rule's ``base`` resets the layer's Linear settings (roles, GEMMs, ``save_for_backward``,
``attention``, ``dpa``) to that preset's; its ``reset`` (a list of dotted keys, e.g.
``["fprop.accumulator.promote_every"]``) then removes those keys, so they take their defaults (a
merge cannot remove a key, and TOML has no null); its other keys are deep-merged on top: a table
merges key by key (``[layer.grad_output] scaling = "current"`` changes only the scaling), any
other value replaces.
Whole-model settings (optimizer state, master weights, loss scaling) belong to the file's top
level, not to a layer: a rule naming one is an error.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fp8lab.recipe.config import GEMMS, ROLES

__all__ = ["LAYER_KEYS", "LayerRule", "deep_merge", "preset", "remove_key", "set_preset_lookup"]

#: recipe keys a ``[[layer]]`` table may set (what a single Linear layer runs): its operand
#: roles, its GEMMs, what it saves for the backward, its attention and the attention's options,
#: and where TE's random Hadamard transform applies (an NVFP4 layer's; a layer restarting from
#: an FP8 preset drops it)
LAYER_KEYS = (*ROLES, *GEMMS, "save_for_backward", "attention", "dpa", "rht_gemms")
#: whole-model keys, set at the file's top level only
_GLOBAL_KEYS = ("optimizer_state", "master_weights", "loss_scaling", "loss_scale", "moe",
                "exp_avg_dtype", "exp_avg_sq_dtype", "moment_expansion", "param_storage",
                "param_master_init", "save_activations")  # fmt: skip

# the preset table lives above this module (presets build Recipes); it registers itself here
_lookup: list[Callable[[str], Any]] = []


def set_preset_lookup(fn: Callable[[str], Any]) -> None:
    """Register the preset table (`fp8lab.recipe.presets.get_recipe` does, on import)."""
    _lookup[:] = [fn]


def preset(name: str) -> Any:
    """The preset ``name`` (a `Recipe`); ValueError listing the valid names when unknown."""
    if not _lookup:
        raise RuntimeError("no preset table registered (import fp8lab.recipe)")
    return _lookup[0](name)


def _plain(v: Any) -> Any:
    """JSON-friendly plain data: configuration objects (QuantSpec, GemmConfig) by ``to_dict``."""
    if hasattr(v, "to_dict"):
        return v.to_dict()
    if isinstance(v, Mapping):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def deep_merge(base: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``changes`` written over it: tables merge key by key, other values replace."""
    out = dict(base)
    for k, v in changes.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = _plain(v)
    return out


def remove_key(plain: Mapping[str, Any], dotted: str) -> dict[str, Any]:
    """``plain`` without the key at the dotted path ``dotted`` (``"fprop.accumulator.group"``);
    a path that is not there leaves ``plain`` as it is. Tables on the path are copied, not
    modified."""
    head, _, rest = dotted.partition(".")
    out = dict(plain)
    if not rest:
        out.pop(head, None)
    elif isinstance(out.get(head), Mapping):
        out[head] = remove_key(out[head], rest)
    return out


@dataclass(frozen=True)
class LayerRule:
    """One ``[[layer]]`` table: the layers it ``match``\\ es (shell globs on qualified module
    names, ``fnmatch``, case-sensitive), an optional preset ``base`` they restart from, the
    dotted keys they ``reset`` to their defaults (each under one of `LAYER_KEYS`) and the recipe
    keys (``changes``, plain data of `LAYER_KEYS`) merged on top. Frozen and hashable."""

    match: tuple[str, ...]
    base: str | None = None
    changes: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)
    reset: tuple[str, ...] = ()
    _canonical: str = field(default="", init=False, repr=False)

    def __post_init__(self) -> None:
        m = (self.match,) if isinstance(self.match, str) else tuple(self.match)
        if not m or not all(isinstance(p, str) and p for p in m):
            raise ValueError(f"layer rule: 'match' must be a glob or a list of globs, got {m!r}")
        if self.base is not None and not isinstance(self.base, str):
            raise ValueError(f"layer rule: 'base' must be a preset name, got {self.base!r}")
        changes = _plain(dict(self.changes))
        for k in changes:
            if k in _GLOBAL_KEYS:
                raise ValueError(
                    f"layer rule {m!r}: {k!r} is a whole-model setting; set it at the top level"
                )
            if k not in LAYER_KEYS:
                raise ValueError(
                    f"layer rule {m!r}: unknown key {k!r}; valid: match, base, reset, "
                    + ", ".join(LAYER_KEYS)
                )
        if self.base is not None:
            preset(self.base)  # unknown preset names fail here, naming the valid ones
        reset = (self.reset,) if isinstance(self.reset, str) else self.reset
        bad = [k for k in reset if not isinstance(k, str) or k.split(".")[0] not in LAYER_KEYS
               or "" in k.split(".")] if isinstance(reset, (list, tuple)) else [reset]  # fmt: skip
        if bad:
            raise ValueError(
                f"layer rule {m!r}: 'reset' takes dotted keys under {', '.join(LAYER_KEYS)} "
                f"(e.g. 'fprop.accumulator.promote_every'), got {bad[0]!r}"
            )
        reset = tuple(reset)
        object.__setattr__(self, "match", m)
        object.__setattr__(self, "changes", changes)
        object.__setattr__(self, "reset", reset)
        canonical = {"match": list(m), "base": self.base, "changes": changes}
        if reset:  # absent otherwise: fingerprints of reset-free rules stay as they were
            canonical["reset"] = list(reset)
        object.__setattr__(self, "_canonical", json.dumps(canonical, sort_keys=True))

    def matches(self, name: str) -> bool:
        """Whether the module named ``name`` falls under this rule."""
        return any(fnmatch.fnmatchcase(name, p) for p in self.match)

    def apply(self, plain: Mapping[str, Any]) -> dict[str, Any]:
        """The plain recipe ``plain`` (`Recipe.to_dict` form, no ``layer``) with this rule
        applied: the base preset's Linear settings first, then the resets, then the changes."""
        out = dict(plain)
        if self.base is not None:
            b = preset(self.base).to_dict()
            out = {k: v for k, v in out.items() if k not in LAYER_KEYS}
            out.update({k: v for k, v in b.items() if k in LAYER_KEYS})
        for key in self.reset:
            out = remove_key(out, key)
        return deep_merge(out, self.changes)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"match": self.match[0] if len(self.match) == 1 else list(self.match)}
        if self.base is not None:
            d["base"] = self.base
        if self.reset:
            d["reset"] = list(self.reset)
        d.update(self.changes)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LayerRule:
        """A ``[[layer]]`` table: ``match`` (required), ``base``, ``reset``, then recipe keys."""
        if not isinstance(d, Mapping):
            raise ValueError(f"a [[layer]] entry must be a table, got {d!r}")
        if "match" not in d:
            raise ValueError("a [[layer]] table needs 'match' (a glob or a list of globs)")
        rest = {k: v for k, v in d.items() if k not in ("match", "base", "reset")}
        return cls(match=d["match"], base=d.get("base"), changes=rest, reset=d.get("reset", ()))

    def describe(self) -> str:
        """One line: ``match -> base + changed keys``."""
        parts = [f"base={self.base}"] if self.base else []
        parts += [f"reset {k}" for k in self.reset]
        parts += [f"{k}={json.dumps(v, sort_keys=True)}" for k, v in self.changes.items()]
        return f"{', '.join(self.match)} -> {'; '.join(parts) or '(no change)'}"

    def replace(self, **changes: Any) -> LayerRule:
        return dataclasses.replace(self, **changes)

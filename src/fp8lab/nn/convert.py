"""Swap ``torch.nn.Linear`` layers for :class:`fp8lab.nn.Linear`, and the ``autocast`` context.

Selection (``convert(model, recipe, include=None, exclude=None)``):

* names are the qualified module names of ``model.named_modules()`` (``"blocks.0.attn.q"``);
* a ``str`` pattern is a shell glob matched against the whole name (``fnmatch``, case-sensitive:
  ``"blocks.*.mlp.*"``, ``"*.attn.q"``); a ``re.Pattern`` is a regex searched anywhere in the name
  (anchor it with ``^...$`` for a full match); a callable ``(name, module) -> bool`` is asked for
  each Linear layer (``lambda n, m: m.out_features >= 1024``); a sequence mixes them;
* ``include=None`` selects every ``torch.nn.Linear``; otherwise only Linear layers matching
  ``include``. A pattern that matches no module, or an exact name that is not a Linear, is an error;
* ``exclude`` patterns are removed from the selection;
* default exclusions (``default_exclude=True``), after DeepSeek-V3, which keeps "the embedding
  module, the output head" in high precision: any name matching :data:`DEFAULT_EXCLUDE`
  (embedding / output-head names), any Linear whose weight is shared with an ``nn.Embedding``
  (tied head), and the *last* Linear of the model in registration order (the output head of most
  models). Pass ``default_exclude=False`` to quantize those too.

Layers that would not run as modules are never claimed converted:

* ``nn.MultiheadAttention.out_proj``: MHA passes its weight to a functional kernel, so a swapped
  module would never run. It is left as is with a warning naming it (``strict=True`` raises).
* ``nn.TransformerEncoderLayer`` (and ``nn.TransformerEncoder``) in eval mode take a fused fast
  path that reads ``linear1``/``linear2``'s weights directly; for a layer holding converted
  Linears that fast path is switched off (`unconvert` switches it back on), so eval runs the
  converted modules.

``transformers``' ``Conv1D`` (the GPT-2 family's projections: ``y = x @ W + b`` with the
weight stored transposed, [in, out]) counts as a Linear layer: it becomes an
:class:`fp8lab.nn.Linear` with ``weight_layout="in_out"`` sharing its Parameters (the weight
keeps its [in, out] shape and state_dict entry; the GEMMs see its transpose), and `unconvert`
gives the Conv1D back. It is recognised by its class (name ``Conv1D`` from a ``transformers``
module), so this module never imports ``transformers``.

`convert` warns when it converts nothing. `unconvert` swaps converted layers back to plain
``torch.nn.Linear`` sharing the same parameters.

Converting again keeps what a layer has learnt: a layer already converted to the same numerics
(``recipe.for_layer(name)``) keeps its delayed-scaling state; to other numerics it is refused
(the scale and amax history would silently restart) unless ``retarget=True``. ``recipe`` is a
`Recipe`, a preset name, or a recipe file (``.toml``/``.json``: fp8lab's recipe files, e.g.
``fp8lab debug``'s ``fix.toml``).

A recipe's ``hp_first_blocks`` / ``hp_last_blocks`` (the NVFP4 paper's high-precision blocks)
are resolved against the model first (`resolve_blocks`): one ``[[layer]]`` rule running those
blocks of the largest numbered ``ModuleList`` of converted Linears in bf16.

A ``transformers`` model keeps its FP8 state out of ``save_pretrained``'s weights and beside
them, and gets it back on ``convert`` after ``from_pretrained`` (`fp8lab.nn.fp8_state`).
"""

from __future__ import annotations

import fnmatch
import os
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fp8lab.nn.attention import hf_attention_dpas, route_hf_attention
from fp8lab.nn.fp8_state import (
    FP8_STATE_FILE,
    install_save_pretrained,
    load_fp8_state,
    pretrained_dir,
    weights_mismatch,
)
from fp8lab.nn.linear import Linear
from fp8lab.recipe import (
    GEMM_OPERANDS,
    GEMMS,
    ROLES,
    LayerRule,
    Recipe,
    RecipeFileError,
    get_recipe,
)
from fp8lab.recipe.shorthands import hp_block_count
from fp8lab.recipe.validate import check_layer_rules, origin

__all__ = [
    "DEFAULT_EXCLUDE",
    "convert",
    "converted",
    "layer_settings",
    "resolve_blocks",
    "select_linears",
    "unconvert",
]

Pattern = str | re.Pattern | Callable[[str, torch.nn.Module], bool]
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

# the attribute through which torch's encoder layer / encoder decide on their fused eval path,
# and the value that switches it off (the non-fast path does not read it)
_FAST_PATH_ATTRS = {
    torch.nn.TransformerEncoderLayer: ("activation_relu_or_gelu", 0),
    torch.nn.TransformerEncoder: ("use_nested_tensor", False),
}
_SAVED = "_fp8lab_fast_path"  # the original value, kept on the module for unconvert


def _as_list(patterns: Patterns, what: str) -> list[Pattern]:
    if patterns is None:
        return []
    if isinstance(patterns, (str, re.Pattern)) or callable(patterns):
        return [patterns]
    try:
        out = list(patterns)
    except TypeError:
        raise TypeError(
            f"{what} must be a str (glob), a re.Pattern, a callable (name, module) -> bool or a "
            f"sequence of them, got {type(patterns).__name__}"
        ) from None
    for p in out:
        if not isinstance(p, (str, re.Pattern)) and not callable(p):
            raise TypeError(
                f"{what} patterns must be str (glob), re.Pattern or a callable (name, module) -> "
                f"bool, got {type(p).__name__}"
            )
    return out


def _match(name: str, pattern: Pattern, module: torch.nn.Module) -> bool:
    if isinstance(pattern, re.Pattern):
        return pattern.search(name) is not None
    if isinstance(pattern, str):
        return fnmatch.fnmatchcase(name, pattern)
    return bool(pattern(name, module))


def _is_conv1d(m: torch.nn.Module) -> bool:
    """``transformers.pytorch_utils.Conv1D`` (or a subclass), recognised without importing it."""
    return any(
        k.__name__ == "Conv1D" and k.__module__.startswith("transformers") for k in type(m).__mro__
    )


def _is_linear(m: torch.nn.Module) -> bool:
    return isinstance(m, torch.nn.Linear) or _is_conv1d(m)


def _functional_only(model: torch.nn.Module) -> set[str]:
    """Linear layers whose parent passes their weight to a functional kernel (MHA out_proj)."""
    return {
        f"{n}.out_proj" if n else "out_proj"
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.MultiheadAttention)
    }


def _check_patterns(modules: dict, linears: list[str], inc: list, exc: list) -> None:
    for p in inc:
        if not isinstance(p, (str, re.Pattern)):  # a callable is asked about Linear layers only
            if not any(_match(n, p, modules[n]) for n in linears):
                raise ValueError(
                    f"include callable {p!r} selects no Linear layer; Linear layers are: {linears}"
                )
            continue
        hits = [n for n in modules if n and _match(n, p, modules[n])]
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
        if not isinstance(p, (str, re.Pattern)):
            continue  # a callable excluding nothing is a valid choice
        if not any(_match(n, p, modules[n]) for n in modules if n):
            raise ValueError(f"exclude pattern {p!r} matches no module")


def _selection(
    model: torch.nn.Module, include: Patterns, exclude: Patterns, default_exclude: bool
) -> tuple[list[str], list[str]]:
    """(names to swap, selected names that cannot run as modules)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    inc, exc = _as_list(include, "include"), _as_list(exclude, "exclude")
    modules = dict(model.named_modules())
    linears = [n for n, m in modules.items() if _is_linear(m) and n]
    _check_patterns(modules, linears, inc, exc)
    chosen = [n for n in linears if not inc or any(_match(n, p, modules[n]) for p in inc)]
    chosen = [n for n in chosen if not any(_match(n, p, modules[n]) for p in exc)]
    if default_exclude:
        dropped = {n for n in linears if any(_match(n, p, modules[n]) for p in DEFAULT_EXCLUDE)}
        emb_weights = {id(m.weight) for m in modules.values() if isinstance(m, torch.nn.Embedding)}
        dropped |= {n for n in linears if id(modules[n].weight) in emb_weights}
        if linears:
            dropped.add(linears[-1])
        chosen = [n for n in chosen if n not in dropped]
    functional = _functional_only(model)
    return [n for n in chosen if n not in functional], [n for n in chosen if n in functional]


def select_linears(
    model: torch.nn.Module,
    include: Patterns = None,
    exclude: Patterns = None,
    *,
    default_exclude: bool = True,
) -> list[str]:
    """Qualified names of the Linear layers ``convert`` would swap (see the module docstring)."""
    return _selection(model, include, exclude, default_exclude)[0]


def _recipe_of(recipe: Recipe | str | os.PathLike) -> Recipe:
    """A `Recipe` from a Recipe, a preset name or a ``.toml``/``.json`` recipe file path; a
    path with another suffix is a ValueError saying recipe files are ``.toml``/``.json``."""
    if isinstance(recipe, os.PathLike):
        recipe = os.fspath(recipe)
    if isinstance(recipe, str) and recipe.endswith((".toml", ".json")):
        return Recipe.load(recipe)  # errors name the file
    looks_like_file = isinstance(recipe, str) and (
        "/" in recipe or os.sep in recipe or os.path.splitext(recipe)[1] or os.path.exists(recipe)
    )
    if looks_like_file:
        try:
            return get_recipe(recipe)
        except ValueError as exc:  # not a preset either: say what a recipe file is
            raise ValueError(
                f"convert: recipe {recipe!r} is neither a recipe file (those end in .toml or "
                f".json: fp8lab's recipe files, e.g. fp8lab debug's fix.toml) nor a preset "
                f"({str(exc).partition('; ')[2]})"
            ) from None
    rec = get_recipe(recipe) if isinstance(recipe, str) else recipe
    if not isinstance(rec, Recipe):
        raise TypeError(
            f"recipe must be a Recipe, a preset name or a recipe file, got {type(recipe).__name__}"
        )
    return rec


def _block_list(model: torch.nn.Module, names: Sequence[str]) -> tuple[str, int] | None:
    """``(qualified name, length)`` of the numbered ``ModuleList`` whose children hold the most
    of the Linear layers ``names`` (the lab's ``blocks``, HF's ``model.layers``); None when no
    ModuleList holds one (the first listed wins a tie)."""
    best: tuple[int, str, int] | None = None
    for n, m in model.named_modules():
        if not n or not isinstance(m, torch.nn.ModuleList):
            continue
        held = {x[len(n) + 1 :].split(".")[0] for x in names if x.startswith(n + ".")}
        count = len(held & {str(i) for i in range(len(m))})
        if count and (best is None or count > best[0]):
            best = (count, n, len(m))
    return None if best is None else (best[1], best[2])


def resolve_blocks(model: torch.nn.Module, recipe: Recipe, names: Sequence[str]) -> Recipe:
    """``recipe`` with its ``hp_first_blocks`` / ``hp_last_blocks`` written out for ``model``
    (whose converted Linear layers are ``names``): one ``[[layer]]`` rule, appended last so it
    wins, running those blocks of the largest numbered ``ModuleList`` of converted Linears
    (``blocks.N``, ``model.layers.N``) from the ``bf16`` preset; both fields then 0. ``recipe``
    itself when both are 0. `RecipeFileError` (naming the recipe's file) when the model has no
    such list or the two counts add up to more blocks than it has."""
    if recipe.hp_last_blocks == 0 and recipe.hp_first_blocks == 0:
        return recipe
    found = _block_list(model, names)
    if found is None:
        raise RecipeFileError(
            f"{origin(recipe)}: hp_last_blocks/hp_first_blocks need a numbered ModuleList of "
            f"converted Linear layers (blocks.N, model.layers.N); {type(model).__name__} has "
            f"none holding {list(names)[:4]}"
        )
    prefix, n = found
    last, first = hp_block_count(recipe.hp_last_blocks, n), recipe.hp_first_blocks
    if last + first > n:
        raise RecipeFileError(
            f"{origin(recipe)}: hp_last_blocks ({recipe.hp_last_blocks} -> {last}) + "
            f"hp_first_blocks ({first}) = {last + first} blocks in high precision, more than "
            f"the {n} blocks of {prefix!r}"
        )
    kept = [*range(first), *range(n - last, n)]
    out = recipe.replace(hp_last_blocks=0, hp_first_blocks=0)
    if not kept:
        return out
    # a block that is itself a Linear is matched by its own name
    match = [
        p for i in kept for p in (f"{prefix}.{i}", f"{prefix}.{i}.*") if p[-1] == "*" or p in names
    ]
    rule = LayerRule(match=tuple(match), base="bf16")
    return out.with_layers(rule)


def _check_retarget(model: torch.nn.Module, rec: Recipe, names: list[str]) -> None:
    """ValueError when a layer already converted to other numerics would be re-targeted."""
    changed = []
    for name in names:
        old = model.get_submodule(name)
        if (
            isinstance(old, Linear)
            and old.recipe.fingerprint() != rec.for_layer(name).fingerprint()
        ):
            changed.append(f"{name} ({old.recipe.name!r})")
    if changed:
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        raise ValueError(
            f"convert: {', '.join(changed[:3])}{more} already converted to other numerics than "
            f"{rec.name!r}; converting again would restart their scaling state. Pass "
            "retarget=True to switch them (fresh scaling state), or unconvert first"
        )


def convert(
    model: torch.nn.Module,
    recipe: Recipe | str,
    include: Patterns = None,
    exclude: Patterns = None,
    *,
    default_exclude: bool = True,
    strict: bool = False,
    retarget: bool = False,
) -> torch.nn.Module:
    """Replace selected ``torch.nn.Linear`` layers of ``model`` in place; returns ``model``.

    ``recipe``: a `Recipe`, a preset name or a recipe file (``.toml``/``.json``). The new
    :class:`fp8lab.nn.Linear` modules share the original ``Parameter`` objects, so an
    optimizer built before the conversion keeps working, and carry their qualified name (used by
    :func:`fp8lab.nn.collect_operands`). A layer already converted to the same numerics keeps
    its scaling state; to other numerics it raises ValueError unless ``retarget=True`` (then it
    switches, its scaling state restarting). A ``transformers`` model loaded from a directory
    holding ``fp8lab_state.safetensors`` gets that FP8 state back in the layers converted now
    (ValueError naming the file if it does not fit; ``retarget=True`` ignores the file).
    Selected layers that would never run as modules (``MultiheadAttention.out_proj``) are left
    as they are with a `UserWarning` naming them, or raise ``ValueError`` with ``strict=True``;
    converting nothing warns.
    """
    rec = _recipe_of(recipe)
    names, skipped = _selection(model, include, exclude, default_exclude)
    if skipped:
        msg = (
            f"convert: {skipped} not converted: nn.MultiheadAttention passes out_proj's weight "
            "to a functional kernel, so a converted module would never run (it stays "
            "high precision)"
        )
        if strict:
            raise ValueError(msg)
        warnings.warn(msg, UserWarning, stacklevel=2)
    rec = resolve_blocks(model, rec, names)
    check_layer_rules(rec, names)  # names the recipe's file (fp8lab.recipe.validate)
    if not retarget:
        _check_retarget(model, rec, names)
    fresh = []
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, attr)
        if isinstance(old, Linear):
            same = old.recipe.fingerprint() == rec.for_layer(name).fingerprint()
            if not same or old.name != name:  # same numerics, same name: nothing to do
                old.name = name
                # resolves the recipe's [[layer]] rules for this name; same numerics keep state
                old.set_recipe(rec, keep_state=same)
        else:
            make = Linear.from_conv1d if _is_conv1d(old) else Linear.from_linear
            setattr(parent, attr, make(old, rec, name=name))
            fresh.append(name)
    if not names:
        warnings.warn(
            f"convert: no Linear layer of {type(model).__name__} was converted to "
            f"{rec.name!r} (include={include!r}, exclude={exclude!r}, "
            f"default_exclude={default_exclude})",
            UserWarning,
            stacklevel=2,
        )
    _set_fast_paths(model)
    route_hf_attention(model, rec)  # FP8 attention of a transformers model, when asked
    saved = pretrained_dir(model)
    if saved is not None and fresh and not retarget:
        _restore(model, saved, fresh)
    install_save_pretrained(model)
    return model


def _restore(model: torch.nn.Module, saved: Any, fresh: list[str]) -> None:
    """Load the saved FP8 state into the layers just converted when the file was saved with
    these weights (else warn why it is not applied: the layers start fresh); on a mismatch of
    layers or recipe swap them back (the failed call leaves the model as it was) and raise
    naming the file."""
    why = weights_mismatch(model, saved)
    if why is not None:
        warnings.warn(
            f"convert: the FP8 state in {why}; it is not applied and the converted layers start "
            "with fresh scaling state. If it does belong to these weights, load it with "
            "fp8lab.nn.load_fp8_state(model, path, check_weights=False)",
            UserWarning,
            stacklevel=3,
        )
        return
    # routed attention that has not run yet gets its saved delayed-scaling state too
    ran = hf_attention_dpas(model)
    attention = [n for n in hf_attention_dpas(model, create=True) if n not in ran]
    try:  # a resume: the saved scaling state (the file may hold layers a later convert takes)
        loaded = load_fp8_state(
            model, saved, layers=[*fresh, *attention], strict=False, check_weights=False
        )
        missing = [n for n in fresh if n not in loaded]
        if missing:
            raise ValueError(f"{saved / FP8_STATE_FILE}: no FP8 state for the layers {missing}")
    except ValueError as exc:
        for name in fresh:
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, attr, getattr(parent, attr).to_linear())
        _set_fast_paths(model)
        raise ValueError(
            f"convert: {exc}. Pass retarget=True to convert with fresh scaling state instead"
        ) from None


def layer_settings(model: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """What each converted layer of ``model`` runs, by qualified name: ``recipe`` (its name),
    ``rules`` (1-based indices of the recipe's ``[[layer]]`` rules that matched, in order; the
    last wins), ``roles`` and ``gemms`` (one short text per role and GEMM: format:granularity:
    scaling, ``fp32``, or a high precision)."""
    out: dict[str, dict[str, Any]] = {}
    for name, m in model.named_modules():
        if not isinstance(m, Linear):
            continue
        r = m.recipe
        roles = {
            role: "fp32" if s is None else s.describe()
            for role in ROLES
            for s in [getattr(r, role)]
        }
        gemms = {}
        for g in GEMMS:
            cells = [
                f"{role}={r.precision(g, role) or ('fp32' if r.spec(g, role) is None else r.spec(g, role).describe())}"
                for role, _ in GEMM_OPERANDS[g]
            ]
            gemms[g] = ", ".join(cells)
        rules = [i + 1 for i in m.layer_rules]
        out[name] = {"recipe": r.name, "rules": rules, "roles": roles, "gemms": gemms}
    return out


def converted(model: torch.nn.Module) -> list[str]:
    """Qualified names of the :class:`fp8lab.nn.Linear` layers inside ``model``."""
    return [n for n, m in model.named_modules() if isinstance(m, Linear)]


def unconvert(model: torch.nn.Module) -> torch.nn.Module:
    """Swap every :class:`fp8lab.nn.Linear` of ``model`` back to a plain ``torch.nn.Linear``
    sharing the same ``Parameter`` objects (the scaling state is dropped); returns ``model``.
    A converted ``transformers`` ``Conv1D`` comes back as that Conv1D (same Parameters).
    A converted ``model`` itself cannot be replaced in place: it raises ``TypeError``."""
    if isinstance(model, Linear):
        raise TypeError("unconvert: model is itself an fp8lab.nn.Linear; use Linear.to_linear()")
    for name in converted(model):
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, getattr(parent, attr).to_linear())
    _set_fast_paths(model)
    install_save_pretrained(model)  # gone with the last converted layer
    return model


def _set_fast_paths(model: torch.nn.Module) -> None:
    """Switch torch's fused encoder eval path off where it would skip converted layers, and
    back on where no converted layer remains."""
    for m in model.modules():
        spec = next((v for k, v in _FAST_PATH_ATTRS.items() if isinstance(m, k)), None)
        if spec is None or not hasattr(m, spec[0]):
            continue
        attr, off = spec
        has_converted = any(isinstance(c, Linear) for c in m.modules())
        if has_converted and _SAVED not in m.__dict__:
            m.__dict__[_SAVED] = getattr(m, attr)
            setattr(m, attr, off)
        elif not has_converted and _SAVED in m.__dict__:
            setattr(m, attr, m.__dict__.pop(_SAVED))

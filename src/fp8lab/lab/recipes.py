"""The recipe names the lab accepts, and the names of seed replicas.

A lab recipe name (``fp8lab compare --recipes``, ``fp8lab debug --recipe``, ``fp8lab cost
--recipe``, the recipes of a run folder) is a preset of ``fp8lab.recipes()``, a recipe the lab
defines itself (:func:`lab_recipes`: the negative control :data:`NEGATIVE_CONTROL`), or a path to
a recipe ``.toml`` / ``.json`` file; :func:`resolve_recipe` turns any of them into a ``Recipe``.

The lab defines its own negative control (E4M3 gradients with a fixed scale of 1, i.e. no
scaling): small gradients flush to zero, so the quantized layers barely learn and the lab must
report it as clearly worse than the baseline.

A seed replica ``NAME@seedS`` (:func:`seed_replica`) is recipe NAME trained under another
``train.seed``: ``fp8lab compare --noise-seeds`` trains the baseline's for the noise estimate.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

NEGATIVE_CONTROL = "e4m3-unscaled-grads"
#: a seed replica of a recipe: the same recipe under another ``train.seed`` (``bf16@seed1338``),
#: trained for the noise estimate (``noise_seeds``), never a row of the table
SEED_SEP = "@seed"


def lab_recipes() -> dict[str, Any]:
    """Recipes defined by the lab itself (not presets of ``fp8lab.recipes()``)."""
    from fp8lab.qtensor import QuantSpec
    from fp8lab.recipe import Recipe

    return {
        NEGATIVE_CONTROL: Recipe(
            name=NEGATIVE_CONTROL,
            input=QuantSpec(format="e4m3"),
            weight=QuantSpec(format="e4m3"),
            grad_output=QuantSpec(format="e4m3", scaling=1.0),
            # stated, as every preset does: the fingerprint (run directories resume by it)
            # predates the dataclass default's change to "high_precision"
            save_for_backward="quantized",
            description="NEGATIVE CONTROL, must fail: te-current's E4M3 forward, but gradients "
            "cast to E4M3 with a fixed scale of 1 (no scaling, no loss scaling). Gradients of a "
            "mean loss are ~1e-4..1e-6, below E4M3's smallest subnormal 2^-9, so they flush to "
            "zero and the quantized layers barely learn.",
            source="fp8lab training lab; gradient underflow without scaling: Micikevicius et "
            "al., 'Mixed Precision Training', arXiv 1710.03740; E5M2 for gradients: 'FP8 "
            "Formats for Deep Learning', arXiv 2209.05433",
        )
    }


def seed_replica(name: str, seed: int) -> str:
    """The name of recipe ``name`` trained under ``train.seed`` = ``seed``: ``NAME@seedS``."""
    return f"{name}{SEED_SEP}{seed}"


def split_replica(name: str) -> tuple[str, int | None]:
    """``("bf16", 1338)`` for ``"bf16@seed1338"``; ``(name, None)`` for a recipe."""
    base, sep, seed = name.rpartition(SEED_SEP)
    if sep and base and seed.isdigit():
        return base, int(seed)
    return name, None


def resolve_recipe(name: str) -> Any:
    """A preset name, a lab recipe name, or a path to a recipe ``.toml`` / ``.json`` file (a seed
    replica ``NAME@seedS`` resolves to NAME's recipe). ValueError naming the valid names for an
    unknown one, or the path of a missing file."""
    from fp8lab.recipe import Recipe, get_recipe, recipes

    name = split_replica(name)[0]
    own = lab_recipes()
    if name in own:
        return own[name]
    p = Path(name)
    if p.suffix in (".toml", ".json"):
        if not p.is_file():
            raise ValueError(f"no such recipe file: {name}")
        return Recipe.load(p)
    if name in recipes():
        return get_recipe(name)
    raise ValueError(
        f"unknown recipe {name!r}; valid: {', '.join([*recipes(), *own])} "
        "(or a path to a recipe .toml/.json file)"
    )


def available_recipes() -> list[str]:
    """Every recipe name the lab accepts besides files: the presets, then the lab's own."""
    from fp8lab.recipe import recipes

    return [*recipes(), *lab_recipes()]

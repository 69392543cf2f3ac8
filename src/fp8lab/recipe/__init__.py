"""L4 recipes: which tensor is quantized how, and how each GEMM of a Linear layer runs.

`Recipe` (frozen configuration, TOML/JSON round trip; `fp8lab.recipe.core`), its per-GEMM
`GemmConfig` and names (`config`), the FP8 attention options (`dpa`: `DPAConfig`), the
mixture-of-experts options (`moe`: `MoEConfig`), type-checked plain data and recipe files
(`plain`; errors are `RecipeFileError`), the TOML writer (`toml_writer`) and the presets (`presets`).
"""

from fp8lab.recipe import config as _config
from fp8lab.recipe.config import *  # noqa: F403  (re-exports exactly config.__all__)
from fp8lab.recipe.core import Recipe
from fp8lab.recipe.dpa import DPAConfig
from fp8lab.recipe.layers import LayerRule
from fp8lab.recipe.moe import MoEConfig
from fp8lab.recipe.presets import get_recipe, recipes

__all__ = [
    "DPAConfig",
    "LayerRule",
    "MoEConfig",
    "Recipe",
    "get_recipe",
    "recipes",
    *_config.__all__,
]

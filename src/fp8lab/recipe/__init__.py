"""L4 recipes: which tensor is quantized how, and how each GEMM of a Linear layer runs.

`Recipe` (frozen configuration, TOML/JSON round trip; `fp8lab.recipe.core`), its per-GEMM
`GemmConfig` and names (`config`), type-checked plain data and recipe files (`plain`; errors are
`RecipeFileError`), the TOML writer (`toml_writer`) and the presets (`presets`).
"""

from fp8lab.recipe.config import (
    GEMM_OPERANDS,
    GEMMS,
    HIGH_PRECISIONS,
    LOSS_SCALINGS,
    OPTIMIZER_STATES,
    ROLES,
    SAVE_MODES,
    GemmConfig,
    RecipeFileError,
)
from fp8lab.recipe.core import Recipe
from fp8lab.recipe.presets import get_recipe, recipes

__all__ = [
    "GEMMS",
    "GEMM_OPERANDS",
    "HIGH_PRECISIONS",
    "LOSS_SCALINGS",
    "OPTIMIZER_STATES",
    "ROLES",
    "SAVE_MODES",
    "GemmConfig",
    "Recipe",
    "RecipeFileError",
    "get_recipe",
    "recipes",
]

"""A configuration value outside its choices is a ValueError naming the field, the choices and
the value (`fp8lab._keys.check_choice`, shared by the recipe and the accumulator)."""

from __future__ import annotations

import re

import pytest

from fp8lab.gemm import Accumulator
from fp8lab.gemm.accumulator import ACC_ROUNDINGS, C_ENTRIES
from fp8lab.recipe import Recipe
from fp8lab.recipe.core import LOSS_SCALINGS, OPTIMIZER_STATES, SAVE_MODES


@pytest.mark.parametrize(
    ("make", "what", "choices"),
    [
        (lambda: Recipe(save_for_backward="x"), "save_for_backward", SAVE_MODES),
        (lambda: Recipe(loss_scaling="x"), "loss_scaling", LOSS_SCALINGS),
        (lambda: Recipe(optimizer_state="x"), "optimizer_state", OPTIMIZER_STATES),
        (lambda: Accumulator(rounding="x"), "accumulator rounding", ACC_ROUNDINGS),
        (lambda: Accumulator(out_rounding="x"), "out_rounding", ACC_ROUNDINGS),
        (lambda: Accumulator(c_entry="x"), "c_entry", C_ENTRIES),
    ],
)
def test_a_value_outside_its_choices_names_them(make, what, choices) -> None:
    with pytest.raises(ValueError, match=re.escape(f"{what} must be one of {choices}, got 'x'")):
        make()

"""The delayed-scaling state a converted Linear owns for one recipe, and when it is updated.

Timing (Transformer Engine): the forward roles (``input``, ``weight``) update after each forward,
or once at the outermost :func:`fp8lab.nn.autocast` exit (max over its micro-batches), and not at
all under ``no_grad`` (the amax is discarded); ``grad_output`` updates at the end of the module's
backward (`ScalingState.after_backward`, called by the autograd Function).
"""

from __future__ import annotations

import torch

from fp8lab.nn.context import ForwardScaling, defer_forward_update, in_autocast
from fp8lab.recipe import GEMM_OPERANDS, GEMMS, Recipe
from fp8lab.scaling.delayed import DelayedScaling

__all__ = ["FORWARD_ROLES", "ScalingState", "after_forward", "state_key"]

FORWARD_ROLES = ("input", "weight")


def state_key(recipe: Recipe, gemm: str, role: str) -> str:
    """Name of the delayed-scaling state serving (gemm, role): the role, or ``gemm_role`` for an
    override with its own delayed scaling."""
    return role if recipe.gemm(gemm).override(role) is None else f"{gemm}_{role}"


class ScalingState:
    """The `DelayedScaling` objects of one module under one recipe, by `state_key`.

    Made only through `DelayedScaling.bind` from the recipe's frozen configuration; empty for
    recipes without delayed scaling (then every method is a no-op).
    """

    def __init__(self, recipe: Recipe) -> None:
        self.by_key: dict[str, DelayedScaling] = {}
        self._roles: list[tuple[str, DelayedScaling]] = []
        for g in GEMMS:
            # a (GEMM, role) cell in high precision keeps its state: a later GEMM may re-tile
            # its nominal quantization (plan's shadow), and the keys match the cell-free recipe
            if recipe.gemm(g).high_precision:
                continue
            for role, _ in GEMM_OPERANDS[g]:
                spec = recipe.spec(g, role)
                key = state_key(recipe, g, role)
                if spec is not None and spec.is_delayed and key not in self.by_key:
                    ds = DelayedScaling.bind(spec.scaling, spec.format)
                    self.by_key[key] = ds
                    self._roles.append((role, ds))

    def __bool__(self) -> bool:
        return bool(self.by_key)

    def update_forward(self) -> None:
        for role, ds in self._roles:
            if role in FORWARD_ROLES:
                ds.update()

    def discard_forward(self) -> None:
        """Forget this step's forward amaxes (no update: evaluation must not move the scales)."""
        for role, ds in self._roles:
            if role in FORWARD_ROLES and ds.measuring:
                ds.stage(0.0)

    def after_backward(self) -> None:
        """End of the module's backward: the gradient role's scales update (TE)."""
        for role, ds in self._roles:
            if role == "grad_output":
                ds.update()


def after_forward(owner: ForwardScaling) -> None:
    """After a forward of ``owner`` (a `ScalingState`, or a module updating all of its states):
    update the forward roles now, at the outermost autocast exit, or discard under no_grad."""
    if in_autocast():
        defer_forward_update(owner)
    elif torch.is_grad_enabled():
        owner.update_forward()
    else:
        owner.discard_forward()

"""The delayed-scaling state a converted Linear owns for one recipe, and when it is updated.

Timing (Transformer Engine): the forward roles (``input``, ``weight``) update after each forward,
or once at the outermost :func:`fp8lab.nn.autocast` exit (max over its micro-batches), and not at
all under ``no_grad`` (the amax is discarded); ``grad_output`` updates at the end of the module's
backward (the autograd Function of `fp8lab.nn.linear` runs both, reading `ScalingState.forward` and
`ScalingState.backward`). A forward that activation checkpointing recomputes runs once more under
the states it first ran with and leaves them as they were (`ScalingState.replaying`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from fp8lab.recipe import GEMM_OPERANDS, GEMMS, Recipe
from fp8lab.scaling.delayed import DelayedScaling

__all__ = ["FORWARD_ROLES", "ScalingState", "delayed_states", "state_key"]

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

    def __init__(self, recipe: Recipe, device: torch.device | str = "cpu") -> None:
        """``device``: where the states start (the module's weight's)."""
        self.by_key: dict[str, DelayedScaling] = {}
        #: the states of the forward roles (updated after the forward) and of the gradient
        #: (updated at the end of the backward), read directly by `fp8lab.nn.Linear`
        self.forward: list[DelayedScaling] = []
        self.backward: list[DelayedScaling] = []
        for g in GEMMS:
            # a (GEMM, role) cell in high precision keeps its state: a later GEMM may re-tile
            # its nominal quantization (plan's shadow), and the keys match the cell-free recipe
            if recipe.gemm(g).high_precision:
                continue
            for role, _ in GEMM_OPERANDS[g]:
                spec = recipe.spec(g, role)
                key = state_key(recipe, g, role)
                if spec is not None and spec.is_delayed and key not in self.by_key:
                    ds = DelayedScaling.bind(spec.scaling, spec.format, device=device)
                    self.by_key[key] = ds
                    (self.forward if role in FORWARD_ROLES else self.backward).append(ds)

    def __bool__(self) -> bool:
        return bool(self.by_key)

    def to(self, device: torch.device | str) -> None:
        """Move every state to ``device`` in place (`DelayedScaling.to`: dtypes kept, the scales
        and histories are float32 whatever dtype the module is cast to; from the ``meta`` device
        uninitialised, as ``to_empty`` leaves the parameters). The quantizers of the module's
        plans hold these `DelayedScaling` objects, not their tensors, so they see the moved
        state."""
        for ds in self.by_key.values():
            ds.to(device)

    def discard_forward(self) -> None:
        """Forget this step's forward amaxes (no update: evaluation must not move the scales)."""
        for ds in self.forward:
            if ds.measuring:
                ds.stage(0.0)

    def snapshot_forward(self) -> list[dict[str, torch.Tensor]]:
        """Copies of the forward roles' states (`DelayedScaling.state_dict`), taken before a
        forward that activation checkpointing will recompute (TE:
        ``copy_forward_fp8_meta_tensors_for_recompute``)."""
        return [ds.state_dict() for ds in self.forward]

    @contextlib.contextmanager
    def replaying(self, snapshot: list[dict[str, torch.Tensor]]) -> Iterator[None]:
        """Inside the block the forward roles' states are ``snapshot`` (`snapshot_forward`), so
        a recomputed forward quantizes with the scales of the forward it repeats; at exit they
        are as before the block, whatever it observed (the recompute neither stages an amax
        nor rolls a history). TE: ``get_old_fp8_meta_tensors_for_recompute`` and
        ``restore_fp8_meta_tensors``."""
        if not snapshot:
            yield
            return
        now = self.snapshot_forward()
        for ds, s in zip(self.forward, snapshot, strict=True):
            ds.load_state_dict(s)
        try:
            yield
        finally:
            for ds, s in zip(self.forward, now, strict=True):
                ds.load_state_dict(s)


def delayed_states(model: torch.nn.Module) -> dict[str, DelayedScaling]:
    """Every `DelayedScaling` a model's modules own, by ``module_name.state_key`` (sorted).

    Found by walking each module's attributes (the scaling state objects of `fp8lab.nn` and any
    dict/list/object holding `DelayedScaling` objects), each object once.
    """
    found: dict[str, DelayedScaling] = {}
    seen: set[int] = set()

    def walk(obj: Any, name: str, depth: int) -> None:
        if depth > 4 or id(obj) in seen:
            return
        if isinstance(obj, DelayedScaling):
            seen.add(id(obj))
            found[name] = obj
        elif isinstance(obj, dict):
            seen.add(id(obj))
            for k, v in obj.items():
                walk(v, f"{name}.{k}", depth + 1)
        elif isinstance(obj, (list, tuple)):
            seen.add(id(obj))
            for i, v in enumerate(obj):
                walk(v, f"{name}.{i}", depth + 1)
        elif not isinstance(obj, (torch.Tensor, torch.nn.Module)) and hasattr(obj, "__dict__"):
            seen.add(id(obj))
            for k, v in vars(obj).items():
                walk(v, f"{name}.{k}", depth + 1)

    for mname, module in model.named_modules():
        for attr, value in vars(module).items():
            if attr.startswith("_") and attr in ("_parameters", "_buffers", "_modules"):
                continue
            if isinstance(value, (torch.Tensor, torch.nn.Module)):
                continue
            walk(value, f"{mname or '<root>'}.{attr}", 0)
    return {k: found[k] for k in sorted(found)}

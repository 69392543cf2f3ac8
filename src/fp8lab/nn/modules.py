"""`fp8lab.nn.Linear`: a drop-in ``torch.nn.Linear`` whose three GEMMs run under a recipe."""

from __future__ import annotations

import functools
import json
from typing import Any

import torch

from fp8lab.nn.convert import _defer_forward_update, effective_recipe, in_autocast
from fp8lab.nn.functional import GEMM_OPERANDS, LinearPlan, build_plan, linear, state_key
from fp8lab.recipe import GEMMS, Recipe, get_recipe
from fp8lab.scaling.delayed import DelayedScaling

_FWD_ROLES = ("input", "weight")
_RECIPE_KEY = "fp8_recipe"


def _make_states(recipe: Recipe) -> dict[str, DelayedScaling]:
    states: dict[str, DelayedScaling] = {}
    for g in GEMMS:
        if recipe.gemm(g).high_precision:
            continue
        for role, _ in GEMM_OPERANDS[g]:
            spec = recipe.spec(g, role)
            if spec is not None and spec.is_delayed:
                key = state_key(recipe, g, role)
                if key not in states:
                    states[key] = DelayedScaling.bind(spec.scaling, spec.format)
    return states


def _role_of(key: str) -> str:
    return key.split("_", 1)[1] if key.split("_", 1)[0] in GEMMS else key


class Linear(torch.nn.Linear):
    """``torch.nn.Linear`` with simulated low-precision GEMMs.

    Same constructor (plus ``recipe`` and ``name``), same initialisation and the same
    ``weight``/``bias`` state_dict keys; the state_dict also holds ``fp8_recipe`` (the recipe's
    numerics as a uint8 JSON tensor) and, for delayed scaling, ``fp8_<role>_<field>`` tensors
    (``scale``, ``amax_history``, ``step``, ``initialized``, ``fmt_max``). Loading a state saved
    under another recipe raises; a checkpoint of a plain ``torch.nn.Linear`` loads (the scaling
    state then starts fresh). The scaling state is written to / read from the state_dict as plain
    tensors but is not a registered buffer, so ``model.to(torch.bfloat16)`` cannot cast it.

    Delayed scaling timing (TE): forward roles' amaxes max-accumulate over the forwards inside an
    outermost :func:`fp8lab.nn.autocast` and update at its exit; outside ``autocast`` they update
    after each forward; ``grad_output`` updates at the end of this module's backward.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: Any = None,
        dtype: Any = None,
        *,
        recipe: Recipe | str = "te-current",
        name: str | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, device, dtype)
        self.name = name
        self._init_recipe(get_recipe(recipe))

    @classmethod
    def from_linear(
        cls, lin: torch.nn.Linear, recipe: Recipe | str, name: str | None = None
    ) -> Linear:
        """Wrap an existing ``torch.nn.Linear``, sharing its Parameter objects."""
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        new.in_features, new.out_features = lin.in_features, lin.out_features
        new.weight = lin.weight
        new.bias = lin.bias
        new.name = name
        new.train(lin.training)
        new._init_recipe(get_recipe(recipe))
        return new

    # ------------------------------------------------------------------ recipe and state
    def _init_recipe(self, recipe: Recipe) -> None:
        self.recipe = recipe
        self._states = _make_states(recipe)
        self._other_states: dict[str, dict[str, DelayedScaling]] = {}
        self._plans: dict[str, LinearPlan] = {}

    def set_recipe(self, recipe: Recipe | str) -> None:
        """Switch to another recipe; delayed-scaling state restarts."""
        self._init_recipe(get_recipe(recipe))

    @property
    def scaling_states(self) -> dict[str, DelayedScaling]:
        """The delayed-scaling objects of this module's recipe, by state key."""
        return dict(self._states)

    def _states_for(self, recipe: Recipe) -> dict[str, DelayedScaling]:
        if recipe is self.recipe or recipe == self.recipe:
            return self._states
        fp = recipe.fingerprint()
        if fp not in self._other_states:
            self._other_states[fp] = _make_states(recipe)
        return self._other_states[fp]

    def _plan(self, recipe: Recipe) -> LinearPlan:
        fp = recipe.fingerprint()
        plan = self._plans.get(fp)
        if plan is None or plan.name != self.name:
            states = self._states_for(recipe)
            plan = build_plan(
                recipe, states, self.name, after_backward=functools.partial(_update_grad, states)
            )
            plan.extra["states"] = states
            self._plans[fp] = plan
        return plan

    def __getstate__(self) -> dict[str, Any]:
        # plans hold bound state objects: rebuild them after copy.deepcopy / pickle
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__
        state = dict(state)
        state["_plans"] = {}
        return state

    def _pending_states(self) -> list[dict[str, DelayedScaling]]:
        return [self._states, *self._other_states.values()]

    def _update_forward_scaling(self) -> None:
        for states in self._pending_states():
            for key, ds in states.items():
                if _role_of(key) in _FWD_ROLES:
                    ds.update()

    def _discard_forward_amax(self) -> None:
        for states in self._pending_states():
            for key, ds in states.items():
                if _role_of(key) in _FWD_ROLES and ds.measuring:
                    ds.stage(0.0)

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(
                f"{self.name or 'Linear'}: input of shape {tuple(x.shape)} does not end in "
                f"in_features={self.in_features}"
            )
        if not x.is_floating_point():
            raise TypeError(f"{self.name or 'Linear'}: input must be floating point, got {x.dtype}")
        recipe = effective_recipe(self.recipe)
        plan = self._plan(recipe)
        y = linear(x, self.weight, self.bias, plan)
        if plan.extra["states"]:
            if in_autocast():
                _defer_forward_update(self)
            elif torch.is_grad_enabled():
                self._update_forward_scaling()
            else:
                self._discard_forward_amax()
        return y

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.name!r}"

    # ------------------------------------------------------------------ state_dict
    def _save_to_state_dict(self, destination, prefix, keep_vars):  # type: ignore[override]
        super()._save_to_state_dict(destination, prefix, keep_vars)
        fp = self.recipe.fingerprint().encode()
        destination[prefix + _RECIPE_KEY] = torch.tensor(list(fp), dtype=torch.uint8)
        for key, ds in self._states.items():
            for field_name, t in ds.state_dict().items():
                destination[f"{prefix}fp8_{key}_{field_name}"] = t

    def _load_from_state_dict(  # type: ignore[override]
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        ours = {k for k in state_dict if k.startswith(prefix + "fp8_")}
        rk = prefix + _RECIPE_KEY
        where = self.name or prefix.rstrip(".") or "Linear"
        if rk in state_dict:
            saved = bytes(state_dict[rk].to(torch.uint8).tolist()).decode()
            if saved != self.recipe.fingerprint():
                raise ValueError(
                    f"{where}: state was saved under another recipe; this module runs "
                    f"{self.recipe.name!r}. Saved recipe numerics: {_short(saved)}"
                )
            for key, ds in self._states.items():
                fields = ds.state_dict()
                need = [f"{prefix}fp8_{key}_{f}" for f in fields]
                missing = [k for k in need if k not in state_dict]
                if missing:
                    raise ValueError(f"{where}: mismatched scaling state, missing {missing}")
                new = {f: state_dict[k] for f, k in zip(fields, need, strict=True)}
                hist = torch.as_tensor(new["amax_history"])
                if hist.numel() != ds.history_len:
                    raise ValueError(
                        f"{where}: mismatched scaling state for {key}: amax_history has "
                        f"{hist.numel()} entries, the recipe uses {ds.history_len}"
                    )
                if bool(torch.isnan(hist).any()) or not bool(
                    torch.isfinite(torch.as_tensor(new["scale"])).all()
                ):
                    raise ValueError(
                        f"{where}: NaN in amax history or non-finite scale of {key} in the "
                        "loaded state"
                    )
                ds.load_state_dict(new)
            known = {rk} | {
                f"{prefix}fp8_{key}_{f}"
                for key, ds in self._states.items()
                for f in ds.state_dict()
            }
            extra = sorted(k for k in ours if k not in known)
            if extra and strict:
                raise ValueError(f"{where}: mismatched scaling state, unexpected {extra}")
        elif ours:
            raise ValueError(f"{where}: scaling state without {_RECIPE_KEY}: {sorted(ours)}")
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        unexpected_keys[:] = [k for k in unexpected_keys if k not in ours]


def _update_grad(states: dict[str, DelayedScaling]) -> None:
    for key, ds in states.items():
        if _role_of(key) == "grad_output":
            ds.update()


def _short(fingerprint: str) -> str:
    try:
        d = json.loads(fingerprint)
    except json.JSONDecodeError:
        return fingerprint[:200]
    parts = []
    for role in ("input", "weight", "grad_output"):
        s = d.get(role)
        parts.append(f"{role}={s['format']}/{s['granularity']}" if s else f"{role}=fp32")
    return ", ".join(parts)

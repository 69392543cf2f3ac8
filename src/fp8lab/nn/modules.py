"""`fp8lab.nn.Linear`: a drop-in ``torch.nn.Linear`` whose three GEMMs run under a recipe.

Under ``torch.autocast`` (e.g. ``torch.autocast("cpu", dtype=torch.bfloat16)``) it does what
Transformer Engine does: the input (and the bias) are cast to the autocast dtype before
quantization, the GEMMs run as emulated (fp32 accumulation of the recipe's operands) and the
output is returned in the autocast dtype; the weight is quantized from its own dtype (the fp32
master weight). ``torch.compile`` treats the layer as opaque (a deliberate graph break: dynamo
cannot trace the numba kernels), so compiled models run it eagerly and compile around it.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from fp8lab.nn.context import active_recipe
from fp8lab.nn.function import linear
from fp8lab.nn.plan import LinearPlan, build_plan
from fp8lab.nn.state import ScalingState, after_forward
from fp8lab.recipe import Recipe, get_recipe
from fp8lab.scaling.delayed import DelayedScaling

_RECIPE_KEY = "fp8_recipe"


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

    @classmethod
    def from_conv1d(
        cls, conv: torch.nn.Module, recipe: Recipe | str, name: str | None = None
    ) -> Linear:
        """Wrap a ``transformers`` ``Conv1D`` (``y = x @ W + b``, weight stored [in, out]),
        sharing its Parameter objects: ``weight_layout = "in_out"``, so the weight keeps its
        shape, its state_dict entry and any optimizer built before the conversion; the GEMMs
        see its transpose [out, in], as TE's and torch's linear do."""
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        new.in_features, new.out_features = (int(n) for n in conv.weight.shape)
        new.weight = conv.weight
        new.bias = conv.bias
        new.weight_layout = "in_out"
        new.__dict__["_replaced"] = conv  # given back by to_linear (not a submodule)
        new.name = name
        new.train(conv.training)
        new._init_recipe(get_recipe(recipe))
        return new

    #: how ``weight`` is stored: ``"out_in"`` (torch.nn.Linear) or ``"in_out"`` (a Conv1D's)
    weight_layout = "out_in"

    def to_linear(self) -> torch.nn.Module:
        """A plain ``torch.nn.Linear`` sharing this module's Parameter objects (no scaling state;
        forward hooks are not carried over); for an ``"in_out"`` layer, the ``Conv1D`` it
        replaced, holding this module's Parameters."""
        if self.weight_layout == "in_out":
            conv = self.__dict__["_replaced"]
            conv.weight, conv.bias = self.weight, self.bias
            conv.train(self.training)
            return conv
        lin = torch.nn.Linear.__new__(torch.nn.Linear)
        torch.nn.Module.__init__(lin)
        lin.in_features, lin.out_features = self.in_features, self.out_features
        lin.weight = self.weight
        lin.bias = self.bias
        lin.train(self.training)
        return lin

    # ------------------------------------------------------------------ recipe and state
    def _init_recipe(self, recipe: Recipe) -> None:
        # a recipe with [[layer]] rules: this layer's resolution, and which rules matched
        self.layer_rules = recipe.layer_rules_for(self.name or "")
        self.recipe = recipe.for_layer(self.name or "")
        self._state = ScalingState(self.recipe)
        self._other_states: dict[str, ScalingState] = {}  # autocast(recipe) overrides
        self._plans: dict[str, LinearPlan] = {}

    def set_recipe(self, recipe: Recipe | str, keep_state: bool = False) -> None:
        """Switch to another recipe (per-layer rules resolved for this module's name).

        Delayed-scaling state restarts, or with ``keep_state`` the histories and scales whose
        state keys (`fp8lab.nn.state.state_key`) and history lengths both recipes share are
        carried over (copies): a step replayed under a counterfactual recipe (one cell in high
        precision) then quantizes every other operand exactly as the original did."""
        old = self._state.by_key
        self._init_recipe(get_recipe(recipe))
        if keep_state:
            for key, ds in self._state.by_key.items():
                if key in old and old[key].history_len == ds.history_len:
                    ds.load_state_dict({k: v.clone() for k, v in old[key].state_dict().items()})

    @property
    def scaling_states(self) -> dict[str, DelayedScaling]:
        """The delayed-scaling objects of this module's recipe, by state key."""
        return dict(self._state.by_key)

    def _state_for(self, recipe: Recipe) -> ScalingState:
        if recipe is self.recipe or recipe == self.recipe:
            return self._state
        fp = recipe.fingerprint()
        if fp not in self._other_states:
            self._other_states[fp] = ScalingState(recipe)
        return self._other_states[fp]

    def _plan(self, recipe: Recipe) -> tuple[LinearPlan, ScalingState]:
        state = self._state_for(recipe)
        fp = recipe.fingerprint()
        plan = self._plans.get(fp)
        if plan is None or plan.name != self.name:
            plan = self._plans[fp] = build_plan(recipe, state, self.name)
        return plan, state

    def __getstate__(self) -> dict[str, Any]:
        # plans hold bound state objects: rebuild them after copy.deepcopy / pickle
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__
        state = dict(state)
        state["_plans"] = {}
        return state

    def update_forward(self) -> None:
        """Update the forward roles' delayed scaling (every recipe this module has run)."""
        for st in (self._state, *self._other_states.values()):
            st.update_forward()

    def discard_forward(self) -> None:
        """Forget the forward roles' staged amaxes (no update)."""
        for st in (self._state, *self._other_states.values()):
            st.discard_forward()

    # ------------------------------------------------------------------ forward
    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(
                f"{self.name or 'Linear'}: input of shape {tuple(x.shape)} does not end in "
                f"in_features={self.in_features}"
            )
        if not x.is_floating_point():
            raise TypeError(f"{self.name or 'Linear'}: input must be floating point, got {x.dtype}")
        plan, state = self._plan(active_recipe(self.recipe).for_layer(self.name or ""))
        w = self.weight if self.weight_layout == "out_in" else self.weight.t()
        y = linear(x, w, self.bias, plan, state)
        if state:
            after_forward(self)
        return y

    def extra_repr(self) -> str:
        layout = "" if self.weight_layout == "out_in" else ", weight_layout='in_out'"
        return f"{super().extra_repr()}, recipe={self.recipe.name!r}{layout}"

    # ------------------------------------------------------------------ state_dict
    def _save_to_state_dict(self, destination, prefix, keep_vars):  # type: ignore[override]
        super()._save_to_state_dict(destination, prefix, keep_vars)
        fp = self.recipe.fingerprint().encode()
        destination[prefix + _RECIPE_KEY] = torch.tensor(list(fp), dtype=torch.uint8)
        for key, ds in self._state.by_key.items():
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
            for key, ds in self._state.by_key.items():
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
                for key, ds in self._state.by_key.items()
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

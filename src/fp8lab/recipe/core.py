"""`Recipe`: which tensor is quantized how, and how each GEMM of a Linear layer runs.

A `Recipe` is frozen, printable data that round-trips through TOML and JSON. It describes:

* per tensor **role** -- ``input`` (activation), ``weight``, ``grad_output`` -- a `QuantSpec`
  (format, granularity, scaling rule or delayed-scaling *configuration*, rounding), or ``None``
  (kept fp32);
* per **GEMM** of a linear layer (NVIDIA developer blog "探索 FP8 训练中 Debug 思路与技巧") --
  ``fprop`` ``y = x Wᵀ``, ``dgrad`` ``dx = dy W``,
  ``wgrad`` ``dW = dyᵀ x`` -- a `GemmConfig`: the `Accumulator`, an optional high-precision
  override (``"fp32"``, ``"bf16"``, ``"fp16"``: both operands merely rounded to that format) and
  optional per-(GEMM, role) spec overrides (that blog's cure: current scaling for
  ``grad_output`` in ``dgrad`` only, while the same gradient feeds ``wgrad`` under the delayed
  spec);
* what is saved for backward (``"high_precision"``, the default: the fp32 operands, quantized
  again in backward, as torchao does; ``"quantized"``: the forward's quantized operands, as TE
  and DeepSeek-V3 do: shared where the backward GEMM quantizes alike, re-tiled from the
  quantized values where only the blocks differ, as DeepSeek-V3 does for its activations), and
  per backward GEMM where each operand comes from (``operand_source``; ``"auto"``: the source
  system's choice, docs/recipes.md);
* whether attention runs in FP8 (``attention``, off by default like TE's ``fp8_dpa``) and how
  (``dpa``, a `DPAConfig`: the ``[dpa]`` table; `fp8lab.nn.DotProductAttention`);
* shorthands for other keys (`fp8lab.recipe.shorthands`): ``backward_override`` (TE's: the
  backward GEMMs in bf16 on the original or the dequantized operands), ``rht_gemms`` (TE's random
  Hadamard transform on the wgrad operands) and the high-precision first/last blocks
  ``hp_first_blocks``/``hp_last_blocks`` (resolved into ``[[layer]]`` rules by
  `fp8lab.nn.convert`);
* the token dispatch format of mixture-of-experts blocks (``moe``, a `MoEConfig`: the ``[moe]``
  table; `fp8lab.nn.moe`);
* the optimizer-state precision (``optimizer_state`` for both moments, or per moment
  ``exp_avg_dtype`` / ``exp_avg_sq_dtype``, Megatron's names; ``moment_expansion``: COAT's
  dynamic range expansion of FP8 moments), the master weights (``master_weights``), how
  quantized Linear weights are stored (``param_storage``: ``"fp8"`` = FP8 codes plus scales, with
  ``param_master_init``) and loss scaling (consumed by `fp8lab.optim` and the lab);
* whether the inputs of nonlinearities (activation function, norms) are saved for backward in
  FP8 (``save_activations``; the lab's GPT, `fp8lab.nn.saved_activations`);
* whether norm affine parameters are quantized with the weight role's spec
  (``norm_weights``: ``"high_precision"``, the default, or ``"quantized"``; the lab's GPT).

Granularity convention: a role's block shape is written for the tensor in its natural layout
(``input`` ``[tokens, in]``, ``weight`` ``[out, in]``, ``grad_output`` ``[tokens, out]``) as used by
the GEMM that reduces along its *last* axis (fprop for input and weight, dgrad for grad_output).
A GEMM that reduces along the first axis (dgrad for weight, wgrad for both operands) uses the
transposed blocks: ``(1, 128)`` becomes ``(128, 1)``, ``"row"`` becomes ``"col"`` (re-tiling).
Per-(GEMM, role) overrides follow the same convention.

A recipe is configuration only: a `DelayedScaling` given in a spec is stored as its frozen
`DelayedScalingConfig`; the scaling state belongs to whoever quantizes (`fp8lab.nn.Linear`, or
the user through `DelayedScaling.bind`). Presets are therefore immutable and shareable.

Recipe files (`Recipe.load`) are type-checked key by key; every error (`RecipeFileError`) names
the file, the table and the key.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp8lab._keys import check_choice
from fp8lab.gemm import Accumulator
from fp8lab.qtensor import QuantSpec
from fp8lab.recipe.config import (
    GEMM_OPERANDS,
    GEMMS,
    LOSS_SCALINGS,
    MASTER_WEIGHTS,
    NORM_WEIGHTS,
    OPTIMIZER_STATES,
    PARAM_MASTER_INITS,
    PARAM_STORAGES,
    ROLES,
    SAVE_ACTIVATIONS,
    SAVE_MODES,
    GemmConfig,
    RecipeFileError,
    _spec,
    check_operand_source,
)
from fp8lab.recipe.dpa import DPAConfig
from fp8lab.recipe.layers import LayerRule
from fp8lab.recipe.moe import MoEConfig
from fp8lab.recipe.plain import recipe_from_plain
from fp8lab.recipe.shorthands import (
    check_hp_blocks,
    check_rht_gemms,
    expand_backward_override,
    plain_hp_last,
)
from fp8lab.recipe.toml_writer import dump_toml

__all__ = ["Recipe"]

#: the optimizer / storage keys `Recipe.__repr__` shows when set (absent from to_dict otherwise)
_STORAGE_KEYS = ("exp_avg_dtype", "exp_avg_sq_dtype", "moment_expansion", "param_storage",
                 "param_master_init", "save_activations")  # fmt: skip


def _load_text(
    text: str, loads: Callable[[str], Any], error: type[Exception], kind: str, where: str
) -> Any:
    """``loads(text)``; a parse ``error`` becomes a `RecipeFileError` naming ``where`` and ``kind``."""
    try:
        return loads(text)
    except error as exc:
        raise RecipeFileError(f"{where}: not valid {kind}: {exc}") from None


def _check_not_empty(d: Any, where: str) -> None:
    """An empty document is refused: it would run silently as an all-fp32 recipe "custom"."""
    if isinstance(d, Mapping) and not d:
        raise RecipeFileError(
            f"{where}: empty recipe (no keys); give 'base = \"PRESET\"' or the roles to "
            "quantize (an all-fp32 run is the preset 'fp32')"
        )


@dataclass(frozen=True)
class Recipe:
    """A complete simulated low-precision training recipe (see the module docstring).

    Frozen configuration: equal to its TOML or JSON round trip, hashable.
    """

    name: str = "custom"
    input: QuantSpec | None = None
    weight: QuantSpec | None = None
    grad_output: QuantSpec | None = None
    fprop: GemmConfig = field(default_factory=GemmConfig)
    dgrad: GemmConfig = field(default_factory=GemmConfig)
    wgrad: GemmConfig = field(default_factory=GemmConfig)
    save_for_backward: str = "high_precision"
    attention: bool = False
    moe: MoEConfig = field(default_factory=MoEConfig)
    dpa: DPAConfig = field(default_factory=DPAConfig)
    optimizer_state: str = "fp32"
    master_weights: str = "fp32"
    norm_weights: str = "high_precision"
    exp_avg_dtype: str | None = None
    exp_avg_sq_dtype: str | None = None
    moment_expansion: bool = False
    param_storage: str = "high_precision"
    param_master_init: str = "high_precision"
    save_activations: str = "high_precision"
    loss_scaling: str = "none"
    loss_scale: float = 2.0**16
    description: str = ""
    source: str = ""
    layers: tuple[LayerRule, ...] = ()
    #: TE's backward_override: "none", "high_precision" or "dequantized" (expanded into the
    #: dgrad/wgrad GemmConfigs on construction: `fp8lab.recipe.shorthands`)
    backward_override: str = "none"
    #: the GEMMs whose operands get TE's random Hadamard transform: "none" or "wgrad"
    rht_gemms: str = "none"
    #: last blocks kept in bf16 (None: the NVFP4 paper's ~15 %); resolved by `fp8lab.nn.convert`
    hp_last_blocks: int | None = 0
    #: first blocks kept in bf16; resolved by `fp8lab.nn.convert`
    hp_first_blocks: int = 0
    #: the file `load` read this recipe from ("" otherwise): named by errors, not compared or saved
    path: str = field(default="", compare=False, repr=False)

    def __post_init__(self) -> None:
        for role in ROLES:
            object.__setattr__(self, role, _spec(getattr(self, role), role))
        for g in GEMMS:
            v = getattr(self, g)
            if isinstance(v, Mapping):
                v = GemmConfig.from_dict(v)
            elif not isinstance(v, GemmConfig):
                raise TypeError(f"{g} must be a GemmConfig or dict, got {type(v).__name__}")
            object.__setattr__(self, g, v)
        for g, v in expand_backward_override(self).items():  # a shorthand: written out here
            object.__setattr__(self, g, v)
        for g in GEMMS:
            object.__setattr__(self, g, check_operand_source(g, getattr(self, g)))
        check_choice(self.save_for_backward, SAVE_MODES, "save_for_backward")
        check_choice(self.loss_scaling, LOSS_SCALINGS, "loss_scaling")
        if not (math.isfinite(self.loss_scale) and self.loss_scale > 0):
            raise ValueError(f"loss_scale must be finite and > 0, got {self.loss_scale}")
        object.__setattr__(self, "loss_scale", float(self.loss_scale))
        check_choice(self.optimizer_state, OPTIMIZER_STATES, "optimizer_state")
        check_choice(self.norm_weights, NORM_WEIGHTS, "norm_weights")
        check_choice(self.master_weights, MASTER_WEIGHTS, "master_weights")
        self._check_optimizer_and_params()
        if not isinstance(self.attention, bool):
            raise TypeError(f"attention must be a bool, got {type(self.attention).__name__}")
        if isinstance(self.moe, Mapping):
            object.__setattr__(self, "moe", MoEConfig.from_dict(self.moe))
        elif not isinstance(self.moe, MoEConfig):
            raise TypeError(f"moe must be a MoEConfig or dict, got {type(self.moe).__name__}")
        if isinstance(self.dpa, Mapping):
            object.__setattr__(self, "dpa", DPAConfig.from_dict(self.dpa))
        elif not isinstance(self.dpa, DPAConfig):
            raise TypeError(f"dpa must be a DPAConfig or dict, got {type(self.dpa).__name__}")
        if not self.attention and not self.dpa.is_default:
            raise ValueError(
                f"[dpa] ({self.dpa.describe()}) sets FP8 attention options but attention = "
                "false; set attention = true or drop the [dpa] table"
            )
        rules = tuple(
            r if isinstance(r, LayerRule) else LayerRule.from_dict(r) for r in self.layers
        )
        object.__setattr__(self, "layers", rules)
        check_rht_gemms(self)
        check_hp_blocks(self.hp_last_blocks, self.hp_first_blocks)
        for i, rule in enumerate(rules, 1):
            # keys and types now, on the Recipe defaults (a rule may only make sense after an
            # earlier one: its combination is checked when a layer resolves, in `for_layer`)
            where = f"[[layer]] {i} (match {', '.join(rule.match)})"
            # attention on: a rule's [dpa] may rely on an earlier rule (or the top level) for it
            recipe_from_plain(type(self), rule.apply({"attention": True}), where)

    def _check_optimizer_and_params(self) -> None:
        """The per-moment, expansion and parameter-storage keys, alone and together."""
        for key in ("exp_avg_dtype", "exp_avg_sq_dtype"):
            v = getattr(self, key)
            if v is not None:
                check_choice(v, OPTIMIZER_STATES, key)
        per_moment = self.exp_avg_dtype is not None or self.exp_avg_sq_dtype is not None
        if per_moment and self.optimizer_state != "fp32":
            raise ValueError(
                f"optimizer_state = {self.optimizer_state!r} sets both moments; give either it "
                "or exp_avg_dtype / exp_avg_sq_dtype, not both"
            )
        if not isinstance(self.moment_expansion, bool):
            raise TypeError(
                f"moment_expansion must be a bool, got {type(self.moment_expansion).__name__}"
            )
        fp8 = ("fp8", "e4m3", "e5m2")
        if self.moment_expansion and not any(m in fp8 for m in self.moment_dtypes):
            raise ValueError(
                f"moment_expansion expands FP8 moments, but the moments are stored in "
                f"{'/'.join(self.moment_dtypes)}; store one in fp8, e4m3 or e5m2"
            )
        check_choice(self.param_storage, PARAM_STORAGES, "param_storage")
        check_choice(self.param_master_init, PARAM_MASTER_INITS, "param_master_init")
        check_choice(self.save_activations, SAVE_ACTIVATIONS, "save_activations")
        if self.param_storage == "fp8":
            from fp8lab.formats import get_format

            spec = self.spec("fprop", "weight")
            if spec is None or get_format(spec.format).bits > 8:
                what = "no weight spec (fp32)" if spec is None else f"weight format {spec.format}"
                raise ValueError(
                    f"param_storage = 'fp8' stores weights as 8-bit codes plus scales; this "
                    f"recipe has {what}, which has no such codes"
                )
        else:
            if self.master_weights == "none":
                raise ValueError(
                    "master_weights = 'none' (no master copy) needs param_storage = 'fp8'"
                )
            if self.param_master_init != "high_precision":
                raise ValueError(
                    f"param_master_init = {self.param_master_init!r} is for FP8-stored weights; "
                    "set param_storage = 'fp8'"
                )

    # ------------------------------------------------------------------ queries
    @property
    def moment_dtypes(self) -> tuple[str, str]:
        """Storage of AdamW's (first, second) moment: ``exp_avg_dtype`` / ``exp_avg_sq_dtype``
        when either is given (the other then fp32, Megatron's default), else
        ``optimizer_state`` for both (`fp8lab.optim.AdamW`'s ``state_precision`` pair)."""
        if self.exp_avg_dtype is None and self.exp_avg_sq_dtype is None:
            return self.optimizer_state, self.optimizer_state
        return self.exp_avg_dtype or "fp32", self.exp_avg_sq_dtype or "fp32"

    def gemm(self, gemm: str) -> GemmConfig:
        if gemm not in GEMMS:
            raise ValueError(f"unknown GEMM {gemm!r}; valid: {', '.join(GEMMS)}")
        return getattr(self, gemm)

    def spec(self, gemm: str, role: str) -> QuantSpec | None:
        """The spec of ``role`` in ``gemm`` (the override if any, else the role's spec), in the
        natural-layout convention; ``None`` when the operand stays unquantized. Under
        ``rht_gemms = "wgrad"`` the quantized wgrad operands carry ``rht=True``."""
        s = self.role_spec(gemm, role)
        if (
            self.rht_gemms == "wgrad"
            and gemm == "wgrad"
            and s is not None
            and self.precision(gemm, role) is None
        ):
            return s.replace(rht=True)
        return s

    def role_spec(self, gemm: str, role: str) -> QuantSpec | None:
        """`spec` without the ``rht_gemms`` transform: the override if any, else the role's."""
        cfg = self.gemm(gemm)
        if role not in (r for r, _ in GEMM_OPERANDS[gemm]):
            raise ValueError(f"{role!r} is not an operand of {gemm}")
        ov = cfg.override(role)
        return ov if ov is not None else getattr(self, role)

    def precision(self, gemm: str, role: str) -> str | None:
        """The high precision ``role`` runs in within ``gemm`` (the GEMM's, else its cell's), or
        ``None`` when quantized (or fp32 as is)."""
        return self.gemm(gemm).precision(role)

    def for_layer(self, name: str) -> Recipe:
        """The recipe the layer named ``name`` runs: the `layers` rules that match it applied in
        order (last match wins), without rules of its own. ``self`` when there are no rules."""
        if not self.layers:
            return self
        cache = self.__dict__.setdefault("_for_layer", {})
        hit = cache.get(name)
        if hit is None:
            d = self._plain_without_layers()
            rules = self.layer_rules_for(name)
            for i in rules:
                d = self.layers[i].apply(d)
            where = f"recipe {self.name!r}, layer {name!r} ([[layer]] {[i + 1 for i in rules]})"
            hit = cache[name] = type(self).from_dict(d, where=where)
        return hit

    def layer_rules_for(self, name: str) -> list[int]:
        """Indices (0-based, in order) of the `layers` rules matching the layer ``name``."""
        return [i for i, r in enumerate(self.layers) if r.matches(name)]

    def _plain_without_layers(self) -> dict[str, Any]:
        d = self.to_dict()
        d.pop("layer", None)
        return d

    @property
    def is_delayed(self) -> bool:
        """Whether any operand uses delayed scaling (the module then keeps state)."""
        return any(
            s is not None and s.is_delayed
            for g in GEMMS
            for r, _ in GEMM_OPERANDS[g]
            for s in [self.spec(g, r)]
        )

    # ------------------------------------------------------------------ derivation
    def replace(self, **changes: Any) -> Recipe:
        return dataclasses.replace(self, **changes)

    def with_high_precision(self, *gemms: str, precision: str = "bf16") -> Recipe:
        """Copy with ``gemms`` run in high precision (the per-GEMM bisection of NVIDIA's
        developer blog "探索 FP8 训练中 Debug 思路与技巧")."""
        ch = {g: dataclasses.replace(self.gemm(g), high_precision=precision) for g in gemms}
        return dataclasses.replace(self, **ch)

    def with_cell_high_precision(self, gemm: str, role: str, precision: str = "bf16") -> Recipe:
        """Copy with only ``role``'s operand of ``gemm`` in high precision (unscaled, rounded to
        ``precision``); the GEMM's other operand stays quantized."""
        cfg = self.gemm(gemm)
        if role not in (r for r, _ in GEMM_OPERANDS[gemm]):
            raise ValueError(f"{role!r} is not an operand of {gemm}")
        cells = {**dict(cfg.high_precision_roles), role: precision}
        return dataclasses.replace(
            self, **{gemm: dataclasses.replace(cfg, high_precision_roles=cells)}
        )

    def with_layers(self, *rules: LayerRule | Mapping[str, Any]) -> Recipe:
        """Copy with ``rules`` appended to `layers` (applied after the existing ones)."""
        return dataclasses.replace(self, layers=(*self.layers, *rules))

    def with_override(self, gemm: str, role: str, spec: QuantSpec | Mapping | str) -> Recipe:
        """Copy with ``role``'s spec replaced in ``gemm`` only."""
        cfg = self.gemm(gemm)
        if role not in (r for r, _ in GEMM_OPERANDS[gemm]):
            raise ValueError(f"{role!r} is not an operand of {gemm}")
        ov = dict(cfg.overrides)
        ov[role] = _spec(spec, f"override for {role}")
        return dataclasses.replace(self, **{gemm: dataclasses.replace(cfg, overrides=ov)})

    def with_accumulator(self, accumulator: Accumulator | str, *gemms: str) -> Recipe:
        """Copy with the accumulator of ``gemms`` (default: all three) replaced."""
        acc = Accumulator.parse(accumulator)
        ch = {g: dataclasses.replace(self.gemm(g), accumulator=acc) for g in (gemms or GEMMS)}
        return dataclasses.replace(self, **ch)

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        """Plain data (no None: absent role = unquantized), TOML/JSON friendly."""
        d: dict[str, Any] = {
            "name": self.name,
            "description": self.description,
            "source": self.source,
            "save_for_backward": self.save_for_backward,
            "attention": self.attention,
            "optimizer_state": self.optimizer_state,
            "master_weights": self.master_weights,
            "loss_scaling": self.loss_scaling,
            "loss_scale": self.loss_scale,
        }
        for role in ROLES:
            s = getattr(self, role)
            if s is not None:
                d[role] = s.to_dict()
        for g in GEMMS:
            d[g] = self.gemm(g).to_dict()
        if not self.moe.is_default:  # absent otherwise: fingerprints stay as they were
            d["moe"] = self.moe.to_dict()
        if not self.dpa.is_default:  # absent otherwise: fingerprints stay as they were
            d["dpa"] = self.dpa.to_dict()
        if self.norm_weights != "high_precision":  # absent at the default: fingerprints stay
            d["norm_weights"] = self.norm_weights
        for key in ("exp_avg_dtype", "exp_avg_sq_dtype"):  # the per-moment form replaces
            if getattr(self, key) is not None:  # optimizer_state (giving both is an error)
                d.pop("optimizer_state", None)
                d[key] = getattr(self, key)
        if self.moment_expansion:
            d["moment_expansion"] = True
        for key in ("param_storage", "param_master_init", "save_activations"):
            if getattr(self, key) != "high_precision":  # absent at the default: fingerprints stay
                d[key] = getattr(self, key)
        # absent at their defaults: fingerprints stay as they were
        if self.backward_override != "none":
            d["backward_override"] = self.backward_override
        if self.rht_gemms != "none":
            d["rht_gemms"] = self.rht_gemms
        if self.hp_last_blocks != 0:
            d["hp_last_blocks"] = plain_hp_last(self.hp_last_blocks)
        if self.hp_first_blocks != 0:
            d["hp_first_blocks"] = self.hp_first_blocks
        if self.layers:  # absent otherwise: fingerprints of rule-free recipes stay as they were
            d["layer"] = [r.to_dict() for r in self.layers]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, where: str = "recipe") -> Recipe:
        """Inverse of `to_dict`, type-checked key by key: a `RecipeFileError` (a ValueError)
        names ``where`` (e.g. the file), the table and the key of a bad or unknown entry."""
        return recipe_from_plain(cls, d, where)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)

    @classmethod
    def from_json(cls, text: str, *, where: str = "recipe") -> Recipe:
        d = _load_text(text, json.loads, json.JSONDecodeError, "JSON", where)
        _check_not_empty(d, where)
        return cls.from_dict(d, where=where)

    def to_toml(self) -> str:
        return dump_toml(self.to_dict())

    @classmethod
    def from_toml(cls, text: str, *, where: str = "recipe") -> Recipe:
        d = _load_text(text, tomllib.loads, tomllib.TOMLDecodeError, "TOML", where)
        _check_not_empty(d, where)
        return cls.from_dict(d, where=where)

    def save(self, path: str | Path) -> None:
        """Write ``.toml`` or ``.json`` (by suffix)."""
        p = Path(path)
        if p.suffix == ".toml":
            p.write_text(self.to_toml(), encoding="utf-8")
        elif p.suffix == ".json":
            p.write_text(self.to_json() + "\n", encoding="utf-8")
        else:
            raise ValueError(f"recipe files end in .toml or .json, got {p.name!r}")

    @classmethod
    def load(cls, path: str | Path) -> Recipe:
        """Read a ``.toml`` or ``.json`` recipe file. Every problem is a `RecipeFileError`
        naming the file: "no such recipe file", unreadable, not TOML/JSON, or a bad table/key."""
        p = Path(path)
        if p.suffix not in (".toml", ".json"):
            raise ValueError(f"recipe files end in .toml or .json, got {p.name!r}")
        if not p.exists():
            raise RecipeFileError(f"no such recipe file: {str(p)!r}")
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise RecipeFileError(f"cannot read recipe file {str(p)!r}: {exc}") from None
        where = f"recipe file {str(p)!r}"
        if p.suffix == ".toml":
            rec = cls.from_toml(text, where=where)
        else:
            rec = cls.from_json(text, where=where)
        object.__setattr__(rec, "path", str(p))
        return rec

    def fingerprint(self) -> str:
        """Canonical JSON of the numerics (name and prose excluded): equal iff same numerics.

        Computed once per (immutable) recipe: modules look it up on every forward."""
        cached = self.__dict__.get("_fingerprint")
        if cached is None:
            d = self.to_dict()
            for k in ("name", "description", "source"):
                d.pop(k)
            d.pop("backward_override", None)  # a shorthand: its expansion is in dgrad/wgrad
            cached = json.dumps(d, sort_keys=True, separators=(",", ":"))
            object.__setattr__(self, "_fingerprint", cached)
        return cached

    def __repr__(self) -> str:
        def spec_str(s: QuantSpec | None) -> str:
            return "fp32" if s is None else s.describe()  # the one text form of a spec

        def gemm_str(name: str) -> str:
            c = self.gemm(name)
            parts = [f"acc={c.accumulator.describe()}"]  # the one text form of an accumulator
            if c.high_precision:
                parts.append(f"high_precision={c.high_precision}")
            for r, s in c.overrides:
                parts.append(f"{r}={spec_str(s)}")
            for r, p in c.high_precision_roles:
                parts.append(f"{r}={p}")
            for r, src in c.operand_source if not isinstance(c.operand_source, str) else ():
                parts.append(f"{r} from {src}")
            return f"{name}({', '.join(parts)})"

        lines = [f"Recipe({self.name!r}"]
        lines.append("  roles: " + ", ".join(f"{r}={spec_str(getattr(self, r))}" for r in ROLES))
        lines.append("  gemms: " + ", ".join(gemm_str(g) for g in GEMMS))
        lines.append(
            f"  save_for_backward={self.save_for_backward}, attention={self.attention}, "
            f"optimizer_state={self.optimizer_state}, master_weights={self.master_weights}, "
            f"loss_scaling={self.loss_scaling}"
            + (f"({self.loss_scale:g})" if self.loss_scaling != "none" else "")
            + ")"
        )
        extra = {"backward_override": "none", "rht_gemms": "none", "hp_last_blocks": 0,
                 "hp_first_blocks": 0}  # fmt: skip
        shown = [f"{k}={getattr(self, k)}" for k, v in extra.items() if getattr(self, k) != v]
        if shown:
            lines.append("  " + ", ".join(shown))
        if not self.moe.is_default:
            lines.append(f"  moe: {self.moe.describe()}")
        if not self.dpa.is_default:
            lines.append(f"  dpa: {self.dpa.describe()}")
        if self.norm_weights != "high_precision":
            lines.append(f"  norm_weights={self.norm_weights}")
        extras = {k: v for k, v in self.to_dict().items() if k in _STORAGE_KEYS}
        if extras:
            lines.append("  " + ", ".join(f"{k}={v}" for k, v in extras.items()))
        lines += [f"  layer {i}: {r.describe()}" for i, r in enumerate(self.layers, 1)]
        return "\n".join(lines)

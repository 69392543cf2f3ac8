"""AdamW with fp32 master weights and emulated low-precision optimizer states.

DeepSeek-V3 keeps FP32 master weights and gradients and BF16 AdamW moments; FP8-LM and COAT store
moments in block-scaled FP8. Here every state is a float32 tensor whose values lie exactly on the
storage grid (see :mod:`fp8lab.optim._storage`): the update math runs in float32 with the same
operation order as ``torch.optim.AdamW(foreach=False)``, so ``state_precision="fp32"`` reproduces
it bit for bit, and each step's new moments are rounded when written back.

Master weights and parameter storage (``param_format``, ``param_specs``, ``master_init``):

* ``param_format`` ``"bf16"``/``"fp16"``: an fp32 master in the state, the parameter holds it
  rounded; ``"fp16-scaled"``: the master itself is stored in FP16 under one power-of-two scale
  per tensor (MS-AMP O2), the parameter holds its value; ``"none"``: no master copy, the update is
  applied to the parameter's (dequantized) value and stored back.
* ``param_specs`` maps parameters to the `QuantSpec` their FP8 storage uses (TE's
  ``fp8_model_init`` / Megatron's ``--fp8-param-gather``): after every step the parameter is the
  dequantized FP8 quantization of its master (``fp8lab.nn.fp8_params``). ``master_init``: the
  master of such a parameter starts from its high-precision initial value
  (``"high_precision"``, TE PR 1121's ``preserve_high_precision_init_val``, kept on the
  parameter as ``_fp8lab_hp_init``) or from the FP8 value (``"from_fp8"``, TE's default path).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from fp8lab.optim._storage import (
    _BLOCK_SCALED,
    canonical_storage,
    round_to,
    store_,
    store_expanded_,
)
from fp8lab.optim.clip import clip_grad_norm_

StatePrecision = str | tuple[str, str]

#: values of ``param_format`` besides the storage names: MS-AMP O2's scaled FP16 master
#: weights, and no master at all
MASTER_ONLY = ("fp16-scaled", "none")
MASTER_INITS = ("high_precision", "from_fp8")
#: the attribute `fp8lab.nn.fp8_params` keeps a parameter's high-precision initial value in
HP_INIT_ATTR = "_fp8lab_hp_init"


def _parse_param_format(fmt: str | None) -> str | None:
    if fmt is None or fmt in MASTER_ONLY:
        return fmt
    return canonical_storage(fmt)


def requantize(w: torch.Tensor, spec: Any) -> torch.Tensor:
    """``w`` (float32) as FP8 storage under ``spec`` holds it: quantized, then dequantized."""
    from fp8lab.qtensor import quantize

    return quantize(w.detach().to(torch.float32), spec).dequantize().reshape(w.shape)


def _parse_state_precision(sp: StatePrecision) -> tuple[str, str]:
    if isinstance(sp, str):
        f = canonical_storage(sp)
        return f, f
    if isinstance(sp, (tuple, list)) and len(sp) == 2:
        return canonical_storage(sp[0]), canonical_storage(sp[1])
    raise ValueError(
        f"state_precision must be a name or a (first_moment, second_moment) pair, got {sp!r}"
    )


class AdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) with master weights and configurable state storage.

    Args:
        params: parameters or param groups, as for ``torch.optim.AdamW``.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (same defaults).
        state_precision: storage of the two moments: ``"fp32"``, ``"bf16"``, ``"fp16"``, ``"fp8"``
            (= block-scaled E4M3), ``"e4m3"``, ``"e5m2"``, or a pair ``(m, v)`` such as
            ``("fp8", "bf16")``. Unscaled fp16 storage of the second moment underflows for small
            gradients (a real hazard, kept visible).
        state_block: block length (elements of the flattened state) for FP8 storage.
        param_format: if given (``"bf16"``, ``"fp16"``, ...), the model parameters hold the master
            weights rounded to that format after every step while an fp32 master copy lives in the
            optimizer state. Parameters whose dtype is not float32 always get an fp32 master copy.
            ``"fp16-scaled"``: the master is stored as scaled FP16 (MS-AMP O2); ``"none"``: no
            master copy (module doc).
        moment_expansion: COAT's dynamic range expansion for the moments stored in FP8
            (`fp8lab.optim._storage.store_expanded_`); ValueError when neither moment is FP8.
        param_specs: parameter -> `QuantSpec` of its FP8 storage (module doc).
        master_init: ``"high_precision"`` or ``"from_fp8"``: where the master of an FP8-stored
            parameter starts (module doc).
        max_grad_norm: if given, gradients are clipped to this total L2 norm before the update.
        skip_nonfinite: if True (default) a step whose gradients contain NaN/inf is skipped
            entirely and counted in :attr:`skipped_steps`; weights are never touched by it.

    ``step()`` returns the closure's loss (``torch`` convention); :attr:`last_step_skipped`
    tells whether the last step was skipped.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        state_precision: StatePrecision = "fp32",
        state_block: int = 128,
        param_format: str | None = None,
        max_grad_norm: float | None = None,
        skip_nonfinite: bool = True,
        moment_expansion: bool = False,
        param_specs: Any = None,
        master_init: str = "high_precision",
    ) -> None:
        if not lr >= 0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        if not eps >= 0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        if not (isinstance(state_block, int) and state_block > 0):
            raise ValueError(f"state_block must be a positive int, got {state_block!r}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0, got {max_grad_norm}")
        self.state_formats = _parse_state_precision(state_precision)
        self.param_format = _parse_param_format(param_format)
        if moment_expansion and not any(f in _BLOCK_SCALED for f in self.state_formats):
            raise ValueError(
                f"moment_expansion expands FP8 moments; the moments are stored in "
                f"{self.state_formats} (give an FP8 state_precision)"
            )
        if master_init not in MASTER_INITS:
            raise ValueError(f"master_init must be one of {MASTER_INITS}, got {master_init!r}")
        self.moment_expansion = bool(moment_expansion)
        self.param_specs = dict(param_specs or {})
        self.master_init = master_init
        self.state_block = state_block
        self.max_grad_norm = max_grad_norm
        self.skip_nonfinite = skip_nonfinite
        self.skipped_steps = 0
        self.last_step_skipped = False
        self.last_grad_norm: torch.Tensor | None = None
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)

    @classmethod
    def from_recipe(cls, params: Iterable, recipe: Any, **kwargs: Any) -> AdamW:
        """AdamW with ``recipe.optimizer_state`` moments and ``recipe.master_weights`` params
        (``"fp32"``: parameters are their own masters; ``"bf16"``/``"fp16"``: parameters hold
        the rounded master). ``recipe`` is a `fp8lab.Recipe` or a preset name."""
        from fp8lab.recipe import get_recipe

        rec = get_recipe(recipe)
        kwargs.setdefault("state_precision", rec.moment_dtypes)
        if rec.master_weights != "fp32":
            kwargs.setdefault("param_format", rec.master_weights)
        kwargs.setdefault("moment_expansion", rec.moment_expansion)
        kwargs.setdefault("master_init", rec.param_master_init)
        return cls(params, **kwargs)

    # ------------------------------------------------------------------ helpers
    def _needs_master(self, p: torch.Tensor) -> bool:
        if p.dtype != torch.float32:
            return True
        if self.param_format == "none":
            return False
        return p in self.param_specs or self.param_format not in (None, "fp32")

    def _initial_master(self, p: torch.Tensor) -> torch.Tensor:
        hp = getattr(p, HP_INIT_ATTR, None)
        if p in self.param_specs and self.master_init == "high_precision" and hp is not None:
            w = hp.detach().to(device=p.device, dtype=torch.float32).clone()
        else:
            w = p.detach().to(torch.float32).clone()
        if self.param_format == "fp16-scaled":
            store_(w, w, "fp16", scaled=True)
        return w

    def _store_moment(self, st: torch.Tensor, value: torch.Tensor, fmt: str) -> None:
        if self.moment_expansion and fmt in _BLOCK_SCALED:
            store_expanded_(st, value, fmt, self.state_block)
        else:
            store_(st, value, fmt, self.state_block)

    def _params_with_grad(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"] if p.grad is not None]

    def master_weight(self, p: torch.Tensor) -> torch.Tensor:
        """The fp32 master copy of parameter ``p`` (``p`` itself when it is its own master)."""
        st = self.state.get(p, {})
        return st.get("master", p)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = self._params_with_grad()
        self.last_step_skipped = False
        if self.skip_nonfinite and not all(bool(torch.isfinite(p.grad).all()) for p in params):
            self.skipped_steps += 1
            self.last_step_skipped = True
            return loss
        if self.max_grad_norm is not None:
            self.last_grad_norm = clip_grad_norm_(params, self.max_grad_norm)
        fm, fv = self.state_formats
        for group in self.param_groups:
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise TypeError("fp8lab.optim.AdamW does not support sparse gradients")
                st = self.state[p]
                if not st:
                    # on the CPU, as torch.optim.AdamW's: read with float() each step, no sync
                    st["step"] = torch.zeros((), dtype=torch.float32, device="cpu")
                    st["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    st["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                    if self._needs_master(p):
                        st["master"] = self._initial_master(p)
                w = st.get("master", p)
                grad = p.grad.to(torch.float32)
                exp_avg, exp_avg_sq = st["exp_avg"], st["exp_avg_sq"]
                st["step"] += 1
                step = float(st["step"])
                # same operation order as torch.optim.adamw._single_tensor_adamw
                w.mul_(1 - lr * wd)
                m = exp_avg.lerp(grad, 1 - beta1)
                v = exp_avg_sq.mul(beta2).addcmul_(grad, grad, value=1 - beta2)
                bias_correction1 = 1 - beta1**step
                bias_correction2 = 1 - beta2**step
                step_size = lr / bias_correction1
                denom = (v.sqrt() / bias_correction2**0.5).add_(eps)
                w.addcdiv_(m, denom, value=-step_size)
                self._store_moment(exp_avg, m, fm)
                self._store_moment(exp_avg_sq, v, fv)
                if self.param_format == "fp16-scaled" and w is not p:
                    store_(w, w, "fp16", scaled=True)
                spec = self.param_specs.get(p)
                if spec is not None:  # FP8 storage: re-quantized after every step
                    p.copy_(requantize(w, spec))
                elif w is not p:
                    if self.param_format not in (None, "fp32", *MASTER_ONLY):
                        p.copy_(round_to(w, self.param_format))
                    else:
                        p.copy_(w)
        return loss

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["fp8lab"] = {
            "skipped_steps": self.skipped_steps,
            "state_formats": list(self.state_formats),
            "param_format": self.param_format,
            "state_block": self.state_block,
        }
        if self.moment_expansion:  # absent otherwise: older checkpoints stay loadable
            sd["fp8lab"]["moment_expansion"] = True
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        extra = state_dict.pop("fp8lab", None)
        if extra is not None:
            if (
                tuple(extra["state_formats"]) != self.state_formats
                or extra["param_format"] != self.param_format
                or extra["state_block"] != self.state_block
                or bool(extra.get("moment_expansion", False)) != self.moment_expansion
            ):
                raise ValueError(
                    "optimizer state was saved with state formats "
                    f"{tuple(extra['state_formats'])}, param_format {extra['param_format']!r}, "
                    f"block {extra['state_block']}, moment_expansion "
                    f"{bool(extra.get('moment_expansion', False))}; this optimizer uses "
                    f"{self.state_formats}, {self.param_format!r}, block {self.state_block}, "
                    f"moment_expansion {self.moment_expansion}"
                )
            self.skipped_steps = int(extra["skipped_steps"])
        super().load_state_dict(state_dict)
        # torch casts floating states to the parameter dtype; ours are float32 by design
        params = [p for g in self.param_groups for p in g["params"]]
        for idx, saved in state_dict["state"].items():
            st = self.state[params[int(idx)]]
            for k, v in saved.items():
                if isinstance(v, torch.Tensor):
                    st[k] = v.detach().to(torch.float32).clone()

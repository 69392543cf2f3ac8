"""AdamW with fp32 master weights and emulated low-precision optimizer states.

DeepSeek-V3 keeps FP32 master weights and gradients and BF16 AdamW moments; FP8-LM and COAT store
moments in block-scaled FP8. Here every state is a float32 tensor whose values lie exactly on the
storage grid (see :mod:`fp8lab.optim._storage`): the update math runs in float32 with the same
operation order as ``torch.optim.AdamW(foreach=False)``, so ``state_precision="fp32"`` reproduces
it bit for bit, and each step's new moments are rounded when written back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from fp8lab.optim._storage import canonical_storage, round_to, store_
from fp8lab.optim.clip import clip_grad_norm_

StatePrecision = str | tuple[str, str]


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
        self.param_format = None if param_format is None else canonical_storage(param_format)
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
        kwargs.setdefault("state_precision", rec.optimizer_state)
        if rec.master_weights != "fp32":
            kwargs.setdefault("param_format", rec.master_weights)
        return cls(params, **kwargs)

    # ------------------------------------------------------------------ helpers
    def _needs_master(self, p: torch.Tensor) -> bool:
        return p.dtype != torch.float32 or self.param_format not in (None, "fp32")

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
                        st["master"] = p.detach().to(torch.float32).clone()
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
                store_(exp_avg, m, fm, self.state_block)
                store_(exp_avg_sq, v, fv, self.state_block)
                if w is not p:
                    if self.param_format not in (None, "fp32"):
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
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        extra = state_dict.pop("fp8lab", None)
        if extra is not None:
            if (
                tuple(extra["state_formats"]) != self.state_formats
                or extra["param_format"] != self.param_format
                or extra["state_block"] != self.state_block
            ):
                raise ValueError(
                    "optimizer state was saved with state formats "
                    f"{tuple(extra['state_formats'])}, param_format {extra['param_format']!r}, "
                    f"block {extra['state_block']}; this optimizer uses {self.state_formats}, "
                    f"{self.param_format!r}, block {self.state_block}"
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

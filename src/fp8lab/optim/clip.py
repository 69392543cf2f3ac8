"""Gradient norm and clipping that never turns a non-finite gradient into NaN weights."""

from __future__ import annotations

from collections.abc import Iterable

import torch

Params = torch.Tensor | Iterable[torch.Tensor] | Iterable[dict]


def _grads(params: Params) -> list[torch.Tensor]:
    if isinstance(params, torch.Tensor):
        params = [params]
    out: list[torch.Tensor] = []
    for p in params:
        if isinstance(p, dict):  # an optimizer param group
            out.extend(q.grad for q in p["params"] if q.grad is not None)
        elif p.grad is not None:
            out.append(p.grad)
    return out


def grad_norm(params: Params, norm_type: float = 2.0) -> torch.Tensor:
    """Total ``norm_type`` norm of all gradients (float32 scalar; 0 when there are none).

    Accepts parameters, an iterable of parameters or optimizer param groups. A NaN or inf
    gradient gives a non-finite norm.
    """
    if norm_type <= 0:
        raise ValueError(f"norm_type must be > 0, got {norm_type}")
    grads = _grads(params)
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    norms = torch.stack([torch.linalg.vector_norm(g.float(), norm_type) for g in grads])
    return torch.linalg.vector_norm(norms, norm_type)


def grads_finite(params: Params) -> bool:
    """True when every gradient is finite (no NaN, no inf)."""
    return all(bool(torch.isfinite(g).all()) for g in _grads(params))


def clip_grad_norm_(params: Params, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale gradients in place so that their total norm is at most ``max_norm``.

    Returns the total norm *before* clipping. When it is non-finite the gradients are left
    untouched (the caller should skip the step; :class:`fp8lab.optim.AdamW` does so by itself),
    instead of multiplying them by NaN as a naive ``grad * max_norm / norm`` would.
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}")
    total = grad_norm(params, norm_type)
    if not torch.isfinite(total):
        return total
    coef = max_norm / (float(total) + 1e-6)
    if coef < 1.0:
        for g in _grads(params):
            g.mul_(coef)
    return total


def unscale_and_clip(
    scaler: object, target: object, params: Params, clip: float = 0.0
) -> tuple[bool, float]:
    """The part of a training step between backward and the optimizer step: unscale the
    gradients (``scaler``: an `fp8lab.optim.LossScaler`, a ``torch.amp.GradScaler`` or None;
    ``target``: what it unscales, the optimizer or the parameters), then the global gradient
    norm, clipping to ``clip`` when > 0. Returns ``(found_inf, norm before clipping)``; the norm
    is non-finite when a gradient is (nothing is clipped then)."""
    # fp8lab's LossScaler returns found_inf; torch's GradScaler returns None (its record of
    # found_inf is private): a non-finite norm says the same
    found_inf = bool(scaler.unscale_(target)) if scaler is not None else False  # type: ignore[attr-defined]
    if found_inf:
        return True, float(grad_norm(params))
    if clip > 0:
        return False, float(clip_grad_norm_(params, clip))
    return False, float(grad_norm(params))

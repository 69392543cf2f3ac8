"""Rounding float64 numpy arrays onto a format with `fp8lab.cast` (the study's only cast), on
the lab's torch device (`fp8lab.lab.machine.torch_device`: the arrays are copied there and
back; stochastic rounding draws from a CPU generator, so the draws are the same on every
device)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from fp8lab.formats import cast, get_format
from fp8lab.lab.machine import torch_device
from fp8lab.lab.snr.config import EXACT_ACCUMULATOR

__all__ = ["Rounder", "cast_array", "make_rounder"]

Rounder = Callable[[np.ndarray], np.ndarray]


def _generator(seed: int) -> torch.Generator:
    # stochastic rounding draws from a generator seeded by the run, so runs are reproducible
    return torch.Generator().manual_seed(seed)


def make_rounder(fmt: str, rounding: str, saturate: bool, size: int, seed: int = 0) -> Rounder:
    """In-place rounding of a float64 [size] numpy array onto ``fmt`` (``"fp64"``: identity).

    Uses `fp8lab.cast` with a preallocated float32 ``out=`` buffer: float32 holds every value of
    the formats used here exactly, and the float64 input is rounded directly (no double rounding
    through float32). ``hybrid`` (HiF8) rounding follows its input dtype and gets float32.
    """
    if fmt == EXACT_ACCUMULATOR:
        return lambda x: x
    f = get_format(fmt)
    device = torch_device()
    buf = torch.empty(size, dtype=torch.float32, device=device)
    host = buf if device.type == "cpu" else torch.empty(size, dtype=torch.float32)
    host_np = host.numpy()
    gen = _generator(seed) if rounding == "stochastic" else None
    f32 = rounding == "hybrid"

    def rnd(x: np.ndarray) -> np.ndarray:
        t = torch.from_numpy(x).to(device)
        if f32:
            t = t.float()
        cast(t, f, rounding=rounding, saturate=saturate, generator=gen, out=buf)
        if host is not buf:
            host.copy_(buf)
        np.copyto(x, host_np)
        return x

    return rnd


def cast_array(x: np.ndarray, fmt: str, rounding: str, saturate: bool, seed: int = 0) -> np.ndarray:
    """Round a float64 array of any shape onto ``fmt``; returns float64 (``"fp64"``: a copy)."""
    if fmt == EXACT_ACCUMULATOR:
        return x.copy()
    t = torch.from_numpy(np.ascontiguousarray(x)).to(torch_device())
    if rounding == "hybrid":
        t = t.float()
    gen = _generator(seed) if rounding == "stochastic" else None
    out = cast(t, get_format(fmt), rounding=rounding, saturate=saturate, generator=gen)
    return out.cpu().numpy().astype(np.float64)

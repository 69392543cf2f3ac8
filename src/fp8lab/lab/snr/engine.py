"""The study's engine: draw the vectors, scale and quantise them, sum the products, compare.

Vectorised across samples: products do not depend on the running sum, so they are rounded to a
format accumulator in one cast; the only Python loop is the sequential sum over the vector length
(`fp8lab.lab.snr.sequential`). Configurations of one `run_many` call sharing the length, sample
count and accumulator are stacked into one such loop; vectors are drawn once per
``(seed, length, sigma, rho, model)``. A GEMM accumulator model (``"limited"``, ``"h100"``, ...)
sums the products through `fp8lab.gemm` instead (`fp8lab.lab.snr.tensorcore`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from fp8lab.formats import get_format
from fp8lab.lab.snr.casts import cast_array
from fp8lab.lab.snr.config import EXACT_ACCUMULATOR, SnrConfig
from fp8lab.lab.snr.result import SnrResult, snr_db
from fp8lab.lab.snr.sequential import accumulate
from fp8lab.scaling.rules import get_rule

__all__ = ["generate_vectors", "run", "run_many", "sweep"]


def generate_vectors(config: SnrConfig) -> tuple[np.ndarray, np.ndarray]:
    """The float64 vectors ``a, b`` of shape [samples, length] for ``config`` (deterministic)."""
    rng = np.random.default_rng(config.seed)
    shape = (config.samples, config.length)
    z1 = rng.normal(0.0, config.sigma, size=shape)
    z2 = rng.normal(0.0, config.sigma, size=shape)
    rho = float(config.rho)
    if rho == 0.0:
        return z1, z2
    if config.correlation_model == "simple":
        return z1, rho * z1 + (1.0 - rho) * z2
    return z1, rho * z1 + math.sqrt(1.0 - rho * rho) * z2


def _scales(x: np.ndarray, config: SnrConfig) -> np.ndarray:
    """Quantisation multipliers: [samples, n_blocks] (n_blocks = 1 without block).

    ``auto`` with ``scale_rule="exact"``: ``scale_target / amax`` per vector or block, in float64
    (the notebook's rule; TE's ``max`` rule divides in float32 and maps amax to the format's max
    only, so it is not the same rule). Another ``scale_rule`` is that rule of
    `fp8lab.scaling.rules` on the amax rounded to float32."""
    samples, length = x.shape
    if config.scaling != "auto":
        return np.full((samples, 1), float(config.scaling))
    nblk = length // config.block if config.block else 1
    amax = np.abs(x.reshape(samples, nblk, -1)).max(axis=2)
    if config.scale_rule != "exact":
        rule = get_rule(config.scale_rule)
        return rule(torch.from_numpy(amax).float(), config.format).double().numpy()
    with np.errstate(divide="ignore"):
        s = config.target / amax
    # an all-zero block: nothing to scale, keep the multiplier finite
    s[~np.isfinite(s)] = 1.0
    return s


def _quantise(x: np.ndarray, s: np.ndarray, config: SnrConfig) -> np.ndarray:
    samples, length = x.shape
    nblk = s.shape[1]
    scaled = (x.reshape(samples, nblk, -1) * s[:, :, None]).reshape(samples, length)
    return cast_array(scaled, config.format, config.rounding, config.saturate, config.seed)


@dataclass
class _Prepared:
    """One config's vectors after scaling and quantisation (everything but the summation)."""

    sa: np.ndarray  # [samples, n_blk] quantisation multipliers of a
    sb: np.ndarray
    qa: np.ndarray  # [samples, length] quantised scaled elements of a
    qb: np.ndarray
    reference: np.ndarray  # [samples] float64 dot products of the unquantised vectors


class _VectorCache:
    """Vectors drawn once per ``(seed, samples, length, sigma, rho, model)``; one length kept."""

    def __init__(self) -> None:
        self._cache: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}

    def get(self, c: SnrConfig) -> tuple[np.ndarray, np.ndarray]:
        key = (c.seed, c.samples, c.length, c.sigma, c.rho, c.correlation_model if c.rho else "")
        if key not in self._cache:
            self._cache = {k: v for k, v in self._cache.items() if k[2] == c.length}
            self._cache[key] = generate_vectors(c)
        return self._cache[key]


def _prepare(c: SnrConfig, vectors: _VectorCache) -> _Prepared:
    a, b = vectors.get(c)
    sa, sb = _scales(a, c), _scales(b, c)
    qa, qb = _quantise(a, sa, c), _quantise(b, sb, c)
    return _Prepared(sa, sb, qa, qb, np.einsum("ij,ij->i", a, b))


def _overflow_fraction(p: np.ndarray, pq: np.ndarray, acc: str) -> float:
    """Fraction of samples with a product clamped at (or overflowing) the accumulator's max."""
    if acc == EXACT_ACCUMULATOR:
        return 0.0
    amax_acc = get_format(acc).max
    over = ~np.isfinite(pq) | ((np.abs(pq) >= amax_acc) & (np.abs(p) > amax_acc))
    return float(np.mean(over.any(axis=1)))


def _model_overflow_fraction(p: _Prepared, result: np.ndarray, config: SnrConfig) -> float:
    """Fraction of samples a tensor-core model could not hold: a product beyond FP32's max (the
    model's terms and output are FP32) or a non-finite result."""
    fmax = config.accumulator_max
    with np.errstate(over="ignore", invalid="ignore"):
        big = (np.abs(p.qa * p.qb) > fmax).any(axis=1)
    return float(np.mean(big | ~np.isfinite(result)))


def _run_sequential(group: Sequence[SnrConfig], vectors: _VectorCache) -> list[SnrResult]:
    """One stack of configs sharing length, samples and a format accumulator: one loop."""
    first = group[0]
    n, length = first.samples, first.length
    acc, acc_rnd = first.accumulator_name, first.accumulator_rounding
    dtype = np.float64 if acc == EXACT_ACCUMULATOR else np.float32
    prods = np.empty((length, n * len(group)), dtype=dtype)
    nblk_max = max(length // c.block if c.block else 1 for c in group)
    sa_all = np.ones((n * len(group), nblk_max))
    sb_all = np.ones_like(sa_all)
    refs: list[np.ndarray] = []
    overflow: list[float] = []
    for i, c in enumerate(group):
        p = _prepare(c, vectors)
        rows = slice(i * n, (i + 1) * n)
        sa_all[rows, : p.sa.shape[1]] = p.sa
        sb_all[rows, : p.sb.shape[1]] = p.sb
        # E4M3 x E4M3 products are exact in float64; round each to the accumulator once
        prod = p.qa * p.qb
        pq = cast_array(prod, acc, acc_rnd, c.saturate, c.seed + 1)
        prods[:, rows] = pq.T
        refs.append(p.reference)
        overflow.append(_overflow_fraction(prod, pq, acc))
    res = accumulate(prods, sa_all, sb_all, group)
    out = []
    for i, c in enumerate(group):
        r = res[i * n : (i + 1) * n].copy()
        out.append(SnrResult(c, snr_db(refs[i], r), refs[i], r, overflow[i]))
    return out


def _run_model(c: SnrConfig, vectors: _VectorCache) -> SnrResult:
    """One config summed by a GEMM accumulator model: chunk sums from the model, de-scaled and
    promoted into float64 in order (per block with its two block scales; else once at the end)."""
    from fp8lab.lab.snr.tensorcore import chunk_sums

    p = _prepare(c, vectors)
    chunk = c.block or c.promote_every or c.length
    parts = chunk_sums(p.qa, p.qb, chunk, c.accumulator_name, get_format(c.format).name)
    total = np.zeros(c.samples)
    for j in range(parts.shape[1]):
        if c.block:
            total += parts[:, j] / (p.sa[:, j] * p.sb[:, j])
        else:
            total += parts[:, j]
    if not c.block:
        total /= p.sa[:, 0] * p.sb[:, 0]
    over = _model_overflow_fraction(p, total, c)
    return SnrResult(c, snr_db(p.reference, total), p.reference, total, over)


def _stack_key(c: SnrConfig) -> tuple:
    return (c.length, c.samples, c.accumulator_name, c.accumulator_rounding, c.saturate)


@contextlib.contextmanager
def _numba_threads(n: int) -> Iterator[None]:
    """Run numba kernels with ``n`` threads inside the block (restored afterwards)."""
    import numba

    old = numba.get_num_threads()
    numba.set_num_threads(min(n, old))
    try:
        yield
    finally:
        numba.set_num_threads(old)


def run_many(
    configs: Iterable[SnrConfig],
    progress: Callable[[int], None] | None = None,
) -> list[SnrResult]:
    """Run several configs (duplicates computed once); results in input order.

    Configs sharing the length, sample count and accumulator are stacked into one sequential
    loop. ``progress(n)`` is called with the number of configs finished after each stack.
    """
    # The loop makes thousands of casts of a few thousand elements: a parallel kernel's
    # fork/join costs more than the work (and stalls badly when the cores are shared).
    with _numba_threads(1):
        return _run_many(list(configs), progress)


def _run_many(configs: list[SnrConfig], progress: Callable[[int], None] | None) -> list[SnrResult]:
    groups: dict[tuple, list[SnrConfig]] = {}
    for c in dict.fromkeys(configs):
        key = ("model", c) if c.uses_model else _stack_key(c)
        groups.setdefault(key, []).append(c)
    done: dict[SnrConfig, SnrResult] = {}
    vectors = _VectorCache()
    for key, group in groups.items():
        if key[0] == "model":
            results = [_run_model(group[0], vectors)]
        else:
            results = _run_sequential(group, vectors)
        done.update((r.config, r) for r in results)
        if progress is not None:
            progress(len(group))
    return [done[c] for c in configs]


def run(config: SnrConfig) -> SnrResult:
    """Run one configuration."""
    return run_many([config])[0]


def sweep(base: SnrConfig, **axes: Sequence[Any]) -> list[SnrConfig]:
    """Cartesian product of ``base`` with every ``field=[values...]`` given (field order kept)."""
    configs = [base]
    for name, values in axes.items():
        if name not in SnrConfig.__dataclass_fields__:
            raise ValueError(f"unknown SnrConfig field {name!r}")
        values = list(values)
        if not values:
            raise ValueError(f"empty sweep for {name!r}")
        configs = [replace(c, **{name: v}) for c in configs for v in values]
    return configs

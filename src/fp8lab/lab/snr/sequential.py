"""The study's sequential format accumulator: one running sum rounded after every addition.

This is the accumulator of the simfloat notebook ("从DeepSeek V3看FP8训练的挑战"): every product
is rounded to the accumulator format, added to the running sum, and the sum is rounded again, one
element at a time. No `fp8lab.gemm` model expresses it (their fp32 kind sums in BLAS order, the
tensor-core models sum MMA groups), so it lives here; `fp8lab.lab.snr.tensorcore` runs the study
through the GEMM models instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fp8lab.lab.snr.casts import Rounder, make_rounder
from fp8lab.lab.snr.config import SnrConfig

__all__ = ["accumulate"]


class _Sums:
    """Running sums of a stack of configs ([rows] each) and what happens at chunk boundaries.

    ``part``: the low-precision sum of the current block / promotion chunk; ``outer``: the
    low-precision sum of de-scaled block partials (``promote_every`` a larger multiple of the
    block); ``total``: the float64 promotion target.
    """

    def __init__(self, configs: Sequence[SnrConfig], rows: int, rnd: Rounder) -> None:
        samples = configs[0].samples
        self.rnd = rnd
        # per row: block size (0 = unblocked) and promotion interval (0 = only at the end)
        self.blk = np.repeat([c.block or 0 for c in configs], samples)
        self.prom = np.repeat([c.promote_every or 0 for c in configs], samples)
        self.blocked = self.blk > 0
        self.any_blocked = bool(self.blocked.any())
        self.descale_direct = self.blocked & (self.prom == self.blk)  # block partial -> float64
        self.descale_outer = self.blocked & (self.prom != self.blk)  # ... or -> low-precision
        self.total = np.zeros(rows)
        self.part = np.zeros(rows)
        self.outer = np.zeros(rows)
        self.tmp = np.zeros(rows)
        # only the interval sizes that occur need a test per element
        sizes = np.concatenate([self.blk, self.prom])
        self.intervals = sorted({int(v) for v in sizes if v > 0})
        self.blk_masks = {n: self.blk == n for n in self.intervals}
        self.prom_masks = {n: self.prom == n for n in self.intervals}

    def boundary(self, count: int, last: bool, sa: np.ndarray, sb: np.ndarray) -> None:
        """After ``count`` products: close the blocks and promotion chunks that end here."""
        ends = [n for n in self.intervals if count % n == 0]
        if not ends and not last:
            return
        rows = self.part.shape[0]
        blk_end = np.zeros(rows, dtype=bool)
        prom_end = np.ones(rows, dtype=bool) if last else np.zeros(rows, dtype=bool)
        for n in ends:
            blk_end |= self.blk_masks[n]
            prom_end |= self.prom_masks[n]
        if self.any_blocked:
            self._end_blocks(blk_end & self.blocked, count, sa, sb)
            m = prom_end & self.descale_outer
            if m.any():
                self.total[m] += self.outer[m]
                self.outer[m] = 0.0
        m = prom_end & ~self.blocked
        if m.any():
            self.total[m] += self.part[m]
            self.part[m] = 0.0

    def _end_blocks(self, m: np.ndarray, count: int, sa: np.ndarray, sb: np.ndarray) -> None:
        """De-scale the block partials of rows ``m`` by their two block scales and promote them
        (into float64, or into the rounded ``outer`` sum)."""
        if not m.any():
            return
        idx = np.nonzero(m)[0]
        k = (count - 1) // self.blk[idx]  # index of the block that just ended
        d = self.part[idx] / (sa[idx, k] * sb[idx, k])
        direct = self.descale_direct[idx]
        self.total[idx[direct]] += d[direct]
        o = idx[~direct]
        if o.size:
            np.copyto(self.tmp, self.outer)
            self.tmp[o] += d[~direct]
            self.rnd(self.tmp)
            self.outer[o] = self.tmp[o]
        self.part[idx] = 0.0


def accumulate(
    prods: np.ndarray,
    sa: np.ndarray,
    sb: np.ndarray,
    configs: Sequence[SnrConfig],
) -> np.ndarray:
    """Sequential low-precision sums for a stack of configs sharing length and accumulator.

    prods: [length, n_cfg*samples] products already rounded to the accumulator (they do not depend
    on the running sum, so they are rounded in one vectorised cast); sa, sb: [n_cfg*samples, n_blk]
    scale multipliers (block scales; unblocked configs use column 0). Returns the de-scaled
    float64 results [n_cfg*samples].
    """
    first = configs[0]
    length, rows = prods.shape
    rnd = make_rounder(
        first.accumulator_name,
        first.accumulator_rounding,
        first.saturate,
        rows,
        first.seed + 2,
    )
    sums = _Sums(configs, rows, rnd)
    part = sums.part
    # the counts after which some block or promotion chunk ends (the loop skips the others)
    stops = {length}.union(*(range(n, length + 1, n) for n in sums.intervals))
    for j in range(length):
        part += prods[j]
        rnd(part)
        if j + 1 in stops:
            sums.boundary(j + 1, j + 1 == length, sa, sb)
    # unblocked rows: undo the (per-vector or fixed) scale once
    ub = ~sums.blocked
    total = sums.total
    total[ub] /= sa[ub, 0] * sb[ub, 0]
    return total

"""Group testing over layers: the fewest layers whose operand, in high precision, explains the gap.

The candidates are ordered by their attribution score (screening), so the question becomes
"how long a prefix of that order must be switched": a k-ary search over the prefix length,
``jobs`` probes per round (round one always tests the single top layer, the common case of a
one-layer fault). A prefix *explains* the gap when its probe closes at least ``close`` of it
(or lands within twice the noise). Monotonicity (more layers switched, smaller gap) is assumed;
when a probe contradicts it the smallest explaining prefix seen wins.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def next_sizes(lo: int, hi: int, jobs: int, tried: set[int]) -> list[int]:
    """Prefix lengths to test next, strictly between ``lo`` (does not explain) and ``hi``
    (explains): 1 first when untried, then evenly spaced points."""
    if hi - lo <= 1:
        return []
    out: list[int] = []
    if lo == 0 and 1 not in tried and hi > 1:
        out.append(1)
    n = max(1, jobs)
    span = hi - lo
    k = 1
    while len(out) < n and k <= n:
        p = lo + round(span * k / (n + 1 - (1 if out and out[0] == 1 and lo == 0 else 0)))
        if lo < p < hi and p not in out and p not in tried:
            out.append(p)
        k += 1
    if not out:  # fall back to the midpoint
        mid = (lo + hi) // 2
        if lo < mid < hi and mid not in tried:
            out.append(mid)
    return sorted(out)[:n]


def prefix_search(
    order: Sequence[str],
    explains: Callable[[list[list[str]]], list[bool]],
    jobs: int = 1,
) -> tuple[list[str], list[tuple[int, bool]]]:
    """The shortest prefix of ``order`` that explains the gap, and every (size, explains) tried.

    ``explains`` runs one probe per prefix given (a batch runs in parallel) and says which
    explain. The full ``order`` is known to explain (the role probe)."""
    lo, hi = 0, len(order)
    tried: dict[int, bool] = {}
    while True:
        sizes = next_sizes(lo, hi, jobs, set(tried))
        if not sizes:
            break
        results = explains([list(order[:k]) for k in sizes])
        for k, ok in zip(sizes, results, strict=True):
            tried[k] = ok
        good = [k for k, ok in tried.items() if ok and k < hi]
        if good:
            hi = min(good)
        bad = [k for k, ok in tried.items() if not ok and k < hi]
        lo = max(bad) if bad else 0
    return list(order[:hi]), sorted(tried.items())


def layer_order(
    layers: Sequence[str],
    scores: Sequence[dict],
    role: str,
    gemm: str | None = None,
    pairs: Sequence[dict] = (),
) -> list[str]:
    """The layers in the order group testing tries them for the culprit ``role``.

    A layer's key is the larger of (a) its pair score: the share of the error removed by the
    replay with ``role`` in high precision in *both* GEMMs that consume that quantized operand
    (input: fprop and wgrad; weight: fprop and dgrad; grad_output: dgrad and wgrad), from
    ``pairs`` rows ``{layer, role, score}``; and (b) its cell score in the culprit ``gemm``
    (without ``gemm``: its strongest cell of ``role``). Ties go to the strongest cell, then
    module order. Never the sum over GEMMs: one strong cell (input in fprop, +0.17) can
    sit next to a strong opposite (the same input in wgrad alone, -0.35: a high-precision
    wgrad next to a flushed fprop input makes the update worse), and a sum would put the
    culprit layer last."""
    layers = list(layers)
    cell: dict[str, dict[str, float]] = {x: {} for x in layers}
    for row in scores:
        if row["role"] == role and row["layer"] in cell:
            cell[row["layer"]][row["gemm"]] = row["score"]
    pair = {r["layer"]: r["score"] for r in pairs if r["role"] == role and r["layer"] in cell}
    neg = float("-inf")

    def key(x: str) -> tuple[float, float, int]:
        best = max(cell[x].values(), default=neg)
        own = cell[x].get(gemm, neg) if gemm is not None else best
        return (-max(own, pair.get(x, neg)), -best, layers.index(x))

    return sorted(layers, key=key)

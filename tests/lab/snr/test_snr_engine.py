"""The dot-product SNR engine: semantics against a scalar re-implementation of the simfloat
notebook's loops ("从DeepSeek V3看FP8训练的挑战"), SNR arithmetic and JSON safety."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from fp8lab import cast
from fp8lab.lab import snr
from fp8lab.lab.snr import SnrConfig, SnrResult

SEED_BASE = SnrConfig(
    samples=6,
    seed=3,
    format="e4m3-ieee",
    rounding="nearest_away",
    correlation_model="simple",
)


def _r(x: float, fmt: str, rounding: str = "nearest_away") -> float:
    """Round one float64 scalar onto ``fmt`` (the per-scalar contexts of the notebook)."""
    if fmt == "fp64":
        return x
    return float(cast(torch.tensor([x], dtype=torch.float64), fmt, rounding=rounding)[0])


def _scalar_reference(a: np.ndarray, b: np.ndarray, c: SnrConfig) -> float:
    """The notebook's `dot_error_snr*` loops written out per element, generalised to the config."""
    acc = c.accumulator_name
    n = len(a)
    blk = c.block or n
    prom = c.promote_every or n
    total = 0.0
    if c.block is None:
        if c.scaling == "auto":
            fa, fb = c.target / np.abs(a).max(), c.target / np.abs(b).max()
        else:
            fa = fb = c.scaling
        part = 0.0
        for i in range(n):
            p = _r(_r(a[i] * fa, c.format) * _r(b[i] * fb, c.format), acc)
            part = _r(part + p, acc)
            if (i + 1) % prom == 0 or i == n - 1:
                total += part
                part = 0.0
        return total / (fa * fb)
    outer = 0.0
    for off in range(0, n, blk):
        fa = c.target / np.abs(a[off : off + blk]).max()
        fb = c.target / np.abs(b[off : off + blk]).max()
        part = 0.0
        for i in range(off, off + blk):
            p = _r(_r(a[i] * fa, c.format) * _r(b[i] * fb, c.format), acc)
            part = _r(part + p, acc)
        d = part / (fa * fb)
        if prom == blk:
            total += d
        else:
            outer = _r(outer + d, acc)
            if (off + blk) % prom == 0 or off + blk == n:
                total += outer
                outer = 0.0
    return total


@pytest.mark.parametrize(
    "cfg",
    [
        replace(SEED_BASE, length=96, scaling=64.0),  # dot_error_snr, E4M3 accumulator
        replace(SEED_BASE, length=96, scaling=64.0, promote_every=32),  # dot_error_snr_chunk
        replace(SEED_BASE, length=100, scaling=1.0, promote_every=30),  # ragged last chunk
        replace(SEED_BASE, length=128, accumulator="e8m8", scale_target=224.0),  # per vector
        replace(SEED_BASE, length=128, accumulator="e8m8", scale_target=224.0, block=32),
        replace(SEED_BASE, length=128, accumulator="e8m8", block=32, promote_every=64),
        replace(SEED_BASE, length=64, rho=0.3, correlation_model="exact", accumulator="fp32"),
        replace(SEED_BASE, length=64, format="e5m2", rounding="nearest_even", accumulator="fp64"),
    ],
    ids=lambda c: f"L{c.length}-s{c.scaling}-b{c.block}-p{c.promote_every}-{c.accumulator}",
)
def test_engine_matches_scalar_reference(cfg: SnrConfig) -> None:
    a, b = snr.generate_vectors(cfg)
    res = snr.run(cfg)
    expected = np.array([_scalar_reference(a[i], b[i], cfg) for i in range(cfg.samples)])
    np.testing.assert_allclose(res.result, expected, rtol=1e-12, atol=0)
    np.testing.assert_allclose(res.reference, np.sum(a * b, axis=1), rtol=1e-12)


def test_stacked_runs_equal_single_runs() -> None:
    # run_many stacks configs of one length/accumulator into one loop; must not mix them up
    cfgs = [
        replace(SEED_BASE, length=128, scaling=64.0),
        replace(SEED_BASE, length=128, scaling=64.0, promote_every=64),
        replace(SEED_BASE, length=128, scaling=128.0, rho=0.2),
        replace(SEED_BASE, length=128, accumulator="e4m3-ieee", block=64, scale_target=16.0),
    ]
    together = snr.run_many(cfgs)
    for c, r in zip(cfgs, together, strict=True):
        np.testing.assert_array_equal(r.result, snr.run(c).result)
    assert together[0].median_db != together[1].median_db


def test_vectors_share_samples_and_correlation_models() -> None:
    c = SnrConfig(length=2048, samples=64, seed=1, rho=0.5)
    a, b = snr.generate_vectors(c)
    a2, _ = snr.generate_vectors(replace(c, rho=0.0))
    np.testing.assert_array_equal(a, a2)  # paired samples across rho
    corr = np.mean([np.corrcoef(a[i], b[i])[0, 1] for i in range(c.samples)])
    assert corr == pytest.approx(0.5, abs=0.02)
    assert b.std() == pytest.approx(0.01, rel=0.02)  # exact model keeps b ~ N(0, sigma)
    _, bs = snr.generate_vectors(replace(c, correlation_model="simple"))
    corr_s = np.mean([np.corrcoef(a[i], bs[i])[0, 1] for i in range(c.samples)])
    assert corr_s == pytest.approx(0.5 / math.sqrt(0.5**2 + 0.5**2), abs=0.02)


def test_snr_definition_and_infinite_snr() -> None:
    ref = np.array([1.0, 2.0, 0.0, 1.0])
    res = np.array([1.1, 2.0, 0.0, 0.0])
    s = snr.snr_db(ref, res)
    assert s[0] == pytest.approx(10 * math.log10(1.0 / 0.01))
    assert math.isinf(s[1]) and s[1] > 0  # exact -> +inf
    assert math.isinf(s[2]) and s[2] > 0  # 0 == 0 exact
    assert s[3] == pytest.approx(0.0)  # result 0: error as large as the signal
    pooled = snr.snr_db(ref, res, pooled=True).item()
    assert pooled == pytest.approx(10 * math.log10(6.0 / (0.01 + 1.0)))
    assert snr.snr_db(np.array([0.0]), np.array([1.0]))[0] == -math.inf


def test_json_has_no_nan_or_infinity() -> None:
    cfg = SnrConfig(length=8, samples=4)
    ref = np.array([1.0, 2.0, 3.0, 4.0])
    out = np.array([1.0, 2.0, 3.0, 4.5])  # three exact samples
    r = SnrResult(cfg, snr.snr_db(ref, out), ref, out)
    assert r.median_db == math.inf and r.exact_fraction == 0.75
    d = r.to_json(pooled=True)
    text = json.dumps(d, allow_nan=False)  # raises on NaN/Infinity
    assert d["snr_db"][:3] == [None, None, None]
    assert d["snr_db"][3] == pytest.approx(20 * math.log10(4.0 / 0.5))
    assert d["median_db"] is None and d["pooled_db"] is not None
    assert set(d) == {
        "config", "median_db", "p10_db", "p90_db", "below_0db_fraction", "snr_db", "pooled_db"
    }  # fmt: skip
    assert '"accumulator": "e4m3"' in text  # defaults resolved in the config


def test_quantile_with_infinities() -> None:
    v = np.array([1.0, 2.0, math.inf, math.inf])
    assert snr.quantile(v, 0.0) == 1.0
    assert snr.quantile(v, 0.5) == math.inf
    assert snr.quantile(np.array([1.0, 3.0]), 0.5) == 2.0


@pytest.mark.parametrize(
    ("rule", "block"), [("max", None), ("pow2_down", 64), ("mx_floor", 32), ("mx_rceil", 32)]
)
def test_scale_rules_of_fp8lab_scaling(rule: str, block: int | None) -> None:
    # the rule of fp8lab.scaling on the float32 amax, elements cast(x * s), exact sums, de-scaled
    from fp8lab.scaling import get_rule

    cfg = SnrConfig(length=128, samples=4, seed=9, block=block, scale_rule=rule, accumulator="fp64")
    a, b = snr.generate_vectors(cfg)
    res = snr.run(cfg)
    n = block or cfg.length
    for i in range(cfg.samples):
        total = 0.0
        for k0 in range(0, cfg.length, n):
            xa, xb = a[i, k0 : k0 + n], b[i, k0 : k0 + n]
            sa, sb = (
                float(
                    get_rule(rule)(
                        torch.tensor(float(np.abs(x).max()), dtype=torch.float32), "e4m3"
                    )
                )
                for x in (xa, xb)
            )
            qa = cast(torch.from_numpy(xa * sa), "e4m3").double().numpy()
            qb = cast(torch.from_numpy(xb * sb), "e4m3").double().numpy()
            total += float(np.sum(qa * qb)) / (sa * sb)
        assert res.result[i] == pytest.approx(total, rel=1e-12)
    if rule.startswith(("mx", "pow2")):  # power-of-two scales: the same SNR at any sigma
        res2 = snr.run(replace(cfg, sigma=cfg.sigma * 8))
        np.testing.assert_array_equal(res2.result, res.result * 64)


def test_scale_rule_changes_only_the_scales() -> None:
    base = SnrConfig(length=256, samples=8, seed=2, accumulator="fp32")
    exact, te = snr.run_many([base, replace(base, scale_rule="max")])
    # TE's max rule maps amax to 448 in float32: nearly the same scales as the float64 rule
    assert abs(exact.median_db - te.median_db) < 1.0
    assert exact.config.to_dict()["scale_rule"] == "exact"

"""The dot-product SNR engine: semantics against a scalar re-implementation of seed 000's loops,
config validation, JSON safety, and seed 000's qualitative findings."""

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
    """Round one float64 scalar onto ``fmt`` (the per-scalar contexts of the seed's notebook)."""
    if fmt == "fp64":
        return x
    return float(cast(torch.tensor([x], dtype=torch.float64), fmt, rounding=rounding)[0])


def _scalar_reference(a: np.ndarray, b: np.ndarray, c: SnrConfig) -> float:
    """Seed 000's `dot_error_snr*` loops written out per element, generalised to the config."""
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


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"length": 1000, "block": 128}, "not divisible by block"),
        ({"rho": 1.0}, r"rho must be in \[0, 1\)"),
        ({"rho": -0.1}, r"rho must be in \[0, 1\)"),
        ({"scaling": 64.0, "block": 128}, "fixed scaling"),
        ({"block": 128, "promote_every": 192}, "multiple of block"),
        ({"correlation_model": "pearson"}, "correlation_model"),
        ({"format": "e9m9"}, "unknown format"),
        ({"accumulator": "nope"}, "unknown format"),
        ({"scale_target": 500.0}, "exceeds the max"),
        ({"scaling": 0.0}, "positive"),
        ({"length": 0}, "positive"),
    ],
)
def test_bad_configs_raise_clear_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SnrConfig(**kwargs)


def test_block_defaults_promotion_to_the_block() -> None:
    assert SnrConfig(block=128).promote_every == 128
    assert SnrConfig(block=128, promote_every=512).promote_every == 512


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


# ------------------------------------------------------------------ seed 000's findings
@pytest.fixture(scope="module")
def seed000() -> dict[SnrConfig, SnrResult]:
    p = snr.preset("seed000", samples=100, seed=0)
    cfgs = p.configs()
    return dict(zip(cfgs, snr.run_many(cfgs), strict=True))


BASE = SnrConfig(
    samples=100, seed=0, format="e4m3-ieee", rounding="nearest_away", correlation_model="simple"
)
TE = replace(BASE, scaling=64.0)
DS = replace(BASE, scale_target=224.0, accumulator="e8m8")


def test_finding_scaling_1_drowns_every_product(seed000) -> None:
    for n in (128, 1024, 4096):
        r = seed000[replace(BASE, length=n, scaling=1.0)]
        # (nearly) every product underflows: the result is 0 and the SNR exactly 0 dB
        assert np.mean(r.result == 0.0) >= 0.9
        assert r.p10_db == r.median_db == r.p90_db == 0.0


def test_finding_snr_falls_with_length(seed000) -> None:
    runs = [seed000[replace(TE, length=n)] for n in (128, 1024, 4096)]
    med = [r.median_db for r in runs]
    neg = [r.below_0db_fraction for r in runs]
    assert med[0] > med[1] + 5 and med[1] > med[2] + 1
    assert neg[0] < neg[1] < neg[2]
    # scaling 64 and 128 give (nearly) the same histograms: powers of two only shift exponents,
    # the differences come from the few products in the subnormal range
    r128 = seed000[replace(BASE, length=1024, scaling=128.0)]
    assert abs(r128.median_db - med[1]) < 1.5


def test_finding_promotion_then_block_scaling(seed000) -> None:
    none = seed000[replace(TE, length=1024)]
    prom = seed000[replace(TE, length=1024, promote_every=128)]
    blk = seed000[replace(DS, length=1024, block=128)]
    assert prom.median_db > none.median_db + 4
    assert blk.median_db > prom.median_db + 8
    assert blk.below_0db_fraction <= 0.06
    assert blk.below_0db_fraction < prom.below_0db_fraction / 3


def test_finding_correlation_narrows_and_fixes_help_more(seed000) -> None:
    r0 = seed000[replace(TE, length=1024)]
    r2 = seed000[replace(TE, length=1024, rho=0.2)]
    assert (r2.p90_db - r2.p10_db) < 0.2 * (r0.p90_db - r0.p10_db)
    assert r2.below_0db_fraction == 0.0

    def gains(rho: float) -> tuple[float, float]:
        base = seed000[replace(TE, length=4096, rho=rho)].median_db
        prom = seed000[replace(TE, length=4096, rho=rho, promote_every=128)].median_db
        blk = seed000[replace(DS, length=4096, rho=rho, block=128)].median_db
        return prom - base, blk - base

    g0, g2 = gains(0.0), gains(0.2)
    assert g2[0] > g0[0] + 5  # chunked accumulation helps more with correlation
    assert g2[1] > g0[1] + 5  # and so does block scaling


def test_preset_figures_are_complete() -> None:
    p = snr.preset("seed000", samples=10)
    names = [f.name for f in p.figures]
    assert len(names) == 9 and len(set(names)) == 9
    assert [f.metric for f in p.figures].count("abs_error") == 2
    assert {c.length for c in p.configs()} == {128, 1024, 4096}
    for f in p.figures:
        for panel in f.panels:
            assert len(panel.series) >= 2
    with pytest.raises(ValueError, match="unknown preset"):
        snr.preset("seed999")


def test_asrun_preset_keeps_the_notebooks_bugs() -> None:
    p = snr.preset("seed000-asrun", samples=10, seed=0)
    fig1 = p.figures[1]
    (_, c1024), (_, c4096) = fig1.panels[1].series[1], fig1.panels[2].series[1]
    assert c1024.length == c4096.length == 1024  # "size=4096" ran with length 1024 ...
    assert c1024.seed != c4096.seed  # ... as a separate draw
    fig3 = p.figures[3]
    series = dict(fig3.panels[1].series)
    assert series["chunk=none"] == series["chunk=128"]  # chunksize=None meant 128
    assert all(c.length <= 1024 for c in p.configs())

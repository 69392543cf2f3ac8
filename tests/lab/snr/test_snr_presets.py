"""The study's findings (the blog article "从DeepSeek V3看FP8训练的挑战" and its simfloat
notebook) reproduced by the ``seed000`` preset, and the presets' structure."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from fp8lab.lab import snr
from fp8lab.lab.snr import SnrConfig, SnrResult


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

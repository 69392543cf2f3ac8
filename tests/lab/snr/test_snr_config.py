"""`SnrConfig` validation: clear errors naming the bad field, resolved defaults."""

from __future__ import annotations

import pytest
import torch

from fp8lab.lab.snr import SnrConfig


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


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"accumulator": "limited", "acc_rounding": "toward_zero"}, "fixes its own rounding"),
        ({"accumulator": "limited", "block": 64, "promote_every": 128}, "must equal block"),
        ({"accumulator": "h999"}, "accumulator model of fp8lab.gemm"),
        ({"accumulator": "h100", "format": "e4m3-ieee"}, "no model for e4m3-ieee"),
        ({"accumulator": "ada", "format": "e2m1"}, "no model for e2m1"),
    ],
)
def test_model_accumulator_configs_raise_clear_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SnrConfig(**kwargs)


def test_accumulator_kinds_are_told_apart() -> None:
    assert SnrConfig(accumulator="limited").uses_model
    for gpu in ("h100", "h200", "ada", "l40s", "b200", "b200-tcgen05"):
        assert SnrConfig(accumulator=gpu).uses_model
    assert SnrConfig(accumulator="h100", format="bf16").uses_model  # the 16-bit row
    assert SnrConfig(accumulator="limited", block=64).promote_every == 64
    for name in (None, "fp32", "e8m8", "fp64"):
        assert not SnrConfig(accumulator=name).uses_model
    d = SnrConfig(accumulator="limited").to_dict()
    assert d["accumulator"] == "limited" and d["acc_rounding"] is None
    assert SnrConfig().to_dict()["accumulator"] == "e4m3"  # the library default stays
    f32max = float(torch.finfo(torch.float32).max)
    assert SnrConfig(accumulator="h100").accumulator_max == f32max  # FP32 accumulator
    assert SnrConfig(format="e4m3-ieee").accumulator_max == 240.0
    assert SnrConfig(accumulator="e8m8").accumulator_max > 1e38
    assert SnrConfig(accumulator="fp64").accumulator_max == float("inf")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"scale_rule": "nvfp4"}, "unknown scale_rule"),
        ({"scale_rule": "max", "scaling": 64.0}, "use scaling='auto'"),
        ({"scale_rule": "mx_floor", "scale_target": 224.0}, "scale_target=224 applies"),
    ],
)
def test_scale_rule_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SnrConfig(**kwargs)

"""QuantSpec's one text form (`describe` / `str`)."""

from __future__ import annotations

import contextlib
import itertools

import torch

import fp8lab
from fp8lab import QuantSpec


def variants() -> list[QuantSpec]:
    """Specs differing in one field each from a few bases, delayed configurations included."""
    bases = [QuantSpec(), QuantSpec("e2m1", "nvfp4"), QuantSpec("hif8", "row")]
    out = []
    for b in bases:
        out.append(b)
        for change in (
            {"format": "e5m2"}, {"granularity": (1, 128)}, {"granularity": (128, 1)},
            {"scaling": "pow2_down"}, {"scaling": 2.0}, {"scaling": 0.5}, {"saturate": False},
            {"pad": False}, {"margin": 1}, {"epsilon": 1e-6}, {"rounding": "stochastic"},
        ):  # fmt: skip
            with contextlib.suppress(ValueError):
                out.append(b.replace(**change))
    nv = QuantSpec("e2m1", "nvfp4")
    out += [
        nv.replace(scale_format="e5m2"),
        nv.replace(two_level=False),
        nv.replace(tensor_scale=0.01),
    ]
    for kw in ({}, {"history_len": 16}, {"margin": 2}, {"interval": 4}, {"nguard": 8},
               {"first_step": "current"}, {"algorithm": "most_recent"}):  # fmt: skip
        out.append(QuantSpec("e4m3", scaling=fp8lab.DelayedScaling(**kw)))
    return out


def test_describe_tells_different_specs_apart():
    specs = variants()
    for a, b in itertools.combinations(specs, 2):
        if a.to_dict() != b.to_dict():
            assert a.describe() != b.describe(), (a, b)
    assert all(str(s) == s.describe() for s in specs)


def test_describe_examples():
    assert QuantSpec("e4m3", (1, 128), "pow2_down").describe() == "e4m3:1x128:pow2_down"
    assert QuantSpec("e4m3", scaling=1.0).describe() == "e4m3:tensor:1"
    assert QuantSpec("e2m1", "nvfp4", scale_format="e5m2").describe() == (
        "e2m1:nvfp4:nvfp4 (scale_format=e5m2)"
    )
    ds = fp8lab.DelayedScaling(history_len=16, margin=1)
    assert QuantSpec(scaling=ds).describe() == "e4m3:tensor:delayed(h=16, max, margin=1)"
    # the recipe's configuration and a state bound from it read the same
    spec = fp8lab.get_recipe("te-delayed").input
    assert spec.describe() == "e4m3:tensor:delayed(h=1024, max)"


def test_describe_matches_the_stats_name_where_that_one_is_complete():
    # stats.spec_name prints format:granularity:scaling; describe() extends it, never changes it
    from fp8lab.stats import spec_name

    for s in variants():
        if not s.is_delayed and s.describe().count(" (") == 0:
            assert spec_name(s) == s.describe(), s


def test_qtensor_repr_shows_the_spec_text():
    q = fp8lab.quantize(torch.randn(4, 256), "e4m3", (1, 128), "pow2_down")
    assert "e4m3:1x128:pow2_down" in repr(q) and "(4, 256)" in repr(q)

"""`Quantizer`: one operand's quantization owns its state; specs stay configuration."""

import copy

import pytest
import torch

import fp8lab
from fp8lab.qtensor import Quantizer, QuantSpec, quantize, retile
from fp8lab.qtensor.quantizer import retile_counts
from fp8lab.scaling.delayed import DelayedScaling, DelayedScalingConfig

SPECS = [
    QuantSpec("e4m3", "tensor", "max"),
    QuantSpec("e4m3", (1, 128), "pow2_down"),
    QuantSpec("e5m2", (128, 128), "max", margin=1),
    QuantSpec("e4m3", "mx", "mx_floor"),
    QuantSpec("e2m1", "nvfp4", "nvfp4"),
    QuantSpec("hif8", "row", "max"),
    QuantSpec("e4m3", "tensor", 3.0),
]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.describe())
def test_quantizer_equals_quantize_bit_for_bit(spec: QuantSpec) -> None:
    torch.manual_seed(0)
    x = torch.randn(256, 384) * torch.logspace(-6, 6, 384)
    x[3, 5] = float("nan")
    want = quantize(x, spec)
    q = Quantizer(spec)
    for _ in range(2):  # the cached geometry serves the second call alike
        got = q.quantize(x)
        assert torch.equal(_bits(got.values), _bits(want.values))
        assert torch.equal(_bits(got.scales), _bits(want.scales))
        assert torch.equal(_bits(got.dequantize()), _bits(want.dequantize()))
        assert got.spec is spec


def test_delayed_quantizer_owns_its_state_and_never_mutates_the_spec() -> None:
    cfg = DelayedScalingConfig(history_len=4)
    spec = QuantSpec("e4m3", "tensor", cfg)
    frozen = copy.deepcopy(spec)
    ds = DelayedScaling.bind(cfg, "e4m3")
    q = Quantizer(spec, ds)
    x = torch.randn(64, 64) * 10
    q.quantize(x)
    assert float(ds.amax_history[0]) == float(x.abs().max())  # staged into its owner's state
    ds.update()  # the owner updates; the quantizer only uses the scale and stages the amax
    assert ds.step == 1 and float(ds.scale) == pytest.approx(448 / float(x.abs().max()))
    assert spec == frozen and spec.scaling is cfg  # configuration untouched
    # the transposed view shares the state
    t = q.transposed()
    assert t.delayed is ds and t.transposed() is q
    t.quantize(x.t().contiguous() * 2)
    assert float(ds.amax_history[0]) == float(x.abs().max()) * 2


def test_a_config_alone_quantizes_at_step_0_and_records_nothing() -> None:
    spec = QuantSpec("e4m3", "tensor", DelayedScalingConfig())
    q = Quantizer(spec)
    assert q.delayed is None
    got = q.quantize(torch.full((4, 4), 1000.0))
    assert float(got.scales) == 1.0  # unit first step, a throwaway state
    # one owner of delayed-scaling state: a quantizer neither updates nor saves it
    for gone in ("observe", "update", "state_dict", "load_state_dict"):
        assert not hasattr(q, gone)


def test_quantize_with_a_users_state() -> None:
    ds = DelayedScaling(history_len=2)
    spec = QuantSpec("e4m3", scaling=ds.cfg)
    q0 = fp8lab.quantize(torch.full((2, 2), 7.0), spec, state=ds)
    assert float(ds.amax_history[0]) == 7.0 and float(q0.scales) == 1.0  # step 0: unit scale
    ds.update()
    q1 = fp8lab.quantize(torch.full((2, 2), 7.0), "e4m3", state=ds)  # scaling=ds.cfg implied
    assert float(q1.scale_multipliers) == float(ds.scale) == pytest.approx(448 / 7)
    assert q1.spec == spec  # the QTensor's spec is configuration
    fq = fp8lab.fake_quant(torch.full((2, 2), 7.0), spec, state=ds)
    assert torch.equal(fq, q1.dequantize())
    with pytest.raises(ValueError, match="scaling must be its configuration"):
        fp8lab.quantize(torch.ones(2, 2), QuantSpec("e4m3"), state=ds)  # "max", not delayed
    with pytest.raises(ValueError, match="scaling must be its configuration"):
        fp8lab.quantize(torch.ones(2, 2), QuantSpec("e4m3", scaling=DelayedScalingConfig(4)),
                        state=ds)  # fmt: skip
    with pytest.raises(TypeError, match="state must be a DelayedScaling"):
        fp8lab.quantize(torch.ones(2, 2), spec, state=ds.cfg)


def test_the_deprecated_state_in_the_spec_still_works_with_a_warning() -> None:
    """``QuantSpec(scaling=DelayedScaling(...))`` (documented before ``state=``) quantizes as
    ``state=`` does, bit for bit, and warns where it is written."""
    x = torch.randn(16, 16) * 30
    old, new = DelayedScaling(history_len=2), DelayedScaling(history_len=2)
    with pytest.warns(DeprecationWarning, match=r"state=ds") as rec:
        spec = QuantSpec("e4m3", "tensor", old)
    assert rec[0].filename == __file__  # points at the caller
    for step in range(3):
        got = fp8lab.quantize(x * (step + 1), spec)
        want = fp8lab.quantize(x * (step + 1), QuantSpec("e4m3", scaling=new.cfg), state=new)
        assert torch.equal(_bits(got.values), _bits(want.values))
        assert torch.equal(_bits(got.scales), _bits(want.scales))
        old.update()
        new.update()
    assert torch.equal(old.amax_history, new.amax_history) and old.step == new.step == 3
    assert Quantizer(spec).delayed is old
    with pytest.warns(DeprecationWarning, match="scaling=DelayedScaling"):
        fp8lab.quantize(x, "e4m3", scaling=old)
    assert float(old.amax_history[0]) == float(x.abs().max())
    with pytest.raises(ValueError, match="two delayed-scaling states"):
        fp8lab.quantize(x, spec, state=new)


def test_retile_equals_the_public_retile_and_is_counted() -> None:
    torch.manual_seed(1)
    x = torch.randn(256, 256)
    fwd = Quantizer(QuantSpec("e4m3", (1, 128), "max"))
    bwd = fwd.transposed()
    q = fwd.quantize(x)
    before = retile_counts()["from_quantized"]
    got = bwd.retile(q, q.dequantize().contiguous())
    want = retile(q, spec=bwd.spec, measure_error=False)
    assert torch.equal(_bits(got.values), _bits(want.values))
    assert torch.equal(_bits(got.scales), _bits(want.scales))
    assert got.retiled == 1 and got.block_shape == (128, 1)
    assert retile_counts()["from_quantized"] == before + 2


def test_geometry_checks_padding_once() -> None:
    q = Quantizer(QuantSpec("e4m3", (1, 128), "max", pad=False))
    assert q.geometry((4, 256)) == (1, 128, 4, 2)
    assert q.varies_along((4, 256), 1) and q.varies_along((4, 256), 0)
    blocks = Quantizer(QuantSpec("e4m3", (128, 128), "max"))
    assert blocks.varies_along((128, 256), 1) and not blocks.varies_along((128, 256), 0)
    with pytest.raises(ValueError, match="multiple of the block width"):
        q.quantize(torch.zeros(4, 200))

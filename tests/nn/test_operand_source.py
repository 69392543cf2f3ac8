"""Which copy each backward GEMM consumes (`GemmConfig.operand_source`), checked against the table
in docs/recipes.md and against operands derived independently from the tensors the layer saw.

Every row of the docs table runs here: one forward and backward of a Linear under the preset,
every backward operand captured with `fp8lab.nn.on_operand` and compared bit for bit with what
its row says: ``shared`` (the operand the earlier GEMM used, the same bits), ``high precision`` (the
high-precision tensor quantized or rounded afresh: `fp8lab.quantize`), ``re-tiled`` (the earlier
GEMM's quantized copy dequantized and quantized again into this GEMM's blocks), ``dequantized``
(that copy's dequantized values). The explicit choices and the delayed-scaling case of the fix
(a wgrad grad_output override quantized from dy with its own state, not from dgrad's copy) follow.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

import fp8lab
from fp8lab import QuantSpec, Recipe
from fp8lab.nn import Linear, on_operand
from fp8lab.nn.plan import Reuse, build_plan
from fp8lab.nn.state import ScalingState
from fp8lab.qtensor import QTensor, Quantizer
from fp8lab.recipe import GEMM_OPERANDS
from fp8lab.scaling.delayed import DelayedScaling, DelayedScalingConfig

DOCS = Path(__file__).resolve().parents[2] / "docs" / "recipes.md"
#: the docs table's columns: (GEMM, role) of the backward
CELLS = (
    ("dgrad", "weight"),
    ("dgrad", "grad_output"),
    ("wgrad", "input"),
    ("wgrad", "grad_output"),
)
#: the operand a backward GEMM may take from an earlier one
EARLIER = {
    ("dgrad", "weight"): ("fprop", "weight"),
    ("wgrad", "input"): ("fprop", "input"),
    ("wgrad", "grad_output"): ("dgrad", "grad_output"),
}
KINDS = {
    "shared": Reuse.SAME,
    "high precision": Reuse.SOURCE,
    "re-tiled": Reuse.RETILE,
    "dequantized": Reuse.DEQUANTIZE,
}
T, IN, OUT = 128, 256, 128  # whole 128x128, 1x128, 128x1, 1x32 and 16x16 blocks


def _docs_table() -> dict[str, dict[tuple[str, str], str]]:
    text = DOCS.read_text(encoding="utf-8")
    body = text.split("<!-- operand-sources -->")[1].split("<!-- /operand-sources -->")[0]
    rows = {}
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        m = re.fullmatch(r"`([\w.-]+)`", cells[0]) if cells and cells[0] else None
        if m:
            rows[m.group(1)] = dict(zip(CELLS, cells[1:5], strict=True))
    return rows


TABLE = _docs_table()


def test_the_docs_table_covers_every_preset_with_known_kinds():
    assert sorted(TABLE) == sorted(fp8lab.recipes())
    assert {k for row in TABLE.values() for k in row.values()} <= set(KINDS)


def _step(rec: Recipe, steps: int = 1, seed: int = 0) -> list[dict]:
    """Forward and backward of a Linear under ``rec`` ``steps`` times; per step, every operand
    seen: (gemm, role) -> (source, used)."""
    torch.manual_seed(seed)
    mod = Linear(IN, OUT, recipe=rec, name="lin")
    seen: list[dict] = []
    for k in range(steps):
        cap: dict = {}
        x = (torch.randn(T, IN) * 2.0**k).requires_grad_()
        dy = torch.randn(T, OUT) * 2.0 ** (-2 * k)  # the gradient's range moves every step
        with on_operand(
            lambda layer, g, r, src, used, cap=cap: cap.__setitem__((g, r), (src, used))
        ):
            mod(x).backward(dy)
        seen.append(cap)
    return seen


def _gemm_spec(rec: Recipe, gemm: str, role: str) -> QuantSpec:
    """``role``'s spec in ``gemm``, transposed where the GEMM reduces it along its first axis."""
    spec = rec.spec(gemm, role)
    return spec.transposed() if dict(GEMM_OPERANDS[gemm])[role] else spec


def _assert_same_q(got: QTensor, want: QTensor) -> None:
    assert isinstance(got, QTensor) and got.spec == want.spec
    assert torch.equal(got.values, want.values)
    assert torch.equal(got.scales, want.scales)
    if want.global_scale is not None:
        assert torch.equal(got.global_scale, want.global_scale)


def _assert_stochastic(got: QTensor, src: torch.Tensor, spec: QuantSpec) -> None:
    """Stochastic rounding from ``src``: the scales of a deterministic quantization of ``src``
    (the scale rule does not depend on the rounding) and each value one of the two grid points
    around the scaled input."""
    down = fp8lab.quantize(src, spec.replace(rounding="toward_zero"))
    assert torch.equal(got.scales, down.scales)
    if down.global_scale is not None:
        assert torch.equal(got.global_scale, down.global_scale)
    grid = torch.unique(fp8lab.cast(torch.linspace(0, 1024, 200001), spec.format).abs())
    lo = down.values.abs()
    up = grid[torch.searchsorted(grid, lo.flatten(), right=True).clamp(max=grid.numel() - 1)]
    hi = got.values.abs()
    assert bool(((hi == lo) | (hi == up.reshape(lo.shape))).all())
    if spec.rht or spec.hadamard:  # the values carry the signs of the transformed tensor
        n = 16 if spec.rht else spec.hadamard
        axis = 1 if spec.block[0] == 1 else 0
        src = fp8lab.qtensor.transforms.transform_along(src.detach(), axis, n, spec.rht, "t")
    assert bool(((got.values == 0) | (torch.sign(got.values) == torch.sign(src))).all())


def _check_high_precision(rec: Recipe, gemm: str, role: str, src: torch.Tensor, used) -> None:
    hp = rec.precision(gemm, role)
    if hp is not None:  # rounded from the high-precision tensor (fp32: the tensor itself)
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[hp]
        assert torch.equal(used, src.to(dtype).float())
        return
    spec = _gemm_spec(rec, gemm, role)
    if spec.rounding == "stochastic":
        _assert_stochastic(used, src, spec)
    else:
        _assert_same_q(used, fp8lab.quantize(src, spec))


def _check(rec: Recipe, kind: str, gemm: str, role: str, cap: dict) -> None:
    src, used = cap[(gemm, role)]
    saved = cap[EARLIER[(gemm, role)]][1] if (gemm, role) in EARLIER else None
    if kind == "shared":  # the same data (rebuilt, not re-made, where the forward stored it)
        if isinstance(saved, QTensor):
            _assert_same_q(used, saved)
            assert used.retiled == saved.retiled
        else:
            assert torch.equal(used, saved)
    elif kind == "high precision":
        _check_high_precision(rec, gemm, role, src, used)
    elif kind == "re-tiled":
        want = fp8lab.quantize(saved.dequantize(), _gemm_spec(rec, gemm, role))
        _assert_same_q(used, want)
        assert used.retiled == saved.retiled + 1
    else:  # dequantized: the saved copy's values, no second rounding
        assert isinstance(saved, QTensor) and not isinstance(used, QTensor)
        assert torch.equal(used, saved.dequantize())


@pytest.mark.parametrize("preset", sorted(TABLE))
def test_each_backward_operand_is_the_copy_the_source_system_uses(preset):
    rec = fp8lab.get_recipe(preset)
    plan = build_plan(rec, ScalingState(rec))
    (cap,) = _step(rec)
    for (gemm, role), kind in TABLE[preset].items():
        if (gemm, role) in EARLIER:
            assert getattr(plan, gemm)[role].reuse is KINDS[kind], (preset, gemm, role)
        _check(rec, kind, gemm, role, cap)


def test_deepseek_v3_retiles_the_cached_x_but_quantizes_the_live_dy():
    # arXiv 2412.19437 §3.3.3: the cached activations go from 1x128 to 128x1 tiles in the
    # backward; dy is live, so its 128x1 copy comes from it (the old plan re-tiled dgrad's copy)
    rec = fp8lab.get_recipe("deepseek-v3")
    (cap,) = _step(rec)
    dy, used = cap[("wgrad", "grad_output")]
    _assert_same_q(used, fp8lab.quantize(dy, "e4m3", (128, 1)))
    retiled = fp8lab.quantize(cap[("dgrad", "grad_output")][1].dequantize(), "e4m3", (128, 1))
    assert not torch.equal(used.values, retiled.values)  # the two differ: the check can fail


@pytest.mark.parametrize(
    ("preset", "gemm", "source", "kinds"),
    [
        ("deepseek-v3", "wgrad", {"input": "high_precision"}, {"input": "high precision"}),
        ("deepseek-v3", "wgrad", {"grad_output": "saved_quantized"}, {"grad_output": "re-tiled"}),
        ("deepseek-v3", "wgrad", "saved_dequantized", {"input": "dequantized",
                                                       "grad_output": "dequantized"}),
        ("te-current", "dgrad", "saved_dequantized", {"weight": "dequantized"}),
        ("te-current", "wgrad", "high_precision", {"input": "shared", "grad_output": "shared"}),
        ("te-current", "wgrad", "saved_quantized", {"input": "shared", "grad_output": "shared"}),
        ("mxfp8", "wgrad", {"input": "saved_quantized"}, {"input": "re-tiled"}),
        ("mxfp8", "dgrad", "saved_dequantized", {"weight": "dequantized"}),
        ("bf16", "wgrad", "saved_dequantized", {"input": "shared", "grad_output": "shared"}),
    ],
)  # fmt: skip
def test_explicit_operand_source(preset, gemm, source, kinds):
    base = fp8lab.get_recipe(preset)
    rec = base.replace(**{gemm: dataclasses.replace(base.gemm(gemm), operand_source=source)})
    (cap,) = _step(rec)
    for role, kind in kinds.items():
        _check(rec, kind, gemm, role, cap)


def test_a_dequantized_operand_runs_its_gemm_in_fp32():
    # an FP8 tensor-core accumulator (here DeepSeek-V3's limited one) takes two FP8 operands: a
    # GEMM given the saved copy's dequantized values multiplies in fp32, as a high-precision cell
    rec = Recipe.from_dict(
        {"base": "deepseek-v3", "wgrad": {"operand_source": {"input": "saved_dequantized"}}}
    )
    plan = build_plan(rec, ScalingState(rec))
    x_op = plan.wgrad["input"]
    assert (x_op.reuse, x_op.high_precision, x_op.quantizer) == (Reuse.DEQUANTIZE, "fp32", None)
    assert plan.fprop["input"].retile_source  # its dequantized copy is written while quantizing
    torch.manual_seed(1)
    mod = Linear(IN, OUT, recipe=rec, name="lin")
    x = torch.randn(T, IN)
    dy = torch.randn(T, OUT)
    cap: dict = {}
    with on_operand(lambda layer, g, r, src, used: cap.__setitem__((g, r), used)):
        mod(x).backward(dy)
    want = (
        cap[("fprop", "input")].dequantize().t() @ cap[("wgrad", "grad_output")].dequantize()
    ).t()
    torch.testing.assert_close(mod.weight.grad, want, rtol=1e-6, atol=1e-6)


def test_wgrad_grad_output_override_is_quantized_from_dy_with_its_own_delayed_state():
    # te-delayed with wgrad's dy in E4M3 under its own DelayedScaling: Transformer Engine's
    # quantizers make every copy of dy from the live high-precision dy, so the override is
    # quantize(dy, spec) under the override's state, not a re-rounding of dgrad's E5M2 copy
    cfg = DelayedScalingConfig(history_len=16, algorithm="max", margin=0)
    override = QuantSpec("e4m3", scaling=cfg)
    rec = fp8lab.get_recipe("te-delayed").with_override("wgrad", "grad_output", override)
    ds = DelayedScaling.bind(cfg, "e4m3")  # an independent copy of the override's state
    grad = DelayedScaling.bind(rec.grad_output.scaling, "e5m2")  # and of dgrad's
    steps = _step(rec, steps=6)
    for k, cap in enumerate(steps):
        dy, used = cap[("wgrad", "grad_output")]
        want = Quantizer(override.transposed(), ds).quantize(dy.contiguous())
        want_dgrad = Quantizer(rec.grad_output, grad).quantize(dy.contiguous())
        ds.update()
        grad.update()
        if k in (0, 5):
            _assert_same_q(used, want)
            _assert_same_q(cap[("dgrad", "grad_output")][1], want_dgrad)
    # the scales moved with dy's range: step 5 ran under a delayed scale, not step 0's
    assert not torch.equal(steps[5][("wgrad", "grad_output")][1].scales,
                           steps[0][("wgrad", "grad_output")][1].scales)  # fmt: skip
    assert build_plan(rec, ScalingState(rec)).wgrad["grad_output"].reuse is Reuse.SOURCE


def test_saved_quantized_keeps_the_re_rounding_when_asked():
    # the old behaviour stays available explicitly: dgrad's E5M2 copy of dy, re-quantized (a
    # recipe file, as a user writes it)
    text = """
base = "te-delayed"
[wgrad]
operand_source = { grad_output = "saved_quantized" }
[wgrad.overrides.grad_output]
format = "e4m3"
[wgrad.overrides.grad_output.scaling.delayed]
history_len = 16
"""
    rec = Recipe.from_toml(text)
    plan = build_plan(rec, ScalingState(rec))
    assert plan.wgrad["grad_output"].reuse is Reuse.RETILE
    assert plan.dgrad["grad_output"].retile_source
    (cap,) = _step(rec)
    saved = cap[("dgrad", "grad_output")][1]
    ds = DelayedScaling.bind(rec.wgrad.override("grad_output").scaling, "e4m3")
    spec = rec.wgrad.override("grad_output").transposed()
    _assert_same_q(
        cap[("wgrad", "grad_output")][1], Quantizer(spec, ds).quantize(saved.dequantize())
    )

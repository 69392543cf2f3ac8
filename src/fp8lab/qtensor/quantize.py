"""The public quantize functions: `quantize` (validates its arguments, then runs a throwaway
`fp8lab.qtensor.quantizer.Quantizer`: block amax -> scale rule -> scaled cast) and `fake_quant`."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from fp8lab.formats import FloatFormat
from fp8lab.qtensor.quantizer import Quantizer
from fp8lab.qtensor.spec import QuantSpec, ScalingLike, _spec_from_args, split_state
from fp8lab.qtensor.tensor import QTensor
from fp8lab.scaling import rules as _rules
from fp8lab.scaling.delayed import DelayedScaling
from fp8lab.scaling.granularity import GranularityLike, check_fit, shape_2d

__all__ = ["fake_quant", "quantize"]


def quantize(
    x: torch.Tensor,
    fmt: str | FloatFormat | QuantSpec = "e4m3",
    granularity: GranularityLike | None = None,
    scaling: ScalingLike = None,
    rounding: str | None = None,
    *,
    saturate: bool | None = None,
    pad: bool | None = None,
    margin: int | None = None,
    epsilon: float | None = None,
    rht: bool | None = None,
    four_over_six: str | None = None,
    four_over_six_use_256: bool | None = None,
    row_scaled: bool | None = None,
    hadamard: int | None = None,
    generator: torch.Generator | None = None,
    out: torch.Tensor | None = None,
    dequantized_out: torch.Tensor | None = None,
    state: DelayedScaling | None = None,
) -> QTensor:
    """Quantize ``x`` (float tensor, any shape) under a spec.

    ``fmt`` is a format name / `FloatFormat` (then the other arguments build a `QuantSpec`) or a
    `QuantSpec` (then non-None arguments override its fields). Returns a `QTensor` whose
    ``values = cast(x * scale)`` per block and ``scales = 1/scale``. Delayed scaling: with
    ``state=ds`` (a `DelayedScaling`, which the caller owns: one per tensor) the current scale
    is used and this tensor's amax is recorded (call ``ds.update()`` once per step); the spec's
    scaling is then ``ds.cfg`` (taken when ``fmt`` is a format name and ``scaling`` is not
    given; any other scaling is a ValueError). Without a state, a `DelayedScalingConfig` (a
    preset's spec) gives step 0's scale from a throwaway state and records nothing. A
    `DelayedScaling` passed as ``scaling`` or held by the spec is deprecated (a
    DeprecationWarning) and acts as ``state=``. ``generator`` feeds stochastic rounding.
    float16/bfloat16/float64 inputs are first converted to float32 (float64 rounds once there; TE
    multiplies in FP32 as well).
    ``rht``, ``four_over_six``, ``four_over_six_use_256``, ``row_scaled``, ``hadamard``: the
    `QuantSpec` fields of the same names (NVFP4's random Hadamard transform, "4 over 6",
    per-row second-level scales; a Hadamard transform over blocks; docs/nvfp4.md), e.g.
    ``quantize(x, "e2m1", "nvfp4", "nvfp4", rht=True)``. Any device: the kernels follow
    ``x``'s (numba on the CPU by default, the device-generic torch kernels elsewhere:
    `fp8lab.kernels`), with the same bits; the QTensor's tensors are on ``x``'s device.

    Buffers (no allocation of full-size outputs): ``out`` receives the values and becomes
    ``QTensor.values``; ``dequantized_out`` receives ``QTensor.dequantize()`` (bit for bit),
    computed in the same pass as the values where the fast kernel applies. Each must be a
    contiguous float32 tensor of ``x``'s shape on ``x``'s device; they must not overlap each other (``out``
    may be ``x`` itself when ``x`` is contiguous float32). The caller owns both buffers;
    ``dequantized_out`` becomes the QTensor's memoised dequantized copy (`QTensor.dequantize`
    returns it), so it must not be overwritten while the QTensor is in use.

    Gradients: when ``x`` requires grad (and grad mode is on), `QTensor.dequantize` passes
    gradients straight through to ``x`` (``QTensor.values`` itself carries none).
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize expects a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"quantize expects a floating-point tensor, got {x.dtype}")
    extra = {"rht": rht, "four_over_six": four_over_six,
             "four_over_six_use_256": four_over_six_use_256, "row_scaled": row_scaled,
             "hadamard": hadamard}  # fmt: skip
    spec, state = _with_state(fmt, granularity, scaling, rounding, saturate, pad, margin,
                              epsilon, state, **extra)  # fmt: skip
    # straight-through gradient (QTensor.dequantize): keep the source only when it can carry one
    source = x if (x.requires_grad and torch.is_grad_enabled()) else None
    x = x.detach()
    s2 = shape_2d(x.shape)
    check_fit(s2, spec.block, spec.pad)
    x2 = x.reshape(s2).to(torch.float32).contiguous()
    # TE: an infinite scale (tiny amax) becomes FLT_MAX per tensor, but the input dtype's max in
    # the block-scaling kernels (compute_scale_from_types<IType>)
    vinf = _rules.FLT_MAX
    if spec.block != (-1, -1) and x.dtype in (torch.bfloat16, torch.float16):
        vinf = torch.finfo(x.dtype).max
    out2 = _check_buffer(out, x, "out")
    deq2 = _check_buffer(dequantized_out, x, "dequantized_out")
    if out2 is not None and deq2 is not None and _overlap(out2, deq2):
        raise ValueError("out and dequantized_out must not overlap")
    q = Quantizer(spec, state).quantize(
        x2, out2, deq2, generator=generator, value_for_inf=vinf, source=source
    )
    q.values = q.values.reshape(x.shape)
    if dequantized_out is not None:
        q._set_dense(dequantized_out)  # the memoised dequantized copy, in x's shape
    return q


def _with_state(
    fmt: str | FloatFormat | QuantSpec,
    granularity: GranularityLike | None,
    scaling: ScalingLike,
    rounding: str | None,
    saturate: bool | None,
    pad: bool | None,
    margin: int | None,
    epsilon: float | None,
    state: DelayedScaling | None,
    **fields: Any,
) -> tuple[QuantSpec, DelayedScaling | None]:
    """`quantize`'s spec (configuration only) and delayed-scaling state: ``state=``, or the
    deprecated `DelayedScaling` given as ``scaling`` or held by a `QuantSpec`; two different
    states, a state beside a scaling that is not its configuration, or a state that is not a
    `DelayedScaling`, are errors."""
    if state is not None and not isinstance(state, DelayedScaling):
        raise TypeError(f"state must be a DelayedScaling, got {type(state).__name__}")
    held = []
    if isinstance(scaling, DelayedScaling):
        warnings.warn(
            "quantize(..., scaling=DelayedScaling(...)) is deprecated: use "
            "quantize(x, fmt, scaling=ds.cfg, state=ds) (or just state=ds)",
            DeprecationWarning,
            stacklevel=3,
        )
        held.append(scaling)
        scaling = scaling.cfg
    if isinstance(fmt, QuantSpec):
        fmt, bound = split_state(fmt)
        if bound is not None:
            held.append(bound)
    for other in held:
        if state is not None and other is not state:
            raise ValueError("quantize: two delayed-scaling states (state= and the spec's)")
        state = other
    if state is not None and scaling is None and not isinstance(fmt, QuantSpec):
        scaling = state.cfg
    spec = _spec_from_args(
        fmt,
        granularity,
        scaling,
        rounding,
        saturate,
        pad,
        margin=margin,
        epsilon=epsilon,
        **fields,
    )
    if state is not None and spec.scaling != state.cfg:
        raise ValueError(
            f"quantize: state= is a DelayedScaling ({state.cfg!r}); the spec's scaling must be "
            f"its configuration (scaling=state.cfg), got {spec.describe()}"
        )
    return spec, state


def _check_buffer(buf: torch.Tensor | None, x: torch.Tensor, name: str) -> torch.Tensor | None:
    """``buf`` as a 2-D [R, C] view after validating it as an output buffer for ``x``."""
    if buf is None:
        return None
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(buf).__name__}")
    if buf.dtype != torch.float32 or buf.device != x.device or not buf.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous float32 tensor on x's device ({x.device}), got "
            f"{buf.dtype} on {buf.device}" + ("" if buf.is_contiguous() else " (not contiguous)")
        )
    if tuple(buf.shape) != tuple(x.shape):
        raise ValueError(f"{name} has shape {tuple(buf.shape)}, expected {tuple(x.shape)}")
    if buf.requires_grad:
        raise ValueError(f"{name} must not require grad")
    return buf.view(shape_2d(x.shape))


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a.numel() > 0 and b.numel() > 0 and a0 < b0 + 4 * b.numel() and b0 < a0 + 4 * a.numel()


def fake_quant(
    x: torch.Tensor,
    fmt: str | FloatFormat | QuantSpec = "e4m3",
    granularity: GranularityLike | None = None,
    scaling: ScalingLike = None,
    rounding: str | None = None,
    **kw: Any,
) -> torch.Tensor:
    """``quantize(x, ...).dequantize()``: float32, ``x``'s shape.

    Straight-through gradient: ``d fake_quant(x) / dx`` is taken as 1 everywhere (saturated
    elements included), as in quantization-aware training; see `fp8lab.formats.straight_through`.
    """
    return quantize(x, fmt, granularity, scaling, rounding, **kw).dequantize()

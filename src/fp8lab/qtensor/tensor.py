"""`QTensor`: quantized values, their per-block scales and the spec that made them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fp8lab.formats import FloatFormat, encode
from fp8lab.formats.straight_through import straight_through
from fp8lab.qtensor.kernels import mul_blocks
from fp8lab.qtensor.spec import QuantSpec
from fp8lab.scaling.granularity import as_2d, expand_blocks, resolve_block, shape_2d

__all__ = ["QTensor"]


@dataclass(eq=False)
class QTensor:
    """A quantized tensor.

    Attributes:
        values: float32, the original shape, every element on the format's grid (the *scaled*
            values: ``x * scale`` after the cast).
        scales: float32 ``[nr, nc]`` per-block dequantization multipliers (TE ``scale_inv``;
            for MX exact powers of two, for NVFP4 the E4M3 block scales). Blocks tile the 2-D
            view ``[R, C]`` of the tensor (`fp8lab.scaling.granularity`).
        spec: the `QuantSpec` used.
        global_scale: NVFP4's FP32 tensor-level dequantization scale (``None`` otherwise): 0-d,
            or ``[R, 1]`` / ``[1, C]`` for a row-scaled spec (one per row / per column).
        retiled: how many re-tilings led to this tensor (0 for a direct quantization).
        meta: free-form notes (re-tiling source and added error).
        scale_multipliers: the per-block *quantization* multipliers actually used
            (``values = cast(x * scale_multipliers)``; TE's ``scale``), same layout as ``scales``.
        block_shape: the block ``(m, k)`` resolved on the 2-D view (no -1), when the quantizer
            that made it knew it (``None``: resolve from ``spec``).

    The QTensor owns its dequantized copy: `dequantize` computes it once (or takes the one
    ``quantize(..., dequantized_out=)`` wrote in the cast pass) and returns that same tensor
    again; ``t()`` shares it and returns its transpose. The copy is keyed by the layout of
    ``values`` (assigning new ``values`` recomputes it); nobody may write into it in place.
    """

    values: torch.Tensor
    scales: torch.Tensor
    spec: QuantSpec
    global_scale: torch.Tensor | None = None
    retiled: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    scale_multipliers: torch.Tensor | None = None
    block_shape: tuple[int, int] | None = None
    # the memoised dequantized copy, one cell shared with t() copies: [(values layout, tensor)]
    _dense: list[Any] = field(default_factory=lambda: [None], repr=False)
    # the high-precision input when it required grad: dequantize() passes gradients to it
    _source: torch.Tensor | None = field(default=None, repr=False)

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def block(self) -> tuple[int, int]:
        return self.spec.block

    @property
    def fmt(self) -> FloatFormat:
        return self.spec.fmt

    def scale_tensor(self) -> torch.Tensor:
        """Per-block dequantization multipliers including the NVFP4 tensor scale."""
        if self.global_scale is None:
            return self.scales
        return self.scales * self.global_scale

    def dequantize(self) -> torch.Tensor:
        """``values * scales`` broadcast over the blocks (float32, the original shape).

        Memoised (see the class doc): the same tensor comes back on every call, so never write
        into it. Straight-through gradient: when the quantized input required grad (and grad
        mode was on), the result is attached to it with gradient 1 everywhere, as
        ``torch.fake_quantize_per_tensor_affine`` does inside its range (no clipping mask:
        saturated elements pass their gradient too).
        """
        d = self._dense_copy()
        if self._source is None:
            return d
        return straight_through(self._source, d)

    def _set_dense(self, d: torch.Tensor) -> None:
        """Adopt ``d`` (bit for bit ``values * scales``) as the memoised dequantized copy."""
        self._dense[0] = (self._key(self.values), d)

    def _dense_copy(self) -> torch.Tensor:
        d = self._memoised()
        if d is None:
            d = self._compute_dense()
            self._dense[0] = (self._key(self.values), d)
        return d

    def _memoised(self) -> torch.Tensor | None:
        """The memoised dequantized copy in this tensor's layout, None if not computed yet."""
        held = self._dense[0]
        if held is None:
            return None
        key, d = held
        v = self.values
        if key == self._key(v):
            return d
        if v.dim() == 2 and key == self._key(v.t()):
            return d.t()
        return None

    def to_tensors(self) -> tuple[list[torch.Tensor | None], dict[str, Any]]:
        """The QTensor as plain tensors and plain data, for ``ctx.save_for_backward``: saved
        that way, ``torch.autograd.graph.saved_tensors_hooks`` (activation checkpointing, CPU
        offload) see every tensor it holds. Tensors: ``[values, scales, global_scale,
        scale_multipliers, the memoised dequantized copy (None until computed), the
        straight-through source]``; the rest is ``spec``, ``retiled``, ``meta`` and
        ``block_shape``. `from_tensors` rebuilds it."""
        rest = {
            "spec": self.spec,
            "retiled": self.retiled,
            "meta": self.meta,
            "block_shape": self.block_shape,
        }
        tensors = [self.values, self.scales, self.global_scale, self.scale_multipliers]
        return [*tensors, self._memoised(), self._source], rest

    @classmethod
    def from_tensors(cls, tensors: Sequence[torch.Tensor | None], rest: dict[str, Any]) -> QTensor:
        """The QTensor `to_tensors` took apart (the tensors may be new copies of the same
        values, e.g. recomputed by activation checkpointing: the dequantized copy is adopted
        as the memoised one, keyed by the new layout)."""
        values, scales, global_scale, multipliers, dense, source = tensors
        q = cls(
            values,  # type: ignore[arg-type]
            scales,  # type: ignore[arg-type]
            rest["spec"],
            global_scale=global_scale,
            retiled=rest["retiled"],
            meta=rest["meta"],
            scale_multipliers=multipliers,
            block_shape=rest["block_shape"],
            _source=source,
        )
        if dense is not None:
            q._set_dense(dense)
        return q

    def _key(self, v: torch.Tensor) -> tuple:
        """What the memoised copy was computed from: the values' layout and the scales' storage
        (the same for a ``t()`` copy, different after replacing values or scales)."""
        g = self.global_scale
        return _layout(v), self.scales.data_ptr(), None if g is None else g.data_ptr()

    def _compute_dense(self) -> torch.Tensor:
        s2 = shape_2d(self.values.shape)
        sc = self.scales
        v2 = as_2d(self.values)
        if sc.numel() == 1:
            out = v2 * sc.reshape(())
        elif v2.dtype == torch.float32 and v2.is_contiguous() and v2.numel():
            # one vectorised pass, no expanded scale tensor
            m, k = resolve_block(self.block, s2)
            out = mul_blocks(v2, sc, m, k)
        else:
            out = v2 * expand_blocks(sc, self.block, s2)
        if self.global_scale is not None:
            out = out * self.global_scale
        return out.reshape(self.values.shape)

    def codes(self) -> torch.Tensor:
        """uint8 bit codes of the element values (`fp8lab.encode`)."""
        return encode(self.values, self.fmt)

    def scale_codes(self) -> torch.Tensor:
        """E8M0 codes (uint8) of power-of-two scales (MX): ``exponent(scale) + 127``.

        Code 0 is ``2**-127``, a float32 subnormal (bits ``0x00400000``); NaN gives 255. Any other
        scale (not a positive power of two in ``[2**-127, 2**127]``) raises ``ValueError``.
        """
        sc = self.scales.to(torch.float32).contiguous()
        b = sc.view(torch.int32)
        expf = (b >> 23) & 0xFF  # b >= 0 below: the sign bit is not in expf
        normal = (b >= 0) & (expf > 0) & (expf < 255) & ((b & 0x007FFFFF) == 0)
        code0 = b == 0x00400000  # 2**-127: E8M0's smallest value is a float32 subnormal
        nan = torch.isnan(sc)
        bad = ~(normal | code0 | nan)
        if bool(bad.any()):
            example = float(sc[bad].reshape(-1)[0])
            raise ValueError(
                f"scales are not all powers of two in [2**-127, 2**127] (e.g. {example!r}); "
                "E8M0 codes need an MX rule"
            )
        code = torch.where(code0, 0, expf)
        return torch.where(nan, 255, code).to(torch.uint8)

    def t(self, spec: QuantSpec | None = None) -> QTensor:
        """The transpose of a 2-D quantized tensor (values, scales and block shape swapped).
        ``spec``: ``self.spec.transposed()`` when the caller has it already."""
        if self.values.dim() != 2:
            raise ValueError(f"t() needs a 2-D QTensor, got shape {tuple(self.values.shape)}")
        bs = self.block_shape
        return QTensor(
            values=self.values.t(),
            scales=self.scales.t(),
            spec=self.spec.transposed() if spec is None else spec,
            block_shape=None if bs is None else (bs[1], bs[0]),
            # a row-scaled NVFP4 tensor's per-row [R, 1] scale becomes per-column
            global_scale=self.global_scale.t()
            if self.global_scale is not None and self.global_scale.dim() == 2
            else self.global_scale,
            retiled=self.retiled,
            meta=dict(self.meta),
            scale_multipliers=None
            if self.scale_multipliers is None
            else self.scale_multipliers.t(),
            _dense=self._dense,
            _source=None if self._source is None else self._source.t(),
        )

    @property
    def T(self) -> QTensor:
        return self.t()

    def __repr__(self) -> str:
        return (
            f"QTensor(shape={tuple(self.values.shape)}, spec={self.spec.describe()!r}, "
            f"scales={tuple(self.scales.shape)}, retiled={self.retiled})"
        )


def _layout(t: torch.Tensor) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    return t.data_ptr(), tuple(t.shape), t.stride()

"""`Quantizer`: one operand's quantization — its spec, its kernels and the delayed-scaling state
it quantizes with.

A `QuantSpec` is configuration only. A `Quantizer` is what quantizes one tensor again and again
(one GEMM operand of one layer): it resolves the spec once (format constants, the fast cast's
grid, the block geometry per input shape, the transposed spec of the other GEMM direction) and,
for delayed scaling, quantizes with the `fp8lab.scaling.delayed.DelayedScaling` its owner hands
it: it uses that object's scale and stages the tensor's amax into it, nothing more. The object
belongs to whoever owns the tensor's scaling (a converted Linear's `fp8lab.nn.state.ScalingState`,
or the user of ``fp8lab.quantize(x, spec, state=ds)``), which updates, saves and loads it.
Operations: `Quantizer.quantize`, `Quantizer.retile`.

The public `fp8lab.quantize` and `fp8lab.retile` run through this class too (a throwaway
quantizer per call), so there is one quantization path.

Output buffers: `POOL` keeps free buffers by shape, device and dtype (a fresh 32 MB tensor costs
more than the quantization pass that fills it: page faults on first touch, ~21 ms vs ~6 ms on the
development machine); `fp8lab.nn` takes an operand's buffers from it and returns them when the
operand is dead.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from fp8lab._counters import read_counts
from fp8lab.kernels import use_torch
from fp8lab.qtensor.kernels import _fast_params, block_amax, scale_cast
from fp8lab.qtensor.nvfp4 import four_over_six_scales, second_level_amax
from fp8lab.qtensor.spec import QuantSpec, split_state
from fp8lab.qtensor.tensor import QTensor
from fp8lab.qtensor.transforms import transform_along
from fp8lab.scaling import rules as _rules
from fp8lab.scaling.delayed import DelayedScaling
from fp8lab.scaling.granularity import check_fit, num_blocks, resolve_block
from fp8lab.scaling.rule_kernels import (
    MX_RULES,
    max_rule_args,
    mx_rule_args,
    nvfp4_fast_ok,
    nvfp4_rule_scales,
    run_rule,
)

__all__ = [
    "POOL",
    "BufferPool",
    "Quantizer",
    "buffer_cache_limit",
    "clear_buffer_cache",
    "retile_counts",
]

_RETILE_COUNTS = {"from_quantized": 0, "from_source": 0}


def retile_counts(reset: bool = False) -> dict[str, int]:
    """How many re-tilings ran in this process, by source; ``reset=True`` zeroes the counters."""
    return read_counts(_RETILE_COUNTS, reset)


class Quantizer:
    """Quantizes one tensor under one spec, again and again (see the module doc).

    ``spec``: a `QuantSpec`. ``delayed``: the `DelayedScaling` this quantizer quantizes with
    (its scale is used, its staging amax updated; the caller owns it and runs its ``update``).
    Without one, a `DelayedScalingConfig` gets a throwaway state per call (step 0, nothing
    recorded: what quantizing under a recipe's spec alone means); a spec of the deprecated form
    ``QuantSpec(scaling=DelayedScaling(...))`` is split into its configuration and that state.
    """

    __slots__ = ("_geom", "_grid", "_nvfp4_fast", "_rule", "_rule_args", "_t", "_transform_axis",
                 "block", "delayed", "spec", "throwaway")  # fmt: skip

    def __init__(self, spec: QuantSpec, delayed: DelayedScaling | None = None) -> None:
        if not isinstance(spec, QuantSpec):
            raise TypeError(f"Quantizer expects a QuantSpec, got {type(spec).__name__}")
        spec, bound = split_state(spec)
        if bound is not None and delayed is not None and bound is not delayed:
            raise ValueError("Quantizer: two delayed-scaling states (delayed= and the spec's)")
        delayed = delayed if delayed is not None else bound
        self.spec = spec
        self.block = spec.block
        sc = spec.scaling
        self.throwaway = delayed is None and spec.is_delayed
        if delayed is not None:
            if not spec.is_delayed:
                raise ValueError(f"a DelayedScaling needs a delayed spec, got {spec.describe()}")
            # the scale targets the spec's format (TE: the quantizer's dtype); a state that knows
            # no format yet learns it here, and step-0 current scaling reads it
            if delayed.cfg.first_step == "current" or float(delayed.state.fmt_max) == 0.0:
                delayed.set_format(spec.fmt)
        self.delayed = delayed
        self._rule = sc if isinstance(sc, str) else None
        self._rule_args = _rule_args(spec)
        self._grid = _fast_params(spec)
        self._nvfp4_fast = sc == "nvfp4" and nvfp4_fast_ok(
            spec.format, spec.scale_format, spec.two_level
        )
        self._transform_axis = spec.transform_axis  # read once: quantize is the hot path
        self._geom: dict[tuple[int, int], tuple[int, int, int, int]] = {}
        self._t: Quantizer | None = None

    # ------------------------------------------------------------------ resolved once
    def geometry(self, shape2d: tuple[int, int]) -> tuple[int, int, int, int]:
        """``(m, k, nr, nc)``: the block and the block counts for a ``[R, C]`` input (cached;
        the first call checks that the shape tiles when the spec has ``pad=False``)."""
        g = self._geom.get(shape2d)
        if g is None:
            check_fit(shape2d, self.block, self.spec.pad)
            m, k = resolve_block(self.block, shape2d)
            g = self._geom[shape2d] = (m, k, *num_blocks(shape2d, (m, k)))
        return g

    def varies_along(self, shape2d: tuple[int, int], axis: int) -> bool:
        """Whether the scales of a ``[R, C]`` input vary along ``axis`` (more than one block)."""
        return self.geometry(shape2d)[axis] < shape2d[axis]

    def transposed(self) -> Quantizer:
        """The quantizer of the other GEMM direction (block axes swapped), sharing this one's
        delayed-scaling state (built once)."""
        t = self._t
        if t is None:
            t = self._t = Quantizer(self.spec.transposed(), self.delayed)
            t._t = self
        return t

    # ------------------------------------------------------------------ per call
    def quantize(
        self,
        x2: torch.Tensor,
        out: torch.Tensor | None = None,
        dequantized_out: torch.Tensor | None = None,
        *,
        generator: torch.Generator | None = None,
        value_for_inf: float = _rules.FLT_MAX,
        source: torch.Tensor | None = None,
    ) -> QTensor:
        """Quantize a contiguous float32 ``[R, C]`` tensor: ``values = cast(x * scale)`` per
        block, ``scales = 1/scale``. ``out`` / ``dequantized_out``: contiguous float32 buffers
        of ``x2``'s shape for the values and for the dequantized copy (written in the same
        pass; it becomes the QTensor's memoised `QTensor.dequantize`). ``source``: the tensor
        a straight-through gradient flows to. Inputs are not validated here (`fp8lab.quantize`
        does that). Any device: the kernels follow ``x2``'s (`fp8lab.kernels.use_torch`), and a
        delayed-scaling state moves there (`DelayedScaling.to`).

        A spec with ``rht`` or ``hadamard`` first transforms ``x2`` along its block axis
        (`fp8lab.qtensor.transforms`; ValueError when that axis is not a multiple of the
        transform's size) and quantizes the transformed tensor: the QTensor holds (and
        dequantizes to) the transformed domain, and carries no straight-through gradient (an
        identity gradient to the untransformed source would be wrong)."""
        spec, axis = self.spec, self._transform_axis
        if axis is not None:
            source = None
            n, what = (16, "rht=True") if spec.rht else (spec.hadamard, f"hadamard={spec.hadamard}")
            x2 = transform_along(x2, axis, n, spec.rht, what)  # type: ignore[arg-type]
        m, k, nr, nc = self.geometry(x2.shape)
        s, inv, g = self._scales(x2, m, k, nr, nc, value_for_inf)
        values = scale_cast(x2, s, m, k, self._grid, self.spec, generator, out,
                            dequantized_out, inv, g)  # fmt: skip
        q = QTensor(
            values=values,
            scales=inv.reshape(nr, nc),
            spec=self.spec,
            global_scale=g,
            scale_multipliers=s.reshape(nr, nc),
            block_shape=(m, k),
            _source=source,
        )
        if dequantized_out is not None:
            q._set_dense(dequantized_out)
        return q

    def _scales(
        self, x2: torch.Tensor, m: int, k: int, nr: int, nc: int, value_for_inf: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(per-block quantization multiplier, per-block scale_inv, NVFP4 global dequant scale)."""
        spec = self.spec
        rule = self._rule
        if self.delayed is not None or self.throwaway:
            ds = self.delayed or DelayedScaling.bind(
                spec.scaling,  # type: ignore[arg-type]
                spec.fmt,
                device=x2.device,
            )
            ds.to(x2.device)  # the state lives where the tensor it observes does (no-op there)
            amax = block_amax(x2, m, k, nr, nc).reshape(())
            s = ds.scale_for(amax).reshape(1, 1)
            ds.observe(amax)
            return s, torch.reciprocal(s), None
        if rule is None:  # a fixed multiplier
            fixed = float(spec.scaling)  # type: ignore[arg-type]
            s = torch.full((nr, nc), fixed, dtype=torch.float32, device=x2.device)
            return s, torch.reciprocal(s), None
        if rule == "quest":
            s = _rules.quest_scale(_block_std(x2, m, k, nr, nc), spec.fmt)
            return s, torch.reciprocal(s), None
        amax = block_amax(x2, m, k, nr, nc)
        if rule == "max" or rule in MX_RULES:
            # the rule and its reciprocal in one numba pass over the block amaxes (a handful of
            # torch ops on the block scales cost more than the amax pass itself on a loaded
            # 2-core machine); the same kernels as fp8lab.scaling.rule_kernels' functions
            kernel, args = self._rule_args  # type: ignore[misc]
            if rule == "max":
                args = (*args, np.float32(value_for_inf))
            s, inv = run_rule(kernel, args, amax)
            return s, inv, None
        if rule == "nvfp4":
            if spec.four_over_six is not None:
                bound = spec.four_over_six_bound
                assert bound is not None  # four_over_six is set
                return four_over_six_scales(
                    x2, amax, (m, k), spec.four_over_six, bound, spec.row_scaled
                )
            if self._nvfp4_fast and not use_torch(amax, what="scale rule"):
                # the rule in one numba pass over the block amaxes (bit for bit nvfp4_scales)
                return nvfp4_rule_scales(amax, (m, k), spec.row_scaled, spec.tensor_scale)
            tensor_amax = None
            if spec.two_level:
                tensor_amax = second_level_amax(amax, (m, k), spec.row_scaled)
            s_blk, s_dec, enc = _rules.nvfp4_scales(
                amax, tensor_amax, spec.fmt, scale_format=spec.scale_format,
                tensor_scale=spec.tensor_scale,
            )  # fmt: skip
            return enc, s_blk, (s_dec if spec.two_level else None)
        s = _rules.get_rule(rule)(
            amax, spec.fmt, margin=spec.margin, epsilon=spec.epsilon, value_for_inf=value_for_inf
        )
        return s, torch.reciprocal(s), None

    def retile(
        self,
        q: QTensor,
        dequantized: torch.Tensor,
        out: torch.Tensor | None = None,
        dequantized_out: torch.Tensor | None = None,
    ) -> QTensor:
        """``q`` (of the same logical tensor) re-quantized into this quantizer's tiles from its
        dequantized values ``dequantized`` (contiguous float32 ``[R, C]``), as DeepSeek-V3
        re-tiles its 1x128 activations for the backward. Counted (`retile_counts`); no
        added-error pass (`fp8lab.retile` measures it). A transformed spec (``rht``,
        ``hadamard``) on either side is a ValueError: the dequantized values are in the old block
        axis's transformed domain, so only the source tensor can be quantized again."""
        if self._transform_axis is not None or q.spec.rht or q.spec.hadamard:  # fields: no call
            check_retile_from_quantized(q.spec, self.spec)
        res = self.quantize(dequantized, out, dequantized_out)
        _RETILE_COUNTS["from_quantized"] += 1
        res.meta["retile_source"] = "quantized"
        res.meta["retile_added_error"] = None
        res.retiled = q.retiled + 1
        return res

    def __repr__(self) -> str:
        own = "" if self.delayed is None else f", step={self.delayed.step}"
        return f"Quantizer({self.spec.describe()}{own})"


def check_retile_from_quantized(old: QuantSpec, new: QuantSpec) -> None:
    """ValueError when either spec transforms its tensor (``rht``, ``hadamard``): a transformed
    QTensor's dequantized values are in its own block axis's transformed domain, so only the
    source tensor can be quantized into the other tiles."""
    for spec in (old, new):
        if spec.transform_axis is not None:
            raise ValueError(
                f"retile: {spec.describe()} quantizes a transformed tensor (rht/hadamard); "
                "re-tiling its dequantized values would mix the transform's domains: "
                "quantize the source tensor again (retile(q, source=x))"
            )


def _block_std(x2: torch.Tensor, m: int, k: int, nr: int, nc: int) -> torch.Tensor:
    """Per-block population standard deviation ``sqrt(mean(x**2) - mean(x)**2)`` (float32
    ``[nr, nc]``), computed in float64 and rounded once to float32 (a negative variance from
    rounding counts as 0). Ragged blocks count their zero padding as elements."""
    xp = x2.to(torch.float64)
    if (nr * m, nc * k) != tuple(x2.shape):
        xp = xp.new_zeros((nr * m, nc * k))
        xp[: x2.shape[0], : x2.shape[1]] = x2
    b = xp.reshape(nr, m, nc, k)
    mean = b.mean(dim=(1, 3))
    var = (b * b).mean(dim=(1, 3)) - mean * mean
    return var.clamp(min=0).sqrt().to(torch.float32)


def _rule_args(spec: QuantSpec) -> tuple[Any, tuple[Any, ...]] | None:
    """The numba kernel of the spec's `max` or MX rule and its constant arguments
    (`fp8lab.scaling.rule_kernels`), resolved once per quantizer."""
    sc = spec.scaling
    if sc == "max":
        return max_rule_args(spec.format, spec.margin, spec.epsilon)
    if isinstance(sc, str) and sc in MX_RULES:
        return mx_rule_args(sc, spec.format)
    return None


# --------------------------------------------------------------------------- output buffers
class BufferPool:
    """Free buffers by (shape, device, dtype), reused across calls and modules; at most
    ``max_bytes`` of free buffers are retained. A buffer is only ever handed out for its own
    device and dtype: a tensor made on the CPU for a CUDA operand would fail the kernels' device
    check (or, worse, cost a copy per call)."""

    def __init__(self, max_bytes: int = 1 << 30) -> None:
        self.max_bytes = max_bytes
        self.free: dict[tuple[tuple[int, ...], torch.device, torch.dtype], list[torch.Tensor]] = {}
        self.free_bytes = 0
        self.lock = threading.Lock()

    def take(
        self,
        shape: tuple[int, ...],
        held: list[torch.Tensor],
        device: torch.device,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """A ``dtype`` buffer of ``shape`` on ``device`` (contents undefined), appended to
        ``held``. ``device``: the operand's ``x.device`` (a CUDA device with its index, as a
        tensor reports it; a returned buffer is filed under its own ``.device``)."""
        key = (tuple(shape), torch.device(device), dtype)
        with self.lock:
            lst = self.free.get(key)
            buf = lst.pop() if lst else None
            if buf is not None:
                self.free_bytes -= buf.element_size() * buf.numel()
        if buf is None:
            buf = torch.empty(key[0], dtype=dtype, device=key[1])
        held.append(buf)
        return buf

    def give(self, held: list[torch.Tensor]) -> None:
        """Return every buffer of ``held`` (their users are dead) and empty the list."""
        with self.lock:
            for buf in held:
                nbytes = buf.element_size() * buf.numel()
                if self.free_bytes + nbytes > self.max_bytes:
                    continue
                key = (tuple(buf.shape), buf.device, buf.dtype)
                self.free.setdefault(key, []).append(buf)
                self.free_bytes += nbytes
        held.clear()

    def clear(self) -> None:
        with self.lock:
            self.free.clear()
            self.free_bytes = 0


POOL = BufferPool()


def clear_buffer_cache() -> None:
    """Drop the free operand buffers kept for reuse (see `buffer_cache_limit`)."""
    POOL.clear()


def buffer_cache_limit(max_bytes: int | None = None) -> int:
    """The limit (bytes) on free operand buffers kept for reuse; set it when ``max_bytes`` is
    given (0 disables reuse). Returns the limit in force. Default 1 GiB."""
    if max_bytes is not None:
        if int(max_bytes) < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        POOL.max_bytes = int(max_bytes)
        if POOL.free_bytes > POOL.max_bytes:
            POOL.clear()
    return POOL.max_bytes

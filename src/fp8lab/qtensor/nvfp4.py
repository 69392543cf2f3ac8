"""NVFP4's second-level choices beyond the plain two-level rule
(`fp8lab.scaling.rules.nvfp4_scales`): the per-row global amax (``row_scaled``) and "4 over 6"
(``four_over_six``), as Transformer Engine's pure-PyTorch reference computes them
(``transformer_engine/pytorch/custom_recipes/reference_nvfp4.py``:
``_quantize_blockwise_reference``, ``_quantize_blockwise_4over6_reference``; arXiv 2512.02010).
docs/nvfp4.md walks the algorithm.

Both return what a scale rule returns to `fp8lab.qtensor.quantizer.Quantizer`: the per-block
quantization multiplier ``enc``, the E4M3 block scale ``s_blk`` and the FP32 second-level
dequantization scale ``s_dec`` (a scalar, or ``[R, 1]`` / ``[1, C]`` when row-scaled); the
element cast ``cast(x * enc)`` onto E2M1 (nearest even, saturating) is the quantizer's, the
same for every NVFP4 spec.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from fp8lab.formats import cast
from fp8lab.kernels import use_torch
from fp8lab.qtensor.kernels import _fast_params_for, _rne_sat
from fp8lab.scaling.rules import FLT_MAX

__all__ = ["four_over_six_scales", "second_level_amax"]

_E2M1_MAX = 6.0
_E4M3_MAX = 448.0


def second_level_amax(amax: torch.Tensor, block: tuple[int, int], row_scaled: bool) -> torch.Tensor:
    """The amax of NVFP4's second level from the block amaxes ``[nr, nc]``: the tensor's (a
    0-d tensor; 0 for an empty tensor) or, ``row_scaled``, one per row for 1x16 blocks
    (``[R, 1]``) and one per column for 16x1 blocks (``[1, C]``: TE's column-wise copy is the
    transpose quantized row by row)."""
    if row_scaled:
        return amax.amax(dim=1 if block[0] == 1 else 0, keepdim=True)
    if amax.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=amax.device)
    return amax.amax()


def _global_scales(g_amax: torch.Tensor, bound: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(encode, decode) FP32 second-level scales: ``min(fl32(bound * 6) / amax, FLT_MAX)``, 1
    where that is 0 or the amax is 0 (fp8lab's convention, `nvfp4_scales`), and its reciprocal."""
    dev = g_amax.device
    enc = torch.div(torch.tensor(bound * _E2M1_MAX, dtype=torch.float32, device=dev), g_amax)
    enc = torch.minimum(enc, torch.tensor(FLT_MAX, dtype=torch.float32, device=dev))
    enc = torch.where((g_amax == 0) | (enc == 0), torch.ones_like(enc), enc)
    return enc, torch.reciprocal(enc)


def _candidate(
    x: torch.Tensor, pre: torch.Tensor, g_dec: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One 4over6 candidate from its pre-cast block scales ``pre`` ``[nr, nc, 1]``: (E4M3 block
    scale, FP32 multiplier, E2M1 values of ``x`` ``[nr*ty, nc, 16]``)."""
    sf = cast(pre.clamp(-_E4M3_MAX, _E4M3_MAX), "e4m3", rounding="nearest_even", saturate=True)
    flt_max = torch.tensor(FLT_MAX, dtype=torch.float32, device=x.device)
    enc = torch.minimum(torch.reciprocal(sf * g_dec), flt_max)
    ty = x.shape[0] // enc.shape[0]
    enc_rows = enc.repeat_interleave(ty, dim=0) if ty > 1 else enc
    q = cast(x * enc_rows, "e2m1", rounding="nearest_even", saturate=True)
    return sf, enc, q


def _errors(
    q: torch.Tensor, sf: torch.Tensor, x: torch.Tensor, g_amax: torch.Tensor, denom: torch.Tensor,
    mode: str, ty: int,
) -> torch.Tensor:  # fmt: skip
    """Per-block error of one candidate, summed in TE's order: along the 16 elements in index
    order, then (16x16 tiles) over the tile's 16 rows as the CUDA warp tree reduces them."""
    sf_rows = sf.repeat_interleave(ty, dim=0) if ty > 1 else sf  # [rows, nc, 1]
    err = torch.zeros(x.shape[:2], dtype=torch.float32, device=x.device)
    for i in range(x.shape[2]):
        val = q[:, :, i] * sf_rows[:, :, 0]  # exact: E2M1 x E4M3
        val = torch.div(val * g_amax, denom)
        d = val - x[:, :, i]
        err = err + (d * d if mode == "mse" else d.abs())
    if ty == 1:
        return err
    rows = err.reshape(err.shape[0] // ty, ty, err.shape[1])
    while rows.shape[1] > 1:  # 16 -> 8 -> 4 -> 2 -> 1: row i + row i + half
        half = rows.shape[1] // 2
        rows = rows[:, :half] + rows[:, half:]
    return rows[:, 0]


def four_over_six_scales(
    x2: torch.Tensor,
    block_amax: torch.Tensor,
    block: tuple[int, int],
    mode: str,
    bound: float,
    row_scaled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ "4 over 6" block scales of a contiguous float32 ``[R, C]`` tensor: ``(enc, s_blk, s_dec)``.

    ``block``: (1, 16), (16, 16), or (16, 1) (done on the transpose, as TE quantizes its
    column-wise copy); ``block_amax``: its ``[nr, nc]`` amaxes; ``mode``: ``"mae"`` | ``"mse"``;
    ``bound``: the global E4M3 bound, 256 or 448. Per block (TE's reference, in FP32):

    1. ``g_enc = min(fl32(bound * 6) / g_amax, FLT_MAX)`` (1 at amax 0), ``g_dec = 1 / g_enc``;
       ``g_amax`` = the tensor's amax (or the row's: ``row_scaled``).
    2. ``base = fl32(block_amax / 6) * g_enc``; map-to-6 ``sf6 = e4m3(clamp(base, +-448))``,
       map-to-4 ``sf4 = e4m3(clamp(fl32(base * 1.5), +-448))`` (RNE).
    3. each candidate: ``enc = min(1 / fl32(sf * g_dec), FLT_MAX)``, ``q = e2m1(x * enc)``;
       error ``sum_i err(fl32(fl32(q_i * sf) * g_amax) / fl32(6 * bound) - x_i)`` with ``err``
       = ``|d|`` (``mae``) or ``d * d`` (``mse``), summed in FP32 in index order; a 16x16 tile
       sums its 16 row errors as a tree (row ``i`` + row ``i + 8``, then ``+ 4``, ``+ 2``,
       ``+ 1``).
    4. map-to-4 where its error is strictly smaller, else map-to-6 (ties to map-to-6).

    Ragged edges are zero-padded (zeros never win or lose a block). TE's fast-math error mode
    (the error in the FP16 product domain) is not simulated.
    """
    if not use_torch(x2, what="4over6 scales"):
        return _four_over_six_numba(x2, block_amax, block, mode, bound, row_scaled)
    if block[0] == 16 and block[1] == 1:
        enc, s_blk, s_dec = four_over_six_scales(
            x2.t().contiguous(), block_amax.t(), (1, 16), mode, bound, row_scaled
        )
        return enc.t(), s_blk.t(), s_dec.t() if s_dec.dim() == 2 else s_dec
    ty = block[0]
    r, c = x2.shape
    nr, nc = block_amax.shape
    xp = x2
    if (nr * ty, nc * 16) != (r, c):
        xp = x2.new_zeros((nr * ty, nc * 16))
        xp[:r, :c] = x2
    x = xp.reshape(nr * ty, nc, 16)
    g_amax = second_level_amax(block_amax, (1, 16), row_scaled)  # [nr, 1] rows when row-scaled
    g_enc, g_dec = _global_scales(g_amax, bound)
    six = torch.tensor(_E2M1_MAX, dtype=torch.float32, device=x2.device)
    base = (torch.div(block_amax, six) * g_enc)[:, :, None]  # [nr, nc, 1]
    g_dec3 = g_dec[:, :, None] if g_dec.dim() == 2 else g_dec
    sf6, enc6, q6 = _candidate(x, base, g_dec3)
    sf4, enc4, q4 = _candidate(x, base * 1.5, g_dec3)
    denom = torch.tensor(_E2M1_MAX * bound, dtype=torch.float32, device=x2.device)
    # the error's global amax per element row ([rows, 1]; row-scaled specs have 1x16 blocks)
    ga = g_amax if g_amax.dim() == 0 else g_amax.reshape(-1, 1)
    e6 = _errors(q6, sf6, x, ga, denom, mode, ty)
    e4 = _errors(q4, sf4, x, ga, denom, mode, ty)
    pick4 = (e4 < e6)[:, :, None]
    s_blk = torch.where(pick4, sf4, sf6)[:, :, 0]
    enc = torch.where(pick4, enc4, enc6)[:, :, 0]
    return enc, s_blk, g_dec


def _four_over_six_numba(
    x2: torch.Tensor, block_amax: torch.Tensor, block: tuple[int, int], mode: str, bound: float,
    row_scaled: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """`four_over_six_scales` on the CPU: the same steps in one numba pass over the blocks
    (`_four_over_six_blocks`); a 16x1 block reads the transpose in place."""
    col = block[0] == 16 and block[1] == 1
    x = x2.t().numpy() if col else x2.numpy()
    amax = np.ascontiguousarray((block_amax.t() if col else block_amax).to(torch.float32).numpy())
    nr, nc = amax.shape
    ng = nr if row_scaled else 1
    enc = np.empty((nr, nc), dtype=np.float32)
    s_blk = np.empty((nr, nc), dtype=np.float32)
    g_dec = np.empty(ng, dtype=np.float32)
    _four_over_six_blocks(x, amax, 1 if col else block[0], mode == "mse", np.float32(bound),
                          row_scaled, _fast_params_for("e2m1", "nearest_even", True),
                          _fast_params_for("e4m3", "nearest_even", True), enc, s_blk, g_dec)  # fmt: skip
    enc_t, s_t = torch.from_numpy(enc), torch.from_numpy(s_blk)
    dec_t = torch.from_numpy(g_dec).reshape(nr, 1) if row_scaled else torch.from_numpy(g_dec)[0]
    if col:
        return enc_t.t(), s_t.t(), dec_t.t() if row_scaled else dec_t
    return enc_t, s_t, dec_t


@njit(cache=True, error_model="numpy")
def _four_over_six_blocks(
    x, amax, ty, mse, bound, row_scaled, g2, g4, enc, s_blk, g_dec
):  # pragma: no cover
    """`four_over_six_scales`' steps 1-4 per block of ``x`` ``[R, C]`` (any strides) with
    ``ty`` x 16 blocks, each float32 operation of the torch version rounded once in the same
    order (`_rne_sat`: the RNE + saturate casts onto E2M1 ``g2`` and E4M3 ``g4``)."""
    rows, cols = x.shape
    nr, nc = amax.shape
    flt_max = np.float32(3.4028234663852886e38)
    one = np.float32(1.0)
    six = np.float32(6.0)
    top = np.float32(bound * six)  # fl32(bound * 6), exact
    smax = np.float32(448.0)
    errs = np.zeros((2, 16), dtype=np.float32)
    for gi in range(g_dec.shape[0]):
        g_dec[gi] = np.float32(0.0)
    for br in range(nr):  # the second-level amax: the tensor's or the block row's
        for cb in range(nc):
            gi = br if row_scaled else 0
            g_dec[gi] = max(g_dec[gi], amax[br, cb])
    g_amax = g_dec.copy()
    g_enc = np.empty_like(g_dec)
    for gi in range(g_dec.shape[0]):
        ga = g_amax[gi]
        ge = min(np.float32(top / ga), flt_max)
        if ga == np.float32(0.0) or ge == np.float32(0.0):
            ge = one
        g_enc[gi] = ge
        g_dec[gi] = np.float32(one / ge)
    for br in range(nr):
        gi = br if row_scaled else 0
        ga, ge, gd = g_amax[gi], g_enc[gi], g_dec[gi]
        for cb in range(nc):
            base = np.float32(np.float32(amax[br, cb] / six) * ge)
            best_sf = np.float32(0.0)
            best_enc = np.float32(0.0)
            for cand in range(2):  # 0: map-to-6, 1: map-to-4
                pre = base if cand == 0 else np.float32(base * np.float32(1.5))
                sf = _rne_sat(min(max(pre, -smax), smax), g4)
                e = min(np.float32(one / np.float32(sf * gd)), flt_max)
                for t in range(16):
                    errs[cand, t] = np.float32(0.0)
                for t in range(ty):
                    r = br * ty + t
                    acc = np.float32(0.0)
                    for i in range(16):
                        c = cb * 16 + i
                        # ragged edges: zeros, as the torch version pads (0 * an infinite
                        # second-level amax is NaN there too)
                        xv = x[r, c] if (r < rows and c < cols) else np.float32(0.0)
                        q = _rne_sat(np.float32(xv * e), g2)
                        val = np.float32(np.float32(np.float32(q * sf) * ga) / top)
                        d = np.float32(val - xv)
                        acc = np.float32(acc + (np.float32(d * d) if mse else abs(d)))
                    errs[cand, t] = acc
                half = ty // 2
                while half >= 1:  # a 16x16 tile: row i + row i + half, 8 -> 4 -> 2 -> 1
                    for t in range(half):
                        errs[cand, t] = np.float32(errs[cand, t] + errs[cand, t + half])
                    half //= 2
                if cand == 0 or errs[1, 0] < errs[0, 0]:
                    best_sf, best_enc = sf, e
            s_blk[br, cb] = best_sf
            enc[br, cb] = best_enc

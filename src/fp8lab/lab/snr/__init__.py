"""Dot-product SNR study: how FP8 dot products lose signal, and what fixes it.

The study follows the blog article "从DeepSeek V3看FP8训练的挑战" and its simfloat notebook
(the preset keeps its public name ``seed000``), extended to every fp8lab format and to the GEMM
accumulator models of `fp8lab.gemm`.

One *run* draws ``samples`` pairs of vectors ``a, b ~ N(0, sigma)`` of ``length`` elements, computes
each dot product once in float64 (the reference) and once through a low-precision pipeline, and
reports the per-sample SNR ``10*log10(ref**2 / (ref - result)**2)`` in dB.

The low-precision pipeline (all of it configurable in `SnrConfig`):

1. **Scale.** ``scaling`` is a fixed factor ``s`` (``a*s``, ``b*s``, result divided by ``s**2``) or
   ``"auto"``: per vector ``s = scale_target / amax`` (result divided by ``s_a * s_b``). With
   ``block=B`` every block of ``B`` elements of ``a`` and of ``b`` gets its own such scale.
   ``scale_target`` defaults to the element format's max. ``scale_rule`` swaps this float64
   rule for one of `fp8lab.scaling.rules` (``max``, ``pow2_down``, ``mx_floor``, ...).
2. **Quantise** the scaled elements to ``format`` with ``rounding`` (`fp8lab.cast`).
3. **Accumulate** with ``accumulator``:

   * a format (default: the element format, as the notebook did): every product is rounded to
     it, and the running sum is rounded after every addition (`sequential`); ``"fp64"`` is an
     exact float64 accumulator (isolates the element quantisation);
   * a GEMM accumulator model of `fp8lab.gemm` (``"limited"``, or a GPU name such as ``"h100"``
     that `fp8lab.gemm.Accumulator.parse` accepts): each block / promotion chunk is summed as a
     tensor core sums one output element (`tensorcore`).
4. **Promote.** Every ``promote_every`` products the low-precision partial sum is added into a
   float64 total and reset (DeepSeek-V3's promotion to CUDA cores). With ``block``, each block's
   partial sum is de-scaled by its two block scales when it is promoted (that is where DeepSeek
   applies the scales), so promotion happens at least once per block: ``promote_every`` defaults to
   the block size and must be a multiple of it; a larger multiple adds the de-scaled block partials
   into the low-precision format accumulator (rounded) and promotes that every ``promote_every``
   elements (a GEMM model needs ``promote_every`` equal to the block).

Correlated vectors: ``correlation_model="exact"`` draws ``b = rho*z1 + sqrt(1-rho**2)*z2`` (so
``corr(a, b) = rho`` and ``b`` has the same law as ``a``); ``"simple"`` is the notebook's generator
``b = rho*z1 + (1-rho)*z2`` whose realised correlation is ``rho / sqrt(rho**2 + (1-rho)**2)``.

Infinite SNR: a result equal to the reference gives ``+inf`` (kept as such in `SnrResult.snr_db`;
`SnrResult.to_json` writes ``null`` for it, and plots draw it at `PLOT_CAP_DB`).

Modules: `config` (`SnrConfig`), `result` (`SnrResult`, `snr_db`, `quantile`), `casts`, `engine`
(`run_many`, `run`, `sweep`, `generate_vectors`), `sequential`, `tensorcore`, `presets`
(``preset("seed000")`` lists every figure of the study as `Figure` objects; `fp8lab.report.snr`
draws them). The lab never imports the report layer.
"""

from fp8lab.lab.snr.casts import Rounder, cast_array, make_rounder
from fp8lab.lab.snr.config import (
    CORRELATION_MODELS,
    EXACT_ACCUMULATOR,
    PLOT_CAP_DB,
    SCALE_RULE_CHOICES,
    SnrConfig,
    is_model_accumulator,
)
from fp8lab.lab.snr.engine import generate_vectors, run, run_many, sweep
from fp8lab.lab.snr.presets import PRESETS, Figure, Panel, Preset, preset
from fp8lab.lab.snr.result import SnrResult, quantile, snr_db

__all__ = [
    "CORRELATION_MODELS",
    "EXACT_ACCUMULATOR",
    "PLOT_CAP_DB",
    "PRESETS",
    "SCALE_RULE_CHOICES",
    "Figure",
    "Panel",
    "Preset",
    "Rounder",
    "SnrConfig",
    "SnrResult",
    "cast_array",
    "generate_vectors",
    "is_model_accumulator",
    "make_rounder",
    "preset",
    "quantile",
    "run",
    "run_many",
    "snr_db",
    "sweep",
]

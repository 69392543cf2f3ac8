"""Dot-product SNR study (seed 000): how FP8 dot products lose signal, and what fixes it.

One *run* draws ``samples`` pairs of vectors ``a, b ~ N(0, sigma)`` of ``length`` elements, computes
each dot product once in float64 (the reference) and once through a low-precision pipeline, and
reports the per-sample SNR ``10*log10(ref**2 / (ref - result)**2)`` in dB.

The low-precision pipeline (all of it configurable in `SnrConfig`):

1. **Scale.** ``scaling`` is a fixed factor ``s`` (``a*s``, ``b*s``, result divided by ``s**2``) or
   ``"auto"``: per vector ``s = scale_target / amax`` (result divided by ``s_a * s_b``). With
   ``block=B`` every block of ``B`` elements of ``a`` and of ``b`` gets its own such scale.
   ``scale_target`` defaults to the element format's max.
2. **Quantise** the scaled elements to ``format`` with ``rounding`` (`fp8lab.cast`).
3. **Accumulate sequentially** in the ``accumulator`` format (default: the element format, as the
   seed did): every product is rounded to it, and the running sum is rounded after every addition.
   ``"fp64"`` means an exact float64 accumulator (isolates the element quantisation).
4. **Promote.** Every ``promote_every`` products the low-precision partial sum is added into a
   float64 total and reset (DeepSeek-V3's promotion to CUDA cores). With ``block``, each block's
   partial sum is de-scaled by its two block scales when it is promoted (that is where DeepSeek
   applies the scales), so promotion happens at least once per block: ``promote_every`` defaults to
   the block size and must be a multiple of it; a larger multiple adds the de-scaled block partials
   into the low-precision accumulator (rounded) and promotes that every ``promote_every`` elements.

Correlated vectors: ``correlation_model="exact"`` draws ``b = rho*z1 + sqrt(1-rho**2)*z2`` (so
``corr(a, b) = rho`` and ``b`` has the same law as ``a``); ``"simple"`` is the seed's generator
``b = rho*z1 + (1-rho)*z2`` whose realised correlation is ``rho / sqrt(rho**2 + (1-rho)**2)``.

Vectorised across samples: products do not depend on the running sum, so they are rounded to
the accumulator in one cast; the only Python loop is the sequential sum over the vector length,
one `fp8lab.cast` per element on ``[configs*samples]``-sized vectors with a preallocated ``out=``
buffer. Configurations of one `run_many` call sharing the length, sample count and accumulator are
stacked into one such loop; vectors are drawn once per ``(seed, length, sigma, rho, model)``.

Infinite SNR: a result equal to the reference gives ``+inf`` (kept as such in `SnrResult.snr_db`;
`SnrResult.to_json` writes ``null`` for it, and plots draw it at `PLOT_CAP_DB`).

``preset("seed000")`` lists every figure of seed 000 as `Figure` objects (``"seed000-asrun"``:
as the seed's notebook actually ran them, bugs included); `fp8lab.report.snr` draws them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch

from fp8lab.formats import get_format

#: plots draw infinite SNR (an exact result) at this value; JSON writes null instead
PLOT_CAP_DB = 150.0

CORRELATION_MODELS = ("exact", "simple")
EXACT_ACCUMULATOR = "fp64"


# --------------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class SnrConfig:
    """One point of the study. Validated on construction (``ValueError`` naming the field).

    Attributes:
        length: vector length (elements); with ``block`` a multiple of it.
        samples: number of vector pairs (dot products).
        seed: RNG seed; runs with the same ``(seed, samples, length, sigma)`` share ``z1, z2``.
        sigma: standard deviation of the vector elements.
        rho: correlation parameter in ``[0, 1)``.
        correlation_model: ``"exact"`` or ``"simple"`` (see the module docstring).
        format: element format name (any fp8lab format).
        rounding: rounding mode of the element cast.
        scaling: ``"auto"`` or a fixed positive factor.
        block: per-block dynamic scaling block size, or None.
        scale_target: value the (block) amax is mapped to; None = the format's max.
        accumulator: accumulator format name; None = the element format; ``"fp64"`` = exact.
        acc_rounding: rounding of the accumulator; None = ``rounding``.
        promote_every: promotion interval in elements, or None (no promotion; with ``block``: the
            block size).
        saturate: clamp overflow to +-max (else Inf/NaN as the format defines).
    """

    length: int = 1024
    samples: int = 200
    seed: int = 0
    sigma: float = 0.01
    rho: float = 0.0
    correlation_model: str = "exact"
    format: str = "e4m3"
    rounding: str = "nearest_even"
    scaling: float | str = "auto"
    block: int | None = None
    scale_target: float | None = None
    accumulator: str | None = None
    acc_rounding: str | None = None
    promote_every: int | None = None
    saturate: bool = True

    def __post_init__(self) -> None:
        _positive_int("length", self.length)
        _positive_int("samples", self.samples)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise TypeError(f"seed must be an int, got {self.seed!r}")
        if not (
            isinstance(self.sigma, int | float) and math.isfinite(self.sigma) and self.sigma > 0
        ):
            raise ValueError(f"sigma must be a positive finite number, got {self.sigma!r}")
        if not (isinstance(self.rho, int | float) and 0.0 <= self.rho < 1.0):
            raise ValueError(f"rho must be in [0, 1), got {self.rho!r}")
        if self.correlation_model not in CORRELATION_MODELS:
            raise ValueError(
                f"correlation_model must be one of {CORRELATION_MODELS}, "
                f"got {self.correlation_model!r}"
            )
        fmt = get_format(self.format)  # raises ValueError listing the valid names
        if self.scaling != "auto":
            if isinstance(self.scaling, bool) or not isinstance(self.scaling, int | float):
                raise ValueError(f"scaling must be 'auto' or a number, got {self.scaling!r}")
            if not (math.isfinite(self.scaling) and self.scaling > 0):
                raise ValueError(f"scaling must be positive and finite, got {self.scaling!r}")
            object.__setattr__(self, "scaling", float(self.scaling))
        if self.block is not None:
            _positive_int("block", self.block)
            if self.scaling != "auto":
                raise ValueError(
                    f"a fixed scaling ({self.scaling:g}) cannot be combined with block={self.block}: "
                    "block scaling is dynamic (each block's amax maps to scale_target); "
                    "use scaling='auto' or drop block"
                )
            if self.length % self.block:
                raise ValueError(f"length {self.length} is not divisible by block {self.block}")
        if self.scale_target is not None:
            st = self.scale_target
            if not (isinstance(st, int | float) and math.isfinite(st) and st > 0):
                raise ValueError(f"scale_target must be positive and finite, got {st!r}")
            if st > fmt.max:
                raise ValueError(f"scale_target {st:g} exceeds the max of {fmt.name} ({fmt.max:g})")
            object.__setattr__(self, "scale_target", float(st))
        if self.accumulator is not None and self.accumulator != EXACT_ACCUMULATOR:
            get_format(self.accumulator)
        if self.promote_every is not None:
            _positive_int("promote_every", self.promote_every)
            if self.block is not None and self.promote_every % self.block:
                raise ValueError(
                    f"promote_every {self.promote_every} must be a multiple of block {self.block}"
                )
        elif self.block is not None:
            object.__setattr__(self, "promote_every", self.block)
        from fp8lab.formats import ROUNDING_MODES

        for name in ("rounding", "acc_rounding"):
            mode = getattr(self, name)
            if mode is not None and mode not in ROUNDING_MODES:
                raise ValueError(f"unknown {name} {mode!r}; valid: {', '.join(ROUNDING_MODES)}")

    # resolved views -------------------------------------------------------------------------
    @property
    def accumulator_name(self) -> str:
        return self.accumulator if self.accumulator is not None else get_format(self.format).name

    @property
    def accumulator_rounding(self) -> str:
        """``acc_rounding``, else the element rounding (HiF8's ``hybrid`` only on HiF8, else
        ``nearest_even``)."""
        if self.acc_rounding is not None:
            return self.acc_rounding
        if self.rounding == "hybrid" and self.accumulator_name != "hif8":
            return "nearest_even"
        return self.rounding

    @property
    def target(self) -> float:
        if self.scale_target is not None:
            return self.scale_target
        return float(get_format(self.format).max)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict with the defaults resolved (accumulator, scale_target, acc_rounding)."""
        d = asdict(self)
        d["accumulator"] = self.accumulator_name
        d["scale_target"] = self.target
        d["acc_rounding"] = self.accumulator_rounding
        d["format"] = get_format(self.format).name
        return d


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")


# --------------------------------------------------------------------------------------- result
@dataclass
class SnrResult:
    """Per-sample outcome of one `SnrConfig`.

    ``snr_db``: float64 [samples], ``+inf`` where the result is exact. ``reference``/``result``:
    the float64 reference dot products and the low-precision results, [samples].
    """

    config: SnrConfig
    snr_db: np.ndarray
    reference: np.ndarray
    result: np.ndarray
    #: fraction of samples with at least one product clamped at the accumulator's max (or
    #: overflowed): a sign that the scale target is too high for the accumulator format
    acc_overflow_fraction: float = 0.0

    @property
    def median_db(self) -> float:
        return quantile(self.snr_db, 0.5)

    @property
    def p10_db(self) -> float:
        return quantile(self.snr_db, 0.1)

    @property
    def p90_db(self) -> float:
        return quantile(self.snr_db, 0.9)

    @property
    def below_0db_fraction(self) -> float:
        return float(np.mean(self.snr_db < 0.0))

    @property
    def exact_fraction(self) -> float:
        """Fraction of samples whose result equals the reference (infinite SNR)."""
        return float(np.mean(np.isposinf(self.snr_db)))

    @property
    def pooled_db(self) -> float:
        """Seed 000's pooled SNR: ``10*log10(sum(ref**2) / sum((ref - result)**2))``."""
        return snr_db(self.reference, self.result, pooled=True).item()

    def to_json(self, pooled: bool = False) -> dict[str, Any]:
        """The run as JSON-safe data: non-finite values (infinite SNR) become None."""
        out: dict[str, Any] = {
            "config": self.config.to_dict(),
            "median_db": _finite_or_none(self.median_db),
            "p10_db": _finite_or_none(self.p10_db),
            "p90_db": _finite_or_none(self.p90_db),
            "below_0db_fraction": self.below_0db_fraction,
            "snr_db": [_finite_or_none(v) for v in self.snr_db.tolist()],
        }
        if pooled:
            out["pooled_db"] = _finite_or_none(self.pooled_db)
        return out


def _finite_or_none(v: float) -> float | None:
    return float(v) if math.isfinite(v) else None


def quantile(values: np.ndarray, q: float) -> float:
    """Linear-interpolation quantile that keeps ``+-inf`` meaningful (inf where it interpolates
    towards an infinite sample) instead of returning NaN."""
    v = np.sort(np.asarray(values, dtype=np.float64).ravel())
    if v.size == 0:
        return math.nan
    pos = q * (v.size - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    frac = pos - lo
    if frac == 0.0 or v[lo] == v[hi]:
        return float(v[lo])
    if not (math.isfinite(v[lo]) and math.isfinite(v[hi])):
        return float(v[hi]) if math.isinf(v[hi]) else float(v[lo])
    return float(v[lo] + (v[hi] - v[lo]) * frac)


def snr_db(reference: np.ndarray, result: np.ndarray, pooled: bool = False) -> np.ndarray:
    """SNR in dB of ``result`` against ``reference``, per element (or pooled over all elements).

    ``+inf`` where the error is 0 (also for a zero reference), ``-inf`` where only the reference
    is 0. Computed as ``20*log10(|ref|/|err|)`` so tiny values do not underflow when squared.
    """
    ref = np.asarray(reference, dtype=np.float64)
    err = ref - np.asarray(result, dtype=np.float64)
    if pooled:
        ref = np.sqrt(np.sum(ref * ref, keepdims=True))
        err = np.sqrt(np.sum(err * err, keepdims=True))
    with np.errstate(divide="ignore", invalid="ignore"):
        out = 20.0 * np.log10(np.abs(ref)) - 20.0 * np.log10(np.abs(err))
    out[err == 0] = math.inf
    return out


# ------------------------------------------------------------------------------------ rounding
Rounder = Callable[[np.ndarray], np.ndarray]


def _generator(seed: int) -> torch.Generator:
    # stochastic rounding draws from a generator seeded by the run, so runs are reproducible
    return torch.Generator().manual_seed(seed)


def make_rounder(fmt: str, rounding: str, saturate: bool, size: int, seed: int = 0) -> Rounder:
    """In-place rounding of a float64 [size] numpy array onto ``fmt`` (``"fp64"``: identity).

    Uses `fp8lab.cast` with a preallocated float32 ``out=`` buffer: float32 holds every value of
    the formats used here exactly, and the float64 input is rounded directly (no double rounding
    through float32). ``hybrid`` (HiF8) rounding follows its input dtype and gets float32.
    """
    if fmt == EXACT_ACCUMULATOR:
        return lambda x: x
    from fp8lab.formats import cast

    f = get_format(fmt)
    buf = torch.empty(size, dtype=torch.float32)
    buf_np = buf.numpy()
    gen = _generator(seed) if rounding == "stochastic" else None
    f32 = rounding == "hybrid"

    def rnd(x: np.ndarray) -> np.ndarray:
        t = torch.from_numpy(x)
        if f32:
            t = t.float()
        cast(t, f, rounding=rounding, saturate=saturate, generator=gen, out=buf)
        np.copyto(x, buf_np)
        return x

    return rnd


def cast_array(x: np.ndarray, fmt: str, rounding: str, saturate: bool, seed: int = 0) -> np.ndarray:
    """Round a float64 array of any shape onto ``fmt``; returns float64."""
    if fmt == EXACT_ACCUMULATOR:
        return x.copy()
    from fp8lab.formats import cast

    t = torch.from_numpy(np.ascontiguousarray(x))
    if rounding == "hybrid":
        t = t.float()
    gen = _generator(seed) if rounding == "stochastic" else None
    out = cast(t, get_format(fmt), rounding=rounding, saturate=saturate, generator=gen)
    return out.numpy().astype(np.float64)


# ------------------------------------------------------------------------------------- engine
def generate_vectors(config: SnrConfig) -> tuple[np.ndarray, np.ndarray]:
    """The float64 vectors ``a, b`` of shape [samples, length] for ``config`` (deterministic)."""
    rng = np.random.default_rng(config.seed)
    shape = (config.samples, config.length)
    z1 = rng.normal(0.0, config.sigma, size=shape)
    z2 = rng.normal(0.0, config.sigma, size=shape)
    rho = float(config.rho)
    if rho == 0.0:
        return z1, z2
    if config.correlation_model == "simple":
        return z1, rho * z1 + (1.0 - rho) * z2
    return z1, rho * z1 + math.sqrt(1.0 - rho * rho) * z2


def _scales(x: np.ndarray, config: SnrConfig) -> np.ndarray:
    """Quantisation multipliers: [samples, n_blocks] (n_blocks = 1 without block)."""
    samples, length = x.shape
    if config.scaling != "auto":
        return np.full((samples, 1), float(config.scaling))
    nblk = length // config.block if config.block else 1
    amax = np.abs(x.reshape(samples, nblk, -1)).max(axis=2)
    with np.errstate(divide="ignore"):
        s = config.target / amax
    # an all-zero block: nothing to scale, keep the multiplier finite
    s[~np.isfinite(s)] = 1.0
    return s


def _quantise(x: np.ndarray, s: np.ndarray, config: SnrConfig) -> np.ndarray:
    samples, length = x.shape
    nblk = s.shape[1]
    scaled = (x.reshape(samples, nblk, -1) * s[:, :, None]).reshape(samples, length)
    return cast_array(scaled, config.format, config.rounding, config.saturate, config.seed)


def _accumulate(
    prods: np.ndarray,
    sa: np.ndarray,
    sb: np.ndarray,
    configs: Sequence[SnrConfig],
) -> np.ndarray:
    """Sequential low-precision sums for a stack of configs sharing length and accumulator.

    prods: [length, n_cfg*samples] products already rounded to the accumulator (they do not depend
    on the running sum, so they are rounded in one vectorised cast); sa, sb: [n_cfg*samples, n_blk]
    scale multipliers (block scales; unblocked configs use column 0). Returns the de-scaled
    float64 results [n_cfg*samples].
    """
    first = configs[0]
    length, rows = prods.shape
    samples = first.samples
    rnd = make_rounder(
        first.accumulator_name,
        first.accumulator_rounding,
        first.saturate,
        rows,
        first.seed + 2,
    )

    # per row: block size (0 = unblocked) and promotion interval (0 = only at the end)
    blk = np.repeat([c.block or 0 for c in configs], samples)
    prom = np.repeat([c.promote_every or 0 for c in configs], samples)
    blocked = blk > 0
    any_blocked = bool(blocked.any())
    descale_direct = blocked & (prom == blk)  # a block partial goes straight into float64
    descale_outer = blocked & (prom != blk)  # ... or into a low-precision sum of partials

    total = np.zeros(rows)  # float64 promotion target
    part = np.zeros(rows)  # running low-precision sum (current block / promotion chunk)
    outer = np.zeros(rows)  # low-precision sum of de-scaled block partials
    tmp = np.zeros(rows)

    # only the interval sizes that occur need a test per element
    intervals = sorted({int(v) for v in np.concatenate([blk, prom]) if v > 0})
    blk_masks = {n: blk == n for n in intervals}
    prom_masks = {n: prom == n for n in intervals}

    for j in range(length):
        part += prods[j]
        rnd(part)
        count = j + 1
        last = count == length
        ends = [n for n in intervals if count % n == 0]
        if not ends and not last:
            continue
        blk_end = np.zeros(rows, dtype=bool)
        prom_end = np.ones(rows, dtype=bool) if last else np.zeros(rows, dtype=bool)
        for n in ends:
            blk_end |= blk_masks[n]
            prom_end |= prom_masks[n]
        if any_blocked:
            m = blk_end & blocked
            if m.any():
                idx = np.nonzero(m)[0]
                k = (count - 1) // blk[idx]  # index of the block that just ended
                d = part[idx] / (sa[idx, k] * sb[idx, k])
                direct = descale_direct[idx]
                total[idx[direct]] += d[direct]
                o = idx[~direct]
                if o.size:
                    np.copyto(tmp, outer)
                    tmp[o] += d[~direct]
                    rnd(tmp)
                    outer[o] = tmp[o]
                part[idx] = 0.0
            m = prom_end & descale_outer
            if m.any():
                total[m] += outer[m]
                outer[m] = 0.0
        m = prom_end & ~blocked
        if m.any():
            total[m] += part[m]
            part[m] = 0.0

    # unblocked rows: undo the (per-vector or fixed) scale once
    ub = ~blocked
    total[ub] /= sa[ub, 0] * sb[ub, 0]
    return total


def _stack_key(c: SnrConfig) -> tuple:
    return (c.length, c.samples, c.accumulator_name, c.accumulator_rounding, c.saturate)


@contextlib.contextmanager
def _numba_threads(n: int) -> Iterator[None]:
    """Run numba kernels with ``n`` threads inside the block (restored afterwards)."""
    import numba

    old = numba.get_num_threads()
    numba.set_num_threads(min(n, old))
    try:
        yield
    finally:
        numba.set_num_threads(old)


def run_many(
    configs: Iterable[SnrConfig],
    progress: Callable[[int], None] | None = None,
) -> list[SnrResult]:
    """Run several configs (duplicates computed once); results in input order.

    Configs sharing the length, sample count and accumulator are stacked into one sequential
    loop. ``progress(n)`` is called with the number of configs finished after each stack.
    """
    # The loop makes thousands of casts of a few thousand elements: a parallel kernel's
    # fork/join costs more than the work (and stalls badly when the cores are shared).
    with _numba_threads(1):
        return _run_many(list(configs), progress)


def _run_many(configs: list[SnrConfig], progress: Callable[[int], None] | None) -> list[SnrResult]:
    unique = list(dict.fromkeys(configs))
    groups: dict[tuple, list[SnrConfig]] = {}
    for c in unique:
        groups.setdefault(_stack_key(c), []).append(c)
    done: dict[SnrConfig, SnrResult] = {}
    vec_cache: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
    for group in groups.values():
        first = group[0]
        n, length = first.samples, first.length
        acc = first.accumulator_name
        acc_rnd = first.accumulator_rounding
        dtype = np.float64 if acc == EXACT_ACCUMULATOR else np.float32
        prods = np.empty((length, n * len(group)), dtype=dtype)
        nblk_max = max(length // c.block if c.block else 1 for c in group)
        sa_all = np.ones((n * len(group), nblk_max))
        sb_all = np.ones_like(sa_all)
        refs: list[np.ndarray] = []
        overflow: list[float] = []
        for i, c in enumerate(group):
            key = (
                c.seed,
                c.samples,
                c.length,
                c.sigma,
                c.rho,
                c.correlation_model if c.rho else "",
            )
            if key not in vec_cache:
                vec_cache = {k: v for k, v in vec_cache.items() if k[2] == length}
                vec_cache[key] = generate_vectors(c)
            a, b = vec_cache[key]
            sa, sb = _scales(a, c), _scales(b, c)
            rows = slice(i * n, (i + 1) * n)
            sa_all[rows, : sa.shape[1]] = sa
            sb_all[rows, : sb.shape[1]] = sb
            # E4M3 x E4M3 products are exact in float64; round each to the accumulator once
            p = _quantise(a, sa, c) * _quantise(b, sb, c)
            pq = cast_array(p, acc, acc_rnd, c.saturate, c.seed + 1)
            prods[:, rows] = pq.T
            refs.append(np.einsum("ij,ij->i", a, b))
            if acc != EXACT_ACCUMULATOR:
                amax_acc = get_format(acc).max
                over = ~np.isfinite(pq) | ((np.abs(pq) >= amax_acc) & (np.abs(p) > amax_acc))
                overflow.append(float(np.mean(over.any(axis=1))))
            else:
                overflow.append(0.0)
        res = _accumulate(prods, sa_all, sb_all, group)
        for i, c in enumerate(group):
            out = res[i * n : (i + 1) * n].copy()
            done[c] = SnrResult(c, snr_db(refs[i], out), refs[i], out, overflow[i])
        if progress is not None:
            progress(len(group))
    return [done[c] for c in configs]


def run(config: SnrConfig) -> SnrResult:
    """Run one configuration."""
    return run_many([config])[0]


def sweep(base: SnrConfig, **axes: Sequence[Any]) -> list[SnrConfig]:
    """Cartesian product of ``base`` with every ``field=[values...]`` given (field order kept)."""
    configs = [base]
    for name, values in axes.items():
        if name not in SnrConfig.__dataclass_fields__:
            raise ValueError(f"unknown SnrConfig field {name!r}")
        values = list(values)
        if not values:
            raise ValueError(f"empty sweep for {name!r}")
        configs = [replace(c, **{name: v}) for c in configs for v in values]
    return configs


# --------------------------------------------------------------------------------------- preset
@dataclass(frozen=True)
class Panel:
    """One histogram panel: overlaid series ``(legend label, config)``."""

    title: str
    series: tuple[tuple[str, SnrConfig], ...]


@dataclass(frozen=True)
class Figure:
    """One figure of a preset: a row of panels, written as ``<name>.png``."""

    name: str
    title: str
    panels: tuple[Panel, ...]
    notes: str = ""
    #: what the histograms show: ``"snr_db"`` or ``"abs_error"`` (|reference - result|)
    metric: str = "snr_db"

    def configs(self) -> list[SnrConfig]:
        return [c for p in self.panels for _, c in p.series]


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    figures: tuple[Figure, ...] = field(default_factory=tuple)

    def configs(self) -> list[SnrConfig]:
        return list(dict.fromkeys(c for f in self.figures for c in f.configs()))


PRESETS = ("seed000", "seed000-asrun")


def preset(name: str, samples: int = 200, seed: int = 0) -> Preset:
    """A named study. ``"seed000"``: every figure of seed 000 at its stated lengths and
    semantics. ``"seed000-asrun"``: the same figures as the seed's v2 notebook actually ran them,
    bugs included: its "4096" (and "2048") vectors have length 1024 (a separate draw), and its
    block-scaling "chunk=none" used chunk 128 (blocks longer than the vector become one block).
    See the README's numerics-lab section."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; valid: {', '.join(PRESETS)}")
    as_run = name == "seed000-asrun"

    def at(c: SnrConfig, n: int) -> SnrConfig:
        """``c`` at the stated length ``n`` (as run: 4096 -> a separate draw of length 1024)."""
        if as_run and n in (2048, 4096):
            return replace(c, length=1024, seed=c.seed + n)
        return replace(c, length=n)

    # The seed's experiment: IEEE-style E4M3 (max 240), ties away from zero, an E4M3 accumulator
    # for the scaling/promotion studies, an E8M8 accumulator and target 224 for block scaling.
    base = SnrConfig(
        samples=samples,
        seed=seed,
        sigma=0.01,
        format="e4m3-ieee",
        rounding="nearest_away",
        correlation_model="simple",
    )
    te = replace(base, scaling=64.0)  # tensor-wise fixed scale, E4M3 accumulator
    ds = replace(base, scale_target=224.0, accumulator="e8m8")  # dynamic scaling, E8M8 acc
    lengths = (128, 1024, 4096)
    rhos = (0.0, 0.01, 0.1, 0.2)

    def blocks_for(n: int) -> list[tuple[str, SnrConfig]]:
        c = at(ds, n)
        if as_run:  # chunksize=None meant 128; a chunk longer than the vector is the vector
            return [("chunk=none", replace(c, block=min(128, c.length)))] + [
                (f"chunk={b}", replace(c, block=min(b, c.length))) for b in (512, 128, 64)
            ]
        out = [("chunk=none", c)]
        out += [(f"chunk={b}", replace(c, block=b)) for b in (512, 128, 64) if b <= n]
        return out

    scaling_panels = tuple(
        Panel(
            f"size={n}",
            tuple((f"scaling={s:g}", replace(at(base, n), scaling=s)) for s in (1.0, 64.0, 128.0)),
        )
        for n in lengths
    )
    correlation_panels = tuple(
        Panel(f"size={n}", tuple((f"rho={r:g}", replace(at(te, n), rho=r)) for r in rhos))
        for n in lengths
    )
    figs = [
        Figure(
            "fig1_error_scaling",
            "|error| vs tensor-wise scaling factor (E4M3 products and sum)",
            scaling_panels,
            metric="abs_error",
        ),
        Figure(
            "fig2_scaling",
            "Tensor-wise scaling factor (E4M3 products and sum)",
            scaling_panels,
        ),
        Figure(
            "fig3_promotion",
            "Chunked high-precision accumulation (scaling 64)",
            tuple(
                Panel(
                    f"size={n}",
                    tuple(
                        (
                            f"chunk={'none' if p is None else p}",
                            replace(at(te, n), promote_every=p),
                        )
                        for p in (None, 512, 128)
                    ),
                )
                for n in lengths
            ),
        ),
        Figure(
            "fig4_block_scaling",
            "Block-wise dynamic scaling (E8M8 accumulator, target 224)",
            tuple(Panel(f"size={n}", tuple(blocks_for(n))) for n in lengths),
        ),
        Figure(
            "fig5_steps",
            "From tensor-wise scaling to the DeepSeek-V3 recipe",
            tuple(
                Panel(
                    f"size={n}",
                    (
                        ("scaling=1", replace(at(base, n), scaling=1.0)),
                        ("scaling=64", at(te, n)),
                        ("+promote 128", replace(at(te, n), promote_every=128)),
                        ("+block 128 (E8M8)", replace(at(ds, n), block=128)),
                    ),
                )
                for n in (1024, 4096)
            ),
        ),
        Figure(
            "fig6_error_correlation",
            "|error| vs vector correlation rho (scaling 64, E4M3 products and sum)",
            correlation_panels,
            metric="abs_error",
        ),
        Figure(
            "fig7_correlation",
            "Vector correlation rho (scaling 64, E4M3 products and sum)",
            correlation_panels,
        ),
        Figure(
            "fig8_correlation_promotion",
            "Correlation x chunked accumulation (size 4096, scaling 64)",
            tuple(
                Panel(
                    f"rho={r:g}",
                    tuple(
                        (
                            f"chunk={'none' if p is None else p}",
                            replace(at(te, 4096), rho=r, promote_every=p),
                        )
                        for p in (None, 512, 128)
                    ),
                )
                for r in rhos
            ),
        ),
        Figure(
            "fig9_correlation_block_scaling",
            "Correlation x block-wise scaling (size 4096, E8M8 accumulator)",
            tuple(
                Panel(
                    f"rho={r:g}",
                    tuple(
                        (label, replace(c, rho=r))
                        for label, c in blocks_for(4096)
                        if label != "chunk=64"
                    ),
                )
                for r in rhos
            ),
        ),
    ]
    desc = "Seed 000: FP8 dot-product SNR vs length, scaling, promotion, block scaling, correlation"
    if as_run:
        desc += " (as the v2 notebook ran it: 'size=4096' is length 1024, chunk=none is 128)"
    return Preset(name, desc, tuple(figs))

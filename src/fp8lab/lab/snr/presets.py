"""Named studies: every figure of the dot-product SNR study of the blog article
"从DeepSeek V3看FP8训练的挑战" and its simfloat notebook, as `Figure` objects.

``preset("seed000")`` (the public name is kept) draws the article's figures at their stated
lengths and semantics; ``"seed000-asrun"`` draws them as the notebook actually ran them, bugs
included. `fp8lab.report.snr` draws them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from fp8lab.lab.snr.config import SnrConfig

__all__ = ["PRESETS", "Figure", "Panel", "Preset", "preset"]

PRESETS = ("seed000", "seed000-asrun")

_LENGTHS = (128, 1024, 4096)
_RHOS = (0.0, 0.01, 0.1, 0.2)
_CHUNKS = (None, 512, 128)  # promotion intervals of the chunked-accumulation figures


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


@dataclass(frozen=True)
class _Study:
    """The article's three base pipelines and the length rule of one preset."""

    base: SnrConfig  # IEEE-style E4M3, ties away, the element format as accumulator
    as_run: bool

    @property
    def te(self) -> SnrConfig:
        """Tensor-wise fixed scale 64, E4M3 accumulator."""
        return replace(self.base, scaling=64.0)

    @property
    def ds(self) -> SnrConfig:
        """Dynamic scaling to 224 with an E8M8 accumulator (the block-scaling figures)."""
        return replace(self.base, scale_target=224.0, accumulator="e8m8")

    def at(self, c: SnrConfig, n: int) -> SnrConfig:
        """``c`` at the stated length ``n`` (as run: 4096 -> a separate draw of length 1024)."""
        if self.as_run and n in (2048, 4096):
            return replace(c, length=1024, seed=c.seed + n)
        return replace(c, length=n)

    def blocks_for(self, n: int) -> list[tuple[str, SnrConfig]]:
        c = self.at(self.ds, n)
        if self.as_run:  # chunksize=None meant 128; a chunk longer than the vector is the vector
            return [("chunk=none", replace(c, block=min(128, c.length)))] + [
                (f"chunk={b}", replace(c, block=min(b, c.length))) for b in (512, 128, 64)
            ]
        out = [("chunk=none", c)]
        out += [(f"chunk={b}", replace(c, block=b)) for b in (512, 128, 64) if b <= n]
        return out

    def promotion_series(self, c: SnrConfig) -> tuple[tuple[str, SnrConfig], ...]:
        return tuple(
            (f"chunk={'none' if p is None else p}", replace(c, promote_every=p)) for p in _CHUNKS
        )


def _scaling_and_correlation(s: _Study) -> list[Figure]:
    scaling_panels = tuple(
        Panel(
            f"size={n}",
            tuple(
                (f"scaling={f:g}", replace(s.at(s.base, n), scaling=f)) for f in (1.0, 64.0, 128.0)
            ),
        )
        for n in _LENGTHS
    )
    correlation_panels = tuple(
        Panel(f"size={n}", tuple((f"rho={r:g}", replace(s.at(s.te, n), rho=r)) for r in _RHOS))
        for n in _LENGTHS
    )
    return [
        Figure(
            "fig1_error_scaling",
            "|error| vs tensor-wise scaling factor (E4M3 products and sum)",
            scaling_panels,
            metric="abs_error",
        ),
        Figure(
            "fig2_scaling", "Tensor-wise scaling factor (E4M3 products and sum)", scaling_panels
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
    ]


def _fixes(s: _Study) -> list[Figure]:
    steps = tuple(
        Panel(
            f"size={n}",
            (
                ("scaling=1", replace(s.at(s.base, n), scaling=1.0)),
                ("scaling=64", s.at(s.te, n)),
                ("+promote 128", replace(s.at(s.te, n), promote_every=128)),
                ("+block 128 (E8M8)", replace(s.at(s.ds, n), block=128)),
            ),
        )
        for n in (1024, 4096)
    )
    return [
        Figure(
            "fig3_promotion",
            "Chunked high-precision accumulation (scaling 64)",
            tuple(Panel(f"size={n}", s.promotion_series(s.at(s.te, n))) for n in _LENGTHS),
        ),
        Figure(
            "fig4_block_scaling",
            "Block-wise dynamic scaling (E8M8 accumulator, target 224)",
            tuple(Panel(f"size={n}", tuple(s.blocks_for(n))) for n in _LENGTHS),
        ),
        Figure("fig5_steps", "From tensor-wise scaling to the DeepSeek-V3 recipe", steps),
        Figure(
            "fig8_correlation_promotion",
            "Correlation x chunked accumulation (size 4096, scaling 64)",
            tuple(
                Panel(f"rho={r:g}", s.promotion_series(replace(s.at(s.te, 4096), rho=r)))
                for r in _RHOS
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
                        for label, c in s.blocks_for(4096)
                        if label != "chunk=64"
                    ),
                )
                for r in _RHOS
            ),
        ),
    ]


_ORDER = (
    "fig1_error_scaling",
    "fig2_scaling",
    "fig3_promotion",
    "fig4_block_scaling",
    "fig5_steps",
    "fig6_error_correlation",
    "fig7_correlation",
    "fig8_correlation_promotion",
    "fig9_correlation_block_scaling",
)


def preset(name: str, samples: int = 200, seed: int = 0) -> Preset:
    """A named study. ``"seed000"``: every figure of the dot-product SNR study of
    "从DeepSeek V3看FP8训练的挑战" (blog article with its simfloat notebook) at its stated lengths
    and semantics. ``"seed000-asrun"``: the same figures as the notebook actually ran them, bugs
    included: its "4096" (and "2048") vectors have length 1024 (a separate draw), and its
    block-scaling "chunk=none" used chunk 128 (blocks longer than the vector become one block).
    See docs/numerics-lab.md."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; valid: {', '.join(PRESETS)}")
    as_run = name == "seed000-asrun"
    # The notebook's experiment: IEEE-style E4M3 (max 240), ties away from zero, an E4M3
    # accumulator for the scaling/promotion studies, E8M8 and target 224 for block scaling.
    base = SnrConfig(
        samples=samples,
        seed=seed,
        sigma=0.01,
        format="e4m3-ieee",
        rounding="nearest_away",
        correlation_model="simple",
    )
    study = _Study(base, as_run)
    by_name = {f.name: f for f in _scaling_and_correlation(study) + _fixes(study)}
    desc = (
        "FP8 dot-product SNR vs length, scaling, promotion, block scaling, correlation (the study "
        'of "从DeepSeek V3看FP8训练的挑战" and its simfloat notebook)'
    )
    if as_run:
        desc += " (as the notebook ran it: 'size=4096' is length 1024, chunk=none is 128)"
    return Preset(name, desc, tuple(by_name[n] for n in _ORDER))

"""Figures and tables of the dot-product SNR study (`fp8lab.lab.snr`).

Histograms follow the figures of the blog article "从DeepSeek V3看FP8训练的挑战" (its simfloat
notebook): one panel per vector length (or rho), the series of a panel drawn as side-by-side
bars over shared bins, SNR in dB on the x axis, sample counts on the y axis.
Infinite SNR (an exact result) is drawn at `fp8lab.lab.snr.PLOT_CAP_DB` and noted in the panel.
The report reads the lab's results; the lab never imports this module.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from fp8lab.lab.snr import PLOT_CAP_DB, Figure, Preset, SnrConfig, SnrResult

Series = Sequence[tuple[str, SnrResult]]


def fmt_db(v: float) -> str:
    """``12.34``, ``inf`` or ``-inf`` (``nan`` for no data)."""
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return f"{v:.2f}"


def _plot_values(r: SnrResult, metric: str = "snr_db") -> np.ndarray:
    if metric == "abs_error":
        return np.abs(r.reference - r.result)
    if metric != "snr_db":
        raise ValueError(f"unknown metric {metric!r}; valid: snr_db, abs_error")
    v = np.array(r.snr_db, dtype=np.float64)
    v[np.isposinf(v)] = PLOT_CAP_DB
    v[np.isneginf(v)] = -PLOT_CAP_DB
    return v


def plot_panels(
    panels: Sequence[tuple[str, Series]],
    path: str | Path,
    title: str = "",
    bins: int = 20,
    metric: str = "snr_db",
) -> Path:
    """Write a row of histogram panels ``[(panel title, [(label, result), ...]), ...]`` as PNG.

    ``metric``: ``"snr_db"`` (per-sample SNR) or ``"abs_error"`` (``|reference - result|``, as
    in the article's first figures)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    if not panels:
        raise ValueError("nothing to plot: no panels")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = len(panels)
    fig, axes = plt.subplots(1, n, figsize=(5.5 * n, 3.6), squeeze=False)
    for ax, (ptitle, series) in zip(axes[0], panels, strict=True):
        data = [_plot_values(r, metric) for _, r in series]
        if metric == "snr_db":
            labels = [f"{lab} (med {fmt_db(r.median_db)})" for lab, r in series]
            n_exact = sum(int(np.isposinf(r.snr_db).sum()) for _, r in series)
            note = f"  [{n_exact} exact at {PLOT_CAP_DB:g} dB]" if n_exact else ""
        else:
            labels = [
                f"{lab} (med {np.median(d):.2e})" for (lab, _), d in zip(series, data, strict=True)
            ]
            note = ""
        ax.hist(data, bins=bins, label=labels)
        ax.set_title(ptitle + note, fontsize=10)
        ax.set_xlabel("SNR (dB)" if metric == "snr_db" else "|error| of the dot product")
        ax.set_ylabel("samples")
        if metric == "snr_db":
            ax.axvline(0.0, color="k", lw=0.6, ls=":")
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_figure(figure: Figure, results: Mapping[SnrConfig, SnrResult], path: str | Path) -> Path:
    """Draw one preset `Figure` from its results."""
    panels = [(p.title, [(lab, results[c]) for lab, c in p.series]) for p in figure.panels]
    return plot_panels(panels, path, figure.title, metric=figure.metric)


def table_rows(preset: Preset, results: Mapping[SnrConfig, SnrResult]) -> list[dict[str, object]]:
    """One row per (figure, panel, series) of the SNR figures with the summary numbers (the
    |error| figures show the same runs)."""
    rows = []
    for f in preset.figures:
        if f.metric != "snr_db":
            continue
        for p in f.panels:
            for lab, c in p.series:
                r = results[c]
                rows.append(
                    {
                        "figure": f.name,
                        "panel": p.title,
                        "series": lab,
                        "median_db": r.median_db,
                        "p10_db": r.p10_db,
                        "p90_db": r.p90_db,
                        "below_0db_fraction": r.below_0db_fraction,
                        "exact_fraction": r.exact_fraction,
                    }
                )
    return rows


def markdown_table(rows: Sequence[Mapping[str, object]]) -> str:
    """Markdown table of `table_rows` output."""
    out = [
        "| figure | panel | series | median dB | p10 dB | p90 dB | < 0 dB |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['figure']} | {r['panel']} | {r['series']} | {fmt_db(r['median_db'])} "
            f"| {fmt_db(r['p10_db'])} | {fmt_db(r['p90_db'])} "
            f"| {100 * float(r['below_0db_fraction']):.1f}% |"
        )
    return "\n".join(out) + "\n"


def write_preset_report(
    preset: Preset, results: Mapping[SnrConfig, SnrResult], out_dir: str | Path
) -> list[Path]:
    """Write every figure of ``preset`` as ``<out_dir>/<figure>.png`` and the summary table as
    ``<out_dir>/<preset>.md``; returns the written paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [plot_figure(f, results, out_dir / f"{f.name}.png") for f in preset.figures]
    md = out_dir / f"{preset.name}.md"
    md.write_text(f"# {preset.description}\n\n" + markdown_table(table_rows(preset, results)))
    written.append(md)
    return written

"""The `fp8lab observe-report` figure: underflow % and saturation % per layer over steps.

`heatmap_data` reduces `fp8lab.watch` records to one cell per (layer, step) and metric: the worst
operand of that layer (max over GEMM x role x call), with the operand that was worst and its
level (`fp8lab.observe.flag`: fine < 0.5 %, warning 0.5..4 %, critical > 4 %). `draw_png` draws
two heatmaps (matplotlib, no pyplot) with the warning cells outlined in orange and the critical
cells in red and marked ``!``; `write_html` embeds that PNG and a table of the flagged cells.
"""

from __future__ import annotations

import base64
import html
import io
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend
from matplotlib.patches import Rectangle

from fp8lab.observe import THRESHOLDS, flag

__all__ = ["METRICS", "draw_png", "heatmap_data", "write_html"]

METRICS = ("underflow_pct", "saturation_pct")
_TITLES = {"underflow_pct": "underflow %", "saturation_pct": "saturation %"}
_EDGE = {"warning": "#ff9900", "critical": "#d62728"}


def heatmap_data(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``{"layers", "steps", "thresholds", METRIC: [[value or None per step] per layer],
    "flags": [{layer, step, metric, value, level, worst}] for warning/critical cells}``."""
    layers = sorted({str(r["layer"]) for r in records})
    steps = sorted({int(r["step"]) for r in records})
    li = {n: i for i, n in enumerate(layers)}
    si = {s: j for j, s in enumerate(steps)}
    out: dict[str, Any] = {"layers": layers, "steps": steps, "thresholds": dict(THRESHOLDS)}
    worst: dict[str, list[list[str | None]]] = {}
    for m in METRICS:
        out[m] = [[None] * len(steps) for _ in layers]
        worst[m] = [[None] * len(steps) for _ in layers]
    for r in records:
        i, j = li[str(r["layer"])], si[int(r["step"])]
        for m in METRICS:
            v = r.get(m)
            if v is None or (isinstance(v, float) and math.isnan(v)):
                continue
            cur = out[m][i][j]
            if cur is None or v > cur:
                out[m][i][j] = float(v)
                worst[m][i][j] = f"{r['gemm']}/{r['role']}"
    flags = []
    for m in METRICS:
        for i, layer in enumerate(layers):
            for j, step in enumerate(steps):
                level = flag(out[m][i][j])
                if level in ("warning", "critical"):
                    flags.append({"layer": layer, "step": step, "metric": m,
                                  "value": out[m][i][j], "level": level,
                                  "worst": worst[m][i][j]})  # fmt: skip
    out["flags"] = flags
    return out


def _figure(data: dict[str, Any]) -> Figure:
    layers, steps = data["layers"], data["steps"]
    h = max(2.5, 0.35 * len(layers) + 1.5)
    w = min(18.0, max(5.0, 0.3 * len(steps) + 3.0))
    fig = Figure(figsize=(2 * w, h), layout="constrained")
    axes = fig.subplots(1, 2)
    for ax, m in zip(axes, METRICS, strict=True):
        grid = [[math.nan if v is None else v for v in row] for row in data[m]]
        # colour to 2x the critical threshold: everything beyond is equally alarming
        im = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=0.0,
                       vmax=2 * THRESHOLDS["critical_above_pct"], interpolation="nearest")  # fmt: skip
        fig.colorbar(im, ax=ax, label="%")
        ax.set_title(f"{_TITLES[m]} (worst operand per layer)")
        ax.set_xlabel("step")
        ax.set_ylabel("layer")
        stride = max(1, len(steps) // 20)
        ax.set_xticks(range(0, len(steps), stride))
        ax.set_xticklabels([str(s) for s in steps[::stride]], rotation=90)
        ax.set_yticks(range(len(layers)))
        ax.set_yticklabels(layers)
    lpos = {n: i for i, n in enumerate(layers)}
    spos = {s: j for j, s in enumerate(steps)}
    for f in data["flags"]:
        ax = axes[METRICS.index(f["metric"])]
        i, j = lpos[f["layer"]], spos[f["step"]]
        ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, lw=1.5,
                               edgecolor=_EDGE[f["level"]]))  # fmt: skip
        if f["level"] == "critical" and len(steps) <= 60:
            ax.text(j, i, "!", ha="center", va="center", color="white", fontweight="bold")
    t = THRESHOLDS
    fig.suptitle(f"fine < {t['fine_below_pct']} %, warning (orange) up to "
                 f"{t['critical_above_pct']} %, critical (red) above")  # fmt: skip
    return fig


def _png_bytes(data: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    _figure(data).savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def draw_png(data: dict[str, Any], path: str | Path) -> Path:
    """Write the two heatmaps of `heatmap_data` output to ``path`` (PNG)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(_png_bytes(data))
    return p


def write_html(data: dict[str, Any], path: str | Path, source: str = "") -> Path:
    """A self-contained HTML page: the heatmaps (embedded PNG) and the flagged cells."""
    img = base64.b64encode(_png_bytes(data)).decode("ascii")
    rows = "".join(
        f"<tr class='{f['level']}'><td>{html.escape(f['layer'])}</td><td>{f['step']}</td>"
        f"<td>{_TITLES[f['metric']]}</td><td>{f['value']:.3g}</td><td>{f['level']}</td>"
        f"<td>{html.escape(str(f['worst']))}</td></tr>"
        for f in data["flags"]
    )
    table = (
        "<table><tr><th>layer</th><th>step</th><th>metric</th><th>%</th><th>level</th>"
        f"<th>worst operand</th></tr>{rows}</table>"
        if rows
        else "<p>No cell above the fine threshold.</p>"
    )
    page = (
        "<!doctype html><html><head><meta charset='utf-8'><title>fp8lab observe-report</title>"
        "<style>body{font-family:sans-serif}td,th{padding:2px 8px}"
        "tr.critical{color:#d62728}tr.warning{color:#b36b00}</style></head><body>"
        f"<h1>Operand underflow and saturation</h1><p>{html.escape(source)}</p>"
        f"<img alt='heatmaps' src='data:image/png;base64,{img}'>"
        f"<h2>Flagged cells ({len(data['flags'])})</h2>{table}</body></html>"
    )
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(page, encoding="utf-8")
    return p

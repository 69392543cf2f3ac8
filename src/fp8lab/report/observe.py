"""The `fp8lab observe-report` figure: underflow % and saturation % per layer over steps.

`heatmap_data` reduces `fp8lab.watch` records to one cell per (layer, step) and metric: the worst
operand of that layer (max over GEMM x role x call), with the operand that was worst and its
level (`fp8lab.observe.flag`: fine < 0.5 %, warning 0.5..4 %, critical > 4 %). A flagged cell on
a layer's first recorded step whose worst operand uses delayed scaling is marked ``warmup``: the
amax history is still empty, so the scale is the initial one and a flag there is expected.
`draw_png` draws two heatmaps (matplotlib, no pyplot) coloured by level (greys fine, oranges
warning, reds critical, as the legend says), critical cells marked ``!`` and warm-up cells ``w``;
at most `MAX_COLUMNS` step columns (consecutive steps aggregated by their worst value) keep the
figure within `MAX_WIDTH_IN` inches, and it is at most `MAX_HEIGHT_IN` inches tall (many layers
get smaller labels). `write_html` embeds that PNG and a table of the flagged cells.
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

from fp8lab.observe import THRESHOLDS, flag

__all__ = [
    "MAX_COLUMNS",
    "MAX_HEIGHT_IN",
    "MAX_WIDTH_IN",
    "METRICS",
    "draw_png",
    "heatmap_data",
    "write_html",
]

METRICS = ("underflow_pct", "saturation_pct")
_TITLES = {"underflow_pct": "underflow %", "saturation_pct": "saturation %"}
_EDGE = {"warning": "#ff9900", "critical": "#d62728"}
#: step columns drawn per heatmap at most (more steps are aggregated, worst value per column)
MAX_COLUMNS = 40
#: the figure's width in inches at most (both heatmaps; 100 dpi)
MAX_WIDTH_IN = 16.0
#: the figure's height in inches at most (many layers get smaller labels, one row each)
MAX_HEIGHT_IN = 12.0
#: colour bands of the heatmaps: (upper bound in % or None = beyond, colour); fine greys,
#: warning oranges, critical reds (the thresholds of fp8lab.observe.THRESHOLDS)
_FINE, _CRIT = THRESHOLDS["fine_below_pct"], THRESHOLDS["critical_above_pct"]
_BANDS = (
    (_FINE / 4, "#f7f7f7"), (_FINE / 2, "#d9d9d9"), (_FINE, "#a6a6a6"),
    (_CRIT / 4, "#fdd49e"), (_CRIT / 2, "#fdae6b"), (_CRIT, "#f16913"),
    (2 * _CRIT, "#ef3b2c"), (None, "#99000d"),
)  # fmt: skip


def heatmap_data(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``{"layers", "steps", "thresholds", METRIC: [[value or None per step] per layer],
    "flags": [{layer, step, metric, value, level, worst}] for warning/critical cells}``."""
    layers = sorted({str(r["layer"]) for r in records})
    steps = sorted({int(r["step"]) for r in records})
    li = {n: i for i, n in enumerate(layers)}
    si = {s: j for j, s in enumerate(steps)}
    out: dict[str, Any] = {"layers": layers, "steps": steps, "thresholds": dict(THRESHOLDS)}
    worst: dict[str, list[list[str | None]]] = {}
    delayed: dict[str, list[list[bool]]] = {}
    for m in METRICS:
        out[m] = [[None] * len(steps) for _ in layers]
        worst[m] = [[None] * len(steps) for _ in layers]
        delayed[m] = [[False] * len(steps) for _ in layers]
    first: dict[str, int] = {}
    for r in records:
        n, st = str(r["layer"]), int(r["step"])
        first[n] = min(first.get(n, st), st)
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
                delayed[m][i][j] = "delayed" in str(r.get("spec") or "")
    flags = []
    for m in METRICS:
        for i, layer in enumerate(layers):
            for j, step in enumerate(steps):
                level = flag(out[m][i][j])
                if level in ("warning", "critical"):
                    warmup = step == first[layer] and delayed[m][i][j]
                    flags.append({"layer": layer, "step": step, "metric": m,
                                  "value": out[m][i][j], "level": level,
                                  "worst": worst[m][i][j], "warmup": warmup})  # fmt: skip
    out["flags"] = flags
    return out


def _columns(steps: list[int]) -> list[list[int]]:
    """Indices of ``steps`` per drawn column: consecutive runs, at most `MAX_COLUMNS` columns."""
    n = len(steps)
    k = max(1, math.ceil(n / MAX_COLUMNS))
    return [list(range(a, min(a + k, n))) for a in range(0, n, k)]


def _figure(data: dict[str, Any]) -> Figure:
    from matplotlib.colors import BoundaryNorm, ListedColormap
    from matplotlib.patches import Patch

    layers, steps = data["layers"], data["steps"]
    cols = _columns(steps)
    label = [str(steps[c[0]]) if len(c) == 1 else f"{steps[c[0]]}-{steps[c[-1]]}" for c in cols]
    h = min(MAX_HEIGHT_IN, max(2.5, 0.35 * len(layers) + 1.5))
    # labels shrink with the rows once the height is capped (72 points per inch)
    fontsize = min(10.0, 0.8 * 72 * (h - 1.5) / max(len(layers), 1))
    w = min(MAX_WIDTH_IN / 2, max(5.0, 0.3 * len(cols) + 3.0))
    fig = Figure(figsize=(2 * w, h), layout="constrained")
    axes = fig.subplots(1, 2)
    # fine is [0, 0.5), warning [0.5, 4], critical (4, ...): the flag's closed ends
    bounds = [0.0] + [math.nextafter(b, math.inf) if b == _CRIT else b for b, _ in _BANDS[:-1]]
    bounds.append(1e9)
    cmap = ListedColormap([c for _, c in _BANDS]).with_extremes(bad="white")
    norm = BoundaryNorm(bounds, cmap.N)
    for ax, m in zip(axes, METRICS, strict=True):
        grid = []
        for row in data[m]:
            vals = [[row[j] for j in c if row[j] is not None] for c in cols]
            grid.append([max(v) if v else math.nan for v in vals])
        im = ax.imshow(grid, aspect="auto", cmap=cmap, norm=norm, interpolation="nearest")
        cb = fig.colorbar(im, ax=ax, label="%", boundaries=[*bounds[:-1], 3 * _CRIT])
        cb.set_ticks([0.0, _FINE, _CRIT, 2 * _CRIT])
        ax.set_title(f"{_TITLES[m]} (worst operand per layer)")
        ax.set_xlabel("step" if len(cols) == len(steps) else "steps (worst of each range)")
        ax.set_ylabel("layer")
        stride = max(1, len(cols) // 20)
        ax.set_xticks(range(0, len(cols), stride))
        ax.set_xticklabels(label[::stride], rotation=90)
        ax.set_yticks(range(len(layers)))
        ax.set_yticklabels(layers, fontsize=fontsize)
    lpos = {n: i for i, n in enumerate(layers)}
    cpos = {steps[j]: x for x, c in enumerate(cols) for j in c}
    marks: dict[tuple[int, int, int], str] = {}
    for f in data["flags"]:
        key = (METRICS.index(f["metric"]), lpos[f["layer"]], cpos[f["step"]])
        mark = "w" if f.get("warmup") else ("!" if f["level"] == "critical" else "")
        if mark == "!" or key not in marks:
            marks[key] = mark or marks.get(key, "")
    for (k, i, x), mark in marks.items():
        if mark:
            axes[k].text(x, i, mark, ha="center", va="center", color="white", fontweight="bold")
    t = THRESHOLDS
    handles = [
        Patch(color=_BANDS[2][1], label=f"fine < {t['fine_below_pct']} %"),
        Patch(
            color=_BANDS[5][1], label=f"warning {t['fine_below_pct']}..{t['critical_above_pct']} %"
        ),
        Patch(color=_BANDS[6][1], label=f"critical > {t['critical_above_pct']} % (!)"),
        Patch(color="white", label="w: warm-up step of delayed scaling (no amax history yet)"),
    ]
    fig.legend(handles=handles, loc="outside upper center", ncols=4, frameon=False)
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
        f"<td>{html.escape(str(f['worst']))}"
        f"{' (warm-up: no amax history yet, expected)' if f.get('warmup') else ''}</td></tr>"
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

"""The ``fp8lab advise`` report: the Pareto figure + ``report.md`` + ``report.html``.

From an `fp8lab.lab.advise.AdviseResult`:

- ``figures/pareto.png``: every measured probe (single recipes, per-layer mixes, bf16) as its
  predicted step speedup over bf16 on the device against its measured gap (mean over the
  seeds), the budget as a horizontal line, the Pareto front joined and the chosen recipe
  ringed;
- the same points as a table (``report.md`` and ``report.html``), the chosen ``advise.toml``
  and the layer ranking.

``report.html`` marks its image with ``data-loaded`` like the training report, so
``scripts/check_report.py`` checks it too.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from fp8lab.report.page import gap_cell as _fmt
from fp8lab.report.page import html_table, md_table, page_start

FIGURES = "figures"
KIND_COLORS = {"baseline": "black", "single": "#1f77b4", "mix": "#2ca02c"}


def plot_pareto(result: Any, path: Path) -> Path:
    """The Pareto figure (see the module doc) at ``path``."""
    fig = Figure(figsize=(9, 5.5))
    ax = fig.subplots()
    pts = [p for p in result.probes.values()
           if p.kind in KIND_COLORS and p.gap_pct is not None
           and p.predicted_speedup is not None]  # fmt: skip
    for kind, color in KIND_COLORS.items():
        ps = [p for p in pts if p.kind == kind]
        if ps:
            ax.scatter([p.predicted_speedup for p in ps], [p.gap_pct for p in ps], s=36,
                       color=color, label=kind, zorder=3)  # fmt: skip
    for p in pts:
        if p.kind != "mix":
            ax.annotate(p.name, (p.predicted_speedup, p.gap_pct), fontsize=8,
                        xytext=(4, 4), textcoords="offset points")  # fmt: skip
    front = [result.probes[n] for n in result.pareto]
    if front:
        ax.plot([p.predicted_speedup for p in front], [p.gap_pct for p in front], color="#7f7f7f",
                lw=1, ls="--", label="Pareto front", zorder=2)  # fmt: skip
    c = result.probes[result.chosen]
    if c.gap_pct is not None and c.predicted_speedup is not None:
        ax.scatter([c.predicted_speedup], [c.gap_pct], s=180, facecolors="none",
                   edgecolors="#d62728", lw=2, label=f"chosen: {c.name}", zorder=4)  # fmt: skip
    ax.axhline(result.budget_pct, color="#d62728", ls=":", lw=1,
               label=f"budget {result.budget_pct:g} %")  # fmt: skip
    ax.axhline(0, color="black", lw=0.8)
    ax.set(title=f"predicted step speedup over bf16 on {result.device} vs measured loss gap",
           xlabel=f"predicted speedup over bf16 on {result.device} (cost model)",
           ylabel=f"final val-loss gap to bf16 (%), mean over {len(result.seeds)} seed(s)")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


PROBE_HEAD = ["probe", "kind", "what", "predicted speedup", "gap % (mean)", "gap % per seed",
              "within budget", "Pareto"]  # fmt: skip


def probe_rows(result: Any) -> list[list[str]]:
    """The table of every probe (noise run included, without speedup), fastest first."""
    front = set(result.pareto)
    ps = sorted(result.probes.values(),
                key=lambda p: (-(p.predicted_speedup or 0.0), p.name))  # fmt: skip
    return [[p.name, p.kind, p.label, _fmt(p.predicted_speedup, ".3f"), _fmt(p.gap_pct),
             " ".join(_fmt(g) for g in p.gap_pct_seeds),
             "—" if p.kind == "noise" else _fmt(p.within_budget),
             "yes" if p.name in front else ""] for p in ps]  # fmt: skip


def _summary_rows(result: Any) -> list[list[str]]:
    c, s = result.probes[result.chosen], result.probes[result.best_single]
    rows = [["device", result.device], ["budget", f"{result.budget_pct:g} %"],
            ["noise (fp32 vs bf16)", _fmt(result.noise_pct, ".4f") + " %"],
            ["seeds", ", ".join(map(str, result.seeds))],
            ["candidates (ladder, fastest first)", " > ".join(result.ladder)],
            ["chosen", f"{c.name}: {_fmt(c.predicted_speedup, '.3f')}x, gap "
                       f"{_fmt(c.gap_pct)} %"],
            ["best single within budget", f"{s.name}: {_fmt(s.predicted_speedup, '.3f')}x, "
                                          f"gap {_fmt(s.gap_pct)} %"]]  # fmt: skip
    if result.skipped:
        rows.append(["not runnable on the device", ", ".join(result.skipped)])
    if result.price_overrides:
        rows.append(["priced model", " ".join(result.price_overrides)])
    return rows


def _ranking_rows(result: Any) -> list[list[str]]:
    return [[key, r["layer"], _fmt(r["score"], ".3f")]
            for key, rows in result.ranking.items() for r in rows]  # fmt: skip


def render_markdown(result: Any, figs: dict[str, str], command: str | None,
                    recipe_text: str | None) -> str:  # fmt: skip
    lines = ["# fp8lab advise: the fastest per-layer recipe within the loss budget", "",
             f"**Verdict.** {result.verdict}", ""]  # fmt: skip
    if command:
        lines += ["Command:", "", "```", command, "```", ""]
    lines += [*md_table(["", ""], _summary_rows(result)), ""]
    lines += [
        "## Probes",
        "",
        "Every probe trained on every seed from the same initial weights "
        "and batches as bf16 on that seed; the gap is the mean of the paired gaps.",
        "",
    ]
    lines += [*md_table(PROBE_HEAD, probe_rows(result)), ""]
    for title, f in figs.items():
        lines += [f"## {title}", "", f"![{title}]({f})", ""]
    if result.ranking:
        lines += ["## Layer ranking (one-step replay)", "", "score = share of the AdamW update "
                  "error against bf16 removed by running only that layer on the promoted "
                  "recipe.", ""]  # fmt: skip
        lines += [*md_table(["base-to-rung", "layer", "score"], _ranking_rows(result)), ""]
    if recipe_text:
        lines += ["## advise.toml", "", "```toml", recipe_text.rstrip(), "```", ""]
    lines += ["## Lab configuration", "", "```json", json.dumps(result.lab_config, indent=2),
              "```", ""]  # fmt: skip
    return "\n".join(lines)


def render_html(result: Any, figs: dict[str, str], command: str | None,
                recipe_text: str | None) -> str:  # fmt: skip
    e = html.escape
    parts = [*page_start("fp8lab advise report",
                         "fp8lab advise: the fastest per-layer recipe within the loss budget"),
             f"<p><b>Verdict.</b> {e(result.verdict)}</p>"]  # fmt: skip
    if command:
        parts.append(f"<p>Command:</p><pre>{e(command)}</pre>")
    parts.append(html_table(["", ""], _summary_rows(result)))
    parts.append("<h2>Probes</h2><p>Every probe trained on every seed from the same initial "
                 "weights and batches as bf16 on that seed; the gap is the mean of the paired "
                 "gaps.</p>")  # fmt: skip
    parts.append(html_table(PROBE_HEAD, probe_rows(result)))
    for title, f in figs.items():
        parts.append(f'<h2>{e(title)}</h2><img src="{e(f)}" alt="{e(title)}">')
    if result.ranking:
        parts.append("<h2>Layer ranking (one-step replay)</h2>")
        parts.append(html_table(["base-to-rung", "layer", "score"], _ranking_rows(result)))
    if recipe_text:
        parts.append(f"<h2>advise.toml</h2><pre>{e(recipe_text)}</pre>")
    parts.append(f"<h2>Lab configuration</h2><pre>{e(json.dumps(result.lab_config, indent=2))}"
                 "</pre>")  # fmt: skip
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(out_dir: str | Path, result: Any, command: str | None = None) -> dict[str, Path]:
    """Write ``figures/pareto.png``, ``report.md`` and ``report.html`` into ``out_dir``;
    return their paths."""
    out = Path(out_dir)
    (out / FIGURES).mkdir(parents=True, exist_ok=True)
    plot_pareto(result, out / FIGURES / "pareto.png")
    figs = {"Pareto front": f"{FIGURES}/pareto.png"}
    recipe = result.files.get("recipe")
    text = Path(recipe).read_text() if recipe and Path(recipe).exists() else None
    (out / "report.md").write_text(render_markdown(result, figs, command, text))
    (out / "report.html").write_text(render_html(result, figs, command, text))
    return {"report.md": out / "report.md", "report.html": out / "report.html",
            "pareto.png": out / FIGURES / "pareto.png"}  # fmt: skip

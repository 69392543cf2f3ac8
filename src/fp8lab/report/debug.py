"""The ``fp8lab debug`` report: figures + ``report.md`` + ``report.html``, from a DebugResult.

Figures:

- ``figures/probes.png``: every probe's validation-loss gap to the baseline over the run, with
  the noise band (`fp8lab.lab.noise.WITHIN` x the fp32-vs-bf16 gap);
- ``figures/attribution.png``: the screening scores, one row per layer, one column per
  (GEMM, role) cell;
- ``figures/remedies.png``: each remedy's final gap against its relative cost.

``report.html`` marks its images with ``data-loaded`` like the training report, so
``scripts/check_report.py`` checks it too.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from fp8lab.lab import noise as noise_rule
from fp8lab.report.page import gap_cell as _fmt
from fp8lab.report.page import html_table, md_table, page_start

FIGURES = "figures"
CELLS = (("fprop", "input"), ("fprop", "weight"), ("dgrad", "grad_output"),
         ("dgrad", "weight"), ("wgrad", "grad_output"), ("wgrad", "input"))  # fmt: skip
KIND_COLORS = {"recipe": "#d62728", "baseline": "black", "noise": "#7f7f7f",
               "recovery": "#9467bd", "fake-quant": "#8c564b", "role": "#1f77b4",
               "gemm": "#17becf", "layers": "#2ca02c", "remedy": "#ff7f0e"}  # fmt: skip


def _gap_curve(val: list, base: dict[int, float | None]) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for s, v in val:
        b = base.get(s)
        if v is None or b is None or b == 0:
            continue
        xs.append(s)
        ys.append(100.0 * (v - b) / b)
    return xs, ys


def plot_probes(result: Any, path: Path) -> Path:
    base = dict(result.probes["baseline"].val) if "baseline" in result.probes else {}
    fig = Figure(figsize=(12, 5))
    ax = fig.subplots()
    for p in result.probes.values():
        if p.kind == "baseline":
            continue
        xs, ys = _gap_curve(p.val, base)
        if not xs:
            continue
        lw = 2.4 if p.kind == "recipe" else 1.1
        ax.plot(xs, ys, color=KIND_COLORS.get(p.kind, "#bcbd22"), lw=lw, marker="o", ms=2.5,
                label=p.name, alpha=1.0 if p.kind in ("recipe", "remedy") else 0.75)  # fmt: skip
    ax.axhline(0, color="black", lw=1)
    if result.noise_pct:
        n = noise_rule.WITHIN * result.noise_pct
        ax.axhspan(-n, n, color="green", alpha=0.12, label=f"±{noise_rule.WITHIN:g}x noise")
    ax.set(title=f"validation-loss gap of every probe to {result.baseline}", xlabel="step",
           ylabel="gap (%)")  # fmt: skip
    ax.set_yscale("symlog", linthresh=0.1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def plot_attribution(result: Any, path: Path) -> Path | None:
    rows = result.attribution
    if not rows:
        return None
    layers = list(dict.fromkeys(result.details.get("layers") or [r["layer"] for r in rows]))
    grid = [[math.nan] * len(CELLS) for _ in layers]
    for r in rows:
        if r["layer"] in layers and (r["gemm"], r["role"]) in CELLS:
            grid[layers.index(r["layer"])][CELLS.index((r["gemm"], r["role"]))] = r["score"]
    fig = Figure(figsize=(9, 0.45 * len(layers) + 1.8))
    ax = fig.subplots()
    im = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=min(0.0, min(
        (v for row in grid for v in row if v == v), default=0.0)))  # fmt: skip
    ax.set_xticks(range(len(CELLS)), [f"{g}\n{r}" for g, r in CELLS], fontsize=8)
    ax.set_yticks(range(len(layers)), layers, fontsize=8)
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            if v == v:
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7,
                        color="white" if v < 0.5 * (max(max(row) for row in grid) or 1) else "black")  # fmt: skip
    fig.colorbar(im, ax=ax, label="share of gradient error removed")
    ax.set_title("one-step attribution: one cell in high precision")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def plot_remedies(result: Any, path: Path) -> Path | None:
    rows = [r for r in result.details.get("remedies", []) if r.get("gap_pct") is not None]
    if not rows:
        return None
    fig = Figure(figsize=(8, 4.5))
    ax = fig.subplots()
    for r in rows:
        ax.scatter([r["relative_cost"]], [r["gap_pct"]], s=40,
                   color="#2ca02c" if r["explains"] else "#d62728")  # fmt: skip
        ax.annotate(r["name"], (r["relative_cost"], r["gap_pct"]), fontsize=8,
                    xytext=(4, 4), textcoords="offset points")  # fmt: skip
    if result.gap_pct is not None:
        ax.axhline(result.gap_pct, color="#d62728", ls="--", lw=1, label="R")
        ax.axhline(0.3 * result.gap_pct, color="#2ca02c", ls=":", lw=1, label="70 % closed")
    ax.axhline(0, color="black", lw=1)
    ax.set(title="remedies: final gap vs relative cost (green: explains the gap)",
           xlabel="relative_cost (GEMM FLOPs moved to high precision + extra quantization passes)",
           ylabel="gap (%)")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


# ----------------------------------------------------------------------------- documents
def _probe_rows(result: Any) -> list[list[str]]:
    rows = []
    for p in result.probes.values():
        rows.append([p.name, p.kind, p.label, _fmt(p.summary.get("final_val_loss"), ".4f"),
                     _fmt(p.gap_pct), _fmt(p.closure, ".2f"),
                     "—" if p.kind in ("baseline", "noise", "recipe") else _fmt(p.explains)])  # fmt: skip
    return rows


PROBE_HEAD = ["probe", "kind", "what", "val loss", "gap %", "share closed", "explains"]


def _summary_rows(result: Any, expect: dict | None) -> list[list[str]]:
    c = result.culprit
    rows = [
        ["recipe", result.recipe], ["baseline", result.baseline],
        ["gap %", _fmt(result.gap_pct)], ["noise %", _fmt(result.noise_pct, ".4f")],
        ["recovers", _fmt(result.recovers)],
        ["culprit", _culprit_text(c)],
        ["best remedy", str(result.details.get("best_remedy") or "none")],
        ["fix", result.fix or "none"],
    ]  # fmt: skip
    pred = result.details.get("predicted_step")  # fp8lab debug --device (fp8lab.cost)
    if pred:
        rows.append([f"predicted step ms on {pred['device']}", "; ".join(
            f"{k} " + ("n/a (" + v["reason"] + ")" if v["ms"] is None else format(v["ms"], ".4g"))
            for k, v in pred["recipes"].items())])  # fmt: skip
    if expect is not None:
        rows.append(["planted (scenario)", json.dumps(expect, default=str)])
    t = result.details.get("timings_s", {})
    rows.append(["time", ", ".join(f"{k[:-2]} {v:.0f} s" for k, v in t.items() if v is not None)])
    return rows


def _culprit_text(c: dict | None) -> str:
    """One line for a culprit of any kind (`fp8lab.lab.debug.kinds`)."""
    if c is None:
        return "none"
    kind = c.get("kind", "operand")
    if kind == "operand":
        return f"role {c['role']}, GEMM {c['gemm']}, layers {', '.join(c['layers'])}"
    extra = f", tensor {c['tensor']}" if c.get("tensor") else ""
    return f"{kind}{extra}" + (f", layers {', '.join(c['layers'])}" if c.get("layers") else "")


def _export_lines(result: Any) -> list[str]:
    """The fix in Megatron-LM's and TE's formats: where, and what they could not express."""
    ex = result.details.get("exports") or {}
    if not ex:
        return []
    lines = ["## The fix in Megatron-LM and Transformer Engine", "",
             f"- `{ex['megatron']}`: Megatron-LM `--te-precision-config-file`",
             f"- `{ex['te']}`: Transformer Engine's precision debug tools (nvdlfw-inspect)", ""]  # fmt: skip
    notes = result.details.get("export_notes") or []
    if notes:
        lines += ["What these formats cannot say as fp8lab does:", ""]
        lines += [f"- {n}" for n in notes] + [""]
    return lines


def render_markdown(result: Any, figs: dict[str, str], command: str | None,
                    expect: dict | None, fix_text: str | None) -> str:  # fmt: skip
    lines = ["# fp8lab debug: which GEMM of which layer breaks the run", "",
             f"**Verdict.** {result.verdict}", ""]  # fmt: skip
    if command:
        lines += ["Command:", "", "```", command, "```", ""]
    lines += [*md_table(["", ""], _summary_rows(result, expect)), ""]
    lines += ["## Probes", "",
              "Every probe trains from the same initial weights on the same batches; gap % = "
              "final validation loss relative to the baseline's; share closed = 1 - gap / R's "
              f"gap; a probe explains the gap when it closes >= 70 % of it or lands within "
              f"{noise_rule.WITHIN:g}x the noise.", ""]  # fmt: skip
    lines += [*md_table(PROBE_HEAD, _probe_rows(result)), ""]
    for title, f in figs.items():
        lines += [f"## {title}", "", f"![{title}]({f})", ""]
    if result.attribution:
        lines += ["## Attribution (one-step replay, top 20 cells)", "",
                  "score = share of the update error |u(g_R) - u(g_baseline)| removed by "
                  "running only that cell in high precision (u: the AdamW update the "
                  "checkpoint's optimizer state makes of a gradient), pooled over the screened "
                  f"checkpoints (steps {result.details['state'].get('screen_steps')}).", ""]  # fmt: skip
        lines += md_table(["layer", "GEMM", "role", "score"],
                           [[a["layer"], a["gemm"], a["role"], _fmt(a["score"], ".3f")]
                            for a in result.attribution[:20]])  # fmt: skip
        lines.append("")
    rem = result.details.get("remedies", [])
    if rem:
        lines += [
            "## Remedies",
            "",
            "relative_cost = share of GEMM FLOPs moved to high precision + extra "
            "quantization passes per step relative to R's (a proxy, docs/debug.md).",
            "",
        ]
        lines += md_table(["remedy", "what", "gap %", "share closed", "relative_cost",
                            "explains"],
                           [[r["name"], r["label"], _fmt(r["gap_pct"]), _fmt(r["closure"], ".2f"),
                             _fmt(r["relative_cost"], "+.3f"), _fmt(r["explains"])]
                            for r in rem])  # fmt: skip
        lines.append("")
    if fix_text:
        lines += ["## fix.toml", "", "```toml", fix_text.rstrip("\n"), "```", ""]
    lines += _export_lines(result)
    lines += ["## Lab configuration", "", "```json",
              json.dumps(result.details.get("lab", {}), indent=2), "```", ""]  # fmt: skip
    return "\n".join(lines)


def render_html(result: Any, figs: dict[str, str], command: str | None,
                expect: dict | None, fix_text: str | None) -> str:  # fmt: skip
    e = html.escape
    parts = [*page_start("fp8lab debug report",
                         "fp8lab debug: which GEMM of which layer breaks the run"),
             f"<p><b>Verdict.</b> {e(result.verdict)}</p>"]  # fmt: skip
    if command:
        parts.append(f"<p>Command:</p><pre>{e(command)}</pre>")
    parts.append(html_table(["", ""], _summary_rows(result, expect)))
    parts.append("<h2>Probes</h2><p>Same initial weights and batches for every probe; a probe "
                 f"explains the gap when it closes at least 70 % of it or lands within "
                 f"{noise_rule.WITHIN:g}x the noise.</p>")  # fmt: skip
    parts.append(html_table(PROBE_HEAD, _probe_rows(result)))
    for title, f in figs.items():
        parts.append(f'<h2>{e(title)}</h2><img src="{e(f)}" alt="{e(title)}">')
    if result.attribution:
        parts.append("<h2>Attribution (one-step replay, top 20 cells)</h2><p>score = share "
                     "of the AdamW update error against the baseline removed by running only "
                     "that cell in high precision.</p>")  # fmt: skip
        parts.append(html_table(["layer", "GEMM", "role", "score"],
                                 [[a["layer"], a["gemm"], a["role"], _fmt(a["score"], ".3f")]
                                  for a in result.attribution[:20]]))  # fmt: skip
    rem = result.details.get("remedies", [])
    if rem:
        parts.append(
            "<h2>Remedies</h2><p>relative_cost = share of GEMM FLOPs moved to high "
            "precision + extra quantization passes relative to R's (a proxy).</p>"
        )
        parts.append(html_table(["remedy", "what", "gap %", "share closed", "relative_cost",
                                  "explains"],
                                 [[r["name"], r["label"], _fmt(r["gap_pct"]),
                                   _fmt(r["closure"], ".2f"), _fmt(r["relative_cost"], "+.3f"),
                                   _fmt(r["explains"])] for r in rem]))  # fmt: skip
    if fix_text:
        parts.append(f"<h2>fix.toml</h2><pre>{e(fix_text)}</pre>")
    ex = _export_lines(result)
    if ex:  # the same lines as the Markdown, as a list
        parts.append(f"<h2>{e(ex[0][3:])}</h2><ul>"
                     + "".join(f"<li>{e(x[2:])}</li>" for x in ex[2:] if x.startswith("- "))
                     + "</ul>")  # fmt: skip
    parts.append(
        f"<h2>Lab configuration</h2><pre>"
        f"{e(json.dumps(result.details.get('lab', {}), indent=2))}</pre>"
    )
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(
    out_dir: str | Path, result: Any, command: str | None = None, expect: dict | None = None
) -> dict[str, Path]:
    """Write figures, ``report.md`` and ``report.html`` into ``out_dir``; return their paths."""
    out = Path(out_dir)
    (out / FIGURES).mkdir(parents=True, exist_ok=True)
    figs: dict[str, str] = {}
    plot_probes(result, out / FIGURES / "probes.png")
    figs["Gap of every probe"] = f"{FIGURES}/probes.png"
    if plot_attribution(result, out / FIGURES / "attribution.png") is not None:
        figs["Attribution"] = f"{FIGURES}/attribution.png"
    if plot_remedies(result, out / FIGURES / "remedies.png") is not None:
        figs["Remedies"] = f"{FIGURES}/remedies.png"
    fix_text = Path(result.fix).read_text() if result.fix else None
    (out / "report.md").write_text(render_markdown(result, figs, command, expect, fix_text))
    (out / "report.html").write_text(render_html(result, figs, command, expect, fix_text))
    paths = {"report.md": out / "report.md", "report.html": out / "report.html"}
    paths.update({Path(f).name: out / f for f in figs.values()})
    return paths

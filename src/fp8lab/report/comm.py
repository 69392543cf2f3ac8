"""The distributed section of the compare report: ranks, amax group, gradient communication.

Built from the metrics records a run under torchrun writes (`fp8lab.distributed.ddp.DataParallel.state`
fields); empty for single-process runs. Bytes per step by precision are counted from the
gradient's element count, the rank count and each precision's wire format
(`fp8lab.distributed.comm.bytes_per_rank`, DDP's 25 MiB buckets).
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["comm_html", "comm_markdown", "comm_rows"]

COLUMNS = (
    ("recipe", "recipe"), ("ranks", "ranks"), ("amax_group", "amax group"),
    ("sharding", "sharding"), ("grad_comm", "grad comm"), ("bytes", "MiB/step/rank"),
    ("gather", "weight all-gather MiB/step/rank"),
    ("bytes_fp32", "fp32"), ("bytes_bf16", "bf16"), ("bytes_fp8", "fp8"),
    ("bytes_fp8-msamp", "fp8-msamp"), ("rel_error", "rel. error vs fp32"),
    ("underflow", "underflow %"), ("overflow", "overflow %"), ("spread", "scale spread (binades)"),
)  # fmt: skip


def comm_rows(metrics: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[dict[str, str]]:
    """One row per recipe trained on several ranks (none for single-process runs), from
    `fp8lab.distributed.ddp.comm_summary`: rel. error = mean over steps of the relative L2 error of the
    reduced gradients against the fp32 all-reduce; underflow / overflow = % of the partial-sum
    elements put on the wire over the run; scale spread = the largest per-rank spread of a
    delayed scale (``--amax-group none``); MiB = what one rank sends per step for the
    gradients, this run's precision and each precision."""
    from fp8lab.distributed.ddp import comm_summary

    rows = []
    for name, recs in metrics.items():
        c = comm_summary(list(recs))
        if c is None:
            continue
        row = {"recipe": name, "ranks": str(c["ranks"]), "amax_group": c["amax_group"],
               "sharding": c["sharding"], "grad_comm": c["grad_comm"],
               "bytes": f"{c['grad_bytes_per_step'] / 2**20:.3f}"}  # fmt: skip
        ag = c["allgather_bytes_per_step"]
        row["gather"] = "-" if ag is None else f"{ag / 2**20:.3f}"
        for p, b in c["grad_bytes_per_step_by_precision"].items():
            row[f"bytes_{p}"] = f"{b / 2**20:.3f}"
        err = c["grad_comm_rel_error"]
        row["rel_error"] = "0 (fp32)" if c["grad_comm"] == "fp32" else f"{err:.2e}"
        for k in ("underflow", "overflow"):
            v = c[f"grad_comm_{k}_pct"]
            row[k] = "-" if v is None else f"{v:.3g}"
        spread = c["max_scale_spread_binades"]
        row["spread"] = "0 (world)" if c["amax_group"] == "world" else f"{spread:.3g}"
        rows.append(row)
    return rows


_NOTE = (
    "Gradient bytes one rank sends per step (ring all-reduce: 2(N-1)/N of the gradient in the "
    "wire format, plus fp8 scales / the MS-AMP amax; FSDP: the fp32 reduce-scatter, and the "
    "weights' all-gather apart), for this run's precision and for each DDP precision; with a "
    "simulated --grad-comm the error is against the fp32 all-reduce of the same gradients and "
    "underflow/overflow count partial-sum elements lost to zero / saturated on the wire "
    "(docs/distributed.md)."
)


def comm_markdown(metrics: Mapping[str, Sequence[Mapping[str, Any]]]) -> str:
    """The section as markdown ("" without distributed runs)."""
    rows = comm_rows(metrics)
    if not rows:
        return ""
    lines = ["## Distributed training", "", _NOTE, ""]
    lines.append("| " + " | ".join(t for _, t in COLUMNS) + " |")
    lines.append("|---" * len(COLUMNS) + "|")
    lines += ["| " + " | ".join(r[k] for k, _ in COLUMNS) + " |" for r in rows]
    return "\n".join(lines) + "\n\n"


def comm_html(metrics: Mapping[str, Sequence[Mapping[str, Any]]]) -> str:
    """The section as HTML ("" without distributed runs)."""
    rows = comm_rows(metrics)
    if not rows:
        return ""
    e = html.escape
    parts = [f"<h2>Distributed training</h2><p>{e(_NOTE)}</p><table><tr>"]
    parts += [f"<th>{e(t)}</th>" for _, t in COLUMNS]
    parts.append("</tr>")
    for r in rows:
        parts.append("<tr>" + "".join(f"<td>{e(r[k])}</td>" for k, _ in COLUMNS) + "</tr>")
    parts.append("</table>")
    return "".join(parts)

"""``fp8lab formats``: the number formats, their derived numbers and special encodings."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Any

import typer

from fp8lab.cli._common import check_plot_path, clear_errors, console, json_flag

HELP = """Show number formats: bits, bias, max, min normal, min subnormal, binades, epsilon, and how
Inf, NaN and -0 are encoded. NAMES are registry names or any eXmY (default: the whole registry).
--plot draws relative precision (grid spacing relative to the binade) against magnitude
2^-24..2^17: HiF8's tapered precision against E4M3/E5M2 by default."""

DEFAULT_PLOT = ("hif8", "e4m3", "e5m2")


def _field(bits: str, n: int) -> str:
    return bits * n if n <= 5 else f"{bits}…{bits}"


def _pattern(sign: str, e: str, m: str) -> str:
    return ".".join(p for p in (sign, e, m) if p)


def describe(fmt: Any) -> dict[str, Any]:
    """A JSON-ready description of a `FloatFormat`."""
    if fmt.kind == "hif8":
        layout, bias = "tapered", None
        inf, nan, neg_zero = "0x6F / 0xEF", "0x80", False
        mant = "3 bits in 2^-3..2^3, 2 in 2^±4..±7, 1 in 2^±8..±15, 0 in 2^-22..-16"
    else:
        layout = f"{int(fmt.signed)}/{fmt.ebits}/{fmt.mbits}"
        bias = fmt.bias
        s = "S" if fmt.signed else ""
        top = _field("1", fmt.ebits)
        inf = _pattern(s, top, _field("0", fmt.mbits)) if fmt.inf else None
        if fmt.nan == "ieee":
            nan = _pattern(s, top, "≠0") if fmt.mbits else None
        elif fmt.nan == "fn" and not fmt.signed:
            nan = f"0x{(1 << fmt.bits) - 1:02X}"
        elif fmt.nan == "fn":
            nan = _pattern(s, top, _field("1", fmt.mbits))
        elif fmt.nan == "fnuz":
            nan = f"0x{1 << (fmt.bits - 1):02X} (the -0 pattern)"
        else:
            nan = None
        neg_zero = bool(fmt.signed and fmt.signed_zero and fmt.has_zero)
        mant = f"{fmt.mbits} bits"
    return {
        "name": fmt.name,
        "aliases": list(fmt.aliases),
        "kind": fmt.kind,
        "bits": fmt.bits,
        "layout": layout,
        "mantissa": mant,
        "bias": bias,
        "max": fmt.max,
        "min_normal": fmt.min_normal,
        "min_subnormal": fmt.min_subnormal,
        "subnormals": fmt.subnormals if fmt.kind != "hif8" else True,
        "binades": fmt.binades,
        "epsilon": fmt.eps,
        "inf": inf,
        "nan": nan,
        "negative_zero": neg_zero,
        "zero": fmt.has_zero,
        "signed": fmt.signed,
    }


def _num(v: float) -> str:
    if v == 0 or not math.isfinite(v):
        return str(v)
    e = math.log2(v)
    if e == int(e) and abs(e) >= 4:
        return f"2^{int(e)}"
    if 1e-3 <= v < 1e6:
        return f"{v:g}"
    return f"{v:.4g}"


def _table(rows: list[dict[str, Any]]) -> None:
    """Two rich tables that fit 80 columns and more (cells wrap or fold, nothing is cut): the
    derived numbers, then the special encodings."""
    from rich import box
    from rich.table import Table

    names = [r["name"] + (f" ({', '.join(r['aliases'])})" if r["aliases"] else "") for r in rows]
    # the name column is never narrower than its longest word: names wrap, never split mid-word
    longest = max((len(w) for n in names for w in n.split()), default=6)

    def table(title: str, cols: tuple[tuple[str, str], ...]) -> Table:
        t = Table(title=title, title_justify="left", header_style="bold", box=box.SIMPLE_HEAD,
                  pad_edge=False, collapse_padding=True)  # fmt: skip
        for i, (col, justify) in enumerate(cols):
            number = justify == "right"
            width = max(6, longest) if i == 0 else None if number else 6
            t.add_column(col, justify=justify, no_wrap=number, overflow="fold",  # type: ignore[arg-type]
                         min_width=width)  # fmt: skip
        return t

    numbers = table("Number formats", (("format", "left"), ("bits", "right"), ("s/e/m", "right"),
                    ("bias", "right"), ("max", "right"), ("min\nnormal", "right"),
                    ("min\nsubnormal", "right"), ("binades", "right"), ("epsilon", "right")))  # fmt: skip
    codes = table("Special encodings", (("format", "left"), ("Inf", "left"), ("NaN", "left"),
                  ("-0", "left"), ("mantissa", "left")))  # fmt: skip
    for r, name in zip(rows, names, strict=True):
        sub = _num(r["min_subnormal"]) if r["subnormals"] else "— (none)"
        zero = "yes" if r["negative_zero"] else ("no zero" if not r["zero"] else "no")
        numbers.add_row(
            name,
            str(r["bits"]),
            r["layout"],
            "—" if r["bias"] is None else str(r["bias"]),
            _num(r["max"]),
            _num(r["min_normal"]),
            sub,
            str(r["binades"]),
            _num(r["epsilon"]),
        )
        codes.add_row(name, r["inf"] or "—", r["nan"] or "—", zero, r["mantissa"])
    out = console()
    out.print(numbers)
    out.print(codes)


def relative_precision(fmt: Any, exponents: Any) -> Any:
    """Grid spacing / 2**floor(log2|x|) at magnitudes ``x = 2**exponents``: ``2**-m`` in a binade
    with m mantissa bits, larger among subnormals; NaN outside the finite range."""
    import numpy as np

    from fp8lab.formats.rounding import _TAB_LO, _params

    p = _params(fmt)
    x = np.exp2(np.asarray(exponents, dtype=np.float64))
    eb = (np.frexp(x)[1] - 1).astype(np.int64)  # exact binade, no floating-point log2
    q = p.qtab[np.clip(eb - _TAB_LO, 0, len(p.qtab) - 1)]
    rel = np.exp2((q - eb).astype(np.float64))
    rel[(x < fmt.min_subnormal) | (x > fmt.max)] = np.nan
    return rel


def plot(formats: list[Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    e = np.linspace(-24, 17, 8201)
    fig, ax = plt.subplots(figsize=(9, 4.8))
    styles = ["-", "--", ":", "-."]
    for i, fmt in enumerate(formats):
        width = 3.2 if fmt.kind == "hif8" else 1.8
        ax.plot(
            e,
            relative_precision(fmt, e),
            styles[i % len(styles)],
            label=fmt.name,
            linewidth=width,
            drawstyle="steps-post",
        )
    ax.set_yscale("log", base=2)
    ax.set_xlabel("log2 |x|")
    ax.set_ylabel("grid spacing / 2^floor(log2 |x|)")
    ax.set_xlim(-24, 17)
    ax.set_title("Relative precision against magnitude (lower is finer)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


NamesArg = Annotated[list[str] | None, typer.Argument(help="Formats to show (default: all).")]
JsonOut = json_flag("the formats")
PlotPath = Annotated[Path | None, typer.Option(
    "--plot",
    help="Write a PNG of relative precision vs magnitude (default formats: "
                    + ", ".join(DEFAULT_PLOT)
                    + ").",
)]  # fmt: skip


def formats(
    names: NamesArg = None,
    json_out: JsonOut = False,
    plot_path: PlotPath = None,
) -> None:
    from fp8lab.formats import format_names, get_format

    with clear_errors():
        fmts = [get_format(n) for n in (names or format_names())]
        if plot_path is not None:
            check_plot_path(plot_path)
    rows = [describe(f) for f in fmts]
    if json_out:
        typer.echo(json.dumps(rows, indent=2))
    else:
        _table(rows)
    if plot_path is not None:
        chosen = fmts if names else [get_format(n) for n in DEFAULT_PLOT]
        with clear_errors():
            plot(chosen, plot_path)
        if not json_out:
            typer.echo(f"wrote {plot_path}")


def register(app: typer.Typer) -> None:
    app.command("formats", help=HELP)(formats)

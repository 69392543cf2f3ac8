"""``fp8lab cost``: what recipes cost on a GPU, per GEMM, per tensor and per layer."""

from __future__ import annotations

import json
from typing import Any

import typer

from fp8lab.cli._common import clear_errors, console, fail

DEFAULT_RECIPES = "bf16,te-delayed,te-current,mxfp8,deepseek-v3,nvfp4"

HELP = """Predicted GEMM and quantization time of recipes on a GPU (a calibrated roofline).

Counts come from fp8lab's own execution of one Linear step per recipe (amax and cast passes,
transposes, re-tilings, scale bytes, promotion FMAs); times from a roofline whose efficiencies
are calibrated on the fprop timings Transformer Engine publishes (docs/cost.md lists the held-out
residuals). Shapes: --hidden/--ffn/--layers/--tokens (default: TE's 5B example, M = 15,872
tokens), or --model gpt: the lab's built-in GPT (its default config; tokens = batch 8 x 128
unless --tokens; model factories are not supported yet). --scenario training prices a forward+backward step (each tensor quantized once);
te-benchmark prices TE's benchmark_gemm.py (each GEMM timed as its own forward). Only GEMMs and
their quantization are priced: attention, norms and communication are not. Devices: h100, h200,
h200-nvl, b200, b300. A recipe the device lacks the tensor cores for (mxfp8, nvfp4 on Hopper) is
skipped with a note on stderr. Exit code 2 for an unknown device or recipe, or a recipe no device
can run (HiF8, fp32 GEMMs).
"""


#: TE's 5B example (docs/examples/gemm_profiling): the default layer shape
TE_5B = {"hidden": 4096, "ffn": 16384, "layers": 24, "tokens": 15872}


def _shape(model: str | None, given: dict[str, int | None]) -> tuple[Any, list | None]:
    """(TransformerShape for the header, the layer's Linears or None for the shape's own)."""
    from fp8lab.cost.model import TransformerShape

    if model is None:
        kw = {k: (TE_5B[k] if v is None else v) for k, v in given.items()}
        return TransformerShape(**kw), None
    if model != "gpt":
        raise ValueError(
            f"--model {model!r}: pricing a model factory is not supported yet; use --model gpt "
            "(the lab's built-in GPT) or give the layer shape with --hidden, --ffn, --layers "
            "and --tokens"
        )
    if any(v is not None for k, v in given.items() if k != "tokens"):
        raise ValueError("--model gpt sets hidden, ffn and layers: drop --hidden/--ffn/--layers")
    from fp8lab.lab.gpt import GPTConfig
    from fp8lab.lab.train import TrainConfig

    cfg = GPTConfig()
    d, ff = cfg.d_model, cfg.d_ff
    tokens = given["tokens"] or TrainConfig().batch_size * cfg.block_size
    shape = TransformerShape(hidden=d, ffn=ff, layers=cfg.n_layer, tokens=tokens)
    # the lab GPT's converted Linears of one block (the output head stays high precision)
    linears = [("qkv", d, 3 * d), ("proj", d, d), ("gate", d, ff), ("up", d, ff), ("down", ff, d)]
    return shape, linears


def _price(
    recipes: list[str], device: str, shape: Any, linears: list | None, scenario: str
) -> tuple[Any, dict]:
    from fp8lab.cost.devices import get_device
    from fp8lab.cost.model import UnpriceableError, price_linears
    from fp8lab.recipe import get_recipe

    dev = get_device(device)
    for r in recipes:
        get_recipe(r)  # unknown names fail before any pricing
    lins = shape.linears() if linears is None else linears

    def one(r: str) -> Any:
        return price_linears(r, dev, lins, shape.tokens, scenario, shape)

    costs, skipped = {}, {}
    for r in recipes:
        try:
            costs[r] = one(r)
        except UnpriceableError as exc:
            if not exc.device_limit:
                raise
            skipped[r] = str(exc)
    if not costs:
        raise ValueError(f"no recipe of {', '.join(recipes)} runs on {dev.name}")
    base = costs["bf16"] if "bf16" in costs else one("bf16")
    return dev, {"bf16_ms": base.layer_ms, "costs": costs, "skipped": skipped}


def _json(dev: Any, priced: dict) -> str:
    base = priced["bf16_ms"]
    out = {
        "schema_version": 1,
        "device": dev.name,
        "recipes": {
            r: {
                "layer_ms": c.layer_ms,
                "speedup_vs_bf16": base / c.layer_ms,
                "gemm_ms": c.gemm_ms,
                "quantize_ms": c.quantize_ms,
                "bytes": c.bytes,
            }
            for r, c in priced["costs"].items()
        },
    }
    return json.dumps(out, indent=2)


def _tables(dev: Any, priced: dict, shape: Any, scenario: str) -> None:
    from rich.table import Table

    con = console()
    costs = priced["costs"]
    names = list(costs)
    con.print(
        f"{dev.name}: {dev.description}; peaks (dense TFLOPS) "
        + ", ".join(f"{k} {v:g}" for k, v in dev.peak_tflops.items())
        + f", {dev.bandwidth_tbs:g} TB/s; efficiencies calibrated on {dev.efficiencies_from}"
    )
    if dev.note:
        con.print(f"note: {dev.note}")
    con.print(
        f"layer: hidden {shape.hidden}, ffn {shape.ffn}, tokens {shape.tokens}, "
        f"{shape.layers} layers; scenario {scenario}"
    )
    g = Table(title="Per-GEMM time (ms; GEMM kernel, its class and bound)")
    g.add_column("GEMM")
    g.add_column("M x K x N")
    for r in names:
        g.add_column(r, justify="right")
    for i, gc in enumerate(costs[names[0]].gemms):
        cells = []
        for r in names:
            c = costs[r].gemms[i]
            cells.append(f"{c.ms:.3f} {c.cls} {c.bound[0]}")
        g.add_row(gc.name, f"{gc.m}x{gc.k}x{gc.n}", *cells)
    con.print(g)
    led = Table(title="Per-tensor bytes ledger (MB read + written by its quantization passes)")
    led.add_column("tensor")
    for r in names:
        led.add_column(r, justify="right")
    ledgers = {r: costs[r].ledger() for r in names}
    tensors = sorted({t for lg in ledgers.values() for t in lg})
    for t in tensors:
        cells = []
        for r in names:
            row = ledgers[r].get(t, {})
            rd = sum(v for k, v in row.items() if k.startswith("read")) / 1e6
            wr = sum(v for k, v in row.items() if k.startswith("written")) / 1e6
            cells.append(f"{rd:.0f}+{wr:.0f}" if row else "-")
        led.add_row(t, *cells)
    con.print(led)
    keys = sorted({k for lg in ledgers.values() for row in lg.values() for k in row})
    prec = Table(title="Quantization bytes per layer by precision (MB)")
    prec.add_column("recipe")
    for k in keys:
        prec.add_column(k.replace(":", " "), justify="right")
    for r in names:
        tot_r = {k: sum(row.get(k, 0) for row in ledgers[r].values()) for k in keys}
        prec.add_row(r, *(f"{tot_r[k] / 1e6:.1f}" for k in keys))
    con.print(prec)
    tot = Table(title="Per-layer totals")
    for col in ("recipe", "layer ms", "GEMM ms", "quantize ms", "quantize %", "speedup vs bf16",
                "model ms", "GB moved"):  # fmt: skip
        tot.add_column(col, justify="left" if col == "recipe" else "right")
    for r, c in costs.items():
        tot.add_row(
            r,
            f"{c.layer_ms:.3f}",
            f"{c.gemm_ms:.3f}",
            f"{c.quantize_ms:.3f}",
            f"{100 * c.quantize_ms / c.layer_ms:.1f}",
            f"{priced['bf16_ms'] / c.layer_ms:.2f}x",
            f"{c.layer_ms * shape.layers:.1f}",
            f"{c.bytes / 1e9:.2f}",
        )
    con.print(tot)


def register(app: typer.Typer) -> None:
    @app.command("cost", help=HELP)
    def cost(
        recipes: str = typer.Option(DEFAULT_RECIPES, "--recipes", help="Comma-separated recipes."),
        device: str = typer.Option("h200", "--device", help="h100, h200, h200-nvl, b200, b300."),
        model: str | None = typer.Option(
            None, "--model", help="gpt: the lab's built-in GPT (other factories: not yet)."
        ),
        hidden: int | None = typer.Option(None, "--hidden", help="Hidden size (default 4096)."),
        ffn: int | None = typer.Option(None, "--ffn", help="FFN size (default 16384)."),
        layers: int | None = typer.Option(None, "--layers", help="Layers (default 24)."),
        tokens: int | None = typer.Option(
            None, "--tokens", help="Tokens per step, micro-batch x sequence (default 15872)."
        ),
        scenario: str = typer.Option(
            "training", "--scenario", help="training or te-benchmark (see above)."
        ),
        json_out: bool = typer.Option(False, "--json", help="Print the totals as JSON."),
    ) -> None:
        names = [r.strip() for r in recipes.split(",") if r.strip()]
        if not names:
            raise fail("--recipes is empty")
        with clear_errors():
            given = {"hidden": hidden, "ffn": ffn, "layers": layers, "tokens": tokens}
            shape, linears = _shape(model, given)
            dev, priced = _price(names, device, shape, linears, scenario)
        for r, why in priced["skipped"].items():
            typer.echo(f"skipped {r}: {why}", err=True)
        if json_out:
            typer.echo(_json(dev, priced))
        else:
            _tables(dev, priced, shape, scenario)

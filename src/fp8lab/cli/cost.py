"""``fp8lab cost``: what recipes cost on a GPU, per GEMM, per tensor and per layer."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any

import typer

from fp8lab.cli._common import clear_errors, console, fail, fitted_tables, json_flag

DEFAULT_RECIPES = "bf16,te-delayed,te-current,mxfp8,deepseek-v3,nvfp4"

HELP = """Predicted GEMM and quantization time of recipes on a GPU (a calibrated roofline).

Counts come from fp8lab's own execution of one Linear step per recipe (amax and cast passes,
transposes, re-tilings, scale bytes, promotion FMAs); times from a roofline whose efficiencies
are calibrated on the fprop timings Transformer Engine publishes (docs/cost.md lists the held-out
residuals). Shapes: --hidden/--ffn/--layers/--tokens (default: TE's 5B example, M = 15,872
tokens), or --model: the quantized Linears of a model (gpt, MODULE:FACTORY, file.py:FACTORY or
hf:CONFIG.json, the Linears fp8lab.nn.convert would swap; a stack of identical blocks is shown
per layer) on batch 8 x 128 tokens unless --tokens. --scenario training prices a forward+backward
step (each tensor quantized once); te-benchmark prices TE's benchmark_gemm.py (each GEMM timed as
its own forward). --ranks N [--grad-comm P] [--fsdp [--fp8-allgather]] [--amax-group G] adds
the bytes one rank sends per step, with fp8lab compare's distributed options: gradient
all-reduce in precision P (a float32 reduce-scatter under FSDP), amax all-reduces, FSDP weight
all-gathers (docs/cost.md). Timed: the Linears' GEMMs and their quantization (TE's RHT and
4over6 included), attention with --heads H --seq-len S (shape options: bf16, or TE's FP8
attention for a recipe with attention = true / [dpa]), and for a --model with MoE blocks the
[moe] dispatch format's casts (its all-to-all bytes in --json as moe_wire_bytes). Norms,
activations, the optimizer and communication time are not. Recipes with hp_last_blocks
(nvfp4-paper) run their last blocks in bf16. Devices: h100, h200, h200-nvl, b200, b300. A recipe the device lacks the tensor cores for (mxfp8, nvfp4 on Hopper) is
skipped with a note on stderr. Exit code 2 for an unknown device or recipe, or a recipe no device
can run (HiF8, fp32 GEMMs).
"""


#: TE's 5B example (docs/examples/gemm_profiling): the default layer shape
TE_5B = {"hidden": 4096, "ffn": 16384, "layers": 24, "tokens": 15872}


@dataclass
class Workload:
    """What is priced: ``block`` = the Linears of one layer, ``layers`` copies of it (or every
    Linear, ``layers`` = 1, when the model is not a stack of identical blocks), on ``tokens``
    tokens; ``every`` = every Linear of the model by name (per-layer rules, collectives);
    ``other`` = parameter elements outside those Linears (0 when only a shape is given)."""

    block: list[tuple[str, int, int]]
    layers: int
    tokens: int
    every: list[tuple[str, int, int]]
    header: str
    shape: Any = None
    other: int = 0
    #: MoE expert Linears -> (n_experts, top_k), by the names of ``every`` and of ``block``
    experts: dict[str, tuple[int, int]] | None = None
    #: the built model (``--model``), or a stand-in holding ``layers`` numbered blocks, for
    #: resolving ``hp_last_blocks`` / ``hp_first_blocks``
    model: Any = None


def _model(spec: str, seed: int = 0) -> Any:
    """The unconverted model of ``--model`` (the lab's resolver: gpt, MODULE:FACTORY,
    file.py:FACTORY, hf:CONFIG.json), built without touching the caller's RNG."""
    import torch

    from fp8lab.lab.models import ModelConfig, build

    with torch.random.fork_rng(devices=[]):
        return build(ModelConfig(factory=spec), seed)


def _workload(model: str | None, given: dict[str, int | None]) -> Workload:
    from fp8lab.cost.model import TransformerShape

    if model is None:
        kw = {k: (TE_5B.get(k) if v is None else v) for k, v in given.items()}
        shape = TransformerShape(**kw)
        block = shape.linears()
        every = [(f"layers.{k}.{n}", i, o) for k in range(shape.layers) for n, i, o in block]
        header = (
            f"layer: hidden {shape.hidden}, ffn {shape.ffn}, tokens {shape.tokens}, "
            f"{shape.layers} layers"
        )
        if shape.heads is not None:
            header += f", attention: {shape.heads} heads, sequences of {shape.seq_len} (causal)"
        return Workload(block, shape.layers, shape.tokens, every, header, shape,
                        model=_stand_in(shape.layers))  # fmt: skip
    if any(v is not None for k, v in given.items() if k != "tokens"):
        raise ValueError(
            "--model sets the Linear shapes: drop --hidden/--ffn/--layers/--heads/--seq-len "
            "(attention is priced with the shape options only)"
        )
    from fp8lab.cost.shapes import (
        block_name,
        expert_routing,
        linear_shapes,
        other_parameters,
        repeated_block,
    )
    from fp8lab.lab.models import ModelConfig
    from fp8lab.lab.train import TrainConfig

    built = _model(model)
    every = linear_shapes(built)
    block, layers = repeated_block(every)
    tokens = given["tokens"]
    if tokens is None:  # the lab's default batch: 8 sequences of 128 tokens
        tokens = TrainConfig().batch_size * ModelConfig().block_size
    other = other_parameters(built, every)
    dims = ", ".join(f"{n} {i}->{o}" for n, i, o in block)
    shape_words = (
        f"{layers} layers x {len(block)} Linears" if layers > 1 else f"{len(block)} Linears"
    )
    header = (
        f"model {model}: {shape_words} quantized ({dims}); tokens {tokens}; "
        f"{other:,} other parameters"
    )
    experts = expert_routing(built)  # MoE experts run on their share of the tokens
    if experts and layers > 1:  # the folded block's names too
        experts = {**experts, **{block_name(n): v for n, v in experts.items()}}
    return Workload(block, layers, tokens, every, header, None, other, experts or None, built)


def _stand_in(layers: int) -> Any:
    """A module holding ``layers`` numbered blocks (``layers.N``, the shape path's names), so
    ``hp_last_blocks`` resolves as `fp8lab.nn.convert` resolves it on a model."""
    import torch

    m = torch.nn.Module()
    m.layers = torch.nn.ModuleList(torch.nn.Module() for _ in range(layers))
    return m


def _hp_blocks(rec: Any, work: Workload) -> Any:
    """``rec`` with ``hp_last_blocks`` / ``hp_first_blocks`` written out as ``[[layer]]`` rules
    for the workload's blocks (`fp8lab.nn.convert.resolve_blocks`, what training applies)."""
    if getattr(rec, "hp_last_blocks", 0) == 0 and getattr(rec, "hp_first_blocks", 0) == 0:
        return rec
    from fp8lab.nn.convert import resolve_blocks

    return resolve_blocks(work.model, rec, [n for n, _, _ in work.every])


def _resolve(name: str) -> Any:
    """A preset, the lab's negative control or a recipe file (as `fp8lab compare` takes)."""
    from fp8lab.lab.recipes import resolve_recipe

    return resolve_recipe(name)


def _validate(recs: dict[str, Any], work: Workload) -> None:
    """Refuse, as ``fp8lab compare`` does, a recipe whose ``[[layer]]`` rules match no Linear or
    whose blocks the GEMM shapes do not tile (errors name the recipe's file)."""
    from fp8lab.recipe.validate import check_layer_rules, check_shapes

    names = [n for n, _, _ in work.every]
    for rec in recs.values():
        if not hasattr(rec, "layers"):
            continue
        check_layer_rules(rec, names)
        check_shapes(rec, work.every if rec.layers else work.block, work.tokens)


def _price(recipes: list[str], device: str, work: Workload, scenario: str) -> tuple[Any, dict]:
    from fp8lab.cost.devices import get_device
    from fp8lab.cost.model import UnpriceableError, price_linears

    dev = get_device(device)
    # unknown names fail before any pricing; high-precision blocks written out as layer rules
    recs = {r: _hp_blocks(_resolve(r), work) for r in recipes}
    _validate(recs, work)
    layered = any(getattr(rec, "layers", ()) for rec in recs.values())
    # per-layer rules differ between layers: price every Linear, the model as one "layer"
    lins, layers = (work.every, 1) if layered else (work.block, work.layers)

    def one(rec: Any) -> Any:
        return price_linears(
            rec, dev, lins, work.tokens, scenario, work.shape, experts=work.experts
        )

    costs, skipped = {}, {}
    for r, rec in recs.items():
        try:
            costs[r] = one(rec)
        except UnpriceableError as exc:
            if not exc.device_limit:
                raise
            skipped[r] = str(exc)
    if not costs:
        raise ValueError(f"no recipe of {', '.join(recipes)} runs on {dev.name}")
    base = costs["bf16"] if "bf16" in costs else one(_resolve("bf16"))
    return dev, {"bf16_ms": base.layer_ms, "costs": costs, "skipped": skipped,
                 "layers": layers, "recipes": recs}  # fmt: skip


def _collectives(priced: dict, work: Workload, dist: dict | None) -> dict[str, Any]:
    """Per priced recipe: its `CollectiveBytes` for the whole model (``dist``: ranks,
    grad_comm, fsdp; None = not distributed)."""
    if dist is None:
        return {}
    from fp8lab.cost.collectives import collective_bytes

    return {
        r: collective_bytes(priced["recipes"][r], work.every, other=work.other, **dist)
        for r in priced["costs"]
    }


def _json(dev: Any, priced: dict, coll: dict, dist: dict | None) -> str:
    base = priced["bf16_ms"]
    out: dict[str, Any] = {
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
    for r, c in priced["costs"].items():  # MoE models only: the all-to-alls' bytes per step
        if c.wire_bytes:
            out["recipes"][r]["moe_wire_bytes"] = sum(c.wire_bytes.values()) * priced["layers"]
    if dist is not None:  # fields added only when --ranks is given (schema_version stays 1)
        out["distributed"] = {**dist, "unit": "bytes one rank sends per step (whole model)"}
        for r, cb in coll.items():
            out["recipes"][r]["collective_bytes"] = cb.to_dict()
    return json.dumps(out, indent=2)


def _tables(dev: Any, priced: dict, work: Workload, scenario: str, coll: dict) -> None:
    """The terminal tables: per GEMM, per tensor, per precision, collectives and totals."""
    con = console()
    costs, layers = priced["costs"], priced["layers"]
    con.print(
        f"{dev.name}: {dev.description}; peaks (dense TFLOPS) "
        + ", ".join(f"{k} {v:g}" for k, v in dev.peak_tflops.items())
        + f", {dev.bandwidth_tbs:g} TB/s; efficiencies calibrated on {dev.efficiencies_from}"
    )
    if dev.note:
        con.print(f"note: {dev.note}")
    con.print(f"{work.header}; scenario {scenario}")
    if layers != work.layers:
        con.print("per-layer recipe rules: every Linear is priced; 'layer' = the whole model")
    tables = [_gemm_table(costs), *_ledger_tables(costs)]
    if coll:
        tables.append(_collective_table(coll))
    tables.append(_totals_table(priced))
    for title, columns, rows, keys in tables:
        # whole cells at any width: constant columns to a caption, the rest folded (_common)
        for t in fitted_tables(title, columns, rows, con.width, keys=keys):
            con.print(t)


#: a table to print: title, (column, justify) pairs, rows, leading key columns
_Table = tuple[str, list[tuple[str, str]], list[list[str]], int]


def _gemm_table(costs: dict[str, Any]) -> _Table:
    names = list(costs)
    rows = []
    for i, gc in enumerate(costs[names[0]].gemms):
        cells = []
        for r in names:
            c = costs[r].gemms[i]
            cells.append(f"{c.ms * 1e3:.4g} {c.cls} {c.bound[0]}")
        rows.append([gc.name, f"{gc.m}x{gc.k}x{gc.n}", *cells])
    return ("Per-GEMM time (µs; GEMM kernel, its class and bound: c/m)",
            [("GEMM", "left"), ("M x K x N", "left"), *((r, "right") for r in names)],
            rows, 2)  # fmt: skip


def _ledger_tables(costs: dict[str, Any]) -> list[_Table]:
    """Bytes of the quantization passes: per tensor, and per precision for each recipe."""
    names = list(costs)
    ledgers = {r: costs[r].ledger() for r in names}
    tensors = sorted({t for lg in ledgers.values() for t in lg})
    rows = []
    for t in tensors:
        cells = []
        for r in names:
            row = ledgers[r].get(t, {})
            rd = sum(v for k, v in row.items() if k.startswith("read")) / 1e6
            wr = sum(v for k, v in row.items() if k.startswith("written")) / 1e6
            cells.append(f"{rd:.0f}+{wr:.0f}" if row else "-")
        rows.append([t, *cells])
    per_tensor = ("Per-tensor bytes ledger (MB read + written by its quantization passes)",
                  [("tensor", "left"), *((r, "right") for r in names)], rows, 1)  # fmt: skip
    keys = sorted({k for lg in ledgers.values() for row in lg.values() for k in row})
    rows = []
    for r in names:
        tot_r = {k: sum(row.get(k, 0) for row in ledgers[r].values()) for k in keys}
        rows.append([r, *(f"{tot_r[k] / 1e6:.1f}" for k in keys)])
    per_precision = ("Quantization bytes per layer by precision (MB)",
                     [("recipe", "left"), *((k.replace(":", " "), "right") for k in keys)],
                     rows, 1)  # fmt: skip
    return [per_tensor, per_precision]


def _collective_table(coll: dict[str, Any]) -> _Table:
    first = next(iter(coll.values()))
    how = f"{first.ranks} ranks, grad-comm {first.grad_comm}" + (
        (", FSDP, FP8 all-gather" if first.fp8_allgather else ", FSDP") if first.fsdp else ""
    )
    labels = [("gradient " + ("reduce-scatter" if first.fsdp else "all-reduce"), "grad_reduce"),
              ("amax all-reduces", "amax_allreduce"), ("FSDP weight all-gathers", "fsdp_allgather"),
              ("total", "total")]  # fmt: skip
    rows = [
        [label, *(f"{getattr(cb, attr) / 1e6:.4g}" for cb in coll.values())]
        for label, attr in labels
    ]
    rows.append(["amax all-reduce calls", *(str(cb.amax_allreduces) for cb in coll.values())])
    return (f"Collective bytes ledger (MB one rank sends per step, whole model; {how})",
            [("collective", "left"), *((r, "right") for r in coll)], rows, 1)  # fmt: skip


def _totals_table(priced: dict) -> _Table:
    cols = ("recipe", "layer ms", "GEMM ms", "quantize ms", "quantize %", "speedup vs bf16",
            "model ms", "GB moved")  # fmt: skip
    rows = [
        [
            r,
            f"{c.layer_ms:.4g}",
            f"{c.gemm_ms:.4g}",
            f"{c.quantize_ms:.4g}",
            f"{100 * c.quantize_ms / c.layer_ms:.1f}",
            f"{priced['bf16_ms'] / c.layer_ms:.2f}x",
            f"{c.layer_ms * priced['layers']:.4g}",
            f"{c.bytes / 1e9:.2f}",
        ]
        for r, c in priced["costs"].items()
    ]
    return ("Per-layer totals", [(c, "left" if c == "recipe" else "right") for c in cols], rows, 1)


# ----------------------------------------------------------------------------- options
Recipes = Annotated[str, typer.Option(
    "--recipes",
    help="Comma-separated recipes: presets, the lab's negative control, or recipe "
    ".toml/.json files (per-layer rules are priced per Linear).",
)]  # fmt: skip
Device = Annotated[str, typer.Option("--device", help="h100, h200, h200-nvl, b200, b300.")]
Model = Annotated[str | None, typer.Option(
    "--model",
    help="Price a model's quantized Linears: gpt (the lab's GPT), MODULE:FACTORY, "
    "path/to/file.py:FACTORY or hf:CONFIG.json (as fp8lab compare --model).",
)]  # fmt: skip
Hidden = Annotated[int | None, typer.Option("--hidden", help="Hidden size (default 4096).")]
Ffn = Annotated[int | None, typer.Option("--ffn", help="FFN size (default 16384).")]
Layers = Annotated[int | None, typer.Option("--layers", help="Layers (default 24).")]
Tokens = Annotated[int | None, typer.Option(
    "--tokens", help="Tokens per step, micro-batch x sequence (default 15872)."
)]  # fmt: skip
Heads = Annotated[int | None, typer.Option(
    "--heads", help="Attention heads: price causal attention too (with --seq-len; shape path)."
)]  # fmt: skip
SeqLen = Annotated[int | None, typer.Option(
    "--seq-len", help="Sequence length of the attention (tokens = sequences x seq-len)."
)]  # fmt: skip
Scenario = Annotated[str, typer.Option("--scenario", help="training or te-benchmark (see above).")]
Ranks = Annotated[int | None, typer.Option(
    "--ranks", help="Data-parallel ranks: add the collective bytes per rank and step."
)]  # fmt: skip
GradComm = Annotated[str | None, typer.Option(
    "--grad-comm",
    help="Gradient reduction precision: fp32 (default), bf16, fp8, fp8-msamp (as fp8lab comm-sim).",
)]  # fmt: skip
Fsdp = Annotated[bool, typer.Option(
    "--fsdp", help="FSDP2: weights all-gathered (fwd + bwd; bf16), gradients reduce-scattered."
)]  # fmt: skip
Fp8Allgather = Annotated[bool, typer.Option(
    "--fp8-allgather", help="With --fsdp: quantized weights all-gathered as FP8/FP4 codes + scales."
)]  # fmt: skip
AmaxGroup = Annotated[str | None, typer.Option(
    "--amax-group",
    help="world (default: delayed-scaling amaxes all-reduced, one batched all-reduce "
    "per step) or none (local amaxes).",
)]  # fmt: skip
JsonOut = json_flag("the totals")


def cost(
    recipes: Recipes = DEFAULT_RECIPES, device: Device = "h200", model: Model = None,
    hidden: Hidden = None, ffn: Ffn = None, layers: Layers = None, tokens: Tokens = None,
    heads: Heads = None, seq_len: SeqLen = None,
    scenario: Scenario = "training", ranks: Ranks = None, grad_comm: GradComm = None,
    fsdp: Fsdp = False, fp8_allgather: Fp8Allgather = False, amax_group: AmaxGroup = None,
    json_out: JsonOut = False,
) -> None:  # fmt: skip
    """``fp8lab cost``: validate, price, then print the JSON or the tables."""
    names = [r.strip() for r in recipes.split(",") if r.strip()]
    if not names:
        raise fail("--recipes is empty")
    with clear_errors():
        dist = _dist(ranks, grad_comm, fsdp, fp8_allgather, amax_group)
        given = {"hidden": hidden, "ffn": ffn, "layers": layers, "tokens": tokens,
                 "heads": heads, "seq_len": seq_len}  # fmt: skip
        work = _workload(model, given)
        dev, priced = _price(names, device, work, scenario)
        coll = _collectives(priced, work, dist)
    for r, why in priced["skipped"].items():
        typer.echo(f"skipped {r}: {why}", err=True)
    if json_out:
        typer.echo(_json(dev, priced, coll, dist))
    else:
        _tables(dev, priced, work, scenario, coll)


def _dist(
    ranks: int | None,
    grad_comm: str | None,
    fsdp: bool,
    fp8_allgather: bool,
    amax_group: str | None,
) -> dict[str, Any] | None:
    """The collective options (None without --ranks); ValueError on a bad one or combination."""
    flags = (grad_comm is not None, fsdp, fp8_allgather, amax_group is not None)
    if ranks is None and any(flags):
        raise ValueError(
            "--grad-comm, --fsdp, --fp8-allgather and --amax-group need --ranks N "
            "(data-parallel ranks)"
        )
    if ranks is None:
        return None
    if ranks < 1:
        raise ValueError(f"--ranks must be >= 1, got {ranks}")
    from fp8lab.distributed.ddp import check_options

    dist = {
        "ranks": ranks,
        "grad_comm": grad_comm or "fp32",
        "fsdp": fsdp,
        "fp8_allgather": fp8_allgather,
        "amax_group": amax_group or "world",
    }
    check_options(dist["amax_group"], dist["grad_comm"], fsdp, fp8_allgather)
    return dist


def register(app: typer.Typer) -> None:
    app.command("cost", help=HELP)(cost)

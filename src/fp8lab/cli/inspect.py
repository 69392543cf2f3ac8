"""``fp8lab inspect FILE``: error statistics of a checkpoint's tensors under quantization specs.

Reads safetensors files, or PyTorch checkpoints through ``torch.load(weights_only=True)`` only
(arbitrary pickles are never executed). Every floating tensor found (nested dicts/lists are
walked, names joined with dots) is quantized under each ``--spec`` / ``--recipe`` and reported
with `fp8lab.stats` (SQNR, cosine, relative error, underflow %, saturation %, amax, range), with
its count of NaN and Inf elements. Empty floating tensors are listed, not measured.
"""

from __future__ import annotations

import fnmatch
import json
import pickle
from pathlib import Path
from typing import Annotated, Any

import typer

from fp8lab.cli._common import TorchDevice, clear_errors, console, json_flag, use_torch_device
from fp8lab.lab.checkpoint import CheckpointError  # the one unreadable-checkpoint error

DEFAULT_SPECS = ("e4m3:tensor", "e4m3:128x128", "mxfp8")

HELP = """Quantization error statistics of the tensors in a checkpoint.

FILE: a .safetensors file or a PyTorch checkpoint loadable with torch.load(weights_only=True).
--spec takes spec strings: FORMAT (plain cast), FORMAT:tensor|row|col|mx|nvfp4|MxK (e.g.
e4m3:128x128, e4m3:1x128) or mxfp8, mxfp8_e5m2, mxfp6, mxfp4, nvfp4. --recipe takes a recipe name
(fp8lab.recipe) and uses its weight spec (delayed scaling measured at its steady state).
Default specs: e4m3:tensor, e4m3:128x128, mxfp8. SQNR "inf" means the quantized tensor is exact.
GEMM operands (weights of fp8lab-converted layers, else tensors of 2+ dims) are listed apart from
other tensors (norms, biases); fp8lab's own state (fp8_* scales, amax histories) is skipped.
Exit code 2 for a missing, empty, unreadable or unsafe file.
"""

#: what fp8lab reads instead of a pickle it refuses
READS = (
    "fp8lab reads .safetensors files and PyTorch checkpoints of plain tensors, numbers, strings, "
    "dicts and lists (torch.load with weights_only=True) and never unpickles other objects; "
    "save the tensors with safetensors.torch.save_file(state_dict, 'model.safetensors') "
    "where the file is trusted"
)


def _is_safetensors(path: Path) -> bool:
    """safetensors layout: u64 little-endian header length, then a JSON object."""
    with path.open("rb") as f:
        head = f.read(9)
    if len(head) < 9:
        return False
    n = int.from_bytes(head[:8], "little")
    return head[8:9] == b"{" and 0 < n <= path.stat().st_size - 8


def load_tensors(path: str | Path) -> dict[str, Any]:
    """Name -> tensor for every tensor in the checkpoint (any dtype; nesting flattened).

    Raises `CheckpointError` (a ValueError) with the reason for a missing, unreadable or
    corrupt file, or one that needs full unpickling.
    """

    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file")
    if path.is_dir():
        raise CheckpointError(f"{path}: is a directory, expected a checkpoint file")
    if not path.is_file():
        raise CheckpointError(f"{path}: not a regular file, expected a checkpoint file")
    try:
        if path.stat().st_size == 0:  # also /proc files, which report size 0
            raise CheckpointError(
                f"{path}: cannot read as a checkpoint: the file is empty (0 bytes)"
            )
        return _load(path)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc})") from None


def _load(path: Path) -> dict[str, Any]:
    import torch

    if path.suffix == ".safetensors" or _is_safetensors(path):
        from safetensors.torch import load_file

        try:
            return dict(load_file(str(path)))
        except Exception as exc:  # safetensors raises its own error types
            raise CheckpointError(
                f"{path}: not a readable safetensors file ({type(exc).__name__}: {exc})"
            ) from None
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # torch's message advises weights_only=False: not offered
        raise CheckpointError(
            f"{path}: refused: it holds pickled Python objects that loading would have to run "
            f"(torch.load(weights_only=True) stops there). {READS}."
        ) from None
    except OSError:
        raise
    except Exception as exc:  # RuntimeError (bad zip), EOFError, ...
        text = str(exc).strip()
        reason = f"{type(exc).__name__}: {text.splitlines()[0] if text else 'no detail'}"
        raise CheckpointError(
            f"{path}: cannot read as safetensors or as a torch checkpoint with "
            f"weights_only=True (fp8lab never unpickles arbitrary objects): {reason}"
        ) from None
    out: dict[str, Any] = {}
    _walk(obj, "", out)
    return out


def _walk(obj: Any, prefix: str, out: dict[str, Any]) -> None:
    import torch

    if isinstance(obj, torch.Tensor):
        out[prefix or "tensor"] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _walk(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            _walk(v, f"{prefix}.{i}" if prefix else str(i), out)


def resolve_specs(specs: list[str], recipes: list[str]) -> list[tuple[str, Any]]:
    """``(display name, QuantSpec)`` for the --spec strings and --recipe names."""
    from fp8lab import stats

    out: list[tuple[str, Any]] = []
    for s in specs:
        out.append((s, stats.parse_spec(s)))
    for name in recipes:
        try:
            from fp8lab.recipe import get_recipe
        except ImportError as exc:  # pragma: no cover - recipes are part of the package
            raise ValueError(f"recipes are not available: {exc}") from None
        r = get_recipe(name)
        if r.weight is None:
            raise ValueError(f"recipe {r.name!r} keeps weights unquantized: nothing to measure")
        out.append((f"recipe:{r.name}", stats.steady_spec(r.weight)))
    if not out:
        out = [(s, stats.parse_spec(s)) for s in DEFAULT_SPECS]
    return out


def _fp8_state(names: list[str]) -> tuple[set[str], set[str]]:
    """(converted layers, fp8lab state tensors): a layer holding ``fp8_recipe`` is converted;
    its ``fp8_*`` tensors are fp8lab's state, not the model's."""
    layers = {n.rpartition(".")[0] for n in names if n.rpartition(".")[2] == "fp8_recipe"}
    state = {
        n for n in names
        if n.rpartition(".")[0] in layers and n.rpartition(".")[2].startswith("fp8_")
    }  # fmt: skip
    return layers, state


def _kind(name: str, t: Any, converted: set[str]) -> str:
    """``"gemm_operand"``: the weight of a converted layer (no converted layer in the file:
    any tensor of 2+ dims); ``"other"``: norms, biases, ... (no recipe quantizes them)."""
    layer, _, leaf = name.rpartition(".")
    if converted:
        return "gemm_operand" if layer in converted and leaf == "weight" else "other"
    return "gemm_operand" if t.dim() >= 2 else "other"


def inspect_file(
    path: str | Path,
    specs: list[tuple[str, Any]],
    pattern: str | None = None,
    per_block: tuple[int, int] | None = None,
    device: Any = None,
) -> dict[str, Any]:
    """The report of `fp8lab inspect` as data (JSON-safe: non-finite numbers are None).
    ``device``: the torch device the statistics are computed on (None: the lab's,
    `fp8lab.lab.machine.torch_device`), recorded as ``torch_device``."""
    import torch

    from fp8lab import stats
    from fp8lab.lab.machine import torch_device

    device = torch_device() if device is None else torch.device(device)
    tensors = load_tensors(path)
    report: dict[str, Any] = {"file": str(path), "specs": [n for n, _ in specs], "tensors": [],
                              "torch_device": str(device)}  # fmt: skip
    skipped, empty = [], []
    converted, state = _fp8_state(list(tensors))
    report["skipped_fp8_state"] = [n for n in tensors if n in state]
    for name, t in tensors.items():
        if name in state:
            continue
        if pattern and not fnmatch.fnmatch(name, pattern):
            continue
        if not t.is_floating_point():
            skipped.append(name)
            continue
        if t.numel() == 0:
            empty.append(name)
            continue
        t = t.detach().to(device)
        entry: dict[str, Any] = {
            "name": name,
            "kind": _kind(name, t, converted),
            "shape": list(t.shape),
            "dtype": str(t.dtype).replace("torch.", ""),
            "numel": t.numel(),
            "amax": stats.amax(t),
            "dynamic_range": stats.dynamic_range(t),
            "nonzero_pct": 100.0 * int((t != 0).sum()) / t.numel(),
            "nan_count": int(t.isnan().sum()),
            "inf_count": int(t.isinf().sum()),
            "specs": {},
        }
        for sname, spec in specs:
            xq, values, fmt = stats.quantized_pair(t, spec)
            s = stats.error_stats(t, xq, fmt, values)
            row = {
                k: s[k]
                for k in ("sqnr_db", "cosine", "rel_error", "underflow_pct", "saturation_pct")
            }
            row["exact"] = s["sqnr_db"] == float("inf")
            if per_block is not None:
                row.update(stats.block_summary(stats.block_stats(t, xq, per_block)))
            entry["specs"][sname] = row
        report["tensors"].append(entry)
    report["skipped_non_float"] = skipped
    report["empty_float"] = empty
    if not report["tensors"]:
        what = f" matching {pattern!r}" if pattern else ""
        only = f" (only empty ones: {', '.join(empty)})" if empty else ""
        raise ValueError(f"{path}: no floating-point tensors{what} to inspect{only}")
    return stats.json_safe(report)


def _num(v: Any, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _print_report(report: dict[str, Any], per_block: bool) -> None:
    """Rich tables that fit 80 columns and more: the GEMM operands, then the other tensors; one
    row per tensor x spec, the tensor's name folded (never cut) and its shape, dtype, amax,
    range and NaN/Inf counts below the name."""
    titles = {
        "gemm_operand": "GEMM operands (weights of converted layers, else tensors of 2+ dims)",
        "other": "other tensors (norms, biases, ...: no recipe quantizes them)",
    }
    con = console()
    for kind, heading in titles.items():
        part = [t for t in report["tensors"] if t.get("kind", "gemm_operand") == kind]
        if part:
            con.print(_table(report["file"], heading, part, per_block))


def _table(file: str, heading: str, tensors: list[dict[str, Any]], per_block: bool) -> Any:
    from rich import box
    from rich.table import Table

    table = Table(
        title=f"fp8lab inspect {_escape(file)}: {heading}",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
        caption="uflow % = nonzeros flushed to 0; sat % = values clamped to the largest",
        caption_justify="left",
    )
    table.add_column("tensor", overflow="fold", ratio=1, min_width=10)
    table.add_column("spec", overflow="fold", min_width=8)
    for col in ("SQNR dB", "cosine", "rel err", "uflow %", "sat %"):
        table.add_column(col, justify="right", no_wrap=True)
    if per_block:
        table.add_column("min blk dB", justify="right", no_wrap=True)
    for t in tensors:
        about = [
            "x".join(map(str, t["shape"])) + f" {t['dtype']}",
            f"amax {_num(t['amax'], '.4g')}, range {_num(t['dynamic_range'], '.1f')}",
        ]
        if t["nan_count"] or t["inf_count"]:
            about.append(f"[bold red]NaN {t['nan_count']}, Inf {t['inf_count']}[/]")
        for i, (sname, s) in enumerate(t["specs"].items()):
            sq = "inf (exact)" if s["exact"] else _num(s["sqnr_db"], ".2f")
            name = _escape(t["name"]) + "\n[dim]" + "\n".join(about) + "[/]" if i == 0 else ""
            row = [
                name,
                _escape(sname),
                sq,
                _num(s["cosine"], ".6f"),
                _num(s["rel_error"], ".3g"),
                _num(s["underflow_pct"], ".2f"),
                _num(s["saturation_pct"], ".2f"),
            ]
            if per_block:
                v = s.get("min_block_sqnr_db")
                row.append("inf" if v is None and s["exact"] else _num(v, ".2f"))
            table.add_row(*row, end_section=i == len(t["specs"]) - 1)
    return table


def _notes(report: dict[str, Any]) -> None:
    bad = [t["name"] for t in report["tensors"] if t["nan_count"] or t["inf_count"]]
    if bad:
        typer.echo(f"{len(bad)} tensor(s) hold NaN or Inf: {', '.join(bad)}")
    if report["empty_float"]:
        names = ", ".join(report["empty_float"])
        typer.echo(f"{len(report['empty_float'])} empty floating tensor(s), not measured: {names}")
    if report["skipped_non_float"]:
        typer.echo(f"skipped {len(report['skipped_non_float'])} non-floating tensors")
    if report.get("skipped_fp8_state"):
        typer.echo(
            f"skipped {len(report['skipped_fp8_state'])} tensors of fp8lab's own state "
            "(fp8_* scales, amax histories, step counters, recipe)"
        )


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def _parse_block(value: str | None) -> tuple[int, int] | None:
    if value is None:
        return None
    try:
        m, k = (int(v) for v in value.lower().split("x"))
    except ValueError:
        raise ValueError(f"--per-block: expected MxK such as 128x128, got {value!r}") from None
    if m <= 0 or k <= 0:
        raise ValueError(f"--per-block: block sizes must be positive, got {value!r}")
    return (m, k)


FileArg = Annotated[Path, typer.Argument(help="Checkpoint (.safetensors or torch.save file).")]
Spec = Annotated[list[str], typer.Option(
    "--spec", help="Spec string (repeatable), e.g. e4m3:128x128, mxfp8."
)]  # fmt: skip
Recipe = Annotated[list[str], typer.Option(
    "--recipe", help="Recipe name (repeatable); its weight spec is used."
)]  # fmt: skip
Tensors = Annotated[str | None, typer.Option(
    "--tensors", help="Only tensors whose name matches this glob."
)]  # fmt: skip
PerBlock = Annotated[str | None, typer.Option(
    "--per-block", help="Add per-block worst SQNR over MxK blocks, e.g. 128x128."
)]  # fmt: skip
JsonOut = json_flag("the report")


def inspect_command(
    file: FileArg,
    spec: Spec = [],  # noqa: B006 (typer always passes a fresh list)
    recipe: Recipe = [],  # noqa: B006 (typer always passes a fresh list)
    tensors: Tensors = None,
    per_block: PerBlock = None,
    json_out: JsonOut = False,
    torch_device: TorchDevice = "auto",
) -> None:
    with clear_errors():
        use_torch_device(torch_device)
        try:
            specs = resolve_specs(list(spec), list(recipe))
            report = inspect_file(file, specs, tensors, _parse_block(per_block))
        except (TypeError, KeyError) as exc:
            raise ValueError(exc.args[0] if exc.args else str(exc)) from None
    if json_out:
        typer.echo(json.dumps(report, allow_nan=False))
    else:
        _print_report(report, per_block is not None)
        _notes(report)


def register(app: typer.Typer) -> None:
    app.command("inspect", help=HELP)(inspect_command)

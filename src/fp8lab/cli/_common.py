"""What every command shares: clear errors with exit code 2, and consoles that fit the terminal."""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Annotated, Any

import typer

#: exit code of bad input (missing or unreadable file, invalid value, full disk)
BAD_INPUT = 2
#: exit code after Ctrl-C (128 + SIGINT), as shells report it
INTERRUPTED = 130

# options several commands share, declared once (typer reads the Annotated metadata; each
# command gives its own default in its signature)
#: --out: the output directory
OutDir = Annotated[Path, typer.Option("--out", help="Output directory.")]
#: --quiet: no progress on stderr
Quiet = Annotated[bool, typer.Option("--quiet", help="No progress output.")]
#: --torch-device: where torch computes (not --device, the cost model's GPU)
TorchDevice = Annotated[str, typer.Option(
    "--torch-device",
    help="Torch device to compute on: cpu, cuda, cuda:N or auto (cuda when CUDA is "
    "available, else cpu; under torchrun each rank's LOCAL_RANK GPU). Recorded as "
    "machine.torch_device; a run resumes on another device.",
)]  # fmt: skip
#: --executor / --ray-address: where the independent jobs run (fp8lab.lab.pool.set_executor)
Executor = Annotated[str, typer.Option(
    "--executor",
    help="Where the parallel jobs (--jobs > 1) run: local (spawned processes on this "
    "machine) or ray (a Ray cluster: pip install 'fp8lab[ray]'; --out must be a filesystem "
    "the workers share).",
)]  # fmt: skip
RayAddress = Annotated[str | None, typer.Option(
    "--ray-address",
    help="With --executor ray: the cluster, HOST:PORT, ray://HOST:PORT or auto (default: "
    "start a local Ray instance).",
    show_default=False,
)]  # fmt: skip


def use_executor(kind: str, address: str | None) -> None:
    """``--executor`` / ``--ray-address`` (`fp8lab.lab.pool.set_executor`): ValueError (exit 2
    under `clear_errors`) for an unknown executor, Ray not installed (naming the extra) or an
    unreachable address, before any work."""
    from fp8lab.lab.pool import set_executor

    set_executor(kind, address)


def echo_machine_mismatch(ev: dict[str, Any], quiet: bool = False) -> bool:
    """Print a ``machine_mismatch`` event (a job ran on a machine that should not give this
    machine's bits: `fp8lab.lab.ray_executor`) on stderr; True when ``ev`` was one."""
    if ev.get("event") != "machine_mismatch":
        return False
    if not quiet:
        typer.echo(f"warning: {ev['text']}", err=True)
    return True


def use_torch_device(value: str) -> Any:
    """Resolve ``--torch-device`` and make it the lab's device in this process
    (`fp8lab.lab.machine.set_torch_device`); returns the concrete torch.device. ValueError
    (exit 2 under `clear_errors`): unknown value, no CUDA, a GPU index that does not exist, an
    ``FP8LAB_DETERMINISTIC`` other than 0 or 1, an ``FP8LAB_TRITON`` other than 0, 1 or
    interpret (checked here, before any work)."""
    from fp8lab.gemm.fused_triton import get_triton
    from fp8lab.lab.machine import deterministic_for, set_torch_device, torch_device

    set_torch_device(value)
    deterministic_for(torch_device())
    get_triton()
    return torch_device()


def check_kernels() -> None:
    """ValueError naming ``FP8LAB_KERNELS`` when it holds an unknown kernel choice."""
    from fp8lab.kernels import get_kernels

    get_kernels()


# the model's starting weights and the data's tokens (compare and debug; fp8lab.lab.models,
# fp8lab.lab.tokens)
#: --tokenizer: a local tokenizer.json encoding --data's text
Tokenizer = Annotated[Path | None, typer.Option(
    "--tokenizer",
    help="A local tokenizer.json (Hugging Face tokenizers, read offline) that encodes the text "
    "of --data instead of UTF-8 bytes; with a token file, the vocabulary its ids must fit. "
    "Default: the tokenizer.json of an hf:DIR model when DIR has one, else bytes. Same as "
    "--set data.tokenizer=PATH.",
    show_default=False,
)]  # fmt: skip
#: --token-dtype: the id type of a .bin token file
TokenDtype = Annotated[str | None, typer.Option(
    "--token-dtype",
    help="Id type of a .bin token file given to --data: uint16, uint32, or auto (default: "
    "uint32 when the vocabulary, --tokenizer's or else the model config's, has more than "
    "65536 ids, else uint16, as nanoGPT writes them).",
    show_default=False,
)]  # fmt: skip
#: --init-from: initial weights for the built-in GPT or a factory's model
InitFrom = Annotated[Path | None, typer.Option(
    "--init-from",
    help="Start the model from the weights of a .safetensors file (the keys of the model's own "
    "state_dict(), matched strictly): the built-in GPT, a factory's model or hf:CONFIG.json. "
    "Not with hf:DIR, which starts from its directory's weights (the pair is refused). Same as "
    "--set model.init_from=PATH.",
    show_default=False,
)]  # fmt: skip


def json_flag(what: str) -> Any:
    """The ``--json`` flag of a command that prints ``what`` ("the summary") as JSON."""
    return Annotated[bool, typer.Option("--json", help=f"Print {what} as JSON.")]


def fail(message: str) -> typer.Exit:
    """Print ``Error: message`` on stderr; return the exit (code 2) to raise."""
    typer.echo(f"Error: {message}", err=True)
    return typer.Exit(BAD_INPUT)


def os_error_message(exc: OSError) -> str:
    """One line for an OSError: its text and file; a full disk always says "no space left"."""
    text = exc.strerror or str(exc)
    if exc.filename is not None:
        text = f"{exc.filename}: {text}"
    if exc.errno == errno.ENOSPC and "no space left" not in text.lower():
        text = f"no space left on the device: {text}"
    return text


@contextlib.contextmanager
def clear_errors(interrupted: str = "interrupted") -> Iterator[None]:
    """Turn expected failures into one line on stderr and exit code 2 instead of a traceback:
    ValueError (bad input, refused files), OSError (missing or unwritable paths, full disk).
    Ctrl-C prints ``interrupted`` and exits 130."""
    try:
        yield
    except KeyboardInterrupt:
        typer.echo(interrupted, err=True)
        raise typer.Exit(INTERRUPTED) from None
    except OSError as exc:
        raise fail(os_error_message(exc)) from None
    except ValueError as exc:
        raise fail(str(exc)) from None


def console(stderr: bool = False) -> Any:
    """A rich Console: the terminal's width, or ``COLUMNS`` when set; 120 columns when writing
    to a pipe or file without ``COLUMNS`` (tables are wrapped to fit, never cut)."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() or os.environ.get("COLUMNS") else 120
    return Console(width=width, stderr=stderr)


#: options of `table` that shape the table itself; every other option goes to each column
_TABLE_OPTIONS = ("box", "title_justify", "pad_edge", "collapse_padding")


def table(title: str, columns: Iterable[tuple[str, str]], **options: Any) -> Any:
    """A rich Table titled ``title`` with ``(name, justify)`` columns; ``options`` go to each
    column, except ``box``, ``title_justify``, ``pad_edge`` and ``collapse_padding``, which go
    to the table."""
    from rich.table import Table

    own = {k: options.pop(k) for k in _TABLE_OPTIONS if options.get(k) is not None}
    t = Table(title=title, **own)
    for name, justify in columns:
        t.add_column(name, justify=justify, **options)
    return t


def comma_items(value: str, name: str) -> list[str]:
    """The non-empty items of a comma list given to ``--name``; ValueError when there are none."""
    items = [v.strip() for v in str(value).split(",") if v.strip()]
    if not items:
        raise ValueError(f"--{name}: empty value")
    return items


def comma_ints(value: str, name: str, allow_none: bool = False) -> list[int | None]:
    """A comma list of integers given to ``--name`` (``none`` too when ``allow_none``)."""
    out: list[int | None] = []
    for item in comma_items(value, name):
        if allow_none and item.lower() == "none":
            out.append(None)
            continue
        try:
            out.append(int(item))
        except ValueError:
            raise ValueError(
                f"--{name}: {item!r} is not an integer" + (" or 'none'" if allow_none else "")
            ) from None
    return out


PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def check_plot_path(path: Path, option: str = "--plot") -> None:
    """Refuse a figure path that cannot be written, before any work: a suffix matplotlib does
    not write as an image, a directory, or a folder that cannot be created or written."""
    if path.suffix.lower() not in PLOT_SUFFIXES:
        raise ValueError(
            f"{option} {path}: the file name must end in {', '.join(PLOT_SUFFIXES)} "
            f"(got {path.suffix or 'no suffix'!r})"
        )
    if path.is_dir():
        raise ValueError(f"{option} {path}: is a directory, expected a file name")
    _check_dir(path.parent, f"{option} {path}")
    if path.exists():
        if not os.access(path, os.W_OK):
            raise ValueError(f"{option} {path}: not writable")
        return
    try:  # a probe: permission bits say nothing to root, and /proc refuses new files
        path.open("xb").close()
        path.unlink()
    except OSError as exc:
        raise ValueError(f"{option} {path}: cannot be written ({exc.strerror})") from None


def check_out_dir(path: Path, option: str = "--out") -> None:
    """Refuse an output directory that is a file or cannot be created or written, before any
    work (nothing is created but the directory itself)."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"{option} {path}: is a file, expected a directory")
    _check_dir(path, f"{option} {path}")


def _check_dir(path: Path, what: str) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{what}: cannot create {path} ({exc.strerror})") from None
    try:  # a probe file: permission bits say nothing to root
        tempfile.TemporaryFile(dir=path).close()
    except OSError as exc:
        raise ValueError(f"{what}: {path} is not writable ({exc.strerror})") from None


def with_run_options(
    cfg: Any,
    overrides: list[str] | None,
    model: str | None,
    steps: int | None,
    data: Any,
    tokenizer: Path | None = None,
    token_dtype: str | None = None,
    init_from: Path | None = None,
) -> Any:
    """``cfg`` (a `fp8lab.lab.train.LabConfig`) with the options ``compare`` and ``debug``
    share applied in their order: ``--set`` assignments, ``--model``, ``--steps``, ``--data``,
    ``--tokenizer``, ``--token-dtype``, ``--init-from``. ValueError for ``--set
    model.vocab_size`` with a factory or ``hf:`` model, which has its own vocabulary."""
    from dataclasses import replace

    from fp8lab.lab.models import ModelConfig, check_factory_keys

    if overrides:
        cfg = cfg.with_overrides(overrides)
    if model is not None:
        cfg = replace(cfg, model=ModelConfig(**{**cfg.model.to_dict(), "factory": model}))
    if init_from is not None:
        cfg = replace(
            cfg, model=ModelConfig(**{**cfg.model.to_dict(), "init_from": str(init_from)})
        )
    if steps is not None:
        cfg = cfg.replace_train(steps=steps)
    if data:
        cfg = replace(cfg, data=replace(cfg.data, paths=tuple(map(str, data))))
    if tokenizer is not None:
        cfg = replace(cfg, data=replace(cfg.data, tokenizer=str(tokenizer)))
    if token_dtype is not None:
        cfg = replace(cfg, data=replace(cfg.data, token_dtype=token_dtype))
    keys = [o.partition("=")[0].strip() for o in overrides or []]
    check_factory_keys(cfg.model, [k[6:] for k in keys if k.startswith("model.")], "--set")
    return cfg


def check_model_data(cfg: Any) -> Any:
    """Before any training: the model's weight files exist and fit (their hashes are taken),
    and the data's tokens fit the model's vocabulary (a tokenizer or token file); ValueError
    naming the file otherwise. Byte text always fits (every model has V >= 256). Returns
    ``cfg`` with a ``.bin`` file's ``token_dtype = "auto"`` made concrete when no tokenizer
    gives the vocabulary: uint32 when the model declares more than 65536 ids
    (`fp8lab.lab.tokens.bin_dtype`), recorded so that a resume reads the same ids; and with
    ``data.tokenizer`` set to an ``hf:DIR`` model's ``tokenizer.json`` when none is given
    (`fp8lab.lab.models.hf_tokenizer`: the model's own tokens, not bytes)."""
    from dataclasses import replace

    from fp8lab.lab import models
    from fp8lab.lab.data import load_corpus
    from fp8lab.lab.tokens import bin_dtype, is_token_file

    models.model_identity(cfg.model)  # a missing --init-from or weight file fails here
    own = None if cfg.data.tokenizer else models.hf_tokenizer(cfg.model)
    if own is not None:
        cfg = replace(cfg, data=replace(cfg.data, tokenizer=str(own)))
    paths = cfg.data.paths
    token_file = bool(paths) and is_token_file(paths[0])
    if token_file and cfg.data.token_dtype == "auto" and not cfg.data.tokenizer:
        dtype = bin_dtype("auto", models.declared_vocab(cfg.model)).name
        if dtype != "uint16" and paths[0].lower().endswith(".bin"):
            cfg = replace(cfg, data=replace(cfg.data, token_dtype=dtype))
    if cfg.data.tokenizer or token_file:
        corpus = load_corpus(cfg.data, cfg.model.block_size)
        models.check_data_fits(cfg.model, corpus, cfg.train.seed)
    return cfg


def fitted_tables(
    title: str,
    columns: list[tuple[str, str]],
    rows: list[list[str]],
    width: int,
    keys: int = 1,
    *,
    wrap: Iterable[str] = (),
    **options: Any,
) -> list[Any]:
    """Tables that show ``rows`` whole within ``width`` columns, never cutting a cell: the one
    table when it fits; else columns holding the same value in every row leave the table for a
    caption (``same in every row: name value; ...``); else the other columns are folded into
    several tables, each repeating the first ``keys`` columns. Cells never wrap, except in the
    columns named in ``wrap``, which break at spaces only (never inside a word; a table fits
    when those columns are as narrow as their longest word). ``options`` go to `table`."""
    from rich.console import Console
    from rich.measure import Measurement

    probe = Console(width=10_000, file=open(os.devnull, "w"))  # noqa: SIM115 (closed below)
    wrap = set(wrap)
    # a wrapping column is never narrower than its longest word (header included)
    narrowest = {
        i: max((len(w) for text in [name, *(r[i] for r in rows)] for w in text.split()), default=1)
        for i, (name, _) in enumerate(columns)
        if name in wrap
    }

    def build(t_title: str, idx: list[int], caption: str | None = None, narrow: bool = False):
        """The table of columns ``idx``; ``narrow``: wrapping cells one word a line, as narrow
        as they may get (to measure the width the table needs)."""
        t = table(t_title, [columns[i] for i in idx], no_wrap=True, **options)
        for col, i in zip(t.columns, idx, strict=True):
            if i in narrowest:
                col.no_wrap, col.overflow, col.min_width = False, "fold", narrowest[i]
        if caption:
            t.caption = caption
            t.caption_justify = "left"
        for r in rows:
            t.add_row(*("\n".join(r[i].split()) if narrow and i in narrowest else r[i]
                        for i in idx))  # fmt: skip
        return t

    def fits(t_title: str, idx: list[int], caption: str | None = None) -> bool:
        t = build(t_title, idx, caption, narrow=True)
        return Measurement.get(probe, probe.options, t).maximum <= width

    try:
        every = list(range(len(columns)))
        if fits(title, every):
            return [build(title, every)]
        fixed = [i for i in every[keys:] if len(rows) > 1 and all(r[i] == rows[0][i] for r in rows)]
        kept = [i for i in every if i not in fixed]
        caption = (
            "same in every row: "
            + "; ".join(f"{' '.join(columns[i][0].split())} {rows[0][i]}" for i in fixed)
            if fixed
            else None
        )
        if fits(title, kept, caption):
            return [build(title, kept, caption)]
        key_idx, rest = kept[:keys], kept[keys:]
        groups: list[list[int]] = []
        for i in rest:
            if groups and fits("", key_idx + groups[-1] + [i]):
                groups[-1].append(i)
            else:
                groups.append([i])
        out = []
        for n, g in enumerate(groups):
            t_title = title if n == 0 else f"{title} (continued)"
            last = n == len(groups) - 1
            out.append(build(t_title, key_idx + g, caption if last else None))
        return out
    finally:
        probe.file.close()


#: what Ctrl-C prints for a command that resumes from its checkpoints
INTERRUPTED_RESUME = "interrupted; rerun the same command to resume"


def command_line() -> str:
    """The command as typed (``fp8lab ...``, shell-quoted), for a report's header."""
    import shlex

    return "fp8lab " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def stop_on_sigterm() -> None:
    """A plain ``kill`` unwinds like Ctrl-C, so worker processes are stopped and checkpoints
    stay."""
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def lab_config(path: Path | None, extra: tuple[str, ...] = ()) -> tuple[Any, dict[str, Any]]:
    """The `fp8lab.lab.train.LabConfig` of ``--config`` (the defaults without one) and its
    ``extra`` tables; ValueError naming the file on any other table."""
    from fp8lab.lab.train import LabConfig

    cfg, rest = LabConfig.from_toml(path) if path else (LabConfig(), {})
    unknown = sorted(set(rest) - set(extra))
    if unknown:
        valid = " ".join(f"[{t}]" for t in ("model", "data", "train", "inject", *extra))
        raise ValueError(f"{path}: unknown table(s) {unknown}; valid: {valid}")
    return cfg, rest

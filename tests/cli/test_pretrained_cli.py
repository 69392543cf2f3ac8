"""Issue 25 through the command line: ``compare --model hf:DIR`` starts from the directory's
weights (its first loss equals transformers' own on the same batch), ``--tokenizer`` and token
files, ``--init-from``, and exit code 2 naming the file for every bad input; ``debug`` takes
the same options."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from fp8lab.cli import app
from tiny_lab import tiny_lab_toml

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

runner = CliRunner()
LLAMA = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}  # fmt: skip
TRAIN = {"steps": 2, "batch_size": 2, "eval_every": 1, "checkpoint_every": 2}


@pytest.fixture
def text(tmp_path) -> Path:
    f = tmp_path / "text.txt"
    f.write_text("Friends, Romans, countrymen, lend me your ears; I come to bury Caesar. " * 40)
    return f


@pytest.fixture
def llama_dir(tmp_path) -> Path:
    torch.manual_seed(1)
    d = tmp_path / "llama"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).save_pretrained(d)
    return d


def _compare(tmp_path: Path, text: Path, *args: str, out: Path | None = None):
    conf = tmp_path / "c.toml"
    conf.write_text(tiny_lab_toml(text, {"block_size": 32}, **TRAIN))
    out = out or tmp_path / "out"
    res = runner.invoke(app, ["compare", "--config", str(conf), "--out", str(out), "--quiet",
                              "--jobs", "1", "--threads", "1", *args])  # fmt: skip
    return res, out


def _bad(res, *words: str) -> None:
    assert res.exit_code == 2, (res.exit_code, res.output)
    assert "Traceback" not in res.output
    for w in words:
        assert w in res.stderr, (w, res.stderr)


def test_hf_dir_first_loss_equals_transformers(tmp_path, text, llama_dir):
    """The acceptance check: the fp32 recipe's first training loss (step 1 of metrics.jsonl)
    equals, bit for bit, the loss transformers computes for the directory's model (loaded with
    from_pretrained) on the same batch."""
    from fp8lab.lab.data import get_batch, load_corpus
    from fp8lab.lab.train import LabConfig

    res, out = _compare(tmp_path, text, "--model", f"hf:{llama_dir}", "--recipes", "fp32,bf16",
                        "--baseline", "fp32", "--json")  # fmt: skip
    assert res.exit_code == 0, res.output
    meta = json.loads((out / "config.json").read_text())
    digest = meta["model"]["weights_sha256"]["model.safetensors"]
    import hashlib

    assert digest == hashlib.sha256((llama_dir / "model.safetensors").read_bytes()).hexdigest()
    first = json.loads((out / "runs/fp32/metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1
    cfg = LabConfig.from_dict(meta["lab"])
    corpus = load_corpus(cfg.data, cfg.model.block_size)
    x, y = get_batch(corpus.train, cfg.train.batch_size, cfg.model.block_size, cfg.train.seed, 0)
    ref = transformers.AutoModelForCausalLM.from_pretrained(llama_dir).train()
    y = y.cpu().contiguous()  # a view of the windows; transformers' loss needs .view()
    want = ref(input_ids=x.cpu(), labels=y, shift_labels=y).loss.item()
    assert first["train_loss"] == want
    # other weights in the same directory: the run is refused on rerun (the hash changed)
    torch.manual_seed(2)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).save_pretrained(llama_dir)
    res2, _ = _compare(tmp_path, text, "--model", f"hf:{llama_dir}", "--recipes", "fp32,bf16",
                       "--baseline", "fp32")  # fmt: skip
    _bad(res2, "different configuration", "weights_sha256")


def test_tokenizer_and_token_files_train(tmp_path, text):
    from tokenizers import Tokenizer, pre_tokenizers, trainers
    from tokenizers.models import BPE

    tk = Tokenizer(BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.train_from_iterator([text.read_text()], trainers.BpeTrainer(
        vocab_size=300, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))  # fmt: skip
    tk.save(str(tmp_path / "tok.json"))
    v = tk.get_vocab_size()
    # the built-in GPT has 256 ids: the tokenizer's are more -> exit 2, both named
    res, out = _compare(tmp_path, text, "--tokenizer", str(tmp_path / "tok.json"), "--recipes",
                        "bf16")  # fmt: skip
    _bad(res, str(tmp_path / "tok.json"), f"has {v} ids", "vocabulary of 256")
    assert not out.exists()
    res, out = _compare(tmp_path, text, "--tokenizer", str(tmp_path / "tok.json"), "--recipes",
                        "bf16", "--set", "model.vocab_size=320", "--json")  # fmt: skip
    assert res.exit_code == 0, res.output
    assert json.loads((out / "config.json").read_text())["lab"]["data"]["tokenizer"] == str(
        tmp_path / "tok.json"
    )
    # the same ids as a nanoGPT .bin file
    np.array(tk.encode(text.read_text()).ids * 4, np.uint16).tofile(tmp_path / "ids.bin")
    res, _ = _compare(tmp_path, text, "--data", str(tmp_path / "ids.bin"), "--recipes", "bf16",
                      "--set", "model.vocab_size=320", out=tmp_path / "o2")  # fmt: skip
    assert res.exit_code == 0, res.output
    # ... and against the 256-id GPT: the first out-of-vocabulary id, its file and offset
    res, _ = _compare(tmp_path, text, "--data", str(tmp_path / "ids.bin"), "--recipes", "bf16",
                      out=tmp_path / "o3")  # fmt: skip
    _bad(res, str(tmp_path / "ids.bin"), "offset", "is outside the vocabulary", "256 ids")


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("dir_without_config", ["has no config.json"]),
        ("dir_without_weights", ["has no weights"]),
        ("weights_not_fitting", ["do not fit the model", "model.safetensors"]),
        ("truncated_bin", ["ids.bin", "not a whole number of uint16 ids"]),
        ("lying_npy", ["ids.npy", "header says"]),
        ("init_from_missing", ["--init-from", "nope.safetensors", "no such file"]),
    ],
)
@pytest.mark.parametrize("command", ["compare", "debug"])
def test_bad_input_exit_2_names_the_file(tmp_path, text, llama_dir, case, words, command):
    model, data, extra = f"hf:{llama_dir}", [], []
    if case == "dir_without_config":
        (llama_dir / "config.json").unlink()
    elif case == "dir_without_weights":
        (llama_dir / "model.safetensors").unlink()
    elif case == "weights_not_fitting":
        cfg = json.loads((llama_dir / "config.json").read_text())
        (llama_dir / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    elif case == "truncated_bin":
        (tmp_path / "ids.bin").write_bytes(b"\x01\x00" * 500 + b"\x02")
        data = ["--data", str(tmp_path / "ids.bin")]
    elif case == "lying_npy":
        np.save(tmp_path / "ids.npy", np.arange(2000, dtype=np.int32) % 200)
        raw = (tmp_path / "ids.npy").read_bytes()
        (tmp_path / "ids.npy").write_bytes(raw[: len(raw) - 40])
        data = ["--data", str(tmp_path / "ids.npy")]
    else:
        model, extra = "gpt", ["--init-from", str(tmp_path / "nope.safetensors")]
    if "dir" in case or "weights" in case:
        words = [*words, str(llama_dir)]
    out = tmp_path / "out"
    if command == "compare":
        res, _ = _compare(tmp_path, text, "--model", model, *data, *extra, "--recipes", "bf16")
    else:
        conf = tmp_path / "d.toml"
        conf.write_text(tiny_lab_toml(text, {"block_size": 32}, steps=4, batch_size=2))
        res = runner.invoke(app, ["debug", "--config", str(conf), "--out", str(out), "--recipe",
                                  "te-current", "--model", model, *data, *extra])  # fmt: skip
    _bad(res, *words)
    assert not out.exists() or not any(out.iterdir())


def test_init_from_for_the_builtin_gpt(tmp_path, text):
    from safetensors.torch import save_file

    from fp8lab.lab.gpt import GPT
    from fp8lab.lab.train import LabConfig

    conf = tmp_path / "c.toml"
    conf.write_text(tiny_lab_toml(text, {"block_size": 32}, **TRAIN))
    cfg, _ = LabConfig.from_toml(conf)
    torch.manual_seed(5)
    save_file(GPT(cfg.model).state_dict(), tmp_path / "w.safetensors")
    res, out = _compare(tmp_path, text, "--init-from", str(tmp_path / "w.safetensors"),
                        "--recipes", "bf16")  # fmt: skip
    assert res.exit_code == 0, res.output
    meta = json.loads((out / "config.json").read_text())
    assert meta["lab"]["model"]["init_from"] == str(tmp_path / "w.safetensors")
    assert list(meta["model"]["init_from_sha256"]) == ["w.safetensors"]


def test_debug_runs_on_hf_dir_and_a_token_file(tmp_path, text, llama_dir):
    """``fp8lab debug`` takes the same model and data options (the plumbing is shared)."""
    np.save(tmp_path / "ids.npy", (np.arange(20_000) * 7919 % 256).astype(np.int32))
    conf = tmp_path / "d.toml"
    conf.write_text(tiny_lab_toml(text, {"block_size": 32}, steps=4, batch_size=2,
                                  warmup_steps=1, eval_every=2, checkpoint_every=100))  # fmt: skip
    out = tmp_path / "dbg"
    res = runner.invoke(app, ["debug", "--config", str(conf), "--out", str(out), "--recipe",
                              "te-current", "--model", f"hf:{llama_dir}", "--data",
                              str(tmp_path / "ids.npy"), "--json", "--quiet",
                              "--threads", "1"])  # fmt: skip
    assert res.exit_code == 0, res.output
    result = json.loads(res.stdout)
    assert result["recipe"] == "te-current" and result["gap_pct"] is not None
    assert (out / "report.html").exists()


def test_bin_id_type_follows_a_model_vocabulary_over_65536(tmp_path):
    """``--token-dtype auto`` with no tokenizer: the model's declared vocabulary chooses, and
    the choice is recorded in the config (a resume reads the same ids)."""
    from fp8lab.cli._common import check_model_data
    from fp8lab.lab.data import DataConfig
    from fp8lab.lab.models import ModelConfig
    from fp8lab.lab.train import LabConfig

    np.array([70_000, 5, 69_999] * 300, np.uint32).tofile(tmp_path / "ids.bin")
    (tmp_path / "big.json").write_text(json.dumps({"model_type": "llama", **LLAMA,
                                                   "vocab_size": 70_016}))  # fmt: skip
    data = DataConfig(paths=(str(tmp_path / "ids.bin"),), split_chunk=64)
    cfg = LabConfig(model=ModelConfig(factory=f"hf:{tmp_path / 'big.json'}", block_size=8),
                    data=data)  # fmt: skip
    assert check_model_data(cfg).data.token_dtype == "uint32"
    small = LabConfig(model=ModelConfig(block_size=8), data=data)  # the GPT: 256 ids, uint16
    with pytest.raises(ValueError, match="is outside the vocabulary of the model"):
        check_model_data(small)
    assert check_model_data(LabConfig(model=ModelConfig(block_size=8, vocab_size=70_016),
                                      data=data)).data.token_dtype == "uint32"  # fmt: skip

"""What a new user of ``--model hf:DIR`` and ``debug --from-checkpoint`` hit (issue 32, part 6):
NaN or integer weights, the directory's tokenizer.json, --init-from's help and behaviour,
``--set model.vocab_size`` on an hf: model, --from-checkpoint without --model, and the process
environment left alone (part 5: no HF_HUB_OFFLINE set by the library)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from fp8lab.cli import app
from fp8lab.cli._common import check_model_data, with_run_options
from fp8lab.lab import models
from fp8lab.lab.train import LabConfig
from tiny_lab import tiny_lab_toml

transformers = pytest.importorskip("transformers")

runner = CliRunner()
LLAMA = {"vocab_size": 320, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
         "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 64}  # fmt: skip
TEXT = "Friends, Romans, countrymen, lend me your ears; I come to bury Caesar. " * 40


@pytest.fixture
def text(tmp_path) -> Path:
    f = tmp_path / "text.txt"
    f.write_text(TEXT)
    return f


def _llama_dir(d: Path, **tensors: torch.Tensor) -> Path:
    """A save_pretrained directory of a tiny Llama; ``tensors`` replace saved tensors."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(1)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).save_pretrained(d)
    if tensors:
        sd = load_file(str(d / "model.safetensors"))
        save_file({**sd, **tensors}, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


def _run(tmp_path: Path, text: Path, command: str, *args: str):
    conf = tmp_path / "c.toml"
    conf.write_text(tiny_lab_toml(text, {"block_size": 16}, steps=4, batch_size=2))
    out = tmp_path / "out"
    which = ["--recipes", "bf16"] if command == "compare" else ["--recipe", "te-current"]
    res = runner.invoke(app, [command, "--config", str(conf), "--out", str(out), "--quiet",
                              *which, *args])  # fmt: skip
    return res, out


def _bad(res, out: Path, *words: str) -> None:
    assert res.exit_code == 2, (res.exit_code, res.output)
    assert "Traceback" not in res.output
    err = " ".join(res.stderr.split())
    for w in words:
        assert w in err, (w, err)
    assert not out.exists() or not any(out.iterdir())


# ----------------------------------------------------------------------------- weights
@pytest.mark.parametrize("command", ["compare", "debug"])
@pytest.mark.parametrize(
    ("bad", "words"),
    [
        ("nan", ["model.layers.0.mlp.up_proj.weight", "1 NaN or infinite value(s)", "finite"]),
        ("int", ["model.layers.0.mlp.up_proj.weight I64", "not floating point"]),
    ],
)
def test_nan_or_integer_weights_in_hf_dir_are_refused_naming_the_tensor(
    tmp_path, text, command, bad, words
):
    w = torch.randn(LLAMA["intermediate_size"], LLAMA["hidden_size"])
    if bad == "nan":
        w[3, 4] = float("nan")
    else:
        w = w.round().to(torch.int64)
    d = _llama_dir(tmp_path / "m", **{"model.layers.0.mlp.up_proj.weight": w})
    res, out = _run(tmp_path, text, command, "--model", f"hf:{d}")
    _bad(res, out, str(d / "model.safetensors"), *words)


# ----------------------------------------------------------------------------- tokenizer
def _tokenizer(path: Path, vocab: int = 300) -> None:
    from tokenizers import Tokenizer, pre_tokenizers, trainers
    from tokenizers.models import BPE

    tk = Tokenizer(BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tk.train_from_iterator([TEXT], trainer)
    tk.save(str(path))


def test_the_tokenizer_json_of_hf_dir_encodes_the_data(tmp_path, text):
    pytest.importorskip("tokenizers")
    d = _llama_dir(tmp_path / "m")
    base = LabConfig().with_overrides(["model.block_size=16"])
    cfg = check_model_data(with_run_options(base, None, f"hf:{d}", 2, [text]))
    assert cfg.data.tokenizer == ""  # no tokenizer.json: bytes
    _tokenizer(d / "tokenizer.json")
    cfg = check_model_data(with_run_options(base, None, f"hf:{d}", 2, [text]))
    assert cfg.data.tokenizer == str(d / "tokenizer.json")  # recorded in the run's config
    from fp8lab.lab.data import load_corpus

    corpus = load_corpus(cfg.data, 16)
    assert corpus.extra["tokenizer"] == str(d / "tokenizer.json") and corpus.vocab_size == 300
    mine = tmp_path / "mine.json"
    _tokenizer(mine, vocab=280)  # --tokenizer wins
    cfg = check_model_data(with_run_options(base, None, f"hf:{d}", 2, [text], tokenizer=mine))
    assert cfg.data.tokenizer == str(mine)
    assert models.hf_tokenizer(cfg.model) == d / "tokenizer.json"
    assert models.hf_tokenizer(base.model) is None


# ----------------------------------------------------------------------------- options
def test_init_from_help_and_behaviour_agree_on_hf_dir(tmp_path, text):
    res = runner.invoke(app, ["compare", "--help"], env={"COLUMNS": "200"})
    help_text = " ".join(res.output.replace("│", " ").split())
    assert "Not with hf:DIR" in help_text and "the pair is refused" in help_text
    assert "the directory's weights are used instead" not in help_text
    d = _llama_dir(tmp_path / "m")
    init = tmp_path / "w.safetensors"
    init.write_bytes(b"")
    res, out = _run(tmp_path, text, "compare", "--model", f"hf:{d}", "--init-from", str(init))
    _bad(res, out, "--init-from", "give one of them")


@pytest.mark.parametrize("command", ["compare", "debug"])
def test_set_model_size_on_an_hf_model_is_an_error(tmp_path, text, command):
    d = _llama_dir(tmp_path / "m")
    res, out = _run(tmp_path, text, command, "--model", f"hf:{d}", "--set", "model.vocab_size=512")
    _bad(res, out, "--set model.vocab_size", "its config file's", "only the built-in GPT")
    factory = tmp_path / "f.py"
    factory.write_text("import torch\ndef make():\n    return torch.nn.Linear(4, 4)\n")
    res, out = _run(tmp_path, text, command, "--model", f"{factory}:make", "--set",
                    "model.vocab_size=300")  # fmt: skip
    _bad(res, out, "--set model.vocab_size", "the one its factory builds")


def test_set_block_size_on_an_hf_model_is_accepted():
    sets = ["model.block_size=8", "model.n_layer=3"]  # n_layer: documented as not read
    cfg = with_run_options(LabConfig(), sets, "hf:x.json", None, None)
    assert cfg.model.block_size == 8
    cfg = with_run_options(LabConfig(), ["model.vocab_size=512"], "gpt", None, None)
    assert cfg.model.vocab_size == 512  # the built-in GPT's own size


def test_debug_from_checkpoint_without_model_says_to_give_it(tmp_path, text):
    ckpt = tmp_path / "ckpt.pt"
    ckpt.write_bytes(b"")  # never read: the missing --model is named first
    res, out = _run(tmp_path, text, "debug", "--from-checkpoint", str(ckpt))
    _bad(res, out, f"--from-checkpoint {ckpt}: give --model", "--model gpt")


# ----------------------------------------------------------------------------- environment
def test_building_an_hf_model_leaves_the_environment_alone(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    before = dict(os.environ)
    d = _llama_dir(tmp_path / "m")
    cfg = models.ModelConfig(factory=f"hf:{d}", block_size=16)
    models.build(cfg, seed=0)
    assert dict(os.environ) == before
    assert "HF_HUB_OFFLINE" not in os.environ

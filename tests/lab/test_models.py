"""Bring your own model (``fp8lab.lab.models``): factories by module path and by file path, and
``transformers`` configs (Llama-style and GPT-2-style), train and resume bit for bit; the same
initial weights for every recipe; the model's identity guards resume; bad factories are
ValueErrors naming the problem."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from fp8lab.lab import models
from fp8lab.lab.data import load_corpus
from fp8lab.lab.parts import build_model
from fp8lab.lab.train import ConfigMismatchError, LabConfig, train_run
from fp8lab.recipe import get_recipe

pytest.importorskip("transformers")

FACTORY_SRC = textwrap.dedent(
    """
    from dataclasses import dataclass

    import torch
    from torch import nn

    @dataclass
    class Sizes:  # a dataclass: its module must be importable while the file runs
        width: int = 128

    class Tiny(nn.Module):
        # embedding -> two hidden Linears -> output head: logits [B, T, 256]
        def __init__(self, sizes=Sizes()):
            super().__init__()
            w = sizes.width
            self.emb = nn.Embedding(256, w)
            self.fc1 = nn.Linear(w, 256)
            self.fc2 = nn.Linear(256, w)
            self.head = nn.Linear(w, 256)

        def forward(self, idx):
            x = self.emb(idx)
            return self.head(x + self.fc2(torch.relu(self.fc1(x))))

    def tiny():
        return Tiny()

    def narrow():  # V = 16 < 256
        return nn.Sequential(nn.Embedding(256, 8), nn.Linear(8, 16))

    def flat():  # logits [B, 256]: the sequence dimension is lost
        class Flat(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(256, 8)
                self.head = nn.Linear(8, 256)
            def forward(self, idx):
                return self.head(self.emb(idx).mean(1))
        return Flat()

    def not_a_module():
        return 42

    NOT_CALLABLE = 3
    """
)

LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
         "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
         "max_position_embeddings": 64, "tie_word_embeddings": False}  # fmt: skip
GPT2 = {"model_type": "gpt2", "vocab_size": 256, "n_embd": 128, "n_inner": 256, "n_layer": 1,
        "n_head": 2, "n_positions": 64, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
        "attn_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 0}  # fmt: skip


@pytest.fixture
def user_files(tmp_path, monkeypatch) -> Path:
    (tmp_path / "user_models_mod.py").write_text(FACTORY_SRC)
    (tmp_path / "llama.json").write_text(json.dumps(LLAMA))
    (tmp_path / "gpt2.json").write_text(json.dumps(GPT2))
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(LabConfig().data, 16)


def _cfg(factory: str, steps: int = 4) -> LabConfig:
    return LabConfig.from_dict(
        {
            "model": {"factory": factory, "block_size": 16},
            "train": {"steps": steps, "batch_size": 2, "warmup_steps": 1, "eval_every": 2,
                      "eval_batches": 1, "stats_every": 2, "checkpoint_every": 2},
        }
    )  # fmt: skip


def _factory(kind: str, root: Path) -> str:
    return {
        "module": "user_models_mod:tiny",
        "file": f"{root / 'user_models_mod.py'}:tiny",
        "hf-llama": f"hf:{root / 'llama.json'}",
        "hf-gpt2": f"hf:{root / 'gpt2.json'}",
    }[kind]


def _strip_time(records):
    return [{k: v for k, v in r.items() if k != "step_time_s"} for r in records]


@pytest.mark.parametrize("recipe", ["te-delayed", "deepseek-v3"])
@pytest.mark.parametrize("kind", ["module", "file", "hf-llama", "hf-gpt2"])
def test_user_model_trains_and_resumes_bit_for_bit(kind, recipe, user_files, corpus, tmp_path):
    cfg = _cfg(_factory(kind, user_files))
    rec = get_recipe(recipe)
    full = train_run(rec, cfg, corpus, None)
    losses = [r["train_loss"] for r in full.records]
    assert all(v is not None for v in losses) and losses[-1] < losses[0]  # it learns
    run = tmp_path / "run"
    train_run(rec, cfg, corpus, run, stop_after=2)
    resumed = train_run(rec, cfg, corpus, run)
    assert _strip_time(resumed.records) == _strip_time(full.records)
    a, b = full.model.state_dict(), resumed.model.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor))
    # the recipe really quantized layers of the user's model
    converted = [m for m in full.model.modules() if type(m).__module__.startswith("fp8lab.nn")]
    assert converted
    stats = (run / "stats.jsonl").read_text().splitlines()
    assert stats and json.loads(stats[0])["layer"].startswith("model.")
    assert json.loads((run / "run.json").read_text())["model"]["factory"] == cfg.model.factory


@pytest.mark.parametrize("kind", ["file", "hf-llama"])
def test_every_recipe_starts_from_the_same_weights(kind, user_files):
    cfg = _cfg(_factory(kind, user_files))
    plain = build_model(cfg.model, None, 7).state_dict()
    quant = build_model(cfg.model, get_recipe("te-delayed"), 7).state_dict()
    other = build_model(cfg.model, None, 8).state_dict()
    for k, v in plain.items():
        assert torch.equal(v, quant[k]), k
    assert any(not torch.equal(v, other[k]) for k, v in plain.items() if v.is_floating_point())


def test_identity_is_the_source_or_config_hash(user_files, corpus, tmp_path):
    src = user_files / "user_models_mod.py"
    cfg = _cfg(f"{src}:tiny", steps=2)
    ident = models.model_identity(cfg.model)
    assert ident["factory"] == f"{src}:tiny" and len(ident["sha256"]) == 64
    hf = models.model_identity(_cfg(_factory("hf-llama", user_files)).model)
    assert hf["transformers"] and len(hf["sha256"]) == 64
    train_run(None, cfg, corpus, tmp_path / "run", stop_after=1)
    src.write_text(FACTORY_SRC + "\n# edited\n")  # same function, another source file
    with pytest.raises(ConfigMismatchError, match="sha256"):
        train_run(None, cfg, corpus, tmp_path / "run")


def test_builtin_gpt_config_is_unchanged():
    d = LabConfig().to_dict()
    assert "factory" not in d["model"]  # configs and checkpoints of the built-in GPT as before
    assert models.model_identity(LabConfig().model) is None
    cfg = LabConfig.from_dict({"model": {"factory": "gpt"}})
    assert cfg.to_dict() == d and LabConfig.from_dict(d) == cfg


@pytest.mark.parametrize(
    ("factory", "words"),
    [
        ("no_such_module_xyz:f", ["cannot import module 'no_such_module_xyz'"]),
        ("user_models_mod:missing", ["has no attribute 'missing'"]),
        ("user_models_mod:NOT_CALLABLE", ["'NOT_CALLABLE' is not callable"]),
        ("nowhere/model.py:f", ["no such Python file"]),
        ("user_models_mod", ["expected 'gpt', 'MODULE:FACTORY'"]),
        ("hf:nowhere.json", ["no such config file"]),
    ],
)
def test_bad_factories_fail_when_checked(factory, words, user_files):
    with pytest.raises(ValueError) as e:
        _cfg(factory).check()
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("narrow", ["[1, 16, 16]", "V >= 256"]),
        ("flat", ["[1, 256]", "[1, 16, V]"]),
        ("not_a_module", ["returned a int", "torch.nn.Module"]),
    ],
)
def test_bad_model_outputs_are_named(name, words, user_files):
    with pytest.raises(ValueError) as e:
        models.build(_cfg(f"user_models_mod:{name}").model, 0)
    for w in words:
        assert w in str(e.value)


def test_bad_config_files(user_files):
    (user_files / "broken.json").write_text('{"model_type": "llama", ')
    (user_files / "untyped.json").write_text('{"vocab_size": 256}')
    (user_files / "alien.json").write_text('{"model_type": "no-such-architecture"}')
    for f, word in [("broken", "not valid JSON"), ("untyped", "no \"model_type\""),
                    ("alien", "transformers rejects the config")]:  # fmt: skip
        with pytest.raises(ValueError, match=word):
            models.build(_cfg(f"hf:{user_files / f}.json").model, 0)


def test_missing_transformers_names_the_package(user_files, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)  # import fails
    with pytest.raises(ValueError, match="package 'transformers' is not installed"):
        _cfg(_factory("hf-llama", user_files)).check()


def test_examples_build_offline():
    root = Path(__file__).resolve().parents[2] / "examples" / "models"
    for name, arch in (("llama-tiny", "LlamaForCausalLM"), ("gpt2-tiny", "GPT2LMHeadModel")):
        cfg = _cfg(f"hf:{root / name}.json")
        model = models.build(cfg.model, 0)
        assert type(model.model).__name__ == arch and model.vocab_size >= 256


def test_conv1d_converts_to_a_linear_sharing_its_in_out_weight():
    from transformers.pytorch_utils import Conv1D

    from fp8lab.nn import Linear, convert, unconvert

    torch.manual_seed(0)
    conv = Conv1D(64, 128)  # nf=64 outputs, nx=128 inputs: weight [128, 64]
    torch.nn.init.normal_(conv.weight, std=0.05)
    torch.nn.init.normal_(conv.bias, std=0.05)
    model = torch.nn.Sequential(conv, torch.nn.Linear(64, 256))  # the last Linear stays as is
    ref = torch.nn.Linear(128, 64)
    ref.weight = torch.nn.Parameter(conv.weight.detach().t().contiguous())
    ref.bias = torch.nn.Parameter(conv.bias.detach().clone())
    x = torch.randn(4, 8, 128)
    plain = conv(x)
    convert(model, "te-delayed")
    assert isinstance(model[0], Linear) and model[0].weight_layout == "in_out"
    assert model[0].weight is conv.weight and model[0].bias is conv.bias  # shared, [in, out]
    assert model.state_dict()["0.weight"].shape == (128, 64)
    expected = Linear.from_linear(ref, "te-delayed")
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = model[0](xa), expected(xb)
    assert torch.equal(ya, yb)  # bit for bit the Linear of the transposed weight
    ya.square().sum().backward()
    yb.square().sum().backward()
    assert torch.equal(xa.grad, xb.grad)
    assert (ya - plain).abs().max() < 0.1 * plain.abs().max()  # and near the fp32 Conv1D
    assert torch.equal(conv.weight.grad, expected.weight.grad.t())  # the user's Parameter learns
    unconvert(model)
    assert model[0] is conv and model[0].weight is conv.weight


def test_memory_model_of_a_user_model(user_files):
    from fp8lab.cost.memory import model_memory
    from fp8lab.lab.recipes import resolve_recipe

    cfg = _cfg(_factory("module", user_files))
    model = models.build(cfg.model, 0)
    n = sum(p.numel() for p in model.parameters())
    fp32 = model_memory(model, 256, 2, 16, None)
    assert fp32["weights"] == 4 * n and fp32["optimizer"] == 8 * n
    # saved inputs of fc1 (128 wide) and fc2 (256 wide; the head is not converted) + fp32 logits
    assert fp32["activations"] == 4 * 32 * (128 + 256) + 4 * 32 * 256
    te = model_memory(model, 256, 2, 16, resolve_recipe("te-delayed"))
    # + an E4M3 copy (1 byte/element, one fp32 scale) of fc1 [256, 128] and fc2 [128, 256]
    assert te["weights"] == 4 * n + 2 * (256 * 128 + 4)


@pytest.mark.parametrize("name", ["fp32", "bf16", "te-current", "mxfp8", "deepseek-v3", "nvfp4"])
def test_conv1d_layout_is_bit_identical_to_the_transposed_linear(name):
    from transformers.pytorch_utils import Conv1D

    from fp8lab.nn import Linear

    torch.manual_seed(1)
    conv = Conv1D(96, 64)
    ref = torch.nn.Linear(64, 96)
    ref.weight = torch.nn.Parameter(conv.weight.detach().t().contiguous())
    ref.bias = torch.nn.Parameter(conv.bias.detach().clone())
    a, b = Linear.from_conv1d(conv, name), Linear.from_linear(ref, name)
    x, dy = torch.randn(32, 64), torch.randn(32, 96)

    def run(m):
        xm = x.clone().requires_grad_()
        torch.manual_seed(7)  # nvfp4 rounds gradients stochastically: same random stream
        y = m(xm)
        y.backward(dy)
        return y, xm.grad

    (ya, dxa), (yb, dxb) = run(a), run(b)
    assert torch.equal(ya, yb) and torch.equal(dxa, dxb)
    assert torch.equal(conv.weight.grad, ref.weight.grad.t())

"""The lab's GPT with a mixture-of-experts MLP (``model.n_experts``, ``model.top_k``)."""

from __future__ import annotations

import math

import pytest
import torch
from typer.testing import CliRunner

import fp8lab
from fp8lab.cli import app
from fp8lab.lab.data import DataConfig, load_corpus
from fp8lab.lab.gpt import GPT, GPTConfig
from fp8lab.lab.models import ModelConfig
from fp8lab.lab.train import LabConfig, TrainConfig, train_run
from fp8lab.nn import GroupedLinear, MoE

MOE = GPTConfig(block_size=16, n_layer=1, n_head=2, d_model=128, d_ff=128, n_experts=4, top_k=2)
TRAIN = TrainConfig(
    steps=6, batch_size=2, lr=3e-3, warmup_steps=1, eval_every=3, eval_batches=1,
    stats_every=3, checkpoint_every=2,
)  # fmt: skip


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    f = tmp_path_factory.mktemp("text") / "t.txt"
    f.write_text("Is this a dagger which I see before me, the handle toward my hand? " * 40)
    return load_corpus(DataConfig(paths=(str(f),), split_chunk=256), block_size=16)


@pytest.mark.no_arithmetic
def test_moe_fields_serialise_only_when_set():
    assert "n_experts" not in GPTConfig().to_dict() and "top_k" not in ModelConfig().to_dict()
    d = ModelConfig(n_experts=8, top_k=2).to_dict()
    assert (d["n_experts"], d["top_k"]) == (8, 2)
    assert ModelConfig(**d) == ModelConfig(n_experts=8, top_k=2)
    assert not {"router", "bias_update_speed", "aux_loss_alpha"} & set(d)
    d = ModelConfig(n_experts=8, top_k=2, router="sigmoid", aux_loss_alpha=1e-4).to_dict()
    assert (d["router"], d["aux_loss_alpha"]) == ("sigmoid", 1e-4)
    assert "bias_update_speed" not in d


@pytest.mark.no_arithmetic
@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"n_experts": 0}, "n_experts"),
        ({"n_experts": 2, "top_k": 3}, r"top_k \(3\) must be <= model.n_experts \(2\)"),
        ({"n_experts": 4, "top_k": 2, "mlp": "smooth_swiglu"}, "SwiGLU experts"),
        ({"router": "sigmoid"}, "dense MLP"),
        ({"n_experts": 4, "router": "noisy"}, "model.router must be one of"),
        ({"n_experts": 4, "bias_update_speed": 0.01}, "set model.router = 'sigmoid'"),
        ({"n_experts": 4, "router": "sigmoid", "aux_loss_alpha": -1.0}, "aux_loss_alpha"),
    ],
)
def test_bad_expert_counts_are_named(kw, words):
    with pytest.raises(ValueError, match=words):
        GPTConfig(**kw)


@pytest.mark.no_arithmetic
def test_cli_refuses_bad_expert_counts_with_exit_2(tmp_path):
    for sets, words in ((["model.n_experts=0"], "n_experts"),
                        (["model.n_experts=2", "model.top_k=3"], "top_k (3)")):  # fmt: skip
        args = ["compare", "--recipes", "bf16", "--steps", "1", "--out", str(tmp_path / "o")]
        for s in sets:
            args += ["--set", s]
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 2 and "Error:" in res.output and words in res.output, res.output
        assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_moe_gpt_structure_and_conversion():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=8, n_layer=1, n_head=2, d_model=32, d_ff=32, n_experts=4,
                          top_k=2))  # fmt: skip
    mlp = model.blocks[0].mlp
    assert isinstance(mlp, MoE) and isinstance(mlp.up, GroupedLinear)
    fp8lab.nn.convert(model, "te-current")
    names = fp8lab.nn.converted(model)
    assert "blocks.0.mlp.down.experts.3" in names and not any("router" in n for n in names)
    assert mlp.router.weight.dtype == torch.float32
    # the down projections of the experts are residual outputs: GPT-2's scaled init
    std = mlp.down.experts[0].weight.std().item()
    assert std == pytest.approx(0.02 / math.sqrt(2), rel=0.2)
    logits, loss = model(torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8)))
    loss.backward()
    assert logits.shape == (2, 8, 256) and mlp.router.weight.grad is not None


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bf16", "te-current", "mxfp8", "deepseek-v3"])
def test_moe_gpt_trains_and_resumes_bit_for_bit(corpus, tmp_path, name):
    recipe = fp8lab.get_recipe(name)
    cfg = LabConfig(model=ModelConfig(**MOE.to_dict()), train=TRAIN)
    full = train_run(recipe, cfg, corpus, tmp_path / "full")
    losses = [r["train_loss"] for r in full.records]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    train_run(recipe, cfg, corpus, tmp_path / "part", stop_after=4)
    resumed = train_run(recipe, cfg, corpus, tmp_path / "part")
    assert [r["train_loss"] for r in resumed.records] == losses
    sa, sb = full.model.state_dict(), resumed.model.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.slow
def test_sigmoid_router_gpt_resumes_bit_for_bit_with_its_bias(corpus, tmp_path):
    """DeepSeek-V3's router in the lab: the selection bias moves each step, is checkpointed and
    resumes bit for bit; the balance loss is part of the training loss."""
    recipe = fp8lab.get_recipe("deepseek-v3")
    model = ModelConfig(**{**MOE.to_dict(), "router": "sigmoid", "bias_update_speed": 0.01,
                           "aux_loss_alpha": 0.01})  # fmt: skip
    cfg = LabConfig(model=model, train=TRAIN)
    full = train_run(recipe, cfg, corpus, tmp_path / "full")
    bias = full.model.state_dict()["blocks.0.mlp.router.bias"]
    assert bias.abs().sum() > 0  # it moved
    train_run(recipe, cfg, corpus, tmp_path / "part", stop_after=4)
    resumed = train_run(recipe, cfg, corpus, tmp_path / "part")
    assert [r["train_loss"] for r in resumed.records] == [r["train_loss"] for r in full.records]
    sa, sb = full.model.state_dict(), resumed.model.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    gpt = full.model
    gpt.train()
    gpt.blocks[0].mlp.router.bias_update_speed = 0.0  # the same routing in both forwards
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    _, loss = gpt(idx, idx)
    aux = gpt.blocks[0].mlp.aux_loss
    assert aux is not None and float(aux.detach()) > 0
    gpt.eval()
    with torch.no_grad():
        _, eval_loss = gpt(idx, idx)
    assert gpt.blocks[0].mlp.aux_loss is None
    assert float(loss.detach()) == pytest.approx(float(eval_loss) + float(aux.detach()), rel=1e-6)

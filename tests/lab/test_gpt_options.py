"""The lab GPT's options: ``model.norm`` (rmsnorm | layernorm), ``model.mlp`` (swiglu |
smooth_swiglu), ``model.qk_norm``, and the recipe key ``norm_weights`` (norm affine parameters
quantized with the weight role's spec). Defaults leave the configuration's plain data as it was."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from fp8lab.cli import app
from fp8lab.lab.gpt import GPT, GPTConfig, LayerNorm, RMSNorm
from fp8lab.lab.models import ModelConfig
from fp8lab.nn import SmoothSwiGLU
from fp8lab.qtensor import QuantSpec
from fp8lab.recipe import Recipe

SMALL = dict(block_size=8, n_layer=1, n_head=2, d_model=32, d_ff=64)


def test_defaults_are_absent_from_the_plain_data_and_set_options_present():
    old = {"vocab_size", "block_size", "n_layer", "n_head", "d_model", "d_ff", "norm_eps",
           "init_std"}  # fmt: skip
    assert set(ModelConfig().to_dict()) == old
    assert set(GPTConfig().to_dict()) == old
    d = ModelConfig(norm="layernorm", mlp="smooth_swiglu", qk_norm=True).to_dict()
    assert (d["norm"], d["mlp"], d["qk_norm"]) == ("layernorm", "smooth_swiglu", True)
    assert ModelConfig(**d) == ModelConfig(norm="layernorm", mlp="smooth_swiglu", qk_norm=True)


def test_modules_follow_the_options_and_the_initial_linear_weights_do_not_change():
    torch.manual_seed(0)
    plain = GPT(GPTConfig(**SMALL))
    torch.manual_seed(0)
    opt = GPT(GPTConfig(**SMALL, norm="layernorm", mlp="smooth_swiglu", qk_norm=True))
    b = opt.blocks[0]
    assert isinstance(b.attn_norm, LayerNorm) and isinstance(opt.norm, LayerNorm)
    assert isinstance(b.mlp, SmoothSwiGLU) and isinstance(b.attn.q_norm, RMSNorm)
    ps = dict(plain.named_parameters())
    for name, p in opt.named_parameters():
        if name in ps:
            assert torch.equal(p, ps[name]), name  # norms add no random draw
        else:
            assert name.endswith(("norm.bias", "q_norm.weight", "k_norm.weight"))


def test_layernorm_matches_its_definition():
    torch.manual_seed(1)
    n = LayerNorm(16, 1e-6)
    with torch.no_grad():
        n.weight.uniform_(0.5, 1.5)
        n.bias.uniform_(-0.5, 0.5)
    x = torch.randn(4, 16, dtype=torch.float64).float()
    xd = x.double()
    ref = (xd - xd.mean(-1, keepdim=True)) / torch.sqrt(xd.var(-1, unbiased=False, keepdim=True)
                                                        + 1e-6)  # fmt: skip
    ref = ref * n.weight.double() + n.bias.double()
    torch.testing.assert_close(n(x).double(), ref, rtol=1e-5, atol=1e-5)


def test_norm_weights_quantized_rounds_the_affine_parameters_to_the_weight_grid():
    """E4M3 with a fixed scale of 1: 1.1 -> 1.125, 1.0625 (a tie) -> 1.0 (even), 3.3 -> 3.25,
    0.3 -> 0.3125 (E4M3: 3 mantissa bits; hand-rounded). The gradient passes straight through."""
    n = RMSNorm(4, 1e-6)
    with torch.no_grad():
        n.weight.copy_(torch.tensor([1.1, 1.0625, 3.3, 0.3]))
    spec = QuantSpec("e4m3", scaling=1.0)
    quant = Recipe(name="q", input=spec, weight=spec, norm_weights="quantized")
    x = torch.tensor([[1.0, -1.0, 1.0, -1.0]])  # rms 1: the output is the weight times x
    y = n(x, quant)
    want = torch.tensor([1.125, 1.0, 3.25, 0.3125]) * x[0]
    torch.testing.assert_close(y[0], want, rtol=1e-5, atol=0)
    y.sum().backward()
    torch.testing.assert_close(n.weight.grad, x[0] / torch.sqrt(torch.tensor(1 + 1e-6)))
    # high precision (the default) and no recipe: the weight as it is
    hp = Recipe(name="hp", input=spec, weight=spec)
    torch.testing.assert_close(n(x, hp)[0], n.weight.detach() * x[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(n(x)[0], n.weight.detach() * x[0], rtol=1e-5, atol=0)


@pytest.mark.no_arithmetic
@pytest.mark.parametrize("bad", ["model.norm=batchnorm", "model.mlp=gelu", "model.qk_norm=1"])
def test_bad_option_is_one_error_line_exit_2(tmp_path, bad):
    r = CliRunner().invoke(app, ["debug", "--scenario", "unscaled-gradient", "--out",
                                 str(tmp_path / "o"), "--set", bad])  # fmt: skip
    assert r.exit_code == 2, r.output
    assert r.output.count("Error:") == 1 and bad.split("=")[0].split(".")[1] in r.output


@pytest.mark.no_arithmetic
def test_gpt_option_on_a_factory_model_is_an_error(tmp_path):
    from pathlib import Path

    model = Path(__file__).parents[2] / "examples" / "models" / "mlp_lm.py"
    r = CliRunner().invoke(app, ["debug", "--recipe", "te-current", "--model", f"{model}:build",
                                 "--set", "model.qk_norm=true", "--out", str(tmp_path / "o")])  # fmt: skip
    assert r.exit_code == 2, r.output
    assert "model.qk_norm" in r.output and "factory" in r.output


@pytest.mark.parametrize(
    ("model", "want"),
    [
        # per block: two norms, the q/k norms, Smooth-SwiGLU's gate and up outputs; the final norm
        ({"qk_norm": True, "mlp": "smooth_swiglu"},
         ["x", "head", "head", "x", "ff", "ff"] * 2 + ["x"]),
        # MoE experts: their SwiGLU's two inputs over the routed rows (2 per token)
        ({"n_experts": 4, "top_k": 2}, ["x", "x", "routed", "routed"] * 2 + ["x"]),
    ],
)  # fmt: skip
def test_save_activations_quantized_covers_every_norm_and_swiglu(monkeypatch, threads, model,
                                                                want):  # fmt: skip
    """Which tensors ``save_activations = "quantized"`` saves in FP8 in the lab's GPT, by shape;
    the forward is unchanged bit for bit."""
    import fp8lab
    import fp8lab.nn.saved_activations as sa

    cfg = GPTConfig(block_size=8, n_layer=2, n_head=2, d_model=32, d_ff=48, **model)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    gpt = GPT(cfg)
    idx = torch.randint(0, 256, (2, 8))
    shapes = {"x": (2, 8, 32), "head": (2, 2, 8, 16), "ff": (2, 8, 48), "routed": (32, 48)}
    seen = []
    quantized = sa._quantized
    monkeypatch.setattr(
        sa, "_quantized", lambda x, spec: seen.append(x.shape) or quantized(x, spec)
    )
    rec = fp8lab.get_recipe("te-current")
    with fp8lab.nn.autocast(rec):
        _, hp = gpt(idx, idx)
    assert seen == []
    with fp8lab.nn.autocast(rec.replace(save_activations="quantized")):
        _, q = gpt(idx, idx)
    assert torch.equal(q, hp)
    assert [tuple(s) for s in seen] == [shapes[w] for w in want]

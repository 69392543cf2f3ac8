"""Per-layer recipes through `convert`, `layer_settings`, the single-cell switch at the bit level."""

import pytest
import torch

from fp8lab.nn import Linear, autocast, collect_operands, convert, layer_settings
from fp8lab.nn.linear import round_high_precision
from fp8lab.recipe import LayerRule, get_recipe


class Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.q, self.k, self.w2 = (torch.nn.Linear(d, d) for _ in range(3))

    def forward(self, x):
        return x + self.w2(torch.relu(self.q(x) * self.k(x)))


class TinyGPT(torch.nn.Module):
    def __init__(self, vocab, d, n):
        super().__init__()
        self.tok_emb = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(n))
        self.lm_head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.tok_emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.lm_head(x)


def _model(seed=0):
    torch.manual_seed(seed)
    return TinyGPT(vocab=32, d=32, n=2)


def test_convert_gives_each_layer_its_rules_and_reports_them():
    rec = get_recipe("te-delayed").with_layers(
        LayerRule("blocks.1.*", base="bf16"),
        LayerRule("blocks.1.w2", changes={"grad_output": {"scaling": "max"}}),
        LayerRule(
            "blocks.0.q", changes={"dgrad": {"high_precision_roles": {"grad_output": "bf16"}}}
        ),
    )
    m = convert(_model(), rec)
    settings = layer_settings(m)
    assert settings["blocks.0.k"]["rules"] == [] and settings["blocks.0.q"]["rules"] == [3]
    assert settings["blocks.1.w2"]["rules"] == [1, 2]
    assert settings["blocks.0.q"]["gemms"]["dgrad"].startswith("grad_output=bf16, weight=e4m3")
    assert settings["blocks.0.k"]["gemms"]["dgrad"].startswith("grad_output=e5m2")
    assert settings["blocks.1.q"]["gemms"]["fprop"] == "input=bf16, weight=bf16"
    # rule 2 after rule 1: on top of bf16 (no grad_output spec) a current-scaled default spec,
    # but the GEMMs stay bf16: the layer runs all GEMMs in bf16
    assert m.blocks[1].w2.recipe.grad_output is not None
    assert m.blocks[1].w2.recipe.dgrad.high_precision == "bf16"
    assert m.blocks[0].k.recipe == rec.replace(layers=())
    assert m.blocks[1].q.recipe.fprop.high_precision == "bf16"
    assert not m.blocks[1].q.scaling_states  # bf16 layers keep no delayed state
    # dgrad's dy cell is bf16, but wgrad still quantizes dy under delayed scaling: kept
    assert set(m.blocks[0].q.scaling_states) == {"input", "weight", "grad_output"}


def test_a_rule_matching_no_converted_layer_is_an_error():
    rec = get_recipe("te-current").with_layers(LayerRule("blocks.*.mlp.*", base="bf16"))
    with pytest.raises(ValueError, match=r"\[\[layer\]\] 1 match \['blocks\.\*\.mlp\.\*'\]"):
        convert(_model(), rec)
    # the head is excluded by default: a rule naming only it matches no converted layer
    with pytest.raises(ValueError, match="matches no converted Linear"):
        convert(_model(), get_recipe("te-current").with_layers(LayerRule("lm_head", base="bf16")))


def _run(recipe, seed=0):
    torch.manual_seed(seed)
    lin = Linear(48, 40, recipe=recipe, name="l")
    with torch.no_grad():
        lin.weight.mul_(3.0)
    x = torch.randn(2, 16, 48, requires_grad=True)
    dy = torch.randn(2, 16, 40) * 1e-3
    with collect_operands(lin) as ops:
        y = lin(x)
        y.backward(dy)
    return (y, x.grad, lin.weight.grad), ops


CELLS = [(g, r) for g in ("fprop", "dgrad", "wgrad") for r in ("input", "weight", "grad_output")]
CELLS = [
    c
    for c in CELLS
    if c[1]
    in {"fprop": "input weight", "dgrad": "grad_output weight", "wgrad": "grad_output input"}[c[0]]
]


@pytest.mark.parametrize("name", ["te-current", "te-delayed", "mxfp8", "deepseek-v3"])
@pytest.mark.parametrize(("gemm", "role"), CELLS)
def test_cell_switch_changes_only_that_operand(name, gemm, role):
    base = get_recipe(name)
    cell = base.with_cell_high_precision(gemm, role, "bf16")
    outs0, ops0 = _run(base)
    outs1, ops1 = _run(cell)
    for g, o0, o1 in zip(("fprop", "dgrad", "wgrad"), outs0, outs1, strict=True):
        assert torch.equal(o0, o1) == (g != gemm), g  # only the switched GEMM's output moves
    for key in ops0:
        same = torch.equal(ops0[key]["used"], ops1[key]["used"])
        assert same == (key != ("l", gemm, role)), key
    rec = ops1[("l", gemm, role)]
    assert torch.equal(rec["used"], round_high_precision(rec["high_precision"], "bf16"))


def test_keep_state_carries_delayed_histories_over():
    torch.manual_seed(0)
    lin = Linear(32, 32, recipe="te-delayed", name="l")
    for _ in range(3):
        lin(torch.randn(8, 32)).sum().backward()
    before = {k: ds.state_dict() for k, ds in lin.scaling_states.items()}
    lin.set_recipe(lin.recipe.with_cell_high_precision("dgrad", "grad_output"), keep_state=True)
    after = lin.scaling_states
    assert set(after) == set(before)  # wgrad still quantizes dy: its state is kept
    for k, ds in after.items():
        for f, t in ds.state_dict().items():
            assert torch.equal(t, before[k][f]), (k, f)
    lin.set_recipe("te-delayed")
    assert all(not ds.initialized for ds in lin.scaling_states.values())


def test_autocast_with_layer_rules_resolves_per_layer():
    m = convert(_model(), "te-current")
    rec = get_recipe("te-current").with_layers(LayerRule("blocks.0.q", base="bf16"))
    with autocast(rec), collect_operands(m) as ops:
        m(torch.randint(0, 32, (2, 8))).sum().backward()
    q, k = ops[("blocks.0.q", "fprop", "input")], ops[("blocks.0.k", "fprop", "input")]
    assert torch.equal(q["used"], round_high_precision(q["high_precision"], "bf16"))
    assert not torch.equal(k["used"], round_high_precision(k["high_precision"], "bf16"))

"""The FP4 recipe flavours and the FP8 flavours users pick (issue 33) on a tiny model: each new
preset trains (forward and backward through every converted Linear), resumes bit for bit from a
checkpoint (weights, optimizer, scaling state and torch's generator, which feeds stochastic
rounding), and round-trips through its TOML file."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import fp8lab
from fp8lab import Recipe
from fp8lab.nn import Linear, convert, converted, on_operand, resolve_blocks, select_linears
from fp8lab.recipe import RecipeFileError

#: the issue's new presets
FLAVOURS = [
    "nvfp4-te",
    "nvfp4-paper",
    "nvfp4-bare",
    "nvfp4-4over6",
    "torchao-tensorwise",
    "torchao-rowwise",
    "torchao-rowwise-gw-hp",
    "mxfp8-2d",
    "mxfp4",
    "mxfp4-quartet",
]
T, D = 32, 32  # whole 32x1 / 16x1 blocks along the token axis, 32x32 weight tiles


class Tiny(torch.nn.Module):
    """Two numbered blocks of one Linear each and an output head (left unconverted)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(D, D) for _ in range(2))
        self.head = torch.nn.Linear(D, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = torch.nn.functional.gelu(b(x))
        return self.head(x)


def _steps(model, opt, batches) -> list[float]:
    out = []
    for x, y in batches:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


@pytest.mark.parametrize("name", FLAVOURS)
def test_flavour_trains_resumes_bit_for_bit_and_round_trips(name):
    rec = fp8lab.get_recipe(name)
    again = Recipe.from_toml(rec.to_toml())
    assert again == rec and again.fingerprint() == rec.fingerprint()
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(T, D, generator=g), torch.randn(T, 4, generator=g)) for _ in range(2)]
    torch.manual_seed(0)
    model = convert(Tiny(), rec)
    res = resolve_blocks(model, rec, converted(model))  # nvfp4-paper: the last block in bf16
    assert all(isinstance(b, Linear) and b.recipe == res.for_layer(f"blocks.{i}")
               for i, b in enumerate(model.blocks))  # fmt: skip
    assert (model.blocks[1].recipe.fprop.high_precision == "bf16") == (rec.hp_last_blocks != 0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _steps(model, opt, batches[:1])
    saved = copy.deepcopy((model.state_dict(), opt.state_dict(), torch.get_rng_state()))
    rest = _steps(model, opt, batches[1:])
    assert all(b.weight.grad is not None and bool(b.weight.grad.abs().sum() > 0)
               for b in model.blocks)  # fmt: skip
    resumed = convert(Tiny(), rec)
    resumed.load_state_dict(saved[0])
    opt2 = torch.optim.Adam(resumed.parameters(), lr=1e-2)
    opt2.load_state_dict(saved[1])
    torch.set_rng_state(saved[2])
    assert _steps(resumed, opt2, batches[1:]) == rest
    sa, sb = resumed.state_dict(), model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sb)


def _train(rec, steps: int = 1) -> tuple[list[float], dict]:
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(T, D, generator=g), torch.randn(T, 4, generator=g))
               for _ in range(steps)]  # fmt: skip
    torch.manual_seed(1)
    model = convert(Tiny(), rec)
    losses = _steps(model, torch.optim.SGD(model.parameters(), lr=0.1), batches)
    return losses, model.state_dict()


@pytest.mark.parametrize("mode", ["high_precision", "dequantized"])
def test_backward_override_trains_as_its_expansion(mode):
    base = fp8lab.get_recipe("nvfp4-bare")
    short = base.replace(backward_override=mode)
    src = "saved_dequantized" if mode == "dequantized" else "auto"
    expanded = base.replace(**{
        g: dataclasses.replace(base.gemm(g), high_precision="bf16", operand_source=src)
        for g in ("dgrad", "wgrad")
    })  # fmt: skip
    a, sa = _train(short)
    b, sb = _train(expanded)
    _, sc = _train(base)
    assert a == b and all(torch.equal(sa[k], sb[k]) for k in sa)
    # the override changes the backward: the comparison can fail
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_dequantized_backward_takes_the_forward_copies_in_bf16():
    # TE's backward_override="dequantized": dgrad's W and wgrad's x are the forward's quantized
    # copies dequantized to bf16; dy is bf16 in both
    rec = fp8lab.get_recipe("nvfp4-bare").replace(backward_override="dequantized")
    mod = Linear(D, D, recipe=rec, name="lin")
    seen = {}
    x = torch.randn(T, D, requires_grad=True)
    with on_operand(lambda layer, g, r, src, used: seen.__setitem__((g, r), (src, used))):
        mod(x).backward(torch.randn(T, D))
    bf16 = lambda t: t.to(torch.bfloat16).float()  # noqa: E731
    fx, fw = seen[("fprop", "input")][1], seen[("fprop", "weight")][1]
    assert torch.equal(seen[("wgrad", "input")][1], bf16(fx.dequantize()))
    assert torch.equal(seen[("dgrad", "weight")][1], bf16(fw.dequantize()))
    dy = seen[("dgrad", "grad_output")][0]
    assert torch.equal(seen[("dgrad", "grad_output")][1], bf16(dy))
    assert torch.equal(seen[("wgrad", "grad_output")][1], bf16(dy))
    assert not torch.equal(bf16(fx.dequantize()), bf16(x.detach()))  # the copy is not x itself


# --------------------------------------------------------------------------- hp blocks
class HFLike(torch.nn.Module):
    """HF's naming: model.layers.N.{self_attn,mlp}.*, plus a shorter numbered list."""

    def __init__(self, n: int) -> None:
        super().__init__()
        layer = lambda: torch.nn.ModuleDict(  # noqa: E731
            {"q_proj": torch.nn.Linear(D, D), "up_proj": torch.nn.Linear(D, D)}
        )
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList(layer() for _ in range(n))
        self.adapters = torch.nn.ModuleList(torch.nn.Linear(D, D) for _ in range(2))
        self.lm_head = torch.nn.Linear(D, 4)


def test_hp_blocks_resolve_over_the_largest_numbered_list():
    model = HFLike(7)
    rec = fp8lab.get_recipe("nvfp4-bare").replace(hp_last_blocks=None, hp_first_blocks=1)
    names = select_linears(model)
    out = resolve_blocks(model, rec, names)
    # 7 blocks: max(1, round(1.05)) = 1 last block, plus the first one
    assert (out.hp_last_blocks, out.hp_first_blocks) == (0, 0)
    assert [r.to_dict() for r in out.layers] == [
        {"match": ["model.layers.0.*", "model.layers.6.*"], "base": "bf16"}
    ]
    convert(model, rec)
    hp = {n for n, m in model.named_modules()
          if isinstance(m, Linear) and m.recipe.fprop.high_precision == "bf16"}  # fmt: skip
    assert hp == {f"model.layers.{i}.{p}" for i in (0, 6) for p in ("q_proj", "up_proj")}
    bare = fp8lab.get_recipe("nvfp4-bare")
    assert resolve_blocks(model, bare, names) is bare  # nothing to resolve


def test_hp_blocks_too_many_or_no_list_is_a_recipe_error(tmp_path):
    f = tmp_path / "fix.toml"
    f.write_text('base = "nvfp4-bare"\nhp_last_blocks = 3\nhp_first_blocks = 2\n')
    with pytest.raises(
        RecipeFileError, match=r"fix.toml.*= 5 blocks.*the 4 blocks of 'model.layers'"
    ):
        convert(HFLike(4), f)
    flat = torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.Linear(D, D), torch.nn.Linear(D, 4))
    with pytest.raises(RecipeFileError, match="numbered ModuleList"):
        convert(flat, fp8lab.get_recipe("nvfp4-bare").replace(hp_last_blocks=1))

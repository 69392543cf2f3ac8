"""fp8lab.nn.convert: selection by glob and regex, default exclusions, errors."""

import re

import pytest
import torch

import fp8lab
from fp8lab.nn import Linear, convert, converted, select_linears


class Block(torch.nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(d, d) for _ in range(4))
        self.w1, self.w3 = torch.nn.Linear(d, 2 * d), torch.nn.Linear(d, 2 * d)
        self.w2 = torch.nn.Linear(2 * d, d)
        self.norm = torch.nn.LayerNorm(d)

    def forward(self, x):
        h = self.norm(x)
        a = self.o(torch.softmax(self.q(h) @ self.k(h).transpose(-1, -2), -1) @ self.v(h))
        x = x + a
        return x + self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


class TinyGPT(torch.nn.Module):
    def __init__(self, vocab=32, d=16, n=2):
        super().__init__()
        self.tok_emb = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(n))
        self.lm_head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.tok_emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.lm_head(x)


def test_default_converts_blocks_keeps_embedding_and_head():
    torch.manual_seed(0)
    m = TinyGPT()
    params = list(m.parameters())
    convert(m, "te-current")
    names = converted(m)
    assert len(names) == 14 and "lm_head" not in names
    assert all(n.startswith("blocks.") for n in names)
    assert isinstance(m.tok_emb, torch.nn.Embedding)
    assert type(m.lm_head) is torch.nn.Linear
    assert list(m.parameters()) == params  # same Parameter objects: old optimizers keep working
    assert m.blocks[0].q.name == "blocks.0.q"
    out = m(torch.randint(0, 32, (2, 8)))
    out.sum().backward()
    assert m.blocks[1].w2.weight.grad is not None


def test_include_exclude_globs_and_regex():
    m = TinyGPT()
    assert select_linears(m, include="blocks.*.w?") == [
        f"blocks.{i}.{w}" for i in range(2) for w in ("w1", "w3", "w2")
    ]
    got = select_linears(m, include=re.compile(r"\.(q|k|v)$"), exclude="blocks.1.*")
    assert got == ["blocks.0.q", "blocks.0.k", "blocks.0.v"]
    got = select_linears(m, include=["*.o", re.compile("w2")])
    assert got == ["blocks.0.o", "blocks.0.w2", "blocks.1.o", "blocks.1.w2"]
    # default exclusions hold even for matching includes; default_exclude=False lifts them
    assert select_linears(m, include="lm_head*", exclude=None) == []
    assert select_linears(m, include="lm_head", default_exclude=False) == ["lm_head"]
    convert(m, "deepseek-v3", include="blocks.0.*")
    assert converted(m) == [f"blocks.0.{n}" for n in ("q", "k", "v", "o", "w1", "w3", "w2")]
    assert converted(m)[0] in dict(m.named_modules())
    assert m.blocks[0].q.recipe.name == "deepseek-v3"


def test_last_linear_and_tied_head_excluded():
    seq = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    assert select_linears(seq) == ["0"]
    emb = torch.nn.Embedding(10, 4)
    tied = torch.nn.Linear(4, 10, bias=False)
    tied.weight = emb.weight
    mod = torch.nn.ModuleDict({"emb": emb, "proj": torch.nn.Linear(4, 4), "dec": tied})
    mod["tail"] = torch.nn.Linear(4, 4)
    assert select_linears(mod) == ["proj"]


def test_bad_targets_are_clear_errors():
    m = TinyGPT()
    with pytest.raises(ValueError, match="non-Linear"):
        convert(m, "te-current", include="tok_emb")
    with pytest.raises(ValueError, match="non-Linear"):
        convert(m, "te-current", include="blocks.0.norm")
    with pytest.raises(ValueError, match="matches no module"):
        convert(m, "te-current", include="blocks.9.*")
    with pytest.raises(ValueError, match="matches no module"):
        convert(m, "te-current", exclude="nothing_here")
    with pytest.raises(TypeError, match="glob"):
        convert(m, "te-current", include=[3])
    with pytest.raises(ValueError, match="unknown recipe"):
        convert(m, "fp5")
    with pytest.raises(TypeError):
        convert("model", "fp32")
    assert converted(m) == []  # nothing changed by failed calls


def test_reconvert_retargets_and_converted_model_trains_finite():
    torch.manual_seed(1)
    m = TinyGPT()
    convert(m, "te-delayed")
    q = m.blocks[0].q
    with pytest.raises(ValueError, match="retarget=True"):  # issue 25: no silent reset
        convert(m, "mxfp8")
    assert q.recipe.name == "te-delayed"
    convert(m, "mxfp8", retarget=True)
    assert m.blocks[0].q is q and q.recipe.name == "mxfp8"
    opt = fp8lab.optim.AdamW(m.parameters(), lr=1e-3)
    idx = torch.randint(0, 32, (2, 16))
    for _ in range(3):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(m(idx).flatten(0, 1), idx.flatten()).backward()
        opt.step()
    assert all(torch.isfinite(p).all() for p in m.parameters())
    assert isinstance(q, Linear)

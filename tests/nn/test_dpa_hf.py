"""A converted ``transformers`` model runs `fp8lab.nn.DotProductAttention` when the recipe sets
``attention`` (its records name the layer's attention module), and transformers' SDPA otherwise."""

from __future__ import annotations

import pytest
import torch

import fp8lab
from fp8lab.nn.attention import HF_ATTENTION

transformers = pytest.importorskip("transformers")

LLAMA = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 1,
         "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 32}  # fmt: skip


def _llama():
    torch.manual_seed(1)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))


def test_hf_attention_runs_fp8_dpa_only_when_the_recipe_asks(threads):
    torch.set_num_threads(1)
    idx = torch.randint(0, 320, (2, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :3] = 0  # left padding: a bool mask reaches the attention
    off = _llama()
    fp8lab.nn.convert(off, "te-current")
    assert off.config._attn_implementation != HF_ATTENTION  # nothing routed
    ref = off(idx, attention_mask=mask).logits.detach()
    on = _llama()
    fp8lab.nn.convert(on, fp8lab.get_recipe("te-current").replace(attention=True))
    assert on.config._attn_implementation == HF_ATTENTION
    rows = []
    handle = fp8lab.nn.on_operand(
        lambda layer, gemm, role, src, used: rows.append((layer, role)) if gemm == "dpa" else None
    )
    out = on(idx, attention_mask=mask, labels=idx)
    out.loss.backward()
    handle.remove()
    layer = "model.layers.0.self_attn.dpa"
    assert set(rows) == {(layer, r) for r in ("Q", "K", "V", "S", "dO", "dP")}
    diff = (out.logits.detach() - ref)[:, :, :].abs()
    assert torch.isfinite(out.logits).all() and 1e-4 < float(diff.max()) < 1.0
    # under an autocast recipe without attention the same model runs SDPA again
    with fp8lab.nn.autocast("te-current"):
        again = on(idx, attention_mask=mask).logits.detach()
    torch.testing.assert_close(again, ref, rtol=0, atol=1e-5)

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


def _step(model, opt, idx):
    loss = model(idx, labels=idx).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


@pytest.mark.slow
def test_hf_attention_delayed_state_is_saved_and_resumed_bit_for_bit(tmp_path, threads):
    """Two steps, save_pretrained, a fresh from_pretrained + convert, one more step: equal bit
    for bit to the uninterrupted run (the attention's delayed scales travel in
    fp8lab_state.safetensors); the same resume with the attention state dropped differs."""
    torch.set_num_threads(1)
    rec = fp8lab.get_recipe("te-delayed").replace(attention=True)
    batches = torch.randint(0, 320, (3, 2, 12), generator=torch.Generator().manual_seed(3))
    run = fp8lab.nn.convert(_llama(), rec)
    opt = torch.optim.SGD(run.parameters(), lr=0.5)
    for idx in batches[:2]:
        _step(run, opt, idx)
    run.save_pretrained(tmp_path)
    layer = "model.layers.0.self_attn.dpa"
    saved = fp8lab.nn.fp8_state.fp8_state_dict(run)
    assert f"{layer}.fp8_dpa_recipe" in saved and f"{layer}.fp8_dpa_S_amax_history" in saved
    assert f"{layer}.fp8_dpa_recipe" not in run.state_dict()  # the HF weights stay as they were
    want = _step(run, opt, batches[2])

    def resumed(drop_attention: bool):
        model = fp8lab.nn.convert(transformers.LlamaForCausalLM.from_pretrained(tmp_path), rec)
        if drop_attention:  # the attention starts afresh, as before its state was saved
            model.model.layers[0].self_attn.__dict__.pop("_fp8lab_dpa")
        loss = _step(model, torch.optim.SGD(model.parameters(), lr=0.5), batches[2])
        return loss, model

    loss, model = resumed(False)
    assert loss == want
    got, ref = dict(model.named_parameters()), dict(run.named_parameters())
    assert all(torch.equal(p, ref[n]) for n, p in got.items())
    assert fp8lab.nn.fp8_state.fp8_state_dict(model).keys() == saved.keys()
    for k, v in fp8lab.nn.fp8_state.fp8_state_dict(model).items():
        assert torch.equal(v, fp8lab.nn.fp8_state.fp8_state_dict(run)[k]), k
    loss, model = resumed(True)
    got = dict(model.named_parameters())
    assert not all(torch.equal(p, ref[n]) for n, p in got.items())
    # a model whose attention is not fp8lab's has no place for that state
    plain = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    fp8lab.nn.convert(plain, "te-delayed", retarget=True)
    with pytest.raises(ValueError, match="attention state for layers that do not run"):
        fp8lab.nn.load_fp8_state(plain, tmp_path, layers=[layer])

import math

import pytest
import torch

from fp8lab.lab.gpt import GPT, GPTConfig

TINY = GPTConfig(block_size=16, n_layer=2, n_head=2, d_model=32, d_ff=64)


def test_default_sizes_make_128_blocks_differ_from_per_tensor():
    cfg = GPTConfig()
    # every GEMM dimension is a multiple of 128 (whole 1x128 tiles / 128x128 blocks) ...
    for dim in (cfg.d_model, cfg.d_ff, 3 * cfg.d_model):
        assert dim % 128 == 0
    # ... and each holds several blocks, so block scales differ from one tensor scale
    assert min(cfg.d_model, cfg.d_ff) // 128 >= 2


def test_forward_shapes_and_initial_loss_near_uniform():
    torch.manual_seed(0)
    model = GPT(TINY)
    idx = torch.randint(0, 256, (3, 16))
    logits, loss = model(idx, idx)
    assert logits.shape == (3, 16, 256)
    # small init -> near-uniform prediction over 256 bytes
    assert abs(float(loss.detach()) - math.log(256)) < 0.1


def test_names_expected_by_convert():
    names = {n for n, _ in GPT(TINY).named_modules()}
    for n in (
        "tok_emb",
        "lm_head",
        "blocks.0.attn.qkv",
        "blocks.0.attn.proj",
        "blocks.1.mlp.gate",
        "blocks.1.mlp.up",
        "blocks.1.mlp.down",
    ):
        assert n in names
    model = GPT(TINY)
    assert model.lm_head.weight.data_ptr() != model.tok_emb.weight.data_ptr()  # untied
    assert all(m.bias is None for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_causal_future_tokens_do_not_change_past_logits():
    torch.manual_seed(0)
    model = GPT(TINY)
    a = torch.randint(0, 256, (1, 16))
    b = a.clone()
    b[0, 10:] = (b[0, 10:] + 1) % 256
    la, _ = model(a)
    lb, _ = model(b)
    assert torch.equal(la[0, :10], lb[0, :10])
    assert not torch.equal(la[0, 10:], lb[0, 10:])


def test_same_seed_same_init():
    torch.manual_seed(5)
    a = GPT(TINY).state_dict()
    torch.manual_seed(5)
    b = GPT(TINY).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_learns_a_repeating_pattern():
    torch.manual_seed(0)
    model = GPT(TINY)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.tensor(list(b"abcdefgh" * 8))[:17]
    x, y = data[:-1][None], data[1:][None]
    for _ in range(60):
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss.detach()) < 0.5


def test_too_long_sequence_is_an_error():
    with pytest.raises(ValueError, match="block_size"):
        GPT(TINY)(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize(
    "kw", [{"d_model": 30, "n_head": 4}, {"n_layer": 0}, {"d_ff": -1}, {"init_std": 0.0}]
)
def test_bad_config(kw):
    with pytest.raises(ValueError):
        GPTConfig(**kw)


def _attention_calls(monkeypatch):
    from fp8lab.nn import DotProductAttention

    calls = []
    real = DotProductAttention.forward

    def spy(self, q, k, v, *, is_causal=False, recipe=None):
        calls.append(recipe.name if recipe is not None else None)
        return real(self, q, k, v, is_causal=is_causal, recipe=recipe)

    monkeypatch.setattr(DotProductAttention, "forward", spy)
    return calls


def test_recipe_attention_runs_the_blocks_dot_product_attention(monkeypatch):
    import fp8lab

    calls = _attention_calls(monkeypatch)
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    logits = {}
    for name, rec in (
        ("off", fp8lab.get_recipe("te-current")),
        ("on", fp8lab.get_recipe("te-current").replace(attention=True)),
        ("fp32-on", fp8lab.get_recipe("fp32").replace(attention=True)),
    ):
        torch.manual_seed(0)
        model = GPT(TINY)
        fp8lab.nn.convert(model, rec)
        calls.clear()
        logits[name] = model(idx)[0].detach()
        n = len(calls)
        assert n == (0 if name == "off" else TINY.n_layer), name
    # a recipe without quantized roles runs plain attention: SDPA up to float rounding ...
    torch.testing.assert_close(logits["fp32-on"], _plain_logits(idx), rtol=0, atol=1e-5)
    # ... and with attention on, FP8 attention changes the logits beyond that
    assert float((logits["on"] - logits["off"]).abs().max()) > 1e-3


def _plain_logits(idx):
    torch.manual_seed(0)
    return GPT(TINY)(idx)[0].detach()


def test_attention_under_nn_autocast_override(monkeypatch):
    import fp8lab

    calls = _attention_calls(monkeypatch)
    torch.manual_seed(0)
    model = GPT(TINY)
    fp8lab.nn.convert(model, "te-current")
    idx = torch.zeros(1, 8, dtype=torch.long)
    with fp8lab.nn.autocast(fp8lab.get_recipe("te-current").replace(attention=True)):
        _, loss = model(idx, idx)
    loss.backward()
    assert len(calls) == TINY.n_layer
    assert model.blocks[0].attn.qkv.weight.grad is not None


def test_fp8_attention_records_and_resumes_bit_for_bit(threads):
    """te-delayed with attention: the watch records TE's DPA roles of each block, and the
    attention's delayed state resumes from the model's state_dict bit for bit."""
    import fp8lab

    torch.set_num_threads(1)  # small GEMMs: one thread is much faster on a busy machine
    rec = fp8lab.get_recipe("te-delayed").replace(attention=True)
    gen = torch.Generator().manual_seed(2)
    batches = [torch.randint(0, 256, (1, 8), generator=gen) for _ in range(3)]

    def build():
        torch.manual_seed(0)
        m = GPT(TINY)
        fp8lab.nn.convert(m, rec)
        return m

    def step(m, idx):
        m.zero_grad()
        _, loss = m(idx, idx)
        loss.backward()
        return loss.detach(), m.blocks[0].attn.qkv.weight.grad.clone()

    a = build()
    from fp8lab.observe import sample

    with sample(a, 0) as rows:
        step(a, batches[0])
    dpa = {(r["layer"], r["role"]) for r in rows if r["gemm"] == "dpa"}
    roles = ("Q", "K", "V", "S", "O", "dO", "dP", "dQKV")
    assert dpa == {(f"blocks.{i}.attn.dpa", r) for i in range(TINY.n_layer) for r in roles}
    step(a, batches[1])
    saved = {k: v.clone() for k, v in a.state_dict().items()}
    assert "blocks.0.attn.dpa.fp8_dpa_S_amax_history" in saved
    b = build()
    b.load_state_dict(saved)
    for x, y in zip(step(a, batches[2]), step(b, batches[2]), strict=True):
        assert torch.equal(x, y)

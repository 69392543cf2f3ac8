"""fp8lab.nn in real training loops: torch.autocast, torch.compile, nn.MultiheadAttention and
nn.TransformerEncoderLayer's eval fast path, unconvert, and a clean public namespace."""

import copy
import types
import warnings

import pytest
import torch

import fp8lab
import fp8lab.nn
from fp8lab.nn import Linear, convert, converted, unconvert


# --------------------------------------------------------------------------- torch.autocast
@pytest.mark.parametrize("name", fp8lab.recipes())
def test_torch_autocast_bf16_casts_input_before_quantization(name):
    # as Transformer Engine: input and bias in the autocast dtype before quantization, the
    # emulated GEMM, the output returned in the autocast dtype (one rounding of the fp32 result)
    torch.manual_seed(0)
    mod = Linear(64, 32, recipe=name)
    ref = copy.deepcopy(mod)  # same weights and same (fresh) delayed-scaling state
    with torch.no_grad():
        ref.bias.copy_(ref.bias.to(torch.bfloat16).float())
    x = (torch.randn(32, 64) * 3).requires_grad_()  # 32 tokens: whole Hadamard blocks
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = mod(x)
        y.float().square().sum().backward()  # backward inside the autocast block too
    assert y.dtype == torch.bfloat16
    want = ref(x.detach().to(torch.bfloat16).float()).to(torch.bfloat16)
    assert torch.equal(y.detach(), want), name
    assert x.grad.dtype == torch.float32 and bool(torch.isfinite(x.grad).all())
    assert mod.weight.grad.dtype == torch.float32 and bool(torch.isfinite(mod.weight.grad).all())


def test_torch_autocast_converted_model_trains():
    torch.manual_seed(1)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32), torch.nn.Linear(32, 4)
    )
    convert(model, "te-delayed")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.randn(8, 32)).float().square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert model[0].scaling_states["grad_output"].step == 3
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


# --------------------------------------------------------------------------- torch.compile
@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_torch_compile_runs_converted_layers_eagerly(backend):
    torch.manual_seed(2)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8), torch.nn.ReLU()
    )
    convert(model, "te-current", default_exclude=False)
    x = torch.randn(4, 16)

    def step(m):
        xx = x.clone().requires_grad_()
        model.zero_grad(set_to_none=True)
        y = m(xx)
        y.sum().backward()
        return y.detach(), xx.grad, model[0].weight.grad.clone()

    want = step(model)
    torch._dynamo.reset()
    got = step(torch.compile(model, backend=backend))
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------- MHA and encoder
class _Attn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = torch.nn.MultiheadAttention(16, 2, batch_first=True)
        self.fc = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.fc(self.mha(x, x, x)[0]))


def test_mha_out_proj_is_never_claimed_converted():
    m = _Attn()
    with pytest.warns(UserWarning, match=r"mha\.out_proj"):
        convert(m, "te-current")
    assert converted(m) == ["fc"]
    assert type(m.mha.out_proj) is not Linear
    with pytest.raises(ValueError, match=r"mha\.out_proj"):
        convert(_Attn(), "te-current", strict=True)


def _calls(mod):
    n = [0]
    mod.register_forward_hook(lambda *_: n.__setitem__(0, n[0] + 1))
    return n


def test_encoder_layer_eval_fast_path_runs_converted_layers():
    torch.manual_seed(3)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    plain = copy.deepcopy(layer).eval()
    with pytest.warns(UserWarning, match="out_proj"):
        convert(layer, "te-current", default_exclude=False)
    assert converted(layer) == ["linear1", "linear2"]
    n1 = _calls(layer.linear1)
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        train_out = layer(x)  # training mode: the module path
        layer.eval()
        eval_out = layer(x)  # the fused fast path would read linear1/2's weights directly
        plain_out = plain(x)
    assert n1[0] == 2
    # eval differs from training mode only by MHA's own fused kernel (float rounding), and the
    # FP8 layers' error is visible against the plain fp32 layer
    torch.testing.assert_close(eval_out, train_out, rtol=0, atol=1e-5)
    assert float((eval_out - plain_out).abs().max()) > 1e-3
    unconvert(layer)
    assert layer.activation_relu_or_gelu == 1  # fast path restored for plain layers


def test_encoder_nested_tensor_path_runs_converted_layers():
    torch.manual_seed(4)
    enc = torch.nn.TransformerEncoder(
        torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True),
        num_layers=2,
        enable_nested_tensor=True,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        convert(enc, "te-current", default_exclude=False)
    n = _calls(enc.layers[1].linear2)
    enc.eval()
    x = torch.randn(2, 5, 16)
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    with torch.no_grad():
        y = enc(x, src_key_padding_mask=pad)
    assert n[0] == 1 and not y.is_nested


def test_convert_warns_when_nothing_is_converted():
    seq = torch.nn.Sequential(torch.nn.Linear(4, 4))  # the only Linear is the head
    with pytest.warns(UserWarning, match="no Linear layer"):
        convert(seq, "te-current")
    assert converted(seq) == []


# --------------------------------------------------------------------------- unconvert
def test_unconvert_restores_plain_linears_sharing_parameters():
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(3, 8)
    want = model(x)
    params = list(model.parameters())
    convert(model, "te-delayed")
    assert not torch.equal(model(x), want)
    assert unconvert(model) is model
    assert converted(model) == [] and type(model[0]) is torch.nn.Linear
    assert list(model.parameters()) == params  # the same Parameter objects
    assert torch.equal(model(x), want)
    assert set(model.state_dict()) == {"0.weight", "0.bias", "2.weight", "2.bias"}


# --------------------------------------------------------------------------- namespace
def test_public_namespace_is_exactly_all():
    names = {n for n in dir(fp8lab.nn) if not n.startswith("_")}
    extra = {
        n
        for n in names - set(fp8lab.nn.__all__)
        if not isinstance(getattr(fp8lab.nn, n), types.ModuleType)
    }
    assert extra == set()
    for leaked in ("Any", "torch", "contextlib", "Callable", "Iterator"):
        assert leaked not in names
    for n in fp8lab.nn.__all__:
        assert hasattr(fp8lab.nn, n)
    from fp8lab.nn.functional import buffer_cache_limit, clear_buffer_cache  # README names

    assert callable(buffer_cache_limit) and callable(clear_buffer_cache)

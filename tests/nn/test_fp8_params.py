"""fp8lab.nn.fp8_params: param_storage = "fp8" (FP8 primary weights)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fp8lab
from fp8lab.formats import decode
from fp8lab.nn import convert
from fp8lab.nn.fp8_params import fp8_codes, fp8_param_specs, storage_spec, store_fp8_params_
from fp8lab.optim import AdamW
from fp8lab.optim.adamw import HP_INIT_ATTR

ml_dtypes = pytest.importorskip("ml_dtypes")


def _model(recipe):
    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Linear(32, 64, bias=False), torch.nn.Linear(64, 16, bias=False)
    )
    convert(m, recipe, exclude=())
    return m


def _reference_codes(w: torch.Tensor) -> tuple[np.ndarray, float]:
    """TE current scaling per tensor, written here: scale = 448 / amax, codes = E4M3(w * scale)."""
    a = w.detach().numpy().astype(np.float32)
    scale = np.float32(448.0) / np.abs(a).max()
    return (a * scale).astype(ml_dtypes.float8_e4m3fn).view(np.uint8), float(1 / scale)


def test_stored_weights_are_fp8_codes_times_scale_and_requantized_each_step():
    rec = fp8lab.get_recipe("te-current").replace(param_storage="fp8")
    m = _model(rec)
    hp = {p: p.detach().clone() for p in m.parameters()}
    specs = store_fp8_params_(m)
    assert specs and all(isinstance(mod, fp8lab.nn.Linear) for mod in m if mod.weight in specs)
    for p in specs:
        w0 = hp[p]
        assert torch.equal(getattr(p, HP_INIT_ATTR), w0)  # kept for param_master_init
        codes, scales = fp8_codes(p, specs[p])
        ref, _ = _reference_codes(w0)
        assert np.array_equal(codes.numpy(), ref)  # the codes of the high-precision weight
        # the parameter holds exactly what codes x scale represent
        assert torch.equal(p.data, decode(codes, "e4m3") * scales.reshape(()))
    opt = AdamW(m.parameters(), lr=1e-2, param_specs=specs)
    m(torch.randn(8, 32)).pow(2).mean().backward()
    opt.step()
    for p in specs:
        codes, scales = fp8_codes(p, specs[p])
        assert torch.equal(p.data, decode(codes, "e4m3") * scales.reshape(()))
        assert not torch.equal(p.data, opt.state[p]["master"])  # the master is not on the grid


def test_delayed_weights_are_stored_with_current_scaling_and_formats_without_codes_refused():
    spec = fp8lab.get_recipe("te-delayed").weight
    assert spec.is_delayed and storage_spec(spec).scaling == "max"
    with pytest.raises(ValueError, match="no 8-bit codes"):
        storage_spec(fp8lab.QuantSpec("bf16"), "layer 'x' weight")
    with pytest.raises(ValueError, match="no such codes"):
        fp8lab.get_recipe("fp32").replace(param_storage="fp8")
    assert fp8_param_specs(_model(fp8lab.get_recipe("te-current"))) == {}  # not asked for


@pytest.mark.slow
def test_fp8_storage_with_high_precision_master_trains_like_high_precision_storage(tmp_path):
    # per-tensor current scaling: the forward's quantization of a stored weight gives the same
    # codes, and the fp32 master starts from the high-precision value: the same run bit for bit
    from fp8lab.lab.data import DataConfig, load_corpus
    from fp8lab.lab.gpt import GPTConfig
    from fp8lab.lab.train import LabConfig, TrainConfig, train_run

    f = tmp_path / "t.txt"
    f.write_text("To be, or not to be, that is the question. " * 30)
    corpus = load_corpus(DataConfig(paths=(str(f),), split_chunk=256), block_size=16)
    cfg = LabConfig(
        model=GPTConfig(block_size=16, n_layer=1, n_head=2, d_model=32, d_ff=64),
        train=TrainConfig(steps=4, batch_size=2, lr=3e-3, warmup_steps=1, eval_every=4,
                          eval_batches=1, stats_every=0, checkpoint_every=100),
    )  # fmt: skip
    base = fp8lab.get_recipe("te-current")
    a = train_run(base, cfg, corpus)
    b = train_run(base.replace(param_storage="fp8"), cfg, corpus)
    c = train_run(base.replace(param_storage="fp8", param_master_init="from_fp8"), cfg, corpus)
    loss = [[r["train_loss"] for r in x.records] for x in (a, b, c)]
    assert loss[0] == loss[1]
    assert loss[2][0] == loss[0][0] and loss[2] != loss[0]  # same forward, another master

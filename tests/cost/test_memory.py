"""fp8lab.cost.memory: MS-AMP O2's scaled fp16 master weights carry one fp32 scale per tensor."""

from __future__ import annotations

import pytest
import torch

import fp8lab
from fp8lab.cost.memory import model_memory, simulated_memory
from fp8lab.lab.gpt import GPT, GPTConfig


@pytest.mark.parametrize("storage", ["high_precision", "fp8"])
def test_fp16_scaled_master_adds_one_fp32_scale_per_parameter_tensor(storage):
    cfg = GPTConfig(n_layer=3, d_model=64, d_ff=128, n_head=2, block_size=16)
    base = fp8lab.get_recipe("te-current").replace(param_storage=storage)
    fp16, scaled = (base.replace(master_weights=m) for m in ("fp16", "fp16-scaled"))
    # the GPT's parameter tensors, counted on the built model: 2 embeddings, per layer two
    # norm weights and five Linear weights, the final norm and the head
    model = GPT(cfg)
    n_tensors = len(list(model.parameters()))
    assert n_tensors == 2 + 7 * cfg.n_layer + 2
    a, b = simulated_memory(cfg, 4, fp16), simulated_memory(cfg, 4, scaled)
    assert b["weights"] - a["weights"] == 4 * n_tensors
    assert b["optimizer"] == a["optimizer"] and b["activations"] == a["activations"]
    a, b = (model_memory(model, 256, 4, 16, r) for r in (fp16, scaled))
    assert b["weights"] - a["weights"] == 4 * n_tensors


def test_model_memory_counts_a_shared_tensor_once():
    lin = torch.nn.Linear(8, 8)
    model = torch.nn.Sequential(lin, torch.nn.ReLU(), lin)  # one weight and one bias, shared
    rec = fp8lab.get_recipe("te-current")
    a, b = (model_memory(model, 8, 1, 4, rec.replace(master_weights=m))
            for m in ("fp16", "fp16-scaled"))  # fmt: skip
    assert b["weights"] - a["weights"] == 4 * 2


@pytest.mark.parametrize("qk_norm", [False, True])
def test_quantized_saved_activations_cover_the_qk_and_final_norms(qk_norm):
    """save_activations = "quantized" saves every norm's input and SwiGLU's in 1 x 16 FP8 groups
    (1 byte + a 4-byte scale per 16 values) instead of bf16 (2 bytes): per token, the two block
    norms (2d), SwiGLU's gate and up (2f) and the q/k norms (2d) per layer, and the final norm (d)."""
    cfg = GPTConfig(n_layer=3, d_model=64, d_ff=128, n_head=2, block_size=16, qk_norm=qk_norm)
    rec = fp8lab.get_recipe("te-current")
    hp, q = (simulated_memory(cfg, 4, rec.replace(save_activations=s))
             for s in ("high_precision", "quantized"))  # fmt: skip
    d, f, N = cfg.d_model, cfg.d_ff, 4 * cfg.block_size
    elems = N * (cfg.n_layer * (2 * d + 2 * f + (2 * d if qk_norm else 0)) + d)
    assert hp["activations"] - q["activations"] == pytest.approx(elems * (2 - (1 + 4 / 16)))
    assert hp["weights"] == q["weights"] and hp["optimizer"] == q["optimizer"]

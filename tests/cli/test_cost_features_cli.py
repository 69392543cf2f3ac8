"""`fp8lab cost` on the NVFP4 presets with high-precision blocks, attention (--heads/--seq-len,
a recipe with [dpa]) and MoE models ([moe] dispatch)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from fp8lab.cli import app
from fp8lab.cost import price_layer
from fp8lab.cost.model import TransformerShape

runner = CliRunner()
SMALL = ["--hidden", "512", "--ffn", "1024", "--layers", "8", "--tokens", "2048"]


def _json(args):
    res = runner.invoke(app, ["cost", "--device", "b200", "--json", *args])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)["recipes"]


@pytest.mark.slow
def test_nvfp4_paper_runs_its_last_blocks_in_bf16():
    rec = _json(["--recipes", "bf16,nvfp4-te,nvfp4-paper", *SMALL])
    shape = TransformerShape(hidden=512, ffn=1024, layers=8, tokens=2048)
    fp4 = price_layer("nvfp4-te", "b200", shape).layer_ms
    bf = price_layer("bf16", "b200", shape).layer_ms
    # max(1, round(0.15 x 8)) = 1 block in bf16, the other 7 as nvfp4-te ('layer' = the model)
    assert rec["nvfp4-paper"]["layer_ms"] == pytest.approx(7 * fp4 + bf)
    assert rec["nvfp4-te"]["layer_ms"] == pytest.approx(8 * fp4)


@pytest.mark.slow
def test_attention_with_a_dpa_recipe(tmp_path):
    f = tmp_path / "dpa.toml"
    f.write_text('base = "te-delayed"\nattention = true\n\n[dpa]\nfp8_mha = true\n')
    args = ["--recipes", f"bf16,te-delayed,{f}", *SMALL, "--heads", "8", "--seq-len", "1024"]
    with_att = _json(args)
    without = _json(["--recipes", f"bf16,te-delayed,{f}", *SMALL])
    # attention adds the same bf16 matmuls to bf16 and te-delayed; FP8 attention costs less
    add_bf = with_att["bf16"]["gemm_ms"] - without["bf16"]["gemm_ms"]
    add_dl = with_att["te-delayed"]["gemm_ms"] - without["te-delayed"]["gemm_ms"]
    add_fp8 = with_att[str(f)]["gemm_ms"] - without[str(f)]["gemm_ms"]
    assert add_bf > 0 and add_dl == pytest.approx(add_bf)
    assert 0 < add_fp8 < add_bf
    assert without[str(f)]["layer_ms"] == pytest.approx(without["te-delayed"]["layer_ms"])
    res = runner.invoke(app, ["cost", "--device", "b200", *args[:2], *SMALL, "--heads", "8",
                              "--seq-len", "1024"])  # fmt: skip
    assert res.exit_code == 0 and "attn.qk.fprop" in res.stdout


@pytest.mark.slow
def test_moe_model_prices_expert_rows_and_the_wire_format(tmp_path):
    model = tmp_path / "moe_model.py"
    model.write_text(
        "def moe():\n    from fp8lab.lab.gpt import GPT, GPTConfig\n\n"
        "    return GPT(GPTConfig(n_layer=2, d_model=128, d_ff=128, n_head=2, n_experts=4, "
        "top_k=2))\n"
    )
    rec_file = tmp_path / "moe.toml"
    rec_file.write_text('base = "mxfp8"\n\n[moe]\ndispatch = "mxfp8"\n')
    rec = _json(["--model", f"{model}:moe", "--recipes", f"mxfp8,{rec_file}"])
    rows = 1024 * 2  # the lab's 8 x 128 tokens, top-2
    bf16_wire = 4 * rows * 128 * 2
    mx_wire = rows * 128 + rows * 4  # E4M3 + one E8M0 scale per 32
    assert rec["mxfp8"]["moe_wire_bytes"] == 2 * bf16_wire  # two MoE blocks
    assert rec[str(rec_file)]["moe_wire_bytes"] == 2 * (2 * mx_wire + 2 * rows * 128 * 2)
    assert rec[str(rec_file)]["gemm_ms"] == rec["mxfp8"]["gemm_ms"]
    assert rec[str(rec_file)]["quantize_ms"] > rec["mxfp8"]["quantize_ms"]


@pytest.mark.no_arithmetic
def test_attention_option_errors():
    for args, msg in (
        (["--heads", "8"], "both heads and seq_len"),
        (["--model", "gpt", "--heads", "8", "--seq-len", "128"], "shape options only"),
        ([*SMALL, "--heads", "8", "--seq-len", "1000"], "whole number of sequences"),
    ):
        res = runner.invoke(app, ["cost", "--device", "b200", *args])
        assert res.exit_code == 2, res.output
        assert msg in res.output and res.output.count("Error:") == 1

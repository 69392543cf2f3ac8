"""`fp8lab cost`: tables, --json schema, bad input exits 2."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from fp8lab.cli import app

runner = CliRunner()
SMALL = ["--hidden", "512", "--ffn", "1024", "--layers", "2", "--tokens", "1024"]


def test_json_schema_exact():
    res = runner.invoke(
        app, ["cost", "--recipes", "bf16,te-current,te-delayed", "--device", "h200", "--json"]
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert set(out) == {"schema_version", "device", "recipes"}
    assert out["schema_version"] == 1 and out["device"] == "h200"
    assert list(out["recipes"]) == ["bf16", "te-current", "te-delayed"]
    for row in out["recipes"].values():
        assert set(row) == {"layer_ms", "speedup_vs_bf16", "gemm_ms", "quantize_ms", "bytes"}
        assert row["layer_ms"] == row["gemm_ms"] + row["quantize_ms"]
    assert out["recipes"]["bf16"]["speedup_vs_bf16"] == 1.0
    cur, dl = out["recipes"]["te-current"], out["recipes"]["te-delayed"]
    assert dl["speedup_vs_bf16"] > cur["speedup_vs_bf16"] > 1  # one amax pass fewer
    assert cur["bytes"] > dl["bytes"]


def test_tables_and_skipped_recipes_on_hopper():
    res = runner.invoke(app, ["cost", "--device", "h200", *SMALL])
    assert res.exit_code == 0, res.output
    for text in ("Per-GEMM", "bytes ledger", "by precision", "read bf16", "written fp8",
                 "Per-layer totals", "qkv.wgrad", "deepseek-v3"):  # fmt: skip
        assert text in res.stdout
    assert "skipped mxfp8" in res.stderr and "skipped nvfp4" in res.stderr


def test_blackwell_prices_every_default_recipe():
    res = runner.invoke(app, ["cost", "--device", "b300", "--json", "--scenario", "te-benchmark"])
    assert res.exit_code == 0, res.output
    rec = json.loads(res.stdout)["recipes"]
    assert set(rec) == {"bf16", "te-delayed", "te-current", "mxfp8", "deepseek-v3", "nvfp4"}
    assert rec["nvfp4"]["speedup_vs_bf16"] > rec["te-delayed"]["speedup_vs_bf16"]


def test_bad_input_exit_2():
    cases = [
        (["--device", "a100"], "unknown device 'a100'"),
        (["--recipes", "hif8-current", "--device", "b300"], "HiF8"),
        (["--recipes", "nope"], "unknown recipe 'nope'"),
        (["--model", "my_models.py:make"], "no such Python file: my_models.py"),
        (["--fsdp"], "need --ranks"),
        (["--ranks", "2", "--grad-comm", "fp16"], "unknown gradient communication 'fp16'"),
        (["--ranks", "0"], "--ranks must be >= 1"),
        (["--ranks", "2", "--fp8-allgather"], "--fp8-allgather needs --fsdp"),
        (["--ranks", "2", "--fsdp", "--grad-comm", "bf16"], "reduce-scattered in fp32"),
        (["--ranks", "2", "--amax-group", "some"], "--amax-group 'some'"),
        (["--model", "gpt", "--hidden", "64"], "drop --hidden"),
        (["--model", "gpt", "--tokens", "0"], "tokens must be a positive integer"),
        (["--hidden", "0"], "hidden must be a positive integer"),
        (["--scenario", "inference"], "unknown scenario"),
        (["--recipes", "mxfp8", "--device", "h100"], "no recipe of mxfp8 runs on h100"),
    ]
    for args, message in cases:
        res = runner.invoke(app, ["cost", *args])
        assert res.exit_code == 2, (args, res.output)
        assert message in res.stderr, (args, res.stderr)


def test_help():
    res = runner.invoke(app, ["cost", "--help"])
    assert res.exit_code == 0
    assert "--recipes" in res.stdout and "te-benchmark" in res.stdout


def test_model_gpt_prices_the_lab_gpt():
    res = runner.invoke(app, ["cost", "--model", "gpt", "--device", "b300", "--json"])
    assert res.exit_code == 0, res.output
    rec = json.loads(res.stdout)["recipes"]
    assert isinstance(rec["bf16"]["quantize_ms"], float)
    # d_model 256 on 1024 tokens: memory-bound GEMMs, quantization passes make FP8 slower
    assert rec["te-delayed"]["speedup_vs_bf16"] < 1
    res = runner.invoke(app, ["cost", "--model", "gpt", "--device", "h200"])
    assert res.exit_code == 0, res.output
    # the GPT's converted Linears (the head stays high precision), folded per block
    assert "2 layers x 5 Linears" in res.stdout and "blocks.*.mlp.gate.fprop" in res.stdout
    assert "1024x256x768" in res.stdout  # gate: 8 x 128 tokens, d_model 256 -> d_ff 768


def _rows(stdout):
    return {line.split("│")[1].strip(): line for line in stdout.splitlines() if "│" in line}


def test_model_from_a_transformers_config():
    # llama-tiny.json: hidden 256, intermediate 768, 4 heads, 2 KV heads (head dim 64: k/v 128)
    res = runner.invoke(app, ["cost", "--model", "hf:examples/models/llama-tiny.json",
                              "--recipes", "bf16,te-current", "--device", "h100"])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "2 layers x 7 Linears" in res.stdout
    rows = _rows(res.stdout)
    pre = "model.model.layers.*."
    assert "1024x256x256" in rows[pre + "self_attn.q_proj.fprop"]
    assert "1024x256x128" in rows[pre + "self_attn.k_proj.fprop"]
    assert "1024x768x256" in rows[pre + "mlp.down_proj.fprop"]
    assert "256x1024x768" in rows[pre + "mlp.up_proj.wgrad"]
    # every parameter's gradient is all-reduced: 1,705,216 elements (hand count: embedding and
    # untied head 256 x 256 each, per layer q/o 256x256, k/v 128x256, gate/up/down 3 x 256x768
    # and two norms of 256, a final norm of 256); fp32 on 2 ranks: 2 (N-1)/N x 4 bytes each
    res = runner.invoke(app, ["cost", "--model", "hf:examples/models/llama-tiny.json",
                              "--recipes", "bf16", "--ranks", "2", "--json"])  # fmt: skip
    assert res.exit_code == 0, res.output
    numel = 2 * 256 * 256 + 2 * (2 * 256 * 256 + 2 * 128 * 256 + 3 * 256 * 768 + 2 * 256) + 256
    assert numel == 1_705_216
    cb = json.loads(res.stdout)["recipes"]["bf16"]["collective_bytes"]
    assert cb["grad_reduce_bytes"] == 4 * numel


def test_model_gpt2_conv1d_shapes():
    # gpt2-tiny.json: n_embd 256, n_inner 1024; Conv1D weights are stored [in, out]
    res = runner.invoke(app, ["cost", "--model", "hf:examples/models/gpt2-tiny.json",
                              "--recipes", "bf16", "--device", "b200"])  # fmt: skip
    assert res.exit_code == 0, res.output
    rows = _rows(res.stdout)
    pre = "model.transformer.h.*."
    assert "1024x256x768" in rows[pre + "attn.c_attn.fprop"]
    assert "1024x256x1024" in rows[pre + "mlp.c_fc.fprop"]
    assert "1024x1024x256" in rows[pre + "mlp.c_proj.fprop"]


def test_collective_bytes_in_json_and_ledger():
    # one layer: qkv 512x1536, proj 512x512, up 512x1024, down 1024x512 = 2,097,152 weights; 2
    # layers; bf16 on 4 ranks: 2 x 3/4 x 2 bytes per element
    args = ["cost", "--recipes", "bf16,te-delayed", *SMALL, "--ranks", "4", "--grad-comm", "bf16"]
    res = runner.invoke(app, [*args, "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["distributed"]["ranks"] == 4 and out["distributed"]["grad_comm"] == "bf16"
    numel = 2 * (512 * 1536 + 512 * 512 + 512 * 1024 + 1024 * 512)
    for r in ("bf16", "te-delayed"):
        cb = out["recipes"][r]["collective_bytes"]
        assert cb["grad_reduce_bytes"] == 1.5 * 2 * numel and cb["fsdp_allgather_bytes"] == 0
        # the old fields are all still there
        assert {"layer_ms", "speedup_vs_bf16", "gemm_ms", "quantize_ms", "bytes"} < set(
            out["recipes"][r]
        )
    # te-delayed: x, W, dy of 4 Linears x 2 layers: 24 float32 amaxes in one all-reduce
    cb = out["recipes"]["te-delayed"]["collective_bytes"]
    assert cb["amax_allreduces"] == 1 and cb["amax_allreduce_bytes"] == 1.5 * 4 * 24
    res = runner.invoke(app, ["cost", "--recipes", "bf16,te-current", *SMALL, "--ranks", "4",
                              "--fsdp", "--fp8-allgather"])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "Collective bytes ledger" in res.stdout and "FSDP weight all-gathers" in res.stdout
    assert "gradient reduce-scatter" in res.stdout and "FP8 all-gather" in res.stdout


def test_per_layer_recipe_file_priced_per_linear(tmp_path):
    # te-current everywhere but layer 1, which runs bf16: the whole model (every Linear priced,
    # "layer" = the model) costs half of each preset's two-layer model
    f = tmp_path / "mixed.toml"
    f.write_text('base = "te-current"\nname = "mixed"\n\n[[layer]]\nmatch = "layers.1.*"\n'
                 'base = "bf16"\n')  # fmt: skip
    res = runner.invoke(app, ["cost", "--recipes", f"bf16,te-current,{f}", *SMALL, "--json"])
    assert res.exit_code == 0, res.output
    rec = json.loads(res.stdout)["recipes"]
    both = rec["bf16"]["layer_ms"] + rec["te-current"]["layer_ms"]
    assert rec[str(f)]["layer_ms"] == pytest.approx(both / 2, rel=1e-12)
    # a layer running a recipe no GPU multiplies natively: a clear error naming the layer
    f.write_text(
        'base = "te-current"\n\n[[layer]]\nmatch = "layers.0.proj"\nbase = "hif8-delayed"\n'
    )
    res = runner.invoke(app, ["cost", "--recipes", str(f), *SMALL])
    assert res.exit_code == 2 and "layers.0.proj" in res.stderr and "HiF8" in res.stderr


def test_refuses_recipe_files_compare_refuses(tmp_path):
    # issue 22: the same file checks as compare (fp8lab.recipe.validate), each naming the file
    f = tmp_path / "fix.toml"
    f.write_text('base = "te-current"\n[[layer]]\nmatch = "blocks.7.*"\nbase = "bf16"\n')
    res = runner.invoke(app, ["cost", "--recipes", str(f), *SMALL])
    assert res.exit_code == 2, res.output
    assert "fix.toml" in res.stderr and "matches no converted Linear" in res.stderr
    f.write_text("")
    res = runner.invoke(app, ["cost", "--recipes", str(f), *SMALL])
    assert res.exit_code == 2 and "fix.toml" in res.stderr and "empty recipe" in res.stderr
    # K = hidden 500 does not tile DeepSeek-V3's 128-wide blocks (a preset names itself)
    odd = ["--hidden", "500", "--ffn", "1024", "--layers", "2", "--tokens", "1024"]
    res = runner.invoke(app, ["cost", "--recipes", "bf16,deepseek-v3", *odd])
    assert res.exit_code == 2, res.output
    assert "deepseek-v3" in res.stderr and "not a multiple of the block 128" in res.stderr
    assert "500" in res.stderr


def test_tables_readable_at_80_columns():
    # issue 22: at 80 columns the GEMM shapes and recipe names ended in '…'
    from table_width_check import NARROW, assert_readable

    res = runner.invoke(app, ["cost", "--device", "b200", "--ranks", "2"], env=NARROW)
    assert res.exit_code == 0, res.output
    headers = ["GEMM", "M x K x N", "tensor", "recipe", "collective", "speedup vs bf16"]
    names = ["te-delayed", "te-current", "mxfp8", "deepseek-v3", "nvfp4", "15872x4096x12288"]
    assert_readable(res.stdout, headers, names)

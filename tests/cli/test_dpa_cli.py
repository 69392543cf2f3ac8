"""FP8 attention on the command line: a head size that does not tile the MXFP8 block is bad
input (exit 2, one ``Error:`` line naming the head size and the block), before any training."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from fp8lab.cli import app
from tiny_lab import tiny_lab_toml

runner = CliRunner()


@pytest.mark.no_arithmetic
def test_mxfp8_attention_head_size_that_does_not_tile_the_block_exits_2(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("to be or not to be " * 80)
    conf = tmp_path / "c.toml"
    conf.write_text(tiny_lab_toml(text, steps=2, batch_size=2))  # d_model 32 / n_head 2 = 16
    rec = tmp_path / "mx_attn.toml"
    rec.write_text('base = "mxfp8"\nattention = true\n')
    out = tmp_path / "out"
    res = runner.invoke(app, ["compare", "--config", str(conf), "--out", str(out), "--quiet",
                              "--recipes", str(rec)])  # fmt: skip
    assert res.exit_code == 2, res.output
    err = " ".join(res.stderr.split())
    assert err.startswith("Error:") and "Traceback" not in res.output
    assert "head size 16 does not tile the MXFP8 block of 32" in err
    assert "blocks.0.attn" in err
    assert not out.exists() or not any(out.iterdir())

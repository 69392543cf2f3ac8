"""Bad optimizer/storage recipe keys in a recipe file: the CLI exits 2 naming the file."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner


@pytest.mark.no_arithmetic
def test_cli_exits_2_naming_the_file(tmp_path):
    from fp8lab.cli import app

    f = tmp_path / "bad.toml"
    for text, what in [('base = "te-current"\nexp_avg_dtype = "fp7"\n', "exp_avg_dtype"),
                       ('base = "fp32"\nparam_storage = "fp8"\n', "no such codes")]:  # fmt: skip
        f.write_text(text)
        res = CliRunner().invoke(app, ["cost", "--recipes", str(f), "--hidden", "256",
                                       "--ffn", "512", "--layers", "1", "--tokens", "256"])  # fmt: skip
        assert res.exit_code == 2, res.output
        assert "bad.toml" in res.stderr and what in res.stderr
        assert res.stderr.count("Error:") == 1

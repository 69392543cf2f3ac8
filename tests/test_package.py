import subprocess
import sys

import pytest

import fp8lab


def test_lazy_exports_resolve_or_name_their_module():
    assert fp8lab.get_format("e4m3").max == 448.0
    with pytest.raises(AttributeError, match="no attribute"):
        fp8lab.does_not_exist  # noqa: B018


def test_quantize_stays_the_function_after_its_module_is_imported():
    import fp8lab.qtensor  # binds the submodule on the package; must not shadow the function

    assert fp8lab.quantize is fp8lab.qtensor.quantize
    q = fp8lab.quantize(fp8lab.qtensor.torch.tensor([2.0, 448.0]), "e4m3")  # scale 1
    assert q.dequantize().tolist() == [2.0, 448.0]


def test_cli_help_runs():
    out = subprocess.run(
        [sys.executable, "-m", "fp8lab.cli", "--help"], capture_output=True, text=True, check=True
    )
    assert "fp8lab" in out.stdout

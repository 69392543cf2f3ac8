import subprocess
import sys

import pytest

import fp8lab


def test_lazy_exports_resolve_or_name_their_module():
    assert fp8lab.get_format("e4m3").max == 448.0
    with pytest.raises(AttributeError, match="no attribute"):
        fp8lab.does_not_exist  # noqa: B018


def test_cli_help_runs():
    out = subprocess.run(
        [sys.executable, "-m", "fp8lab.cli", "--help"], capture_output=True, text=True, check=True
    )
    assert "fp8lab" in out.stdout

"""The amax all-reduce of delayed scaling is turned on explicitly, never by an import: under an
initialised process group, ``import fp8lab`` and ``from fp8lab.nn import Linear`` behave alike
(before, only the first installed it), a delayed-scaled Linear warns naming the call until it is
made, and `fp8lab.distributed.set_amax_reduction()` turns the reduction on. One process, a
one-rank gloo group, in a fresh interpreter per import style."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = """
import json, sys, warnings
import torch
import torch.distributed as dist

style, store = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
if style == "package":
    import fp8lab
    Linear, get_recipe = fp8lab.nn.Linear, fp8lab.get_recipe
else:
    from fp8lab.nn import Linear
    from fp8lab.recipe import get_recipe
from fp8lab.scaling.delayed import amax_reduction_installed

def warned():
    lin = Linear(32, 16, recipe=get_recipe("te-delayed"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lin(torch.randn(4, 32)).sum().backward()
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]

out = {"installed_after_import": amax_reduction_installed(), "warnings_before": warned()}
import fp8lab.distributed
out["previous"] = fp8lab.distributed.set_amax_reduction()
out["installed_after_call"] = amax_reduction_installed()
out["warnings_after"] = warned()
dist.destroy_process_group()
print(json.dumps(out))
"""


@pytest.mark.slow  # two interpreters under torch.distributed (~10-25 s)
@pytest.mark.no_arithmetic  # which code runs on import: the same on every kernel and CPU
def test_both_import_styles_behave_alike(tmp_path: Path) -> None:
    got = {}
    for style in ("package", "submodule"):
        res = subprocess.run(
            [sys.executable, "-c", WORKER, style, str(tmp_path / f"store-{style}")],
            capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
        assert res.returncode == 0, res.stderr
        got[style] = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["package"] == got["submodule"]
    run = got["package"]
    assert run["installed_after_import"] is False and run["previous"] is False
    assert any("fp8lab.distributed.set_amax_reduction()" in w for w in run["warnings_before"])
    assert run["installed_after_call"] is True and run["warnings_after"] == []

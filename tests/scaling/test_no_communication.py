"""The scaling layer never communicates: amax reductions are installed from above (fp8lab.distributed)."""

import ast
from pathlib import Path

import torch

import fp8lab.scaling.delayed as delayed
from fp8lab.scaling.delayed import DelayedScaling, set_amax_reduction

SCALING = Path(delayed.__file__).parent


def test_no_torch_distributed_in_the_scaling_layer() -> None:
    bad = []
    for path in sorted(SCALING.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "distributed":
                bad.append(f"{path.name}:{node.lineno}")
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.dist"):
                bad.append(f"{path.name}:{node.lineno}")
    assert not bad, bad


def test_an_installed_reducer_serves_measured_updates_only_while_active() -> None:
    calls = []

    class Reducer:
        def defer_update(self, ds: DelayedScaling, fmt: object = None) -> None:
            calls.append(ds)
            ds.update(fmt, reduced=torch.tensor(8.0))

    old = (delayed._REDUCTION.reducer, delayed._REDUCTION.active)
    try:
        ds = DelayedScaling(history_len=2, fmt="e4m3")
        ds.observe(2.0)
        set_amax_reduction(Reducer(), lambda: False)
        ds.update()
        assert calls == [] and float(ds.scale) == 448 / 2  # inactive: the local amax
        ds.observe(2.0)
        set_amax_reduction(Reducer(), lambda: True)
        ds.update()
        assert calls == [ds] and float(ds.scale) == 448 / 8  # the reduced amax
        local = DelayedScaling(history_len=2, fmt="e4m3", reduce_amax=False)
        local.observe(2.0)
        local.update()
        assert calls == [ds]  # reduce_amax=False never reduces
    finally:
        set_amax_reduction(*old)

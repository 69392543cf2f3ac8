"""Outside torch.autocast a Linear step does not enter an autocast context (each entry and exit
costs ~6 us, twice per layer and step); under autocast the GEMMs still run with it off."""

from __future__ import annotations

import torch

from fp8lab.nn import Linear


class _Counting(torch.autocast):
    entered = 0

    def __enter__(self):
        type(self).entered += 1
        return super().__enter__()


def test_no_autocast_context_outside_autocast(monkeypatch):
    monkeypatch.setattr(torch, "autocast", _Counting)
    lin = Linear(32, 16, recipe="te-current")
    x = torch.randn(8, 32, requires_grad=True)
    _Counting.entered = 0
    lin(x).sum().backward()
    assert _Counting.entered == 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _Counting.entered = 0
        y = lin(x)
        assert _Counting.entered == 1  # the Function's own autocast-off block
    assert y.dtype == torch.bfloat16

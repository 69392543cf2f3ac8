"""The thread policy of the numba kernels (fp8lab.kernels): numba follows torch's thread count,
one thread or a small tensor runs the serial variant, and serial and parallel variants give the
same bits. Behaviour only (which variant ran, numba's thread count), no timing."""

from __future__ import annotations

import numba
import pytest
import torch

import fp8lab.kernels as th
from fp8lab import Accumulator, QuantSpec, cast, qmatmul, quantize
from fp8lab.formats import decode, encode
from fp8lab.gemm import fused_dot
from fp8lab.nn._kernels import round_bf16

pytestmark = pytest.mark.numba_only  # the thread policy of the numba kernels themselves

MULTI = numba.config.NUMBA_NUM_THREADS >= 2
BIG = 1 << 22  # above SERIAL_BELOW


def _cast_big():
    return cast(torch.randn(BIG, generator=torch.Generator().manual_seed(0)), "e4m3")


def test_one_torch_thread_runs_serial(threads):
    torch.set_num_threads(1)
    th.dispatch_counts(reset=True)
    _cast_big()
    assert th.dispatch_counts() == {"serial": 1, "parallel": 0}


@pytest.mark.skipif(not MULTI, reason="needs NUMBA_NUM_THREADS >= 2")
def test_numba_follows_torch(threads):
    numba.set_num_threads(1)  # e.g. left so by someone else: the policy overrides it
    torch.set_num_threads(2)
    th.dispatch_counts(reset=True)
    _cast_big()
    assert th.dispatch_counts() == {"serial": 0, "parallel": 1}
    assert numba.get_num_threads() == 2


@pytest.mark.skipif(not MULTI, reason="needs NUMBA_NUM_THREADS >= 2")
def test_torch_above_numba_cap(threads):
    torch.set_num_threads(numba.config.NUMBA_NUM_THREADS + 3)
    _cast_big()
    assert numba.get_num_threads() == numba.config.NUMBA_NUM_THREADS


def test_small_tensors_run_serial(threads):
    torch.set_num_threads(2)
    th.dispatch_counts(reset=True)
    for n in (1, 1000, th.SERIAL_BELOW - 1):
        cast(torch.randn(n), "e4m3")
    round_bf16(torch.randn(128, 128))
    assert th.dispatch_counts() == {"serial": 4, "parallel": 0}


def _all_kernels() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(300, 700, generator=g) * 10
    out = {
        "cast det": cast(x, "e4m3"),
        "cast stochastic": cast(
            x, "e5m2", "stochastic", generator=torch.Generator().manual_seed(2)
        ),
        "cast hif8": cast(x, "hif8"),
        "cast float64": cast(x.double(), "e4m3"),
        "cast e3m3 bf16": cast(x.bfloat16(), "e3m3"),
        "encode": encode(x, "e4m3").to(torch.int32),
        "decode": decode(torch.arange(256, dtype=torch.uint8).repeat(1000), "e4m3"),
        "round_bf16": round_bf16(x),
    }
    a, b = torch.randn(96, 256, generator=g), torch.randn(256, 160, generator=g)
    qa = quantize(a, QuantSpec("e4m3", (1, 128)))
    qb = quantize(b, QuantSpec("e4m3", (128, 128)))
    for name, acc in [
        ("h100 fast", Accumulator("h100", promote_every=128)),
        ("h100 reference", Accumulator("h100", promote_every=128)),
        ("b200", Accumulator("b200", promote_every=128)),
        ("per_product", Accumulator("limited", promote_every=128, per_product=True)),
    ]:
        if name == "h100 reference":
            from fp8lab.gemm.fused import fused

            out[name] = fused(qa, qb, acc.resolve("e4m3", "e4m3"), 128, fast=False)
        else:
            out[name] = qmatmul(qa, qb, acc)
    out["fused_dot"] = fused_dot(qa.values[:, :256], qb.values.T[:96], "h100")
    return out


@pytest.mark.skipif(not MULTI, reason="needs NUMBA_NUM_THREADS >= 2")
def test_serial_and_parallel_bit_identical(threads, monkeypatch):
    torch.set_num_threads(2)
    monkeypatch.setattr(th, "SERIAL_BELOW", 1 << 62)
    th.dispatch_counts(reset=True)
    serial = _all_kernels()
    assert th.dispatch_counts()["parallel"] == 0
    monkeypatch.setattr(th, "SERIAL_BELOW", 0)
    th.dispatch_counts(reset=True)
    par = _all_kernels()
    counts = th.dispatch_counts()
    assert counts["serial"] == 0 and counts["parallel"] >= len(par)
    for name, s in serial.items():
        p = par[name]
        assert s.shape == p.shape, name
        if s.dtype.is_floating_point:
            s, p = s.float().view(torch.int32), p.float().view(torch.int32)
        assert torch.equal(s, p), name

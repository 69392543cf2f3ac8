"""Parallel GEMM kernels whose threads claim jobs (`fp8lab.kernels.claim`): every job runs once,
a thread held up on one job leaves the rest to the others, and the bits never depend on the
thread count or on which thread ran which job. Behaviour only, no timing."""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

import fp8lab.kernels as th
from fp8lab import Accumulator, QuantSpec, qmatmul, quantize
from fp8lab.gemm import limited as lim
from fp8lab.kernels import claim

pytestmark = pytest.mark.numba_only

MULTI = numba.config.NUMBA_NUM_THREADS >= 2


@intrinsic
def _peek(typingctx, counter):  # pragma: no cover - numba
    """An atomic read of ``counter[0]`` (a plain read may be hoisted out of a spin loop)."""

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, sig.args[0], ary, [cgutils.intp_t(0)])
        return builder.load_atomic(ptr, "monotonic", 8)

    return types.int64(counter), codegen


@njit(parallel=True)
def _claimed(jobs, workers, ran, who, hold):  # pragma: no cover - numba
    """The kernels' loop: ``ran[j]`` counts the runs of job j, ``who[j]`` its thread. With
    ``hold`` > 0 the thread that claims job 0 stays on it until every job is claimed (at most
    ``hold`` polls): a core taken by another process."""
    counter = np.zeros(1, dtype=np.int64)
    for _ in prange(workers):
        job = claim(counter)
        while job < jobs:
            ran[job] += 1
            who[job] = numba.get_thread_id()
            if job == 0:
                i = 0
                while i < hold and _peek(counter) < jobs:
                    i += 1
            job = claim(counter)


@pytest.mark.parametrize("workers", [1, 2, 7])
@pytest.mark.parametrize("jobs", [0, 1, 3, 257])
def test_every_job_runs_once(threads, workers, jobs):
    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    ran = np.zeros(jobs, dtype=np.int64)
    _claimed(jobs, workers, ran, np.zeros(jobs, dtype=np.int64), 0)
    assert (ran == 1).all()


@pytest.mark.skipif(not MULTI, reason="needs NUMBA_NUM_THREADS >= 2")
def test_a_held_thread_leaves_the_rest_to_the_others(threads):
    # prange's static split would give jobs 0..49 to the held thread; claimed, the other
    # thread runs all of 1..99 while job 0 holds its thread
    numba.set_num_threads(2)
    ran, who = np.zeros(100, dtype=np.int64), np.full(100, -1, dtype=np.int64)
    _claimed(100, 2, ran, who, 1 << 40)
    assert (ran == 1).all()
    assert (who[1:] != who[0]).all()


def _limited_cases() -> dict[str, tuple[int, object]]:
    """name -> (parallel kernel calls above the cut-off, the qmatmul)."""
    g = torch.Generator().manual_seed(3)
    a = torch.randn(70, 600, generator=g) * torch.exp(torch.randn(70, 600, generator=g) * 2)
    b = torch.randn(600, 530, generator=g)  # two column tiles of the kernel, the second ragged
    qa, qb = quantize(a, QuantSpec("e4m3", (1, 128))), quantize(b, QuantSpec("e4m3", (128, 128)))
    ta, tb = quantize(a, QuantSpec("e5m2")), quantize(b, QuantSpec("e4m3"))
    sa, sb = quantize(a[:, :256], QuantSpec("e4m3")), quantize(b[:256, :70], QuantSpec("e4m3"))
    rne = Accumulator("limited", mantissa_bits=9, rounding="nearest_even", group=16)
    pp = Accumulator("limited", promote_every=128, per_product=True)
    return {
        "promoted": (1, lambda: qmatmul(qa, qb, Accumulator("limited", promote_every=128))),
        "never promoted": (1, lambda: qmatmul(ta, tb, Accumulator("limited"))),
        "nearest even, group 16": (1, lambda: qmatmul(ta, tb, rne)),
        "per_product": (2, lambda: qmatmul(sa, sb, pp)),  # per interval
        "h100": (1, lambda: qmatmul(qa, qb, Accumulator("h100", promote_every=128))),
    }


@pytest.mark.skipif(not MULTI, reason="needs NUMBA_NUM_THREADS >= 2")
def test_limited_runs_parallel_and_keeps_its_bits(threads, monkeypatch):
    # `limited` without per-product alignment ran its sums serially before (a batched torch GEMM
    # and a serial numba pass); now one parallel kernel whose threads claim jobs
    torch.set_num_threads(2)
    for name, (calls, fn) in _limited_cases().items():
        monkeypatch.setattr(th, "SERIAL_BELOW", 1 << 62)
        serial = fn()
        monkeypatch.setattr(th, "SERIAL_BELOW", 0)
        th.dispatch_counts(reset=True)
        par = fn()
        assert th.dispatch_counts() == {"serial": 0, "parallel": calls}, name
        assert torch.equal(serial.view(torch.int32), par.view(torch.int32)), name


@pytest.mark.parametrize("workers", [1, 2, 5])
def test_limited_kernel_any_worker_count(threads, workers):
    # more workers than threads or jobs: the surplus find no job
    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    g = torch.Generator().manual_seed(4)
    m, k, n = 9, 100, 40
    va = quantize(torch.randn(m, k, generator=g), QuantSpec("e4m3", scaling=1.0)).values
    vb = quantize(torch.randn(k, n, generator=g), QuantSpec("e4m3", scaling=1.0)).values.double()
    one = torch.ones((1, 1), dtype=torch.float32)
    no_c = torch.zeros(0, n, dtype=torch.float64)
    bp = np.empty((-(-k // 32) * (n // 8) * 32, 8))  # b's panels, as `_numba_sums` packs them
    lim._pack_b(vb.numpy(), bp, 32)
    outs = []
    for kernel, w in ((lim._acc_sums_serial, 1), (lim._acc_sums, workers)):
        out = torch.zeros(m, n)
        kernel(va.numpy(), vb.numpy(), bp, no_c.numpy(), out.numpy(), one.numpy(), one.numpy(),
               32, 4, 0, 39, False, 1, w)  # fmt: skip
        outs.append(out)
    assert outs[0].abs().sum() > 0
    assert torch.equal(outs[0].view(torch.int32), outs[1].view(torch.int32))

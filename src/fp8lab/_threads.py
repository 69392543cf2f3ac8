"""One thread policy for every parallel numba kernel of fp8lab.

torch and numba each run their own OpenMP pool (torch ships its own ``libgomp``, numba's ``omp``
threading layer loads the system one), and an OpenMP worker spins for a while after its parallel
region before it sleeps. A numba kernel that wakes ``NUMBA_NUM_THREADS`` (= the core count)
threads between torch's GEMMs therefore puts up to twice the core count of busy threads on the
cores; on a machine already loaded by other work the spinning workers take turns on the cores
and a step of two small Linear layers took 50-150 ms instead of 1 ms (issue 22).
`torch.set_num_threads` did not reach numba's pool.

The policy, applied by `parallel` before every kernel that has a parallel variant:

* numba uses as many threads as torch (`torch.get_num_threads`, which ``--threads`` and
  `torch.set_num_threads` set), capped by ``NUMBA_NUM_THREADS``; `numba.set_num_threads` is
  thread-local and costs about 1 us, so it is set on every parallel call;
* one thread, or less than `SERIAL_BELOW` elementary operations of work, runs the kernel's serial
  variant: no thread pool is woken at all.

Serial and parallel variants compute every output element the same way (no reduction is split
across threads), so results are bit-identical either way (tests/formats/test_threads.py).

**Jobs are claimed, not assigned.** numba's ``prange`` gives every thread one equal, contiguous
share of the iterations up front (the ``omp`` layer's ``#pragma omp for`` has no schedule clause,
so static; ``workqueue`` splits the same way; more, smaller chunks through
``numba.set_parallel_chunksize`` are still dealt out statically). A core shared with another
process (a nice-19 job in another session gets an equal share of its core: nice only weighs
within a session's autogroup) then holds every other thread at the region's end, and the
``limited`` GEMM at 2048^3 took 2-2.5x its time beside one busy neighbour. The GEMM kernels'
parallel variants therefore run one ``prange`` iteration per thread, each taking the next job
from a shared counter (`claim`, an atomic fetch-and-add) until none is left: a slowed thread
takes fewer jobs and the others finish the rest (`benchmarks/bench_threads.py --neighbour`,
docs/gemm.md). Which thread runs a job never changes its bits.
"""

from __future__ import annotations

import numba
import torch
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from fp8lab._counters import read_counts

__all__ = ["SERIAL_BELOW", "claim", "dispatch_counts", "parallel"]

SERIAL_BELOW = 1 << 21
"""Work (elementary operations: elements of a cast, products of a GEMM) below which a kernel runs
serially. Measured with ``benchmarks/bench_threads.py`` (docs/gemm.md, the thread policy)."""

_COUNTS = {"serial": 0, "parallel": 0}


def parallel(work: int) -> bool:
    """Should a kernel of ``work`` operations run its parallel variant? If so, numba's thread
    count has been set to torch's (at most ``NUMBA_NUM_THREADS``)."""
    threads = min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)
    if threads <= 1 or work < SERIAL_BELOW:
        _COUNTS["serial"] += 1
        return False
    numba.set_num_threads(threads)
    _COUNTS["parallel"] += 1
    return True


def dispatch_counts(reset: bool = False) -> dict[str, int]:
    """How many kernel calls took the serial and the parallel variant in this process."""
    return read_counts(_COUNTS, reset)


@intrinsic
def claim(typingctx, counter):  # pragma: no cover - compiled by numba
    """In numba code: the next job number, ``counter[0]`` before an atomic ``counter[0] += 1``
    (every number is handed out once, whatever the threads). A parallel kernel over ``jobs``
    jobs runs, in ``for _ in prange(workers)``, ``job = claim(counter)`` then
    ``while job < jobs: work(job); job = claim(counter)``, with ``counter`` a fresh int64 [1]
    zero and ``workers`` = `numba.get_num_threads` passed in by the caller (read inside the
    kernel, it would keep numba from caching the kernel)."""
    if not (isinstance(counter, types.Array) and counter.dtype == types.int64):
        return None

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, sig.args[0], ary, [cgutils.intp_t(0)])
        # monotonic is enough: the counter orders nothing else; the jobs' writes are published
        # by the parallel region's closing barrier
        return builder.atomic_rmw("add", ptr, ir.Constant(ir.IntType(64), 1), "monotonic")

    return types.int64(counter), codegen

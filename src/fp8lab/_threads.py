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
"""

from __future__ import annotations

import numba
import torch

from fp8lab._counters import read_counts

__all__ = ["SERIAL_BELOW", "dispatch_counts", "parallel"]

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

"""Which implementation of fp8lab's kernels runs: numba (CPU) or the device-generic torch kernels.

Every kernel of fp8lab (casts and codecs, scale rules, amax and block reductions, quantize and
retile, the GEMM accumulators and epilogues, the statistics passes) has two implementations that
give the same bits on the same input:

* ``numba``: compiled CPU loops, the default for CPU tensors;
* ``torch``: tensor operations on integer bit patterns, which run on any device torch runs on
  (CUDA included) and are the only choice for a tensor that is not on the CPU.

The choice, for the whole process:

* ``"auto"`` (default): the kernels follow the tensor's device: numba on the CPU, torch elsewhere;
* ``"torch"``: the generic kernels everywhere, also on the CPU (how the oracle suite checks them
  against numba on a machine without a GPU);
* ``"numba"``: numba only; a tensor on another device is an error rather than a silent copy.

It is read once from the environment variable ``FP8LAB_KERNELS`` and changed with `set_kernels`
(or, scoped, `using_kernels`). The name is "kernels" because "backend" already names the
torch.distributed process-group backend.

The numba kernels' thread policy (`parallel`, `claim`) lives here too: see the section below.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import numba
import torch
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from fp8lab._counters import read_counts

__all__ = [
    "ENV_VAR",
    "KERNEL_CHOICES",
    "SERIAL_BELOW",
    "ProcessChoice",
    "claim",
    "dispatch_counts",
    "get_kernels",
    "kernel_counts",
    "parallel",
    "set_kernels",
    "use_torch",
    "using_kernels",
]

KERNEL_CHOICES: tuple[str, ...] = ("auto", "numba", "torch")
"""The values `set_kernels` and ``FP8LAB_KERNELS`` accept."""

ENV_VAR = "FP8LAB_KERNELS"

_COUNTS = {"numba": 0, "torch": 0}


class ProcessChoice:
    """One process-wide choice among fixed names: read once from the environment variable
    ``env_var`` (on first use; unset or empty gives ``default``), changed with `set`, scoped
    with `using`. fp8lab's kernels (``FP8LAB_KERNELS``) and the fused GEMM's Triton kernel
    (``FP8LAB_TRITON``, `fp8lab.gemm.fused_triton`) are such choices. Names are matched
    case-insensitively after stripping blanks; an unknown name is a ValueError naming where it
    came from (the variable, or the setter), the value and the valid names."""

    def __init__(
        self, env_var: str, choices: tuple[str, ...], default: str, noun: str, setter: str
    ) -> None:
        self.env_var, self.choices, self.default = env_var, choices, default
        self.noun, self.setter = noun, setter
        self.value: str | None = None  # None: not read from the environment yet

    def check(self, name: object, where: str) -> str:
        """``name`` normalised; ValueError naming ``where`` when it is not a valid choice."""
        if not isinstance(name, str) or name.strip().lower() not in self.choices:
            raise ValueError(
                f"{where}: unknown {self.noun} {name!r}; choose one of {', '.join(self.choices)}"
            )
        return name.strip().lower()

    def get(self) -> str:
        """The current choice (the environment's on first use)."""
        if self.value is None:
            raw = os.environ.get(self.env_var, "").strip()
            where = f"environment variable {self.env_var}"
            self.value = self.check(raw, where) if raw else self.default
        return self.value

    def set(self, name: str) -> str:
        """Make ``name`` the choice for the whole process; returns the previous one."""
        new = self.check(name, self.setter)
        old = self.get()
        self.value = new
        return old

    @contextmanager
    def using(self, name: str) -> Iterator[None]:
        """Run a block under ``name``, then restore the previous choice."""
        old = self.set(name)
        try:
            yield
        finally:
            self.set(old)


_KERNELS = ProcessChoice(ENV_VAR, KERNEL_CHOICES, "auto", "kernels", "set_kernels")


def get_kernels() -> str:
    """The current choice: ``"auto"``, ``"numba"`` or ``"torch"``.

    Raises:
        ValueError: ``FP8LAB_KERNELS`` holds an unknown name (named in the message).
    """
    return _KERNELS.get()


def set_kernels(name: str) -> str:
    """Choose the kernels for the whole process; returns the previous choice.

    Args:
        name: ``"auto"`` (numba on the CPU, torch elsewhere), ``"numba"`` or ``"torch"``.

    Raises:
        ValueError: an unknown name.
    """
    return _KERNELS.set(name)


@contextmanager
def using_kernels(name: str) -> Iterator[None]:
    """Run a block with the given kernels, then restore the previous choice."""
    with _KERNELS.using(name):
        yield


def use_torch(*tensors: torch.Tensor | None, what: str = "fp8lab") -> bool:
    """Should a kernel on these tensors run the torch implementation (True) or numba (False)?

    The first tensor that is not None decides the device; every other one must be on the same
    device. Each call is counted (`kernel_counts`), so tests can check which implementation ran.

    Raises:
        ValueError: tensors on different devices, or a non-CPU tensor under ``"numba"``.
    """
    present = [t for t in tensors if t is not None]
    device = present[0].device if present else torch.device("cpu")
    for t in present[1:]:
        if t.device != device:
            raise ValueError(
                f"{what}: tensors on different devices ({device} and {t.device}); "
                "move them to one device first"
            )
    choice = get_kernels()
    if device.type != "cpu":
        if choice == "numba":
            raise ValueError(
                f"{what}: a tensor on {device} cannot run the numba kernels "
                f"({ENV_VAR}=numba / set_kernels('numba') is CPU-only); use 'auto' or 'torch'"
            )
        generic = True
    else:
        generic = choice == "torch"
    _COUNTS["torch" if generic else "numba"] += 1
    return generic


def kernel_counts(reset: bool = False) -> dict[str, int]:
    """How many kernel dispatches chose numba and torch in this process (``reset`` zeroes them)."""
    return read_counts(_COUNTS, reset)


# =========================================================================== numba's threads
# One thread policy for every parallel numba kernel of fp8lab.
#
# torch and numba each run their own OpenMP pool (torch ships its own ``libgomp``, numba's ``omp``
# threading layer loads the system one), and an OpenMP worker spins for a while after its parallel
# region before it sleeps. A numba kernel that wakes ``NUMBA_NUM_THREADS`` (= the core count)
# threads between torch's GEMMs therefore puts up to twice the core count of busy threads on the
# cores; on a machine already loaded by other work the spinning workers take turns on the cores
# and a step of two small Linear layers took 50-150 ms instead of 1 ms (issue 22).
# `torch.set_num_threads` did not reach numba's pool.
#
# The policy, applied by `parallel` before every kernel that has a parallel variant:
#
# * numba uses as many threads as torch (`torch.get_num_threads`, which ``--threads`` and
#   `torch.set_num_threads` set), capped by ``NUMBA_NUM_THREADS``; `numba.set_num_threads` is
#   thread-local and costs about 1 us, so it is set on every parallel call;
# * one thread, or less than `SERIAL_BELOW` elementary operations of work, runs the kernel's serial
#   variant: no thread pool is woken at all.
#
# Serial and parallel variants compute every output element the same way (no reduction is split
# across threads), so results are bit-identical either way (tests/formats/test_threads.py).
#
# **Jobs are claimed, not assigned.** numba's ``prange`` gives every thread one equal, contiguous
# share of the iterations up front (the ``omp`` layer's ``#pragma omp for`` has no schedule clause,
# so static; ``workqueue`` splits the same way; more, smaller chunks through
# ``numba.set_parallel_chunksize`` are still dealt out statically). A core shared with another
# process (a nice-19 job in another process session, `setsid`, gets an equal share of its core: nice only weighs
# within a session's autogroup) then holds every other thread at the region's end, and the
# ``limited`` GEMM at 2048^3 took 2-2.5x its time beside one busy neighbour. The GEMM kernels'
# parallel variants therefore run one ``prange`` iteration per thread, each taking the next job
# from a shared counter (`claim`, an atomic fetch-and-add) until none is left: a slowed thread
# takes fewer jobs and the others finish the rest (`benchmarks/bench_threads.py --neighbour`,
# docs/gemm.md). Which thread runs a job never changes its bits.

SERIAL_BELOW = 1 << 21
"""Work (elementary operations: elements of a cast, products of a GEMM) below which a kernel runs
serially. Measured with ``benchmarks/bench_threads.py`` (docs/gemm.md, the thread policy)."""

_DISPATCH = {"serial": 0, "parallel": 0}


def parallel(work: int) -> bool:
    """Should a kernel of ``work`` operations run its parallel variant? If so, numba's thread
    count has been set to torch's (at most ``NUMBA_NUM_THREADS``)."""
    threads = min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)
    if threads <= 1 or work < SERIAL_BELOW:
        _DISPATCH["serial"] += 1
        return False
    numba.set_num_threads(threads)
    _DISPATCH["parallel"] += 1
    return True


def dispatch_counts(reset: bool = False) -> dict[str, int]:
    """How many kernel calls took the serial and the parallel variant in this process."""
    return read_counts(_DISPATCH, reset)


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

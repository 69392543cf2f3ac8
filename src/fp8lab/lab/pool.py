"""The lab's one process pool: named jobs, ``jobs`` at a time, in spawned worker processes.

`WorkerPool` runs module-level functions ``fn(**kwargs, events=...)`` (plain-data arguments:
they cross process boundaries) for `fp8lab compare` (one job per recipe) and the debugger (one
job per probe). What it guarantees:

- ``jobs`` > 1: that many *spawned* worker processes (never forked: torch and numba state do not
  survive a fork), started once and kept for the pool's life; each limits its torch and numba
  thread pools to ``threads`` (`set_threads`) and computes on the parent's torch device,
  kernels and Triton mode (`fp8lab.lab.machine.torch_device`, `fp8lab.kernels.get_kernels`,
  `fp8lab.gemm.fused_triton.get_triton`, read when the pool starts). ``jobs`` 1: the jobs run here, one after another, and their exceptions propagate
  unchanged.
- Progress: ``events.put(dict)`` in a job reaches the parent's ``callback``, in the order put.
- Errors: the first job that fails stops the pool (jobs not yet started are cancelled, running
  ones terminated; their checkpoints stay, so a rerun resumes them) and its error is raised in
  the parent naming the job: ``ValueError("<label> 'name': message")`` for a ValueError (bad
  input, a corrupt checkpoint), ``OSError(errno, ...)`` for an OSError (e.g. a full disk),
  ``RuntimeError("<label> 'name' failed: ...")`` with the worker's traceback for anything else.
- Interrupts: an exception in the parent (KeyboardInterrupt included, e.g. from ``callback``)
  terminates the workers when the pool is closed (use it as a context manager).
- Executors: ``jobs`` > 1 runs on the process-wide executor (`set_executor`, the commands'
  ``--executor``): ``local`` (the spawned processes above, the default) or ``ray``
  (`fp8lab.lab.ray_executor.RayRunner`: the same jobs as Ray tasks, same results, errors and
  events, each job's machine recorded and a mismatch flagged, a dead worker retried once).
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch

from fp8lab.gemm.fused_triton import get_triton, set_triton
from fp8lab.kernels import get_kernels, set_kernels
from fp8lab.lab.machine import set_torch_device, torch_device

Callback = Callable[[dict[str, Any]], None]

#: the process-wide executor of `WorkerPool`'s parallel jobs (`set_executor`)
_EXECUTOR: dict[str, Any] = {"kind": "local", "address": None}
EXECUTORS = ("local", "ray")


def set_executor(kind: str, address: str | None = None) -> None:
    """Run the parallel jobs of every `WorkerPool` opened from now on in ``kind``'s workers:
    ``local`` (spawned processes) or ``ray`` (a Ray cluster at ``address``; None: a local Ray
    instance). ValueError for another kind, for ``ray`` without Ray installed or with an
    unreachable ``address`` (`fp8lab.lab.ray_executor.check_ray`), for an address with
    ``local``."""
    if kind not in EXECUTORS:
        raise ValueError(f"unknown executor {kind!r}; valid: {', '.join(EXECUTORS)}")
    if kind == "local" and address is not None:
        raise ValueError("--ray-address needs --executor ray")
    if kind == "ray":
        from fp8lab.lab.ray_executor import check_ray

        check_ray(address)
    _EXECUTOR.update(kind=kind, address=address)


def get_executor() -> tuple[str, str | None]:
    """(kind, address) of `set_executor`."""
    return _EXECUTOR["kind"], _EXECUTOR["address"]


def check_count(name: str, value: Any, minimum: int, note: str = "") -> None:
    """ValueError unless ``value`` is an integer (not a bool) >= ``minimum``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}{note}, got {value!r}")


def set_threads(threads: int) -> None:
    """Limit torch's and numba's thread pools (0 = leave both alone).

    Both matter: jobs running in parallel processes each start numba's pool too, and an
    oversubscribed pool makes the parallel cast kernels several times slower on 2 cores.
    """
    check_count("threads", threads, 0, " (0 = the defaults)")
    if threads == 0:
        return
    import numba

    torch.set_num_threads(threads)
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))


def _init_worker(threads: int, device: str, kernels: str, triton: str) -> None:
    """A spawned worker: the parent's threads, torch device, kernel choice and Triton mode."""
    set_threads(threads)
    set_torch_device(device)
    set_kernels(kernels)
    set_triton(triton)


@dataclass(frozen=True)
class Job:
    """One job: ``fn(**kwargs, events=...)``; ``name`` names it in errors."""

    name: str
    fn: Callable[..., Any]
    kwargs: dict[str, Any] = field(default_factory=dict)


class _Direct:
    """The ``events`` of a job run in this process: straight to the callback."""

    def __init__(self, emit: Callback) -> None:
        self.put = emit


def _call(fn: Callable[..., Any], kwargs: dict[str, Any], events: Any) -> tuple[bool, Any]:
    """Worker side: (True, result), or (False, the error as plain data) — an exception object
    need not survive pickling, its kind, text and traceback do."""
    try:
        return True, fn(**kwargs, events=events)
    except BaseException as exc:  # reported to the parent, which raises
        kind = "value" if isinstance(exc, ValueError) else "os" if isinstance(exc, OSError) else ""
        return False, {
            "kind": kind or "other",
            "message": f"{type(exc).__name__}: {exc}",
            "text": str(exc),
            "errno": getattr(exc, "errno", None),
            "traceback": traceback.format_exc(),
        }


def raise_job_error(label: str, name: str, err: dict[str, Any]) -> NoReturn:
    """Raise a worker's error (`_call`'s record) in the parent, naming the job."""
    if err.get("kind") == "value":
        raise ValueError(f"{label} {name!r}: {err['text']}")
    if err.get("kind") == "os":
        raise OSError(err["errno"], f"{label} {name!r}: {err['text']}")
    raise RuntimeError(f"{label} {name!r} failed: {err['message']}\n{err.get('traceback', '')}")


def _drain(events: Any, emit: Callback) -> None:
    while True:
        try:
            ev = events.get_nowait()
        except queue.Empty:
            return
        emit(ev)


class WorkerPool:
    """``jobs`` spawned workers with ``threads`` threads each (see the module docstring).

    ``label`` names a job in errors ("recipe", "probe"); ``after_each`` runs after every job
    run in this process (``jobs`` 1), e.g. a torchrun barrier. Use as a context manager.
    """

    def __init__(
        self,
        jobs: int = 1,
        threads: int = 0,
        label: str = "job",
        after_each: Callable[[], None] | None = None,
    ) -> None:
        self.jobs, self.threads, self.label = jobs, threads, label
        self.after_each = after_each
        self._executor: Any = None
        self._manager: Any = None
        self._events: Any = None
        self._ray: Any = None  # the `RayRunner` under ``set_executor("ray")``

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.close(terminate=exc_type is not None)

    def close(self, terminate: bool = False) -> None:
        """Shut the workers down; ``terminate``: stop running jobs now (an error or an
        interrupt)."""
        if self._ray is not None:
            self._ray.close()
            self._ray = None
        if self._executor is not None:
            if terminate:
                # the executor offers no terminate; its worker processes are kept here
                for proc in list((getattr(self._executor, "_processes", None) or {}).values()):
                    proc.terminate()
            self._executor.shutdown(wait=not terminate, cancel_futures=True)
            self._executor = None
        if self._manager is not None:
            self._manager.shutdown()
            self._manager = None

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._manager = ctx.Manager()
        self._events = self._manager.Queue()
        self._executor = ProcessPoolExecutor(
            max_workers=self.jobs, mp_context=ctx, initializer=_init_worker,
            initargs=(self.threads, str(torch_device()), get_kernels(), get_triton()),
        )  # fmt: skip

    def run(self, jobs: Sequence[Job], callback: Callback | None = None) -> list[Any]:
        """Run ``jobs`` (started in this order); their results in the same order."""
        emit = callback or (lambda e: None)
        if self.jobs <= 1 or (len(jobs) <= 1 and self._executor is None and self._ray is None):
            return self._run_here(jobs, emit)
        kind, address = get_executor()
        if kind == "ray":
            if self._ray is None:
                from fp8lab.lab.ray_executor import PoolHelpers, RayRunner

                helpers = PoolHelpers(_init_worker, _call, raise_job_error)
                self._ray = RayRunner(self.jobs, self.threads, self.label, helpers, address)
            return self._ray.run(jobs, emit)
        if self._executor is None:
            self._start()
        futures = {self._executor.submit(_call, j.fn, j.kwargs, self._events): i
                   for i, j in enumerate(jobs)}  # fmt: skip
        results: list[Any] = [None] * len(jobs)
        pending = set(futures)
        try:
            while pending:
                done, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
                _drain(self._events, emit)
                for fut in done:
                    i = futures[fut]
                    results[i] = self._result(fut, jobs[i].name)
        except BaseException:
            for fut in pending:
                fut.cancel()
            raise
        _drain(self._events, emit)
        return results

    def _run_here(self, jobs: Sequence[Job], emit: Callback) -> list[Any]:
        set_threads(self.threads)
        out = []
        for job in jobs:
            out.append(job.fn(**job.kwargs, events=_Direct(emit)))
            if self.after_each is not None:
                self.after_each()
        return out

    def _result(self, fut: Any, name: str) -> Any:
        try:
            ok, value = fut.result()
        except BrokenProcessPool as exc:  # the worker died (killed, out of memory)
            raise RuntimeError(f"{self.label} {name!r} failed: its worker process ended "
                               f"({exc})") from None  # fmt: skip
        if not ok:
            raise_job_error(self.label, name, value)
        return value


def run_jobs(
    jobs: Sequence[Job],
    workers: int = 1,
    threads: int = 0,
    callback: Callback | None = None,
    label: str = "job",
) -> list[Any]:
    """`WorkerPool` for one batch of jobs."""
    with WorkerPool(workers, threads, label) as pool:
        return pool.run(jobs, callback)

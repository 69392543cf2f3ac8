"""The lab's jobs on a Ray cluster (``--executor ray``): `fp8lab.lab.pool.WorkerPool`'s other
executor.

`WorkerPool` runs named jobs ``fn(**kwargs, events=...)`` either in spawned local processes (the
``local`` executor, the default) or, after ``set_executor("ray", address)``, as Ray tasks through
:class:`RayRunner`. Both give the same results, errors and progress events; what Ray adds:

- **Where.** ``address`` None starts a local Ray instance (as many CPUs as the pool's jobs x
  threads); otherwise the cluster at ``address`` (``HOST:PORT``, ``ray://HOST:PORT`` or
  ``auto``). The jobs write their checkpoints and results under the lab's ``--out``, so on a
  multi-machine cluster ``--out`` must be a filesystem every worker sees (as under torchrun).
- **Same bits.** Every task sets the parent's thread count (the pool's ``threads``; 0: the
  parent's current torch thread count, where a local spawned worker would take torch's default,
  the same on the same machine), torch device, kernel choice and Triton mode, as a local worker
  does. Each job returns its machine (`fp8lab.lab.machine.machine_info`, recorded in
  ``RayRunner.machines``); a machine that should not give the local machine's bits
  (`fp8lab.lab.machine.same_results_expected`: another CPU, CPU capability, library version or
  thread count) is flagged by a ``{"event": "machine_mismatch", "job", "machine", "text"}``
  event (with ``recipe`` and ``probe`` = ``job`` for the commands' progress handlers).
- **Never lost.** A task whose worker dies (killed, out of memory, a node lost) is retried once
  by Ray (``max_retries=1``); a second death is raised as ``RuntimeError("<label> 'name' failed:
  its Ray worker died twice ...")``. An error inside the job is not retried: it is raised as the
  local pool raises it. Finished jobs keep their results on disk, so a rerun resumes.

Ray is an optional extra (``pip install 'fp8lab[ray]'``): `check_ray` turns its absence, or an
unreachable ``address``, into one ValueError naming the fix.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from fp8lab.gemm.fused_triton import get_triton
from fp8lab.kernels import get_kernels
from fp8lab.lab.machine import describe, machine_info, same_results_expected, torch_device

# `fp8lab.lab.pool` imports this module and hands it its worker helpers (`PoolHelpers`):
# importing the pool here would make an import cycle
Callback = Callable[[dict[str, Any]], None]

__all__ = ["RAY_EXTRA", "PoolHelpers", "RayRunner", "check_ray"]

#: what to install for ``--executor ray``
RAY_EXTRA = "pip install 'fp8lab[ray]'"
#: seconds to wait for a TCP connection to ``--ray-address``
CONNECT_TIMEOUT_S = 5.0


def check_ray(address: str | None = None) -> None:
    """ValueError unless Ray is importable and ``address`` (``HOST:PORT`` or ``ray://HOST:PORT``;
    None or ``auto``: nothing to reach yet) accepts a TCP connection."""
    try:
        import ray  # noqa: F401
    except ImportError:
        raise ValueError(f"--executor ray needs Ray, which is not installed: {RAY_EXTRA}") from None
    if address is None or address == "auto":
        return
    hostport = address.removeprefix("ray://")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--ray-address {address!r}: expected HOST:PORT or ray://HOST:PORT")
    try:
        with socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as exc:
        raise ValueError(f"--ray-address {address}: cannot reach it ({exc})") from None


class PoolHelpers(NamedTuple):
    """`fp8lab.lab.pool`'s worker side, shared with the local executor: ``init_worker(threads,
    device, kernels, triton)``, ``call(fn, kwargs, events) -> (ok, value)`` and
    ``raise_error(label, name, err)``."""

    init_worker: Callable[..., None]
    call: Callable[..., tuple[bool, Any]]
    raise_error: Callable[..., Any]


def _task(fn: Any, kwargs: dict[str, Any], init: tuple, events: Any,
          helpers: PoolHelpers) -> tuple[bool, Any, dict]:  # fmt: skip
    """Ray side: the parent's settings (``helpers.init_worker``), the job (``helpers.call``:
    its error as plain data), and the machine it ran on."""
    helpers.init_worker(*init)
    ok, value = helpers.call(fn, kwargs, events)
    return ok, value, machine_info()


class _Events:
    """A job's ``events`` on a Ray worker: batched into the parent's Ray queue."""

    def __init__(self, queue: Any) -> None:
        self.queue = queue

    def put(self, ev: dict[str, Any]) -> None:
        self.queue.put(ev)


class RayRunner:
    """`fp8lab.lab.pool.WorkerPool`'s jobs as Ray tasks (module docstring): ``jobs`` at a time,
    ``threads`` threads each. ``machines``: job name -> the machine it ran on."""

    def __init__(
        self, jobs: int, threads: int, label: str, helpers: PoolHelpers, address: str | None = None
    ) -> None:
        import ray

        check_ray(address)
        self.jobs, self.label, self.helpers = jobs, label, helpers
        self.threads = threads or torch.get_num_threads()
        self.machines: dict[str, dict[str, Any]] = {}
        self._started = not ray.is_initialized()
        if self._started:
            cpus = None if address is not None else jobs * self.threads
            ray.init(address=address, num_cpus=cpus, include_dashboard=False,
                     log_to_driver=False, configure_logging=False)  # fmt: skip
        from ray.util.queue import Queue

        self._queue = Queue()
        self._remote = ray.remote(max_retries=1, num_cpus=self.threads)(_task)
        expected = machine_info()  # the local machine, at the threads every job will use
        expected["torch_threads"] = self.threads
        self._expected = expected

    def close(self) -> None:
        """Stop the queue actor and, when this runner started it, the local Ray instance."""
        import ray

        if ray.is_initialized():
            ray.kill(self._queue.actor)
            if self._started:
                ray.shutdown()

    def _drain(self, emit: Callback) -> None:
        while not self._queue.empty():
            for ev in self._queue.get_nowait_batch(self._queue.qsize()):
                emit(ev)

    def run(self, jobs: Sequence[Any], emit: Callback) -> list[Any]:
        """Run ``jobs`` (submitted in order, ``self.jobs`` at a time); results in job order."""
        import ray

        init = (self.threads, str(torch_device()), get_kernels(), get_triton())
        events = _Events(self._queue)
        results: list[Any] = [None] * len(jobs)
        waiting = list(enumerate(jobs))
        running: dict[Any, int] = {}
        try:
            while waiting or running:
                while waiting and len(running) < self.jobs:
                    i, j = waiting.pop(0)
                    running[self._remote.remote(j.fn, j.kwargs, init, events, self.helpers)] = i
                done, _ = ray.wait(list(running), num_returns=1, timeout=0.2)
                self._drain(emit)
                for ref in done:
                    i = running.pop(ref)
                    results[i] = self._result(ref, jobs[i].name, emit)
        except BaseException:
            for ref in running:
                ray.cancel(ref, force=True)
            raise
        self._drain(emit)  # a job's events are in the queue before its result (put is blocking)
        return results

    def _result(self, ref: Any, name: str, emit: Callback) -> Any:
        import ray

        try:
            ok, value, machine = ray.get(ref)
        except ray.exceptions.RayTaskError as exc:  # raised outside `_call`: report, not lose
            raise RuntimeError(f"{self.label} {name!r} failed on Ray: {exc}") from None
        except ray.exceptions.RayError as exc:  # the worker died, and again on its one retry
            raise RuntimeError(f"{self.label} {name!r} failed: its Ray worker died twice "
                               f"(retried once; rerun to resume): {exc}") from None  # fmt: skip
        self.machines[name] = machine
        if not same_results_expected(self._expected, machine):
            emit({"event": "machine_mismatch", "job": name, "recipe": name, "probe": name,
                  "machine": machine,
                  "text": f"{self.label} {name!r} ran on {describe(machine)}, not on this "
                  f"machine ({describe(self._expected)}): its bits may differ"})  # fmt: skip
        if not ok:
            self.helpers.raise_error(self.label, name, value)
        return value

"""The lab's one process pool (`fp8lab.lab.pool`): results in job order, progress events to the
parent, a worker's error raised in the parent naming the job, in-process runs for one job."""

from __future__ import annotations

import errno

import pytest

from fp8lab.lab.pool import Job, WorkerPool, run_jobs


def square(x: int, events) -> int:
    events.put({"event": "step", "x": x})
    return x * x


def fail(kind: str, events) -> None:
    events.put({"event": "start", "kind": kind})
    if kind == "value":
        raise ValueError("bad input")
    if kind == "os":
        raise OSError(errno.ENOSPC, "No space left on device")
    raise ZeroDivisionError("boom")


def test_results_in_order_and_events_reach_the_parent():
    events: list[dict] = []
    with WorkerPool(2, threads=1, label="recipe") as pool:
        jobs = [Job(f"j{i}", square, {"x": i}) for i in range(4)]
        assert pool.run(jobs, events.append) == [0, 1, 4, 9]
        # the same workers run a second batch; a worker's error names the job
        with pytest.raises(ValueError, match=r"^recipe 'v': bad input$"):
            pool.run([Job("v", fail, {"kind": "value"})], events.append)
    assert sorted(e["x"] for e in events if "x" in e) == [0, 1, 2, 3]
    assert {"event": "start", "kind": "value"} in events


def test_os_and_other_errors_name_the_job():
    with pytest.raises(OSError, match=r"recipe 'full': .*No space") as err:
        run_jobs([Job("full", fail, {"kind": "os"}), Job("ok", square, {"x": 2})], 2, 1,
                 label="recipe")  # fmt: skip
    assert err.value.errno == errno.ENOSPC
    with pytest.raises(RuntimeError, match=r"(?s)probe 'z' failed: ZeroDivisionError: boom.*"
                                           r"Traceback"):  # fmt: skip
        run_jobs([Job("z", fail, {"kind": "other"}), Job("ok", square, {"x": 2})], 2, 1,
                 label="probe")  # fmt: skip


def test_one_worker_runs_here_and_raises_unchanged():
    events: list[dict] = []
    after: list[int] = []
    pool = WorkerPool(1, after_each=lambda: after.append(1))
    assert pool.run([Job("a", square, {"x": 3}), Job("b", square, {"x": 4})], events.append) == [
        9,
        16,
    ]
    assert events == [{"event": "step", "x": 3}, {"event": "step", "x": 4}] and after == [1, 1]
    with pytest.raises(ZeroDivisionError):  # not wrapped: the caller's own traceback
        pool.run([Job("z", fail, {"kind": "other"})])


def test_an_interrupt_in_the_parent_stops_the_workers():
    def stop(ev):
        raise KeyboardInterrupt

    pool = WorkerPool(2, threads=1)
    with pytest.raises(KeyboardInterrupt), pool:
        pool.run([Job(f"j{i}", square, {"x": i}) for i in range(3)], stop)
    assert pool._executor is None and pool._manager is None


def test_the_debuggers_tasks_are_named_jobs_of_the_same_pool():
    from fp8lab.lab.debug.runner import ProbeSpec, TaskPool, _job

    spec = ProbeSpec("noise-fp32", {"name": "fp32"})
    assert _job(square, {"spec": spec, "x": 1}).name == "noise-fp32"
    assert _job(square, {"snapshot": "/r/snapshots/step_40.pt"}).name == "step_40"
    assert _job(square, {"x": 1}).name == "square"
    with TaskPool(1) as pool:  # in this process: plain (fn, kwargs) tasks, results in order
        assert isinstance(pool, WorkerPool) and pool.label == "probe"
        assert pool.run([(square, {"x": 5}), (square, {"x": 6})]) == [25, 36]

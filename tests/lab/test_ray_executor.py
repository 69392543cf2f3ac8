"""``--executor ray`` (`fp8lab.lab.ray_executor`, `fp8lab.lab.pool.set_executor`): the same jobs
as the local pool on a local 2-CPU Ray instance, bit for bit, with the same errors; each job's
machine recorded and a mismatch flagged; a worker that dies retried once, then reported; Ray
missing or an unreachable address is one clear error (exit 2 in the commands)."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fp8lab.cli import app
from fp8lab.lab.pool import Job, WorkerPool, get_executor, set_executor

runner = CliRunner()


@pytest.fixture
def local_executor():
    yield
    set_executor("local")


def quantized_matmul(seed: int, events) -> bytes:
    """fp8lab arithmetic whose bits depend on the thread count and the CPU's kernels."""
    import torch

    from fp8lab.qtensor import quantize

    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(256, 512, generator=g), torch.randn(512, 384, generator=g)
    q = quantize(a, "e4m3").dequantize()
    events.put({"event": "step", "seed": seed, "threads": torch.get_num_threads()})
    return (q @ b).sum(dim=1).numpy().tobytes()


def die_once(marker: str, events) -> str:
    """Kill the worker process the first time (the marker file records it), succeed after."""
    if not Path(marker).exists():
        Path(marker).write_text("died")
        os._exit(1)
    return "survived"


def die_always(events) -> None:
    os._exit(1)


def bad_input(events) -> None:
    raise ValueError("bad input")


def _closed_port() -> int:
    with socket.socket() as s:  # a port nobody listens on: bound, then released
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.no_arithmetic
def test_without_ray_the_executor_is_one_error_naming_the_extra(monkeypatch, local_executor):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(ValueError, match=r"needs Ray.*pip install 'fp8lab\[ray\]'"):
        set_executor("ray")
    assert get_executor() == ("local", None)
    with pytest.raises(ValueError, match="unknown executor 'dask'"):
        set_executor("dask")
    with pytest.raises(ValueError, match="--ray-address needs --executor ray"):
        set_executor("local", "127.0.0.1:6379")
    for cmd in (["compare", "--recipes", "bf16,te-current"], ["debug", "--recipe", "te-current"]):
        r = runner.invoke(app, [*cmd, "--executor", "ray", "--out", "unused"])
        assert r.exit_code == 2, r.output
        errors = [ln for ln in r.output.splitlines() if ln.startswith("Error:")]
        assert len(errors) == 1 and "fp8lab[ray]" in errors[0], r.output
        assert "Traceback" not in r.output


@pytest.mark.no_arithmetic
def test_an_unreachable_ray_address_is_one_error(local_executor):
    pytest.importorskip("ray", reason="the ray extra is not installed")
    addr = f"127.0.0.1:{_closed_port()}"
    with pytest.raises(ValueError, match=rf"--ray-address {addr}: cannot reach it"):
        set_executor("ray", addr)
    with pytest.raises(ValueError, match="expected HOST:PORT"):
        set_executor("ray", "nowhere")
    r = runner.invoke(app, ["compare", "--recipes", "bf16,te-current", "--executor", "ray",
                            "--ray-address", addr, "--out", "unused"])  # fmt: skip
    assert r.exit_code == 2 and "cannot reach" in r.output and "Traceback" not in r.output


@pytest.mark.slow  # starts a local Ray instance (seconds on 2 cores)
def test_ray_gives_the_local_pools_bits_errors_and_never_loses_a_job(tmp_path, local_executor):
    pytest.importorskip("ray", reason="the ray extra is not installed")
    import ray

    from fp8lab.cli._common import echo_machine_mismatch

    jobs = [Job(f"s{i}", quantized_matmul, {"seed": i}) for i in range(3)]
    with WorkerPool(2, threads=1, label="probe") as pool:
        want = pool.run(jobs)
    set_executor("ray")  # a local Ray instance: 2 jobs x 1 thread = 2 CPUs
    events: list[dict] = []
    with WorkerPool(2, threads=1, label="probe") as pool:
        # cloudpickle sends this test module's functions by value (workers cannot import it)
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        got = pool.run(jobs, events.append)
        assert got == want  # bit for bit: same machine, same thread count
        steps = [e for e in events if e["event"] == "step"]
        assert sorted(e["seed"] for e in steps) == [0, 1, 2] and {e["threads"] for e in steps} == {
            1
        }
        assert set(pool._ray.machines) == {"s0", "s1", "s2"}
        assert not [e for e in events if e["event"] == "machine_mismatch"]
        # an error inside a job: raised as the local pool raises it, not retried
        with pytest.raises(ValueError, match=r"^probe 'v': bad input$"):
            pool.run([Job("v", bad_input, {}), Job("ok", quantized_matmul, {"seed": 0})])
        # a worker that dies is retried once; one that dies again is reported, naming the job
        marker = tmp_path / "died"
        assert pool.run([Job("d", die_once, {"marker": str(marker)}),
                         Job("ok", quantized_matmul, {"seed": 1})]) == ["survived", want[1]]  # fmt: skip
        assert marker.read_text() == "died"
        with pytest.raises(RuntimeError, match=r"probe 'dead' failed: its Ray worker died twice"):
            pool.run([Job("dead", die_always, {}), Job("ok", quantized_matmul, {"seed": 2})])
        # a worker whose machine should not give these bits is flagged
        pool._ray._expected = {**pool._ray._expected, "cpu_capability": "another"}
        events.clear()
        assert pool.run(jobs[:2], events.append) == want[:2]
        flagged = [e for e in events if e["event"] == "machine_mismatch"]
        assert {e["job"] for e in flagged} == {"s0", "s1"}
        assert all("its bits may differ" in e["text"] for e in flagged)
        assert echo_machine_mismatch(flagged[0], quiet=True) and not echo_machine_mismatch(steps[0])
    assert not ray.is_initialized()  # the instance this pool started is shut down

"""Run tests/distributed/_ddp_worker.py on N local processes with a bounded wait."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

WORKER = Path(__file__).with_name("_ddp_worker.py")


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def run_ranks(tmp: Path, world: int, *args: str, timeout: float = 150.0) -> list[dict]:
    """Start ``world`` workers, wait at most ``timeout`` s, return each rank's saved dict."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = []
    for r in range(world):
        out = tmp / f"rank{r}_of{world}.pt"
        cmd = [sys.executable, str(WORKER), str(r), str(world), port, str(out), *args]
        procs.append((subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True), out))
    try:
        for p, _ in procs:
            _, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, err[-3000:]
    finally:
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
    return [torch.load(out, weights_only=True) for _, out in procs]

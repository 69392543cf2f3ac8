"""``--torch-device`` for the benchmarks: one definition of the flag, its parsing and its exit.

Same values as the CLI's (``cpu``, ``cuda``, ``cuda:N``, ``auto``; default ``auto``: ``cuda`` when
CUDA is available, else ``cpu``), resolved by `fp8lab.distributed.runtime.resolve_torch_device`. A
value the machine cannot honour (``cuda`` without CUDA, an unknown name) prints the problem on
stderr and exits 2 before any work, as the CLI does. A benchmark names the resolved device in
its output and creates its tensors there.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from fp8lab.distributed.runtime import resolve_torch_device

HELP = "torch device to compute on: cpu, cuda, cuda:N or auto (cuda when available, else cpu)"


def add_torch_device(ap: argparse.ArgumentParser) -> None:
    """Add ``--torch-device`` (default ``auto``) to a benchmark's parser."""
    ap.add_argument("--torch-device", default="auto", help=HELP)


def torch_device(args: argparse.Namespace, lab: bool = False) -> torch.device:
    """The device ``args.torch_device`` names; with ``lab`` also the lab's device of this
    process (`fp8lab.lab.machine.set_torch_device`: its models, batches and checkpoints go
    there). Exits 2 with the problem on stderr when the value cannot be used here."""
    try:
        device = resolve_torch_device(args.torch_device)
        if lab:
            from fp8lab.lab.machine import set_torch_device

            set_torch_device(device)
    except ValueError as exc:
        print(f"{Path(sys.argv[0]).name}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    return device


def sync(device: torch.device) -> None:
    """Wait for the device's queued kernels (CUDA runs asynchronously: time the work, not its
    launch); nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)

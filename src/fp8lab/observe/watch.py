"""`watch`: per-layer x GEMM x role operand statistics on every N-th step of any training loop.

::

    with fp8lab.watch(model, every=50, out="watch.jsonl") as w:
        for x, y in batches:                 # a plain PyTorch loop
            loss = loss_fn(model(x), y)      # each forward of ``model`` starts a step ...
            loss.backward()
            opt.step(); opt.zero_grad()      # ... or count="step" and call w.step() here

On a sampled step an operand observer (`fp8lab.nn.on_operand`) is registered from the
step's first forward until the next step begins, so the forward's and the backward's GEMM
operands are measured (`fp8lab.observe.records`). On the other steps it is not registered: the
only cost is a forward pre-hook that counts.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from fp8lab.nn import OperandHandle, on_operand
from fp8lab.observe.experts import expert_scales
from fp8lab.observe.records import OperandStats
from fp8lab.observe.sinks import TensorBoardSink, open_sink

__all__ = ["COUNT_MODES", "Watch", "sample", "watch"]

COUNT_MODES = ("forward", "step")


class _Sampler:
    """The hook callback of one sampled step: appends one row per operand to ``rows``."""

    def __init__(self, stats: OperandStats, step: int, rows: list[dict[str, Any]]) -> None:
        self.stats, self.step, self.rows = stats, step, rows
        self.calls: dict[tuple[str, str, str], int] = {}
        stats.new_step()

    def __call__(self, layer: str, gemm: str, role: str, hp: torch.Tensor, used: Any) -> None:
        if self.stats.modules and not self.stats.knows(layer):
            return  # a converted layer of another model
        with torch.no_grad():
            r = self.stats.row(layer, gemm, role, hp, used)
        if r is None:
            return
        key = (layer, gemm, role)
        call = self.calls.get(key, 0)
        self.calls[key] = call + 1
        self.rows.append({"step": self.step, "layer": layer, "gemm": gemm, "role": role,
                          "call": call, **r})  # fmt: skip


@contextmanager
def sample(model: torch.nn.Module, step: int = 0) -> Iterator[list[dict[str, Any]]]:
    """Record one step's operand statistics: ``with sample(model, step) as rows:`` run the
    forward and backward; ``rows`` holds one dict per operand (`fp8lab.observe.FIELDS`).

    What a training loop with its own writer calls on the steps it samples (the lab's
    ``stats.jsonl``); `watch` records with the same per-step sampler, kept registered across
    calls instead of one ``with``."""
    rows: list[dict[str, Any]] = []
    cb = _Sampler(OperandStats(model), int(step), rows)
    with on_operand(cb):
        yield rows


class Watch:
    """The context manager `watch` returns. ``step_index``: the current step; ``records``: every
    row written so far (also kept without ``out``)."""

    def __init__(
        self,
        model: torch.nn.Module,
        every: int = 50,
        out: str | Path | None = None,
        *,
        count: str = "forward",
        tensorboard: str | Path | None = None,
        keep: bool = True,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"watch expects a torch.nn.Module, got {type(model).__name__}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive integer, got {every!r}")
        if count not in COUNT_MODES:
            raise ValueError(f"count must be one of {', '.join(COUNT_MODES)}, got {count!r}")
        self.model, self.every, self.count, self.keep = model, every, count, keep
        self.out = None if out is None else Path(out)
        self.tensorboard = None if tensorboard is None else Path(tensorboard)
        self.step_index = 0
        self.records: list[dict[str, Any]] = []
        self._stats = OperandStats(model)
        self._sinks: list[Any] = []
        self._rows: list[dict[str, Any]] = []
        self._cb: OperandHandle | None = None  # the sampler's registration
        self._hook: Any = None
        self._forwards = 0
        self._open = False

    def expert_scales(self) -> list[dict[str, Any]]:
        """Per-expert scale statistics of the records so far (`fp8lab.observe.expert_scales`:
        the experts of every `fp8lab.nn.GroupedLinear` side by side)."""
        return expert_scales(self.records)

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Watch:
        if self._open:
            raise RuntimeError("this watch is already active")
        if not self._stats.modules:
            raise ValueError(
                "watch: the model has no converted fp8lab.nn.Linear layer "
                "(call fp8lab.nn.convert(model, recipe) first)"
            )
        if self.out is not None:
            self._sinks.append(open_sink(self.out))
        if self.tensorboard is not None:
            self._sinks.append(TensorBoardSink(self.tensorboard))
        if self.count == "forward":
            self._hook = self.model.register_forward_pre_hook(self._on_forward)
        self._open = True
        self._set_sampling(self._sampled(0))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._set_sampling(False)
        self._flush()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        for s in self._sinks:
            s.close()
        self._sinks = []
        self._open = False

    # ------------------------------------------------------------------ steps
    def _sampled(self, step: int) -> bool:
        return step % self.every == 0

    def _on_forward(self, module: torch.nn.Module, args: Any) -> None:
        if self._forwards:  # every forward after the first starts the next step
            self._advance()
        self._forwards += 1

    def step(self) -> None:
        """End the current step (``count="step"``: call it once per optimizer step)."""
        if not self._open:
            raise RuntimeError("watch.step() outside the with block")
        if self.count != "step":
            raise ValueError(
                "watch.step(): this watch counts forward calls; pass count='step' to count "
                "optimizer steps with step() instead"
            )
        self._advance()

    def _advance(self) -> None:
        self._flush()
        self.step_index += 1
        self._set_sampling(self._sampled(self.step_index))

    def _set_sampling(self, on: bool) -> None:
        if self._cb is not None:
            self._cb.remove()
            self._cb = None
            self._stats.new_step()  # drop the step's operands now, not at the next sampled step
        if on:
            self._cb = on_operand(_Sampler(self._stats, self.step_index, self._rows))

    def _flush(self) -> None:
        if not self._rows:
            return
        rows, self._rows = self._rows, []
        if self._cb is not None:  # the active sampler appends to the new list from now on
            self._cb.fn.rows = self._rows
        for s in self._sinks:
            s.write(rows)
        if self.keep:
            self.records.extend(rows)


def watch(
    model: torch.nn.Module,
    every: int = 50,
    out: str | Path | None = None,
    *,
    count: str = "forward",
    tensorboard: str | Path | None = None,
    keep: bool = True,
) -> Watch:
    """Record amax, scale, underflow %, saturation % and SQNR of every GEMM operand of the
    converted layers of ``model`` (per layer x GEMM x role) on steps 0, every, 2*every, ...

    ``out``: a JSONL file (CSV when it ends in ``.csv``), rewritten; None keeps the rows only
    in ``Watch.records``. ``count``: ``"forward"`` (each call of ``model``'s forward starts a
    step, so eval forwards count too) or ``"step"`` (call ``w.step()`` once per optimizer step:
    gradient accumulation, several forwards per step). ``tensorboard``: a log directory for
    scalars (needs the ``tensorboard`` package). ``keep=False`` does not keep rows in memory.
    Definitions: docs/observe.md and `fp8lab.observe.records.operand_row`."""
    return Watch(model, every, out, count=count, tensorboard=tensorboard, keep=keep)

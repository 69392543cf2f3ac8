"""`GuardMonitor`: the guard's runtime for one training run.

The training loop calls, per step: `before_step` (remember each delayed-scaling state's scale
before this step uses it), `check` after backward and gradient clipping, before the optimizer
step (every detector; returns the findings and keeps the step's signals), then `accept` when the
step is kept (the findings' running windows learn only from kept steps) and `end_step`. The
detector state is plain data (`state_dict`), saved with every checkpoint and restored by a
rollback. `reset_scaling` restarts delayed-scaling histories: zero history, then current scaling
until the next update has set a scale (the HiFloat8 training recipe's restart).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch

import fp8lab.guard.detectors as det
from fp8lab.guard.config import AnomalyGuard
from fp8lab.observe.records import NATURAL_OPERANDS as NATURAL
from fp8lab.scaling.delayed import DelayedScaling

__all__ = ["GuardMonitor", "delayed_states", "layer_states"]


def layer_states(model: torch.nn.Module) -> list[tuple[str, DelayedScaling]]:
    """``("layer:key", DelayedScaling)`` for every delayed-scaling state of the converted
    Linears of ``model`` (key: the role, or ``gemm_role`` for a GEMM override): the guard's
    view by layer name (`fp8lab.nn.delayed_states` names every state a model owns by its
    attribute path)."""
    from fp8lab.nn import Linear

    out = []
    for name, mod in model.named_modules():
        if isinstance(mod, Linear):
            for key, ds in mod.scaling_states.items():
                out.append((f"{mod.name or name}:{key}", ds))
    return out


def delayed_states(model: torch.nn.Module) -> list[tuple[str, DelayedScaling]]:
    """Deprecated name of `layer_states`."""
    warnings.warn("fp8lab.guard.delayed_states is deprecated: use fp8lab.guard.layer_states",
                  DeprecationWarning, stacklevel=2)  # fmt: skip
    return layer_states(model)


def _min_subnormals(model: torch.nn.Module, names: list[str]) -> list[float]:
    """The smallest positive value of the format of each delayed-scaling state ``layer:key``
    (`layer_states` order; the format the layer's recipe gives that state's operand)."""
    from fp8lab.formats import get_format
    from fp8lab.nn import Linear
    from fp8lab.nn.state import state_key
    from fp8lab.recipe import GEMM_OPERANDS, GEMMS

    tiny: dict[str, float] = {}
    for name, mod in model.named_modules():
        if not isinstance(mod, Linear) or not mod.scaling_states:
            continue
        rec = mod.recipe
        for g in GEMMS:
            for role, _ in GEMM_OPERANDS[g]:
                spec = rec.spec(g, role)
                if spec is not None and spec.is_delayed:
                    key = f"{mod.name or name}:{state_key(rec, g, role)}"
                    tiny.setdefault(key, float(get_format(spec.format).min_subnormal))
    return [tiny.get(n, 0.0) for n in names]


class GuardMonitor:
    """Detectors of one run (see the module doc). ``dynamic_scaler``: a dynamic loss scaler
    handles gradient overflows itself."""

    def __init__(
        self, guard: AnomalyGuard, model: torch.nn.Module, dynamic_scaler: bool = False
    ) -> None:
        self.guard = guard
        self.params = guard.detector_params
        self.model = model
        self.dynamic_scaler = dynamic_scaler
        self.loss_count = 0
        self.loss_max = 0.0
        self.loss_window: list[float] = []
        self.gnorm_window: list[float] = []
        self.overflow_run = 0
        self.last_pct: dict[str, list[float | None]] = {}
        self.signals: dict[str, Any] = {}
        self.warnings: list[det.Finding] = []  # the last check's findings that do not act
        self._pinned: dict[int, Any] = {}  # id(ds) -> (ds, its own config) while restarting
        self.refresh()

    # ------------------------------------------------------------------ scaling states
    def refresh(self) -> None:
        """Enumerate the model's delayed-scaling states again (after a recipe change)."""
        self.states = layer_states(self.model)
        groups: dict[int, list[int]] = {}
        for i, (_, ds) in enumerate(self.states):
            groups.setdefault(ds.history_len, []).append(i)
        self._groups = list(groups.values())
        self._pre: tuple[torch.Tensor, ...] | None = None
        dss = [ds for _, ds in self.states]  # constants of each state, read once
        self._margin = torch.tensor([float(ds.total_margin) for ds in dss])
        self._interval = torch.tensor([ds.interval for ds in dss], dtype=torch.int64)
        self._tiny = torch.tensor(_min_subnormals(self.model, self.tensor_names))

    @property
    def tensor_names(self) -> list[str]:
        return [n for n, _ in self.states]

    def before_step(self) -> None:
        """Remember each state's scale, step and whether a scale was set, before the step."""
        if not self.states:
            return
        st = [ds.state for _, ds in self.states]
        # the signals are computed on the CPU (a few numbers per state), whatever device the
        # model's scaling state lives on (.cpu() of a CPU tensor is the tensor itself)
        self._pre = (
            torch.stack([s.scale for s in st]).cpu(),
            torch.stack([s.step for s in st]).cpu(),
            torch.stack([s.initialized for s in st]).cpu(),
        )

    def _scaling_signals(
        self,
    ) -> tuple[list[tuple[str, float]], list[tuple[str, float]], dict[str, float], bool]:
        """(headroom per tensor, staleness per tensor, floor per tensor, every amax history
        finite). The floor is log2(amax * scale / smallest subnormal) of this step: binades of
        the step's largest scaled element above the format's smallest subnormal."""
        if not self.states or self._pre is None:
            return [], [], {}, True
        scale, step, init = self._pre
        n = len(self.states)
        last = torch.empty(n)
        hmax = torch.empty(n)
        for idx in self._groups:
            hist = torch.stack([self.states[i][1].state.amax_history for i in idx]).cpu()
            last[idx] = hist[:, -1]
            hmax[idx] = hist[:, 1:].max(dim=1).values  # NaN propagates: caught below
        ok = bool(torch.isfinite(hmax).all())
        fmt_max = torch.stack([ds.state.fmt_max for _, ds in self.states]).cpu()
        margin = self._margin
        measured = (step % self._interval == 0) & (init == 1) & (last > 0) & torch.isfinite(last)
        # binades by which amax * scale exceeds the format's max (less the margin): > 0 clamps
        head = torch.log2(last * scale / (fmt_max * torch.exp2(-margin)))
        stale = torch.log2(hmax / last)
        floor = torch.log2(last * scale / self._tiny)
        names = self.tensor_names
        sel = measured.nonzero().flatten().tolist()
        h, s, f = head.tolist(), stale.tolist(), floor.tolist()
        return ([(names[i], h[i]) for i in sel], [(names[i], s[i]) for i in sel],
                {names[i]: f[i] for i in sel}, ok)  # fmt: skip

    # ------------------------------------------------------------------ detectors
    def wants_rows(self, step: int) -> bool:
        """Whether step ``step`` (0-based) should measure per-operand percentages."""
        for name in ("saturation", "underflow"):
            if name in self.params and (step + 1) % int(self.params[name]["every"]) == 0:
                return True
        return False

    def check(
        self,
        step: int,
        loss: float,
        grad_norm: float,
        rows: Iterable[Mapping[str, Any]] | None = None,
    ) -> list[det.Finding]:
        """Run every enabled detector on step ``step`` (0-based); return the findings. The
        step's signals (the largest per-tensor values and the tensor) stay in ``signals``."""
        p = self.params
        found: list[det.Finding] = []
        warned: list[det.Finding] = []
        head, stale, floor, amax_ok = self._scaling_signals()
        overflow = not math.isfinite(grad_norm)
        run = self.overflow_run + 1 if overflow else 0
        sig: dict[str, Any] = {"step": step, "loss": loss, "grad_norm": grad_norm}
        if "nonfinite" in p:
            found += det.nonfinite(loss, grad_norm, amax_ok, run, p["nonfinite"],
                                   self.dynamic_scaler)  # fmt: skip
        if "loss_spike" in p:
            found += det.loss_spike(loss, self.loss_max, self.loss_count, p["loss_spike"])
        sig["loss_ratio"] = abs(loss) / self.loss_max if self.loss_max > 0 else None
        for name, x, window, two in (("loss_zscore", loss, self.loss_window, False),
                                     ("grad_norm_zscore", grad_norm, self.gnorm_window, True)):  # fmt: skip
            if name in p:
                z, f = det.zscore(name, x, window[-int(p[name]["window"]) :], p[name], two)
                sig[name] = z
                found += f
        for name, values in (("headroom", head), ("staleness", stale)):
            top = max(values, key=lambda t: t[1], default=(None, None))
            sig[name], sig[name + "_tensor"] = top[1], top[0]
        if "headroom" in p:
            found += det.headroom_findings(head, p["headroom"])
        if "staleness" in p:  # a warning unless the stale scale flushed the whole operand
            act, warn = det.staleness_findings(stale, p["staleness"], floor)
            found += act
            warned += warn
        sig["floor"] = min(floor.values(), default=None)
        if rows is not None:  # each operand once, in its natural layout
            rows = [r for r in rows if "gemm" not in r or (r["gemm"], r["role"]) in NATURAL]
            # acted on for delayed-scaled operands only: a stale history is what a restart cures;
            # a current-, block- or fixed-scaled operand's percentages are reported as signals
            delayed = set(self.tensor_names)
            found += [f for f in det.percent_findings(rows, self.last_pct, p)
                      if f.tensor in delayed]  # fmt: skip
            for key, col in (("saturation", "saturation_pct"), ("underflow", "underflow_pct")):
                vals = [r[col] for r in rows if r.get(col) is not None]
                sig[key + "_pct"] = max(vals) if vals else None
            self._rows = rows
        else:
            self._rows = None
        self._run = run
        # the early-warning study's firings: acting findings and warnings alike
        sig["fired"] = sorted({f.detector for f in found + warned})
        sig["warned"] = sorted({f.detector for f in warned})
        self.signals = sig
        self.warnings = warned
        return found

    def accept(self) -> None:
        """The checked step is kept: its values join the detectors' running statistics."""
        sig = self.signals
        loss, gnorm = sig["loss"], sig["grad_norm"]
        self.overflow_run = self._run
        if math.isfinite(loss):
            if self.loss_count < self.params.get("loss_spike", {}).get("samples", 100):
                self.loss_count += 1
                self.loss_max = max(self.loss_max, abs(loss))
            if loss > 0:
                self.loss_window.append(math.log(loss))
        if math.isfinite(gnorm) and gnorm > 0:
            self.gnorm_window.append(math.log(gnorm))
        for name, window in (("loss_zscore", self.loss_window),
                             ("grad_norm_zscore", self.gnorm_window)):  # fmt: skip
            keep = int(self.params[name]["window"]) if name in self.params else 0
            del window[: max(0, len(window) - keep)]
        for r in self._rows or ():
            self.last_pct[f"{r['layer']}:{r['role']}"] = [r.get("underflow_pct"),
                                                         r.get("saturation_pct")]  # fmt: skip

    # ------------------------------------------------------------------ restart
    def reset_scaling(self, tensors: Iterable[str]) -> list[str]:
        """Restart the named delayed-scaling states (``"layer:key"``): zero amax history, no
        scale set, and current scaling until an update has set one (then delayed again).
        Returns the names reset."""
        want = set(tensors)
        done = []
        for name, ds in self.states:
            if name not in want:
                continue
            ds.state.amax_history.zero_()
            ds.state.initialized.zero_()
            if ds.cfg.first_step != "current":
                self._pinned.setdefault(id(ds), (ds, ds.cfg))
                ds.cfg = ds.cfg.replace(first_step="current")
            done.append(name)
        return done

    def pinned_names(self) -> list[str]:
        """States restarted by `reset_scaling` still waiting for their first scale (saved with
        a checkpoint: `pin_current` re-applies it on resume)."""
        ids = set(self._pinned)
        return [n for n, ds in self.states if id(ds) in ids]

    def pin_current(self, names: Iterable[str]) -> None:
        """Current scaling until the next update for the named states (their state unchanged)."""
        want = set(names)
        for name, ds in self.states:
            if name in want and ds.cfg.first_step != "current":
                self._pinned.setdefault(id(ds), (ds, ds.cfg))
                ds.cfg = ds.cfg.replace(first_step="current")

    def end_step(self) -> None:
        """After a step: states restarted by `reset_scaling` that have a scale again go back
        to their own configuration (delayed scaling from their fresh history)."""
        for key, (ds, cfg) in list(self._pinned.items()):
            if ds.initialized:
                ds.cfg = cfg
                del self._pinned[key]

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The detectors' running statistics as plain data (checkpointed with the run)."""
        return {
            "loss_count": self.loss_count,
            "loss_max": self.loss_max,
            "loss_window": list(self.loss_window),
            "gnorm_window": list(self.gnorm_window),
            "overflow_run": self.overflow_run,
            "last_pct": {k: list(v) for k, v in self.last_pct.items()},
        }

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        self.loss_count = int(d["loss_count"])
        self.loss_max = float(d["loss_max"])
        self.loss_window = [float(x) for x in d["loss_window"]]
        self.gnorm_window = [float(x) for x in d["gnorm_window"]]
        self.overflow_run = int(d["overflow_run"])
        self.last_pct = {k: list(v) for k, v in d["last_pct"].items()}

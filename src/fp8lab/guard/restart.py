"""Restarting after an anomaly: last-good in-memory checkpoints and the escalation rule."""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["ESCALATION_ROLES", "Snapshots", "current_scaling_rule"]

#: roles an escalation can pin (a GEMM override key ``gemm_role`` pins its role)
ESCALATION_ROLES = ("input", "weight", "grad_output")


class Snapshots:
    """The newest ``keep`` snapshots, each ``(steps done, payload)``; payloads are deep
    copies (plain tensors and data), so later training cannot change them."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.items: list[tuple[int, Any]] = []

    def save(self, step: int, payload: Any) -> None:
        self.items = [(s, p) for s, p in self.items if s < step]
        self.items.append((step, copy.deepcopy(payload)))
        del self.items[: -self.keep]

    def pick(self, at_most: int, back: int = 0) -> tuple[int, Any] | None:
        """The snapshot ``back`` places before the newest one taken at or before step
        ``at_most`` (the oldest kept one when fewer exist); None when there is none."""
        ok = [(s, p) for s, p in self.items if s <= at_most]
        if not ok:
            return None
        return ok[max(0, len(ok) - 1 - back)]

    def drop_after(self, step: int) -> None:
        """Forget snapshots of an abandoned trajectory (taken after ``step``)."""
        self.items = [(s, p) for s, p in self.items if s <= step]

    def clear(self) -> None:
        self.items.clear()


def current_scaling_rule(layer: str, key: str) -> Any:
    """The per-layer recipe rule pinning one tensor of one layer to current per-tensor scaling
    (``scaling = "max"``: fmt_max / amax of the tensor itself, Transformer Engine's
    Float8CurrentScaling). ``key``: a role or a ``gemm_role`` state key (its role is pinned)."""
    from fp8lab.recipe import LayerRule

    role = key.split("_", 1)[1] if key.split("_", 1)[0] in ("fprop", "dgrad", "wgrad") else key
    if role not in ESCALATION_ROLES:
        raise ValueError(f"cannot pin {key!r}: not one of {ESCALATION_ROLES}")
    return LayerRule(match=layer, changes={role: {"scaling": "max"}})

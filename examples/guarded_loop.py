"""The anomaly guard in your own training loop: `fp8lab.GuardedStep` wraps the step (closure:
forward + backward), applies, skips or rolls back the update, and tells the loop where to
continue in its data. Trains the tiny character model of ``own_loop.py`` under te-delayed
twice from the same weights on the same batches: clean, and with a NaN loss and a 2^40
gradient spike injected; both faults are rolled back and the final losses agree.

    .venv/bin/python examples/guarded_loop.py [--tiny] [--steps 120]
"""

from __future__ import annotations

import argparse
import copy
import functools

import torch
from own_loop import batches, make_model

import fp8lab


def forward_backward(model: torch.nn.Module, x, y, fault: str | None) -> torch.Tensor:
    """The user's step up to the gradients: loss, backward (and the injected fault)."""
    loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    if fault == "nan":
        loss = loss * float("nan")
    loss.backward()
    if fault == "spike":  # a corrupted gradient, 2^40 times too large
        for p in model.parameters():
            p.grad.mul_(2.0**40)
    return loss


def train(model: torch.nn.Module, data: list, steps: int, faults: dict[int, str]) -> dict:
    """Train ``steps`` steps; ``faults``: step -> "nan" | "spike", each injected once."""
    fp8lab.nn.convert(model, "te-delayed")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    guard = fp8lab.AnomalyGuard(policy="rollback", checkpoint_every=10)
    gs = fp8lab.GuardedStep(model, opt, guard=guard)
    pos, losses = 0, []
    while gs.steps_done < steps:
        x, y = data[pos]
        fault = faults.pop(gs.steps_done, None)  # one-shot: the replay runs clean
        closure = functools.partial(forward_backward, model, x, y, fault)
        result = gs.step(closure, position=pos)
        for e in result.events:  # what the guard did, as the lab's guard_events records
            print(f"step {e['step']}: {e['action']} ({result.reason}) to step "
                  f"{e.get('to_step')}, continuing at batch {result.next_position}")  # fmt: skip
        pos = result.next_position  # rewound after a rollback
        if result.rolled_back:  # the steps after the snapshot are redone
            del losses[result.steps_done :]
        else:
            losses.append(result.loss)
    return {"final_loss": sum(losses[-10:]) / 10, "events": gs.events}


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny model and few steps")
    ap.add_argument("--steps", type=int, default=120)
    args = ap.parse_args(argv)
    d, steps = (32, 40) if args.tiny else (64, args.steps)
    text = b"To be, or not to be, that is the question: " * 200
    data = list(batches(text, steps + 10, batch=8, seq=32))  # + batches a rollback skips
    torch.manual_seed(0)
    initial = make_model(256, d)
    clean = train(copy.deepcopy(initial), data, steps, {})
    faulty = train(
        copy.deepcopy(initial), data, steps, {steps // 3: "nan", 2 * steps // 3: "spike"}
    )
    rel = abs(faulty["final_loss"] - clean["final_loss"]) / clean["final_loss"]
    print(f"clean  final loss {clean['final_loss']:.4f}")
    print(f"faulty final loss {faulty['final_loss']:.4f} ({100 * rel:.2f} % apart)")
    actions = [e["action"] for e in faulty["events"]]
    return {"clean": clean["final_loss"], "faulty": faulty["final_loss"], "rel": rel,
            "rollbacks": actions.count("rollback")}  # fmt: skip


if __name__ == "__main__":
    main()

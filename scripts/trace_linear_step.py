"""Which files and functions of fp8lab one steady-state ``fp8lab.nn.Linear`` step visits.

Runs a few warm-up steps (so delayed-scaling histories and numba compilation are past their first
call), then traces one forward + backward with ``sys.setprofile`` and prints every call into
``src/fp8lab`` in order, the distinct files and functions, and the returns to a file already left
(how often the step jumps back into a file it had finished with). ``tests/test_trace.py`` holds
the limits of these counts and checks that ``docs/design.md``'s walk names the files visited.

    python scripts/trace_linear_step.py --recipe te-delayed
    python scripts/trace_linear_step.py --recipe deepseek-v3 --json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import fp8lab

SRC = str(Path(fp8lab.__file__).resolve().parent)


def trace_step(recipe: str, tokens: int = 256, features: int = 256) -> list[tuple[str, str]]:
    """(file relative to src/fp8lab, qualified function) of every call during one step, in order."""
    torch.manual_seed(0)
    layer = fp8lab.nn.Linear(features, features, recipe=recipe)
    x = torch.randn(tokens, features, requires_grad=True)

    def step() -> None:
        layer(x).square().mean().backward()

    for _ in range(3):
        step()
    calls: list[tuple[str, str]] = []

    def profiler(frame, event, arg) -> None:
        if event != "call":
            return
        path = frame.f_code.co_filename
        if path.startswith(SRC):
            rel = Path(path).relative_to(SRC).as_posix()
            calls.append((rel, frame.f_code.co_qualname))

    sys.setprofile(profiler)
    try:
        step()
    finally:
        sys.setprofile(None)
    return calls


def summarize(calls: list[tuple[str, str]]) -> dict:
    """Counts: distinct files and functions, and returns to a file left earlier."""
    files, seen_left, returns = [], set(), 0
    prev = None
    for f, _ in calls:
        if f not in files:
            files.append(f)
        if f != prev:
            if f in seen_left:
                returns += 1
            if prev is not None:
                seen_left.add(prev)
            prev = f
    functions = list(dict.fromkeys(calls))
    return {
        "files": files,
        "functions": [f"{f}:{q}" for f, q in functions],
        "n_files": len(files),
        "n_functions": len(functions),
        "n_calls": len(calls),
        "returns_to_left_files": returns,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="te-delayed")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = ap.parse_args()
    s = summarize(trace_step(args.recipe)) | {"recipe": args.recipe}
    if args.json:
        print(json.dumps(s, indent=2))
        return
    print(f"recipe {args.recipe}: one steady-state fp8lab.nn.Linear forward + backward")
    for f in s["functions"]:
        print(f"  {f}")
    print("files, in order of first visit:")
    for f in s["files"]:
        print(f"  {f}")
    print(
        f"{s['n_files']} files, {s['n_functions']} functions, {s['n_calls']} calls, "
        f"{s['returns_to_left_files']} returns to a file already left"
    )


if __name__ == "__main__":
    main()

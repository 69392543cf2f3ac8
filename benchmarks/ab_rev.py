"""Run a benchmark on this tree and on an earlier revision, alternately, and compare.

    python benchmarks/ab_rev.py --base 4da2626 --repeat 3 -- benchmarks/bench_linear.py --iters 5

The base revision is checked out once into a git worktree (``/tmp/fp8lab_ab_<rev>``) and run with
``PYTHONPATH`` at its ``src`` and the same interpreter; the benchmark script itself is taken from
this tree unless ``--base-script`` says to run the base's copy. Runs alternate new, old, new, old
... so that a change in the machine's load hits both sides alike. Every number of the benchmark's
output lines is parsed per line label (the text before the first number); the report gives, per
label and column, the median over the repeats of each side and the ratio new/old.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NUM = re.compile(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def worktree(rev: str) -> Path:
    """A checkout of ``rev`` (made once, reused)."""
    sha = subprocess.check_output(["git", "-C", str(ROOT), "rev-parse", "--short", rev], text=True)
    path = Path(f"/tmp/fp8lab_ab_{sha.strip()}")
    if not (path / "src" / "fp8lab").is_dir():
        subprocess.check_call(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), rev],
            stdout=subprocess.DEVNULL,
        )
    return path


def run(src: Path, script: Path, args: list[str]) -> str:
    env = dict(os.environ, PYTHONPATH=str(src))
    out = subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True,
                         text=True, check=True)  # fmt: skip
    return out.stdout


def numbers(text: str) -> dict[str, list[float]]:
    """label -> the numbers on its line: the label is the line's leading words up to the first
    word that is a number (so ``deepseek-v3`` and ``fp32`` stay labels)."""
    rows: dict[str, list[float]] = {}
    for line in text.splitlines():
        words = line.replace("|", " ").split()
        k = next((i for i, w in enumerate(words) if NUM.fullmatch(w.rstrip("x%"))), None)
        if k is None or k == 0:
            continue
        vals = [float(w.rstrip("x%")) for w in words[k:] if NUM.fullmatch(w.rstrip("x%"))]
        rows[" ".join(words[:k])] = vals
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the earlier revision (a commit or ref)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each side (alternating)")
    ap.add_argument("--base-script", action="store_true",
                    help="run the base revision's copy of the benchmark script")  # fmt: skip
    ap.add_argument("command", nargs=argparse.REMAINDER,
                    help="-- SCRIPT [ARGS]: the benchmark, relative to the repository")  # fmt: skip
    a = ap.parse_args()
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        ap.error("give the benchmark after --, e.g. -- benchmarks/bench_linear.py")
    base = worktree(a.base)
    new_script = ROOT / cmd[0]
    old_script = base / cmd[0] if a.base_script else new_script
    sides: dict[str, list[dict[str, list[float]]]] = {"new": [], "old": []}
    for i in range(a.repeat):
        for side, src, script in (("new", ROOT / "src", new_script),
                                  ("old", base / "src", old_script)):  # fmt: skip
            text = run(src, script, cmd[1:])
            sides[side].append(numbers(text))
            print(f"[{i + 1}/{a.repeat}] {side} done", file=sys.stderr, flush=True)
    print(f"{' '.join(cmd)}: this tree (new) vs {a.base} (old), median of {a.repeat} runs each")
    for label in sides["new"][0]:
        runs_new = [r[label] for r in sides["new"] if label in r]
        runs_old = [r[label] for r in sides["old"] if label in r]
        if not runs_old:
            continue
        cols = []
        for j in range(min(len(runs_new[0]), len(runs_old[0]))):
            n = statistics.median(r[j] for r in runs_new if len(r) > j)
            o = statistics.median(r[j] for r in runs_old if len(r) > j)
            spread = max(r[j] for r in runs_new if len(r) > j) - min(
                r[j] for r in runs_new if len(r) > j
            )
            ratio = f"{n / o:.3f}" if o else "-"
            cols.append(f"{n:.4g} vs {o:.4g} (x{ratio}, new spread {spread:.3g})")
        print(f"  {label}: " + "; ".join(cols))


if __name__ == "__main__":
    main()

"""Data-parallel throughput (1 vs 2 gloo ranks, one thread each) and gradient bytes per step.

Throughput: the default lab GPT (``GPTConfig()``) under a recipe, trained with
`fp8lab.distributed.ddp.DataParallel` (DDP, or FSDP2 with or without the FP8 all-gather) on a fixed
global batch split across the ranks (`fp8lab.distributed.data`: global-token-count loss, summed
gradients, ``--amax-group world``, the amax all-reduces batched into one per step, or one per
state and update with the ``unbatched`` setup), one thread per rank, timed after warm-up
steps; tokens/s counts the global batch. ``amax all-reduces/step`` counts the MAX all-reduces
rank 0 issues (delayed-scaling amaxes; with the FP8 all-gather also one per gathered
current-scaled weight: a delayed-scaled one needs none).
Bytes: what one rank sends per step to all-reduce the model's gradients at each
``--grad-comm`` precision (`fp8lab.distributed.comm.bytes_per_rank`, DDP's 25 MiB buckets), for
N = 2, 4, 8, 16.

    .venv/bin/python benchmarks/bench_dist.py [--recipe te-delayed] [--steps 6] [--batch 8]
        [--modes ddp,unbatched,fsdp,fsdp-fp8] [--repeat 3]
    .venv/bin/python benchmarks/bench_dist.py --readme     # every row of the README table

On a shared machine the wall-clock numbers move with other jobs' load: the rounds are
interleaved and the best of each setup is kept; rank 0's CPU time per step is printed too.

Memory per rank (rank 0, not timed, so not affected by load): ``peak RSS`` is the process's
peak resident set (``getrusage``: Python, torch and numba included, so it is dominated by a
fixed few hundred MiB); ``tensors between steps`` is the sum of the distinct storages of every
live tensor after the last step (parameters or their shards, optimizer state, anything a step
left allocated), which is where FSDP's sharding shows: with the gathered weights freed after
use, only the shards and their optimizer state stay.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

import torch

DDP_BUCKET_BYTES = 25 * 1024 * 1024


def _rank(rank: int, world: int, port: str, recipe: str, steps: int, batch: int, mode: str) -> None:
    torch.set_num_threads(1)
    from fp8lab.distributed.data import global_token_loss, shard_batch
    from fp8lab.distributed.ddp import DataParallel
    from fp8lab.lab.gpt import GPT, GPTConfig
    from fp8lab.nn import convert

    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    cfg = GPTConfig()
    model = GPT(cfg)
    if recipe != "fp32":
        convert(model, recipe)
    dp = None
    max_reduces = [0]  # all-reduces with op MAX (amaxes), counted as they are issued
    if world > 1:
        d = torch.distributed
        plain = d.all_reduce

        def counted(tensor, op=d.ReduceOp.SUM, group=None, async_op=False):  # type: ignore[no-untyped-def]
            max_reduces[0] += int(op == d.ReduceOp.MAX)
            return plain(tensor, op=op, group=group, async_op=async_op)

        d.all_reduce = counted
        dp = DataParallel(model, "world", fsdp="fsdp" in mode, fp8_allgather="fp8" in mode,
                          batch_amax="unbatched" not in mode)  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    warm = 2
    for step in range(warm + steps):
        if step == warm:
            if world > 1:
                torch.distributed.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
        x = torch.randint(0, 256, (batch, cfg.block_size), generator=gen)
        y = torch.randint(0, 256, (batch, cfg.block_size), generator=gen)
        xs, ys = shard_batch(x, y, rank, world)
        if dp is None:
            logits, _ = model(xs)
            loss, _ = global_token_loss(logits, ys, y.numel())
        else:  # the lab's path: the backward ends with the batched amax all-reduce
            loss, _, _ = dp.loss(xs, ys)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if world > 1:
        torch.distributed.barrier()
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    if rank == 0:
        import resource

        flushes = None if dp is None else max_reduces[0]
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        print(json.dumps({"tokens_per_s": steps * batch * cfg.block_size / dt,
                          "cpu_ms_per_step": 1000 * cpu / steps, "amax_all_reduces": flushes,
                          "peak_rss_mib": peak, "live_mib": _live_tensor_bytes() / 2**20}))  # fmt: skip
    if world > 1:
        torch.distributed.destroy_process_group()


def _live_tensor_bytes() -> int:
    """Bytes of the distinct storages of every live tensor (the inner tensors of wrapper
    subclasses such as DTensor are live tensors of their own)."""
    import gc
    import warnings

    gc.collect()
    seen: dict[int, int] = {}
    with warnings.catch_warnings():  # isinstance on deprecated torch objects warns
        warnings.simplefilter("ignore")
        objs = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for obj in objs:
        try:
            st = obj.untyped_storage()
            ptr, size = st.data_ptr(), st.nbytes()
        except (RuntimeError, NotImplementedError):  # wrapper subclasses have no storage
            continue
        if ptr and size:
            seen[ptr] = max(size, seen.get(ptr, 0))
    return sum(seen.values())


def _run(world: int, args: argparse.Namespace, mode: str, recipe: str | None = None) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    cmd = [sys.executable, __file__, "--_rank"]
    tail = [str(world), port, recipe or args.recipe, str(args.steps), str(args.batch), mode]
    procs = [
        subprocess.Popen([*cmd, str(r), *tail], env=env, stdout=subprocess.PIPE, text=True)
        for r in range(world)
    ]
    outs = [p.communicate(timeout=1200)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"a rank failed: {[p.returncode for p in procs]}")
    return json.loads(outs[0].strip().splitlines()[-1])


MODES = ("ddp", "unbatched", "fsdp", "fsdp-fp8")
#: the README table: its recipes and their 2-rank setups (`--readme`)
README_ROWS = (("te-delayed", ("ddp", "unbatched", "fsdp-fp8")),
               ("te-current", ("ddp", "fsdp", "fsdp-fp8")),
               ("fp32", ("ddp", "fsdp")))  # fmt: skip
SETUP_NAMES = {"one": "1 process", "ddp": "DDP", "unbatched": "DDP, one all-reduce per state",
               "fsdp": "FSDP2", "fsdp-fp8": "FSDP2 + FP8 all-gather"}  # fmt: skip


def measure(args: argparse.Namespace, recipe: str, modes: list[str]) -> dict[str, dict]:
    """Best run of each setup ("one" = 1 process, then ``modes`` on 2 ranks) over
    ``args.repeat`` interleaved rounds (load from other jobs hits every setup alike)."""
    best: dict[str, dict] = {}
    for _ in range(args.repeat):
        for mode in ["one", *modes]:
            r = _run(1, args, "ddp", recipe) if mode == "one" else _run(2, args, mode, recipe)
            b = best.setdefault(mode, r)
            if r["tokens_per_s"] > b["tokens_per_s"]:
                best[mode] = r
    return best


def _row(best: dict[str, dict], mode: str, steps: int) -> list[str]:
    r, one = best[mode], best["one"]["tokens_per_s"]
    n = r.get("amax_all_reduces")
    per = "-" if n is None else f"{n / (steps + 2):.0f}"
    return [f"{r['tokens_per_s']:,.0f}", f"{r['tokens_per_s'] / one:.2f}x",
            f"{r['cpu_ms_per_step']:.0f}", per, f"{r['peak_rss_mib']:.0f}",
            f"{r['live_mib']:.2f}"]  # fmt: skip


COLUMNS = ("tokens/s | vs 1 process | rank-0 CPU ms/step | amax all-reduces/step | "
           "peak RSS MiB/rank | tensors between steps MiB/rank")  # fmt: skip


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--_rank":
        a = sys.argv[2:]
        _rank(int(a[0]), int(a[1]), a[2], a[3], int(a[4]), int(a[5]), a[6])
        return
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="No --torch-device: the ranks are CPU processes with gloo, one thread each. On "
        "GPUs the lab's data parallelism runs under torchrun (fp8lab compare --torch-device "
        "cuda: each rank its LOCAL_RANK GPU and NCCL), not measured here.",
    )
    ap.add_argument("--recipe", default="te-delayed")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    ap.add_argument(
        "--modes", default="ddp,unbatched",
        help="2-rank setups, comma list of: ddp (DDP, batched amax all-reduce), unbatched (DDP, "
        "one all-reduce per state), fsdp (FSDP2), fsdp-fp8 (FSDP2 + FP8 all-gather)",
    )  # fmt: skip
    ap.add_argument("--repeat", type=int, default=3, help="interleaved rounds; best is kept")
    ap.add_argument(
        "--readme", action="store_true",
        help="every row of the README table (te-delayed: ddp, unbatched, fsdp-fp8; te-current: "
        "ddp, fsdp, fsdp-fp8; fp32: ddp, fsdp), printed as that table (--recipe and --modes "
        "ignored)",
    )  # fmt: skip
    args = ap.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not set(modes) <= set(MODES):
        raise SystemExit(f"--modes: expected a comma list of {', '.join(MODES)}")
    from fp8lab.distributed.comm import GRAD_COMMS, bytes_per_rank
    from fp8lab.lab.gpt import GPT, GPTConfig

    rows = README_ROWS if args.readme else ((args.recipe, tuple(modes)),)
    print(f"recipes {', '.join(r for r, _ in rows)}; global batch {args.batch} x 128 tokens, "
          f"1 thread per rank, {args.steps} timed steps, best of {args.repeat} interleaved "
          "rounds per recipe")  # fmt: skip
    print(f"| recipe | setup | {COLUMNS} |")
    print("|---|---|" + "---|" * len(COLUMNS.split("|")))
    for recipe, setups in rows:
        best = measure(args, recipe, list(setups))
        for mode in ["one", *setups]:
            name = SETUP_NAMES[mode]
            if mode == "ddp" and recipe == "te-delayed":
                name = "DDP, amax all-reduces batched"
            print(f"| {recipe} | {name} | " + " | ".join(_row(best, mode, args.steps)) + " |")
    numel = GPT(GPTConfig()).num_params()
    bucket = DDP_BUCKET_BYTES // 4
    print(f"\n| gradient bytes one rank sends per step ({numel:,} parameters) | "
          + " | ".join(f"N={n}" for n in (2, 4, 8, 16)) + " |")  # fmt: skip
    print("|---|" + "---|" * 4)
    for p in GRAD_COMMS:
        cells = [f"{bytes_per_rank(numel, n, p, bucket) / 2**20:.2f} MiB" for n in (2, 4, 8, 16)]
        print(f"| {p} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

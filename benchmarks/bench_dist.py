"""Data-parallel throughput (1 vs 2 gloo ranks, one thread each) and gradient bytes per step.

Throughput: the default lab GPT (``GPTConfig()``) under a recipe, trained with
`fp8lab.dist.ddp.DataParallel` (DDP, or FSDP2 with ``--fsdp [--fp8-allgather]``) on a fixed
global batch split across the ranks (`fp8lab.dist.data`: global-token-count loss, summed
gradients, ``--amax-group world``, the amax all-reduces batched into one per step unless
``--unbatched``), one thread per rank, timed after warm-up steps; tokens/s counts the global
batch. Bytes: what one rank sends per step to all-reduce the model's gradients at each
``--grad-comm`` precision (`fp8lab.dist.comm.bytes_per_rank`, DDP's 25 MiB buckets), for
N = 2, 4, 8, 16.

    .venv/bin/python benchmarks/bench_dist.py [--recipe te-delayed] [--steps 6] [--batch 8]
        [--unbatched] [--fsdp [--fp8-allgather]]
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
    from fp8lab.dist.data import global_token_loss, shard_batch
    from fp8lab.dist.ddp import DataParallel
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
    net = model
    if world > 1:
        dp = DataParallel(model, "world", fsdp="fsdp" in mode, fp8_allgather="fp8" in mode,
                          batch_amax="unbatched" not in mode)  # fmt: skip
        net = dp.ddp
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    warm = 2
    for step in range(warm + steps):
        if step == warm:
            if world > 1:
                torch.distributed.barrier()
            t0 = time.perf_counter()
        x = torch.randint(0, 256, (batch, cfg.block_size), generator=gen)
        y = torch.randint(0, 256, (batch, cfg.block_size), generator=gen)
        xs, ys = shard_batch(x, y, rank, world)
        logits, _ = net(xs)
        loss, _ = global_token_loss(logits, ys, y.numel())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if world > 1:
        torch.distributed.barrier()
    dt = time.perf_counter() - t0
    if rank == 0:
        print(json.dumps({"tokens_per_s": steps * batch * cfg.block_size / dt}))
    if world > 1:
        torch.distributed.destroy_process_group()


def _throughput(world: int, args: argparse.Namespace) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    cmd = [sys.executable, __file__, "--_rank"]
    mode = "-".join(
        m for m, on in (("unbatched", args.unbatched), ("fsdp", args.fsdp),
                        ("fp8", args.fp8_allgather)) if on
    ) or "ddp"  # fmt: skip
    tail = [str(world), port, args.recipe, str(args.steps), str(args.batch), mode]
    procs = [
        subprocess.Popen([*cmd, str(r), *tail], env=env, stdout=subprocess.PIPE, text=True)
        for r in range(world)
    ]
    outs = [p.communicate(timeout=1200)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"a rank failed: {[p.returncode for p in procs]}")
    return float(json.loads(outs[0].strip().splitlines()[-1])["tokens_per_s"])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--_rank":
        a = sys.argv[2:]
        _rank(int(a[0]), int(a[1]), a[2], a[3], int(a[4]), int(a[5]), a[6])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="te-delayed")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    ap.add_argument("--unbatched", action="store_true", help="one amax all-reduce per state")
    ap.add_argument("--fsdp", action="store_true", help="FSDP2 fully_shard instead of DDP")
    ap.add_argument("--fp8-allgather", action="store_true", help="with --fsdp: FP8 all-gather")
    ap.add_argument("--skip-one", action="store_true", help="only the 2-rank run")
    args = ap.parse_args()
    from fp8lab.dist.comm import GRAD_COMMS, bytes_per_rank
    from fp8lab.lab.gpt import GPT, GPTConfig

    print(
        f"recipe {args.recipe}, global batch {args.batch} x 128 tokens, 1 thread per rank, "
        f"unbatched={args.unbatched} fsdp={args.fsdp} fp8_allgather={args.fp8_allgather}"
    )
    one = None if args.skip_one else _throughput(1, args)
    two = _throughput(2, args)
    print("| ranks | tokens/s | vs 1 rank |\n|---|---|---|")
    if one is not None:
        print(f"| 1 | {one:,.0f} | 1.00x |")
    print(f"| 2 | {two:,.0f} | {'-' if one is None else f'{two / one:.2f}x'} |")
    numel = GPT(GPTConfig()).num_params()
    bucket = DDP_BUCKET_BYTES // 4
    print(f"\ngradient bytes one rank sends per step ({numel:,} parameters, 25 MiB buckets)")
    print("| grad-comm | " + " | ".join(f"N={n}" for n in (2, 4, 8, 16)) + " |")
    print("|---|" + "---|" * 4)
    for p in GRAD_COMMS:
        cells = [f"{bytes_per_rank(numel, n, p, bucket) / 2**20:.2f} MiB" for n in (2, 4, 8, 16)]
        print(f"| {p} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

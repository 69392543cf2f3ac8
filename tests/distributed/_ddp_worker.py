"""One rank of the 2-process gloo tests (run as a script by tests/distributed/test_*_dist.py).

argv: rank world port out_file modes [steps]; modes is a comma list, each mode's results keyed
``mode:key``. world == 1 runs without torch.distributed (the one-rank references on the same
global batch). Writes a dict of tensors with torch.save.
"""

from __future__ import annotations

import os
import sys

import torch


def main() -> None:
    rank, world, port, out, modes = (
        int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5],
    )  # fmt: skip
    steps = int(sys.argv[6]) if len(sys.argv) > 6 else 3
    torch.set_num_threads(1)
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    result: dict[str, object] = {}
    for mode in modes.split(","):  # several modes share one launch (process start-up is slow)
        if mode == "fsdp":  # FP8 all-gather as a function, under fully_shard, --grad-comm hook
            part = {**fsdp_gather(rank, world), **fully_shard_gather(rank, world),
                    **grad_comm(rank)}  # fmt: skip
        else:
            part = train(mode, rank, world, steps)
        result.update({f"{mode}:{k}": v for k, v in part.items()})
    torch.save(result, out)
    if world > 1:
        torch.distributed.destroy_process_group()


def train(mode: str, rank: int, world: int, steps: int) -> dict[str, object]:
    """A few SGD steps of a tiny GPT on a fixed global batch split over the ranks.

    modes: world | none | unbatched (world, one all-reduce per state and update) under
    te-delayed (on one rank: the reference); under te-current: fsdp8 (FSDP2 with the FP8
    all-gather), fsdp32 (FSDP2 gathering fp32) and ddp8 (DDP); under te-delayed: fsdp8d and
    fsdp8du (FSDP2 with the FP8 all-gather, amax all-reduces batched / one per state and update),
    whose reference is world; under hif8-delayed (first step current-scaled, interval 5):
    fsdp8h and ddph."""
    from fp8lab.distributed.amax import assert_identical_scales, delayed_states, scale_spread
    from fp8lab.distributed.data import gather_token_losses, global_token_loss, shard_batch
    from fp8lab.distributed.ddp import DataParallel
    from fp8lab.lab.gpt import GPT, GPTConfig
    from fp8lab.nn import convert

    recipe = "te-current" if mode in ("fsdp8", "fsdp32", "ddp8") else "te-delayed"
    recipe = "hif8-delayed" if mode in ("fsdp8h", "ddph") else recipe
    fsdp_modes = ("fsdp8", "fsdp32", "fsdp8d", "fsdp8du", "fsdp8h")
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, d_model=64, n_head=2, d_ff=128, block_size=16))
    convert(model, recipe)
    dp = None
    if world > 1 and mode in fsdp_modes:
        dp = DataParallel(model, "world", fsdp=True, fp8_allgather=mode != "fsdp32",
                          batch_amax=mode != "fsdp8du")  # fmt: skip
    elif world > 1 and mode in ("ddp8", "ddph"):
        dp = DataParallel(model, "world")
    elif world > 1:
        dp = DataParallel(model, "world" if mode == "unbatched" else mode,
                          batch_amax=mode != "unbatched")  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(1)
    result: dict[str, object] = {"names": list(delayed_states(model))}
    seen = _watch_gathered(model) if mode in fsdp_modes and world > 1 else None
    max_reduces = _count_max_all_reduces() if world > 1 else None
    for step in range(steps):
        if max_reduces is not None:
            max_reduces[0] = 0
        x = torch.randint(0, 256, (4, 16), generator=gen)
        y = torch.randint(0, 256, (4, 16), generator=gen)
        xs, ys = shard_batch(x, y, rank, world)
        if dp is None:
            logits, _ = model(xs)
            loss, per_token = global_token_loss(logits, ys, y.numel())
        else:
            loss, total, per_token = dp.loss(xs, ys)
            result[f"loss{step}"] = torch.tensor(total)
        if seen is not None:  # after the forward, before the backward: resharded (FSDP2)
            result[f"fwd_unsharded{step}"] = torch.tensor(_unsharded(model))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if max_reduces is not None:  # amax all-reduces (MAX) this rank issued in the step
            result[f"max_reduces{step}"] = torch.tensor(max_reduces[0])
        if seen is not None:  # between steps: what was gathered for this step is gone
            result[f"gathered{step}"] = torch.tensor(len(seen))
            result[f"alive{step}"] = torch.tensor(_alive(seen, model))
            seen.clear()
        if world > 1:
            per_token = gather_token_losses(per_token)
            if mode in ("world", "unbatched", "fsdp8d", "fsdp8du", "fsdp8h", "ddph"):
                assert_identical_scales(model)  # raises naming the state otherwise
            result[f"spread{step}"] = torch.tensor(list(scale_spread(model).values()))
        result[f"tokens{step}"] = per_token
        scales = [ds.scale for ds in delayed_states(model).values()]
        result[f"scales{step}"] = torch.stack(scales) if scales else torch.zeros(0)
        hists = [ds.amax_history for ds in delayed_states(model).values()]
        result[f"hist{step}"] = torch.stack(hists) if hists else torch.zeros(0)
    if world > 1:  # the trained weights, whole (FSDP: every rank's rows gathered)
        from fp8lab.distributed.ddp import _full

        full = _full(dict(model.named_parameters()))
        result["weights"] = torch.cat([full[k].detach().reshape(-1) for k in sorted(full)])
    if dp is not None and dp.amax is not None:
        result["amax_flushes"] = torch.tensor(dp.amax.flushes)
    if world > 1 and mode == "none":
        from fp8lab.distributed.runtime import agree_any, gather_scaling_states

        result["agree"] = torch.tensor([agree_any(rank == 1), agree_any(False)])
        states = gather_scaling_states(model)
        result["states_ranks"] = torch.tensor(len(states))
        result["states_scale_r1"] = torch.stack([v["scale"] for v in states[1].values()])
        result["state"] = torch.tensor(dp.state()["scale_spread_binades"])
    return result


def _count_max_all_reduces() -> list[int]:
    """Count the all-reduces with op MAX (amaxes) from now on: [count], reset by the caller."""
    d = torch.distributed
    plain, count = d.all_reduce, [0]

    def counted(tensor, op=d.ReduceOp.SUM, group=None, async_op=False):  # type: ignore[no-untyped-def]
        count[0] += int(op == d.ReduceOp.MAX)
        return plain(tensor, op=op, group=group, async_op=async_op)

    d.all_reduce = counted
    return count


def _watch_gathered(model: torch.nn.Module) -> list:
    """Weak references to the storage of every fp8lab Linear's unsharded weight (float32) and of
    its gathered codes as the forward sees them (FSDP2: full-size tensors)."""
    import weakref

    from fp8lab.nn import Linear

    seen: list = []

    def watch(module: torch.nn.Module, args: object) -> None:
        seen.append(weakref.ref(module.weight.untyped_storage()))
        gathered = module.gathered_weight
        if gathered is not None:
            seen.append(weakref.ref(gathered.qtensor.values.untyped_storage()))

    for m in model.modules():
        if isinstance(m, Linear):
            m.register_forward_pre_hook(watch)  # after shard_model's hook: the gathered weight
    return seen


def _unsharded(model: torch.nn.Module) -> int:
    """How many fp8lab Linear weights FSDP holds unsharded (their gathered data allocated)."""
    from torch.distributed.fsdp import FSDPModule

    from fp8lab.distributed.fsdp import _fsdp_params
    from fp8lab.nn import Linear

    n = 0
    for m in model.modules():
        if isinstance(m, FSDPModule):
            for fp in _fsdp_params(m):
                p = getattr(fp, "_unsharded_param", None)
                mine = isinstance(fp._module_info.module, Linear)
                n += int(mine and p is not None and p.untyped_storage().nbytes() > 0)
    return n


def _alive(seen: list, model: torch.nn.Module) -> int:
    """How many watched full-size storages are still allocated, plus FSDP unsharded parameters
    of fp8lab Linears still holding data (both 0 when FSDP freed everything it gathered)."""
    import gc

    from torch.distributed.fsdp import FSDPModule

    from fp8lab.distributed.fsdp import _fsdp_params

    gc.collect()
    n = sum(1 for r in seen if r() is not None and r().nbytes() > 0)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            for fp in _fsdp_params(m):
                p = getattr(fp, "_unsharded_param", None)
                n += int(p is not None and p.untyped_storage().nbytes() > 0)
                n += int(getattr(fp._module_info.module, "gathered_weight", None) is not None)
    return n


def grad_comm(rank: int) -> dict[str, object]:
    """DDP with GradCommHook: the gradient equals ring_allreduce of the ranks' local gradients."""
    import copy

    from fp8lab.distributed.comm import GRAD_COMMS, ring_allreduce
    from fp8lab.distributed.hooks import GradCommHook

    result: dict[str, object] = {}
    for p in GRAD_COMMS:
        torch.manual_seed(0)
        lin = torch.nn.Linear(5, 8, bias=False)
        local = copy.deepcopy(lin)
        x = torch.randn(3, 5, generator=torch.Generator().manual_seed(10 + rank)) * 4.0**rank
        local(x).square().sum().backward()
        grads = [torch.empty_like(local.weight.grad) for _ in range(2)]
        torch.distributed.all_gather(grads, local.weight.grad)
        want = ring_allreduce(torch.stack(grads).reshape(2, -1), p).out.reshape(8, 5)
        ddp = torch.nn.parallel.DistributedDataParallel(lin)
        hook = GradCommHook(p).register(ddp)
        ddp(x).square().sum().backward()
        result[f"comm:{p}"] = torch.tensor(
            bool(torch.equal(lin.weight.grad.view(torch.int32), want.view(torch.int32)))
        )
        result[f"comm:{p}:err"] = torch.tensor(hook.rel_error())
        result[f"comm:{p}:bytes"] = torch.tensor(hook.bytes_sent)
    return result


def fsdp_gather(rank: int, world: int) -> dict[str, object]:
    """FP8 all-gather of every Linear weight of the default lab GPT vs unsharded quantization."""
    from fp8lab.distributed.fsdp import fp8_all_gather, shard_rows
    from fp8lab.lab.gpt import GPT, GPTConfig
    from fp8lab.qtensor import quantize
    from fp8lab.recipe import get_recipe

    torch.manual_seed(0)
    model = GPT(GPTConfig())
    result: dict[str, object] = {}
    for preset in ("te-current", "deepseek-v3", "mxfp8"):
        spec = get_recipe(preset).spec("fprop", "weight")
        same = []
        for name, mod in model.named_modules():
            if isinstance(mod, torch.nn.Linear):
                w = mod.weight.detach()
                got = fp8_all_gather(shard_rows(w, rank, world), spec, w.shape[0])
                want = quantize(w, spec).dequantize()
                same.append(bool(torch.equal(got.view(torch.int32), want.view(torch.int32))))
                result[f"{preset}:{name}"] = torch.tensor(same[-1])
        result[f"{preset}:count"] = torch.tensor(len(same))
    result.update(_delayed_gather(model, rank, world))
    return result


def _delayed_gather(model: torch.nn.Module, rank: int, world: int) -> dict[str, object]:
    """fp8_all_gather under a bound DelayedScaling (te-delayed with a scale from a history,
    hif8-delayed's current-scaled first step) vs quantizing the unsharded weight with an equal
    state: bit for bit; the gather's state observed this rank's shard amax."""
    from fp8lab.distributed.fsdp import fp8_all_gather, shard_rows
    from fp8lab.qtensor import quantize
    from fp8lab.recipe import get_recipe
    from fp8lab.scaling.delayed import DelayedScaling

    result: dict[str, object] = {}
    for preset in ("te-delayed", "hif8-delayed"):
        spec = get_recipe(preset).spec("fprop", "weight")
        same = []
        for mod in model.modules():
            if isinstance(mod, torch.nn.Linear):
                w = mod.weight.detach()
                mine, ref = (DelayedScaling.bind(spec.scaling, spec.format) for _ in range(2))
                if preset == "te-delayed":  # a history: scale 448 / 0.37, not 1
                    state = {**mine.state_dict(), "scale": torch.tensor(448 / 0.37)}
                    mine.load_state_dict(state)
                    ref.load_state_dict(state)
                shard = shard_rows(w, rank, world)
                got = fp8_all_gather(shard, spec, w.shape[0], state=mine)
                want = quantize(w, spec, state=ref).dequantize()
                observed = mine.amax_history[0]
                same.append(bool(torch.equal(got.view(torch.int32), want.view(torch.int32)))
                            and bool(observed == shard.abs().amax()))  # fmt: skip
        result[f"{preset}:delayed"] = torch.tensor(all(same) and len(same) >= 9)
    # a NaN in rank 0's shard: the amax ignores it, as the unsharded quantize's does (TE)
    w = torch.arange(24.0).reshape(6, 4) / 7
    w[0, 1] = float("nan")
    same = []
    for preset in ("te-current", "te-delayed", "hif8-delayed"):
        spec = get_recipe(preset).spec("fprop", "weight")
        mine, ref = (
            (DelayedScaling.bind(spec.scaling, spec.format) for _ in range(2))
            if spec.is_delayed
            else (None, None)
        )
        got = fp8_all_gather(shard_rows(w, rank, world), spec, 6, state=mine)
        want = quantize(w, spec, state=ref).dequantize()
        same.append(bool(torch.equal(got.view(torch.int32), want.view(torch.int32))))
        if mine is not None:  # the observed amax: the shard's largest non-NaN magnitude
            want_amax = shard_rows(w, rank, world).nan_to_num(0.0).abs().amax()
            same.append(bool(mine.amax_history[0] == want_amax))
    result["nan_shard"] = torch.tensor(same)
    return result


def fully_shard_gather(rank: int, world: int) -> dict[str, object]:
    """FSDP2 fully_shard of the default lab GPT with the FP8 all-gather: after unsharding, every
    Linear's gathered QTensor vs the unsharded quantization of the same weight, bit for bit."""
    from torch.distributed.fsdp import FSDPModule

    from fp8lab.distributed.fsdp import shard_model
    from fp8lab.lab.gpt import GPT, GPTConfig
    from fp8lab.nn import Linear, convert
    from fp8lab.qtensor import quantize

    result: dict[str, object] = {}
    for preset in ("te-current", "deepseek-v3", "mxfp8"):
        torch.manual_seed(0)
        model = GPT(GPTConfig())
        convert(model, preset)
        full = {n: m.weight.detach().clone() for n, m in model.named_modules()
                if isinstance(m, Linear)}  # fmt: skip
        shard_model(model, fp8_allgather=True)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.unshard()  # runs the pre/post all-gather hooks
        same = []
        for name, m in model.named_modules():
            if name not in full:
                continue
            spec, got = m.gathered_weight.spec, m.gathered_weight.qtensor
            want = quantize(full[name], spec)
            same.append(
                torch.equal(got.values, want.values)
                and torch.equal(got.scales.view(torch.int32), want.scales.view(torch.int32))
                and torch.equal(got.dequantize().view(torch.int32),
                                want.dequantize().view(torch.int32))
            )  # fmt: skip
            result[f"fs:{preset}:{name}"] = torch.tensor(same[-1])
        result[f"fs:{preset}:count"] = torch.tensor(len(same))
        for m in model.modules():  # FSDP frees the all-gather outputs (storage resized to 0):
            if isinstance(m, FSDPModule):  # the hooks must leave them resizable
                m.reshard()
    return result


if __name__ == "__main__":
    main()

"""Study: optimizer-state precision on the lab's GPT (README "Optimizer states").

1. Trains a small lab GPT under the ``bf16`` recipe with fp32 moments, then quantizes the final
   AdamW moments per 128-value block to E4M3/E5M2 without and with COAT's dynamic range expansion
   (arXiv 2410.19313 Table 1 reports the same comparison as the MSE of m/sqrt(v)), printing each
   moment's relative mean squared error and that of m/sqrt(v).
2. Trains the same model for ``--steps`` steps under each state precision and prints the final
   validation loss and its gap to fp32 moments.

Usage: python benchmarks/study_optimizer_states.py [--steps 400] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import torch

import fp8lab
from fp8lab.lab.data import DataConfig, load_corpus
from fp8lab.lab.gpt import GPTConfig
from fp8lab.lab.train import LabConfig, TrainConfig, train_run
from fp8lab.optim._storage import store_, store_expanded_

TEXT = Path(__file__).resolve().parent.parent / "README.md"


def _rel_mse(q: torch.Tensor, x: torch.Tensor) -> float:
    return float((q - x).double().pow(2).sum() / x.double().pow(2).sum())


def moment_errors(opt_state: dict) -> list[dict]:
    ms = torch.cat([s["exp_avg"].reshape(-1) for s in opt_state.values()])
    vs = torch.cat([s["exp_avg_sq"].reshape(-1) for s in opt_state.values()])
    eps = 1e-8
    ref = ms / (vs.sqrt() + eps)
    rows = []
    for fmt in ("e4m3", "e5m2"):
        for expand in (False, True):
            store = store_expanded_ if expand else store_
            qm = store(torch.empty_like(ms), ms, fmt)
            qv = store(torch.empty_like(vs), vs, fmt)
            rows.append({
                "format": fmt, "expansion": expand,
                "rel_mse_m": _rel_mse(qm, ms), "rel_mse_v": _rel_mse(qv, vs),
                "rel_mse_m_over_sqrt_v": _rel_mse(qm / (qv.sqrt() + eps), ref),
            })  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="No --torch-device: the study is sized for a 2-core CPU and its table is "
        "measured there.",
    )
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    corpus = load_corpus(DataConfig(paths=(str(TEXT),), split_chunk=512), block_size=32)
    cfg = LabConfig(
        model=GPTConfig(block_size=32, n_layer=1, n_head=2, d_model=32, d_ff=96),
        train=TrainConfig(steps=args.steps, batch_size=4, lr=3e-3, warmup_steps=20,
                          eval_every=args.steps, eval_batches=4, stats_every=0,
                          checkpoint_every=args.steps),
    )  # fmt: skip
    base = fp8lab.get_recipe("bf16")
    out = args.out or Path(tempfile.mkdtemp())
    runs = {
        "fp32": {}, "bf16": {"optimizer_state": "bf16"}, "fp16": {"optimizer_state": "fp16"},
        "fp8 (e4m3)": {"optimizer_state": "fp8"},
        "fp8 + expansion": {"optimizer_state": "fp8", "moment_expansion": True},
        "m fp8, v bf16": {"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "bf16"},
    }  # fmt: skip
    results = {}
    for name, kw in runs.items():
        t = time.time()
        d = out / name.replace(" ", "_").replace(",", "").replace("(", "").replace(")", "")
        r = train_run(base.replace(**kw), cfg, corpus, d)
        results[name] = {"val_loss": r.summary["final_val_loss"], "seconds": time.time() - t}
        print(name, results[name], flush=True)
        if name == "fp32":
            ck = torch.load(d / "checkpoint.pt", weights_only=False)
            errors = moment_errors(ck["optimizer"]["state"])
            for row in errors:
                print(row, flush=True)
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((ln.split(":", 1)[1].strip() for ln in cpu.splitlines()
                  if ln.startswith("Model name")), platform.processor())  # fmt: skip
    print(json.dumps({"machine": model, "date": time.strftime("%Y-%m-%d"),
                      "moment_errors": errors, "runs": results}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()

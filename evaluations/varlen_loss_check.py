"""Static against dynamic context parallelism on packed documents: the loss curves side by
side over N steps, from the same seed and data.

    python -m gridwright.evaluations.varlen_loss_check [--steps 50] [--gpus 2]

Runs the bench model on `--gpus` GPUs, one layout after another, on the varlen suite's data
(rows of 32k tokens, the long-tailed document mix of `bench_gpu --suite varlen_2gpu`):
static CP over every GPU, then dynamic CP under Megatron-Core's and gridwright's
schedulers. The mathematics is the same for every layout (per-token loss over the same
documents); only the bf16 rounding differs (summation order, CP's split of attention), so
the curves should agree to bf16 noise. The table gives the loss every fifth step, the
largest difference from static CP, and tokens/s/GPU.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from gridwright.evaluations.bench_gpu import COMMON, VARLEN_BASE, device_overrides
from gridwright.evaluations.results_file import card_of_this_machine, write_markdown
from gridwright.runtime.jobdir import read_metrics

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--gpus", type=int, choices=(2, 4), default=2)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", REPO / "evaluations" / "results")))
    args = ap.parse_args()
    n = args.gpus
    base = VARLEN_BASE + [f"cluster=h100_x{n}", f"train.global_batch_size={2 * n}", f"train.steps={args.steps}"]
    dynamic = ["parallel.cp_mode=dynamic", f"parallel.max_seqlen_per_rank={32768 // n}"]
    layouts = {
        f"static CP={n}": [f"parallel.cp={n}"],
        "dynamic, megatron": dynamic + ["parallel.cp_scheduler=megatron"],
        "dynamic, gridwright": dynamic + ["parallel.cp_scheduler=gridwright"],
    }
    jobs = Path(tempfile.mkdtemp(prefix="varlen_loss_"))
    curves, speed = {}, {}
    for i, (name, overrides) in enumerate(layouts.items()):
        job = jobs / f"layout{i}"
        cmd = [sys.executable, "-m", "gridwright", *COMMON, *base, *overrides, *device_overrides(), f"job_dir={job}"]
        print("+", " ".join(cmd), flush=True)
        proc = subprocess.run(cmd, text=True, capture_output=True)
        if proc.returncode:
            print(proc.stdout[-2000:], proc.stderr[-3000:], flush=True)
            continue
        history = read_metrics(job)
        curves[name] = [h["loss"] for h in history]
        speed[name] = sum(h["tokens_per_s_per_gpu"] for h in history[1:]) / max(1, len(history) - 1)
        write_table(args, n, curves, speed)  # after every layout: a cut-short call keeps the rest


def write_table(args, n: int, curves: dict, speed: dict) -> None:
    import torch

    reference = curves.get(f"static CP={n}")
    marks = list(range(0, args.steps, 5)) + [args.steps - 1]
    lines = [f"GPU: {n} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}; bench model, rows of 32k, "
             f"{2 * n} rows a step, {args.steps} steps", "",
             "| layout | tokens/s/GPU | " + " | ".join(f"loss @{s}" for s in marks)
             + " | largest difference from static CP (relative) |", "| --- " * (len(marks) + 3) + "|"]
    for name, curve in curves.items():
        diff = (max(abs(a - b) / abs(b) for a, b in zip(curve, reference)) if reference and name in curves
                else None)
        lines.append(f"| {name} | {speed[name]:,.0f} | " + " | ".join(f"{curve[s]:.4f}" for s in marks)
                     + f" | {'' if diff is None else f'{diff:.2e}'} |")
    text = "\n".join(lines)
    print(text, flush=True)
    write_markdown(args.out, "varlen_loss_check", card_of_this_machine(), "python -m gridwright.evaluations."
                   "varlen_loss_check " + " ".join(sys.argv[1:]), text)


if __name__ == "__main__":
    main()

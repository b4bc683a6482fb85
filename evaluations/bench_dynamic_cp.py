"""Megatron-Core's balanced CP scheduler at scale, simulated (no GPUs): the balance it
reaches and the time it takes to schedule one global batch, by number of DP ranks.

    python -m gridwright.evaluations.bench_dynamic_cp [--ranks 4 64 1024 16384] [--limit-s 300]

Each rank gets `--tokens-per-rank` tokens of documents a global batch (rows of
`--row` tokens, packed as the synthetic long-tailed stream packs them: lognormal lengths,
median 1k, sigma 1.5, capped at the row); documents longer than `--max-seqlen-per-rank`
get CP 2, 4, ... This is the scheduler `dynamic_cp` calls on every rank each step, so its
time is host time every step pays. A size that does not finish within `--limit-s` is
reported as such (the scheduler is Python, with loops over every rank per document).

Both schedulers of `cp_schedulers` run on the same documents. Balance: per rank the
training FLOPs of its documents (bench_1b's, each divided by its CP size), max over mean
(1.00 is perfect); groups: barriers per step plus one; aligned: every document on a
Megatron-Core hybrid group (ranks [j·k, (j+1)·k)).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

from gridwright.evaluations.results_file import write_markdown


def _simulate(name: str, ranks: int, args, queue) -> None:
    from gridwright.data.packing import document_lengths, histogram
    from gridwright.engines.cp_schedulers import aligned, make_scheduler
    from gridwright.engines.dynamic_cp import document_cost
    from gridwright.config.compose import compose_config

    import numpy as np

    lengths_cfg = OmegaConf.create({"distribution": "lognormal", "median": 1024, "sigma": 1.5, "min": 8,
                                    "cap": args.row})
    rows = ranks * args.tokens_per_rank // args.row
    lengths = [n for i in range(rows)
               for n in document_lengths(np.random.default_rng([args.seed, i]), lengths_cfg, args.row)]
    bench = compose_config(["model=bench_1b"])
    cost = document_cost(bench.model, bench.evaluate)
    scheduler = make_scheduler(name, args.max_seqlen_per_rank, ranks, cost)
    started = time.perf_counter()
    plan = scheduler.schedule(lengths)
    seconds = time.perf_counter() - started
    queue.put({
        "scheduler": name, "ranks": ranks, "documents": len(lengths), "tokens": sum(lengths), "schedule_s": seconds,
        "imbalance": plan.imbalance, "groups": len(plan.work), "aligned": aligned(plan.work, plan.cp_size),
        "cp_sizes": histogram(plan.cp_size.values()),
    })


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[4, 64, 1024, 16384])
    ap.add_argument("--tokens-per-rank", type=int, default=65536)
    ap.add_argument("--row", type=int, default=32768)
    ap.add_argument("--max-seqlen-per-rank", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--schedulers", nargs="+", default=["megatron", "gridwright"])
    ap.add_argument("--limit-s", type=float, default=300.0, help="give up on a size after this long")
    ap.add_argument("--out", type=Path, help="also write the table into this folder (bench_dynamic_cp_cpu.md, replacing the last call's)")
    args = ap.parse_args()
    head = ("| scheduler | DP ranks | documents | tokens | schedule s | imbalance (max/mean) | groups | aligned "
            "| documents by CP size |")
    lines = [head, "| --- " * 9 + "|"]
    print("\n".join(lines), flush=True)
    for name, ranks in ((name, ranks) for ranks in args.ranks for name in args.schedulers):
        queue = mp.get_context("fork").Queue()
        proc = mp.get_context("fork").Process(target=_simulate, args=(name, ranks, args, queue))
        proc.start()
        proc.join(args.limit_s)
        if proc.is_alive():
            proc.terminate()
            proc.join()
            line = f"| {name} | {ranks:,} | | | > {args.limit_s:.0f} (stopped) | | | | |"
        else:
            r = queue.get()
            sizes = ", ".join(f"CP{k}: {n:,}" for k, n in r["cp_sizes"].items())
            line = (f"| {name} | {ranks:,} | {r['documents']:,} | {r['tokens']:,} | {r['schedule_s']:.3f} | {r['imbalance']:.3f} "
                    f"| {r['groups']} | {'yes' if r['aligned'] else 'no'} | {sizes} |")
        lines.append(line)
        print(line, flush=True)
    if args.out:
        text = (f"{args.tokens_per_rank:,} tokens per rank a step, rows of {args.row:,}, lognormal lengths "
                f"(median 1,024, sigma 1.5), max_seqlen_per_rank {args.max_seqlen_per_rank:,}; one process of this "
                "machine.\n\n" + "\n".join(lines))
        write_markdown(args.out, "bench_dynamic_cp", "cpu", "python -m gridwright.evaluations.bench_dynamic_cp "
                       + " ".join(sys.argv[1:]), text)


if __name__ == "__main__":
    main()

"""Two checks that the trace analysis measures what it claims, on 2 GPUs.

    python -m gridwright.evaluations.validate_trace_analysis [--engine megatron|deepspeed] [--out DIR] [--jobs DIR]

1. Closure: on every rank and traced step, compute + exposed communication + idle equals
   the step timer's time within 5 %.
2. A/B: DP=2 with gradient-reduce/parameter-gather overlap off, then on, in a shape where
   communication is a large share of the step (one micro-batch per step, so the whole
   gradient is reduced every step, and NCCL held to one channel). The change in exposed
   communication must agree with the change in step time within 20 %. `--engine megatron`
   (the default) switches Megatron-Core DDP's overlap_grad_reduce and overlap_param_gather;
   `--engine deepspeed` runs ZeRO-2 and switches DeepSpeed's `zero.overlap_comm` (its
   gradient reduction on a side stream during the backward).
Both runs are real `launch.py` runs with `evaluate.profile_steps`; results go to
`--out` (a markdown table and the JSON), with the card named.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from gridwright.evaluations.results_file import card_of_this_machine, write_json, write_markdown

REPO = Path(__file__).resolve().parents[1]
AB_BASE = ["tracking=off", "+bench=eval_dp2", "train.global_batch_size=4", "train.steps=12",
           "evaluate.profile_steps=[8,12]"]
# engine -> (overrides added to AB_BASE, the overrides that switch overlap off or on)
MODES = {
    "megatron": ([], lambda flag: [f"engine.overlap_grad_reduce={flag}", f"engine.overlap_param_gather={flag}"]),
    "deepspeed": (["engine=deepspeed", "zero=stage2"], lambda flag: [f"zero.overlap_comm={flag}"]),
}


def run_case(name: str, overlap: bool, jobs: Path, card: list[str], engine: str = "megatron") -> Path:
    job = jobs / name
    flag = str(overlap).lower()
    extra, switch = MODES[engine]
    cmd = [sys.executable, "-m", "gridwright", *AB_BASE, *extra, *card, *switch(flag), f"job_dir={job}",
           f"name=ab_{engine}_overlap_{flag}"]
    env = dict(os.environ, NCCL_MAX_NCHANNELS="1", NCCL_MIN_NCHANNELS="1")
    print("+ NCCL_MAX_NCHANNELS=1", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, env=env, text=True, capture_output=True)
    print(proc.stdout[-3000:], proc.stderr[-3000:] if proc.returncode else "", flush=True)
    if proc.returncode:
        raise SystemExit(f"{name} failed with exit code {proc.returncode}")
    return job


def closure(doc: dict) -> float:
    return max(rec["closure_error"] for steps in doc["ranks"].values() for rec in steps.values())


def mean_over(doc: dict, key: str) -> float:
    recs = [rec for steps in doc["ranks"].values() for rec in steps.values()]
    return sum(r[key] for r in recs) / len(recs)


def main() -> None:
    import torch

    from gridwright.evaluations.bench_gpu import device_overrides
    from gridwright.analysis.trace_analysis import analyze

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", REPO / "evaluations" / "results")))
    ap.add_argument("--jobs", type=Path, default=None)
    ap.add_argument("--engine", choices=sorted(MODES), default="megatron", help="whose overlap switch the A/B flips")
    args = ap.parse_args()
    jobs = args.jobs or Path(tempfile.mkdtemp(prefix="validate_traces_"))
    card = device_overrides()
    docs = {}
    for overlap in (False, True):
        name = f"overlap_{'on' if overlap else 'off'}"
        docs[name] = analyze(run_case(name, overlap, jobs, card, args.engine))
    off, on = docs["overlap_off"], docs["overlap_on"]
    d_step = mean_over(off, "timer_step_s") - mean_over(on, "timer_step_s")
    d_exposed = mean_over(off, "exposed_comm_s") - mean_over(on, "exposed_comm_s")
    agreement = abs(d_exposed - d_step) / abs(d_step) if d_step else float("inf")
    rows = []
    for name, doc in docs.items():
        rows.append(f"| {name} | {mean_over(doc, 'timer_step_s') * 1e3:.1f} | {mean_over(doc, 'compute_s') * 1e3:.1f} | "
                    f"{mean_over(doc, 'exposed_comm_s') * 1e3:.1f} | {mean_over(doc, 'idle_s') * 1e3:.1f} | "
                    f"{mean_over(doc, 'overlap_pct'):.1f} % | {closure(doc):.2%} |")
    text = "\n".join([
        f"GPU: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}; "
        f"NCCL_MAX_NCHANNELS=1; `{' '.join(AB_BASE + MODES[args.engine][0])}`, overlap switched by "
        f"`{' '.join(MODES[args.engine][1]('off|on'))}`",
        "",
        "| case | step ms (timer) | compute ms | exposed comm ms | idle ms | overlap | max closure error |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        *rows,
        "",
        f"step time fell by {d_step * 1e3:.1f} ms; exposed communication fell by {d_exposed * 1e3:.1f} ms; "
        f"they differ by {agreement:.1%} of the step-time change (goal: within 20 %).",
        f"closure: the largest |compute + exposed + idle - timer| / timer over every rank and step is "
        f"{max(closure(off), closure(on)):.2%} (goal: within 5 %).",
    ])
    print(text)
    benchmark, here = f"validate_traces_{args.engine}", card_of_this_machine()
    write_markdown(args.out, benchmark, here, "python -m gridwright.evaluations.validate_trace_analysis --engine "
                   f"{args.engine}", text, title=f"Trace analysis validation ({args.engine})")
    write_json(args.out, benchmark, here,
               {"engine": args.engine, "d_step_s": d_step, "d_exposed_s": d_exposed, "agreement": agreement,
                "cases": {k: {"mean": v["mean"], "max_closure_error": closure(v)} for k, v in docs.items()}})


if __name__ == "__main__":
    main()

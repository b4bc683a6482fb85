"""Time of a whole plan command, as a user types it, and what it imports.

    python -m gridwright.evaluations.bench_plan [--repeats 5]

Each row runs `python launch.py ARGS` in a fresh process (interpreter start, Hydra
composition, validation, placement, the job directory and plan.json), `--repeats` times,
and reports the median and range of the wall time, and which heavy packages the process
imported (none: a plan never imports torch or Megatron-Core). `import torch` alone is
timed beside them: it is what a plan used to pay. Writes a table under evaluations/results/.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gridwright.evaluations.results_file import write_json, write_markdown

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "evaluations" / "results"
HEAVY = ("torch", "megatron", "deepspeed", "transformers", "mlflow")
GOAL_S = 2.0  # the goal: a plan of mixtral_ep8 in under 2 s on the 2-core development machine

CASES = [
    ["+experiment=mixtral_ep8", "launcher=plan"],
    ["+experiment=llama3_8b", "launcher=plan"],
    ["+experiment=llama3_70b"],  # writes the Slurm script
    ["+experiment=llama3_70b", "launcher=plan", "cluster.nodes=512", "train.global_batch_size=1024"],  # 4,096 GPUs
]

# launch.py's entry point, then the heavy packages the process imported.
PROBE = """
import json, sys
args = json.loads(sys.argv[1])
sys.argv = ["launch.py"] + args
from gridwright.cli import main
try:
    main()
except SystemExit as e:
    if e.code:
        raise
print("HEAVY=" + json.dumps(sorted({m.split(".")[0] for m in sys.modules} & set(%r))))
""" % (HEAVY,)


def time_command(cmd: list[str], cwd: Path) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{done.stderr[-2000:]}")
    return elapsed, done.stdout


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="gridwright-bench-plan-") as tmp:
        tmp = Path(tmp)
        for i, case in enumerate(CASES):
            base = [*case, f"job_root={tmp / f'jobs{i}'}"]
            times = [time_command([sys.executable, str(REPO / "launch.py"), *base], tmp)[0]
                     for _ in range(args.repeats)]
            _, out = time_command([sys.executable, "-c", PROBE, json.dumps(base)], tmp)
            heavy = json.loads(out.rsplit("HEAVY=", 1)[1].strip())
            rows.append({"command": "python launch.py " + " ".join(case), "median_s": statistics.median(times),
                         "min_s": min(times), "max_s": max(times), "heavy_imports": heavy})
        torch_times = [time_command([sys.executable, "-c", "import torch"], tmp)[0] for _ in range(args.repeats)]
    lines = [
        f"# Plan command time ({platform.node()}, {platform.processor() or platform.machine()}, "
        f"Python {platform.python_version()}, {args.repeats} runs each)",
        "",
        "| command | median s | min s | max s | heavy packages imported |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(f"| `{r['command']}` | {r['median_s']:.2f} | {r['min_s']:.2f} | {r['max_s']:.2f} | "
                     f"{', '.join(r['heavy_imports']) or 'none'} |")
    lines.append(f"| `python -c 'import torch'` (for scale) | {statistics.median(torch_times):.2f} | "
                 f"{min(torch_times):.2f} | {max(torch_times):.2f} | torch |")
    mixtral = rows[0]["median_s"]
    lines += ["", f"Goal: a plan of mixtral_ep8 in under {GOAL_S:g} s: {mixtral:.2f} s "
              f"({'met' if mixtral < GOAL_S else 'NOT met'})."]
    text = "\n".join(lines) + "\n"
    print(text)
    path = write_markdown(RESULTS, "bench_plan", "cpu", "python -m gridwright.evaluations.bench_plan "
                          + " ".join(sys.argv[1:]), text)
    write_json(RESULTS, "bench_plan", "cpu", {"rows": rows, "repeats": args.repeats, "import_torch_s": torch_times})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Shrink profiler traces to what `gridwright.analysis.trace_analysis` reads, for committed test data.

    python -m gridwright.evaluations.trim_traces JOB_DIR OUT_DIR

Keeps the GPU activity (kernels, copies, memsets), the step ranges, the host-side launch
calls (name, time and correlation id only: what the host-wait split reads) and the trace
header (distributedInfo, device properties); drops host-side operator events, which are
most of a trace's size. Also copies placement.json, metrics.jsonl and the step-timer files.
"""
from __future__ import annotations

import argparse
import gzip
import json
import shutil
from pathlib import Path

from gridwright.analysis.trace_analysis import GPU_CATEGORIES, LAUNCH_CATEGORIES

KEEP_CATEGORIES = {*GPU_CATEGORIES, "user_annotation", "gpu_user_annotation"}


def trim(src: Path, dst: Path) -> None:
    with gzip.open(src, "rt") as f:
        doc = json.load(f)
    kept = [e for e in doc["traceEvents"] if e.get("cat") in KEEP_CATEGORIES]
    kept += [{"ph": "X", "cat": e["cat"], "name": e["name"], "ts": e["ts"], "dur": e.get("dur", 0),
              "args": {"correlation": e["args"]["correlation"]}}
             for e in doc["traceEvents"]
             if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})]
    doc["traceEvents"] = kept
    with gzip.open(dst, "wt", compresslevel=9) as f:
        json.dump(doc, f, separators=(",", ":"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("job_dir", type=Path)
    ap.add_argument("out_dir", type=Path)
    args = ap.parse_args()
    (args.out_dir / "traces").mkdir(parents=True, exist_ok=True)
    for name in ("placement.json", "metrics.jsonl", "summary.json"):
        if (args.job_dir / name).exists():
            shutil.copy(args.job_dir / name, args.out_dir / name)
    for src in sorted((args.job_dir / "traces").iterdir()):
        if src.name.endswith(".json.gz"):
            trim(src, args.out_dir / "traces" / src.name)
        else:
            shutil.copy(src, args.out_dir / "traces" / src.name)


if __name__ == "__main__":
    main()

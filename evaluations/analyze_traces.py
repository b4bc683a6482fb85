"""Analyse a job's profiler traces: where each step's time went, per rank and group.

    python -m gridwright.evaluations.analyze_traces JOB_DIR [--json]

A run with `evaluate.profile_steps` does this itself at the end (communication.json);
this command re-runs it, e.g. on a job directory copied back from a cluster.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gridwright.basics.atomic_io import write_text_atomic
from gridwright.analysis.trace_analysis import COMMUNICATION_FILE, TraceError, analyze, format_report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("job_dir", type=Path)
    ap.add_argument("--json", action="store_true", help="print the whole record as JSON")
    args = ap.parse_args(argv)
    try:
        doc = analyze(args.job_dir)
    except TraceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    old = args.job_dir / COMMUNICATION_FILE
    if old.exists():  # keep the run's prediction, which needs its comm profile
        doc["predicted"] = json.loads(old.read_text()).get("predicted")
    write_text_atomic(old, json.dumps(doc, indent=1))
    print(json.dumps(doc, indent=1) if args.json else format_report(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Log job and sweep directories into MLflow afterwards: `python -m gridwright.tracking.sync PATH...`

For runs made where MLflow is not installed or was switched off (`tracking=off`, as on
the GPU machines). Each job directory has a stable id (`job.json`) and each sweep one
(`sweep.json`); a run carrying that id is never logged twice, so syncing again logs
only what is missing. A job directory becomes one run (params, the curves of
metrics.jsonl and the summary's headline metrics (gridwright.tracking.headline), its files
as artifacts, FINISHED when it left summary.json, else FAILED; its start and end times from
its own records); a sweep directory becomes a parent run with a
nested run per point and the comparison table and plots (gridwright.tracking.sweep_report).

The store: --tracking-uri, else MLFLOW_TRACKING_URI, else the job's own `tracking.uri`
(`sqlite:///mlflow.db` relative to the current directory by default).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from . import mlflow_runs as tracking
from ..runtime.jobdir import is_job_dir, is_sweep_dir, load_job_config
from .sweep import SweepRecord
from .store import absolute_uri

EXIT_BAD_INPUT = 2


def _store(uri_arg: str | None, configured: str) -> str:
    return absolute_uri(uri_arg or os.environ.get("MLFLOW_TRACKING_URI") or configured)


def sync_sweep(path: Path, uri_arg: str | None) -> None:
    record = SweepRecord.load(path)
    uri = _store(uri_arg, record.tracking["uri"])
    client = tracking.client_for(uri)
    exp_id = tracking.experiment_id(client, record.tracking["experiment"], uri)
    parent, created = tracking.log_sweep(client, exp_id, path, record)
    if created:
        print(f"logged {path}: sweep run {parent} with {created} new run(s) in {uri}")
    else:
        print(f"already logged: {parent}")
    print("\n".join(tracking.sweep_links(uri, parent)))


def sync_job(path: Path, uri_arg: str | None) -> None:
    cfg = load_job_config(path)
    uri = _store(uri_arg, cfg.tracking.uri)
    client = tracking.client_for(uri)
    exp_id = tracking.experiment_id(client, cfg.tracking.experiment, uri)
    run_id, created = tracking.log_job_dir(client, exp_id, path)
    print(f"logged {path}: run {run_id} in {uri}" if created else f"already logged: {run_id}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gridwright.tracking.sync", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", type=Path, metavar="PATH", help="job or sweep directories")
    parser.add_argument("--tracking-uri", default=None, help="MLflow store (default: see above)")
    args = parser.parse_args(argv)
    todo = []
    for path in args.paths:  # every path is checked before anything is logged
        path = path.resolve()
        if not path.exists():
            print(f"error: {path} does not exist; nothing was logged.", file=sys.stderr)
            return EXIT_BAD_INPUT
        if is_sweep_dir(path):
            todo.append((sync_sweep, path))
        elif is_job_dir(path):
            todo.append((sync_job, path))
        else:
            print(f"error: {path} is neither a job directory (config.yaml, placement.json) nor a sweep "
                  "directory (sweep.json); nothing was logged.", file=sys.stderr)
            return EXIT_BAD_INPUT
    for sync, path in todo:
        sync(path, args.tracking_uri)
    return 0


if __name__ == "__main__":
    from gridwright.basics.process_exit import exit_without_final_collection

    exit_without_final_collection(main())

"""Which process keeps a job's MLflow run open: `run_owner.json` in the job directory.

MLflow cannot tell a run whose process was killed from one still training: both stay
RUNNING. The process that opened the run (the local launcher, or on torchrun and Slurm
the logging rank) records itself here; whoever sees the job directory later (the agent at
its end, `gridwright.tracking.sync`, a re-run of the job) closes a RUNNING run whose owner is gone.
"""
from __future__ import annotations

import json
import socket
from pathlib import Path

import psutil

from ..basics.atomic_io import write_text_atomic
from ..runtime.jobdir import read_json

OWNER_FILE = "run_owner.json"


def claim(job_dir: Path, run_id: str) -> None:
    me = psutil.Process()
    write_text_atomic(Path(job_dir) / OWNER_FILE, json.dumps(
        {"run_id": run_id, "host": socket.gethostname(), "pid": me.pid, "started": me.create_time()}))


def owner(job_dir: Path) -> dict:
    """The recorded owner ({} when the run was never opened from this job directory)."""
    return read_json(Path(job_dir) / OWNER_FILE)


def owner_gone(record: dict) -> bool | None:
    """True when the owner process no longer runs; None when that cannot be told from
    here (it ran on another host)."""
    if record.get("host") != socket.gethostname():
        return None
    try:
        proc = psutil.Process(int(record["pid"]))
        return abs(proc.create_time() - float(record["started"])) > 1e-3 or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except (psutil.Error, KeyError, ValueError):
        return None

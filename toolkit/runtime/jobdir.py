"""The job directory: the composed config, the placement and everything a run writes.

A job directory is created once and never reused: an existing directory is an error,
so a second run can never overwrite the records of a first. Each gets a stable id
(`job.json`), by which MLflow finds its run again (`python -m gridwright.tracking.sync`).

A `-m` sweep gets one directory `job_root/sweeps/<experiment>/<time>-<id>/` (its record
is `sweep.json`, see gridwright.tracking.sweep); each point's job directory is `<num>-<slug>/` in it.

`logs/` holds what the processes of the job's latest run printed (gridwright.launchers.agent
writes it, on every launcher): `rank<N>.log`, rank N's stdout and stderr as they came,
tracebacks included; `node<K>.log`, node K's agent's own output; `rank<N>.error.json`,
torchrun's error file of a rank that raised; `node<K>.exits.json`, the exit codes torchrun saw
for node K's failed ranks; `torchrun/`, torchrun's own per-attempt copies
(`<run id>_<random>/attempt_<A>/<local rank>/stdout.log, stderr.log`), every attempt kept.
"""
from __future__ import annotations

import datetime
import json
import os
import secrets
import time
import uuid
from pathlib import Path
from typing import NamedTuple

from omegaconf import OmegaConf

from ..basics.atomic_io import write_text_atomic
from ..planning.layout import ParallelLayout
from ..planning.placement import Placement

CONFIG_FILE = "config.yaml"
PLACEMENT_JSON = "placement.json"
PLACEMENT_CSV = "placement.csv"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
RANKS_DIR = "ranks"
JOB_FILE = "job.json"  # the job's stable id and creation time
# job.json's keys for the job's MLflow run: tags and what its name adds (a sweep point's).
RUN_TAGS_KEY, RUN_NAME_SUFFIX_KEY = "mlflow_run_tags", "mlflow_run_name_suffix"
FAILURE_FILE = "failure.json"  # why the logging rank's training failed (the agent tags the run with it)
PLAN_FILE = "plan.json"  # FLOPs per token, peak, parameters, memory estimate (written at planning)
ADVICE_FILE = "advise.json"  # launcher=advise: the ranked layouts (gridwright.validation.layout_advice)
SWEEP_FILE = "sweep.json"
SWEEPS_DIR = "sweeps"
LOGS_DIR = "logs"  # every rank's console and each node agent's own output (see the module's docstring)
TORCHRUN_LOGS_DIR = "torchrun"  # in LOGS_DIR: torchrun's own per-attempt files


def rank_log(job_dir: Path, rank: int) -> Path:
    return Path(job_dir) / LOGS_DIR / f"rank{rank}.log"


def rank_error_file(job_dir: Path, rank: int) -> Path:
    return Path(job_dir) / LOGS_DIR / f"rank{rank}.error.json"


def node_log(job_dir: Path, node: int) -> Path:
    return Path(job_dir) / LOGS_DIR / f"node{node}.log"


def node_exits_file(job_dir: Path, node: int) -> Path:
    return Path(job_dir) / LOGS_DIR / f"node{node}.exits.json"


class SweepPoint(NamedTuple):
    """A point of a `-m` sweep: its job directory goes inside the sweep's directory."""

    sweep_dir: Path
    num: int


class JobDirExists(FileExistsError):
    pass


def _fresh_name() -> str:
    return f"{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def sweep_point_name(num: int, layout: ParallelLayout) -> str:
    return f"{num}-{layout.slug()}"


def planned_job_dir(cfg, point: SweepPoint | None = None) -> Path:
    """`job_dir` when given; else `<sweep dir>/<num>-<slug>` for a sweep point; else
    `job_root/<experiment>/<time>-<id>`."""
    if cfg.job_dir:
        return Path(cfg.job_dir).resolve()
    if point is not None:
        name = sweep_point_name(point.num, ParallelLayout.from_config(cfg))
        return (Path(point.sweep_dir) / name).resolve()
    return (Path(cfg.job_root) / cfg.name / _fresh_name()).resolve()


def create_sweep_dir(job_root: str, experiment: str) -> Path:
    """A new directory `job_root/sweeps/<experiment>/<time>-<id>/` for one `-m` sweep."""
    path = (Path(job_root) / SWEEPS_DIR / experiment / _fresh_name()).resolve()
    path.mkdir(parents=True)  # fails if it exists
    return path


def check_job_dir_free(path: Path) -> None:
    if path.exists():
        raise JobDirExists(
            f"job directory {path} already exists with another config; gridwright never overwrites a job "
            "(launched again with the same config, a local job resumes). Fix: choose another job_dir."
        )


def same_job(cfg, path: Path) -> bool:
    """Whether `path` is a job directory planned with exactly this config: launching it
    again is a re-run of that job (it resumes), not a new job."""
    try:
        return is_job_dir(path) and (Path(path) / CONFIG_FILE).read_text() == OmegaConf.to_yaml(cfg)
    except OSError:
        return False


def create_job_dir(cfg, placement: Placement, path: Path, point: SweepPoint | None = None,
                   run_tags: dict[str, str] | None = None, run_name_suffix: str = "") -> Path:
    """Create `path` (failing if it exists) and write the config and placement into it;
    `run_tags` and `run_name_suffix` are for the job's MLflow run (a sweep point's nest it
    under the sweep's run), which the node-0 agent opens."""
    check_job_dir_free(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkdir(path)  # atomic: fails if another process created it first
    write_text_atomic(path / CONFIG_FILE, OmegaConf.to_yaml(cfg))
    write_text_atomic(path / PLACEMENT_JSON, placement.to_json())
    write_text_atomic(path / PLACEMENT_CSV, placement.to_csv())
    _write_job_record(path, point, run_tags, run_name_suffix)
    return path


def _write_job_record(path: Path, point: SweepPoint | None = None, run_tags: dict | None = None,
                      run_name_suffix: str = "") -> dict:
    now = time.time()
    record = {
        "job_id": uuid.uuid4().hex,
        "created": datetime.datetime.fromtimestamp(now).isoformat(timespec="seconds"),
        "created_ms": int(now * 1000),
    }
    if point is not None:
        record["sweep_point"] = point.num
    if run_tags:
        record[RUN_TAGS_KEY] = dict(run_tags)
    if run_name_suffix:
        record[RUN_NAME_SUFFIX_KEY] = run_name_suffix
    write_text_atomic(path / JOB_FILE, json.dumps(record, indent=1))
    return record


def read_json(path: Path) -> dict:
    """A JSON object from a job's or sweep's file; {} when it is missing, unreadable or cut short."""
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def read_metrics(job_dir: Path) -> list[dict]:
    """metrics.jsonl's step records, without a line cut short by a killed run."""
    out = []
    try:
        lines = (Path(job_dir) / METRICS_FILE).read_text().splitlines()
    except FileNotFoundError:
        return out
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "step" in record:
            out.append(record)
    return out


def job_record(path: Path) -> dict:
    """The job's `job.json` (id and creation time); written now for a job directory that
    predates it, so that its id stays stable from here on."""
    try:
        return json.loads((Path(path) / JOB_FILE).read_text())
    except FileNotFoundError:
        return _write_job_record(Path(path))


def is_job_dir(path: Path) -> bool:
    return (Path(path) / CONFIG_FILE).is_file() and (Path(path) / PLACEMENT_JSON).is_file()


def is_sweep_dir(path: Path) -> bool:
    return (Path(path) / SWEEP_FILE).is_file()


def load_job_config(path: Path):
    """The typed config a job was planned with."""
    from ..config.compose import strip_hydra

    return strip_hydra(OmegaConf.load(Path(path) / CONFIG_FILE))

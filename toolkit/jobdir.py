"""The job directory: the composed config, the placement and everything a run writes.

A job directory is created once and never reused: an existing directory is an error,
so a second run can never overwrite the records of a first.
"""
from __future__ import annotations

import datetime
import os
import secrets
from pathlib import Path

from omegaconf import OmegaConf

from .atomic_io import write_text_atomic
from .placement import Placement

CONFIG_FILE = "config.yaml"
PLACEMENT_JSON = "placement.json"
PLACEMENT_CSV = "placement.csv"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
RANKS_DIR = "ranks"


class JobDirExists(FileExistsError):
    pass


def planned_job_dir(cfg) -> Path:
    if cfg.job_dir:
        return Path(cfg.job_dir).resolve()
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return (Path(cfg.job_root) / cfg.name / f"{stamp}-{secrets.token_hex(2)}").resolve()


def check_job_dir_free(path: Path) -> None:
    if path.exists():
        raise JobDirExists(
            f"job directory {path} already exists; gridwright never overwrites a job. "
            "Fix: choose another job_dir, or remove it yourself."
        )


def create_job_dir(cfg, placement: Placement, path: Path) -> Path:
    """Create `path` (failing if it exists) and write the config and placement into it."""
    check_job_dir_free(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkdir(path)  # atomic: fails if another process created it first
    write_text_atomic(path / CONFIG_FILE, OmegaConf.to_yaml(cfg))
    write_text_atomic(path / PLACEMENT_JSON, placement.to_json())
    write_text_atomic(path / PLACEMENT_CSV, placement.to_csv())
    return path


def load_job_config(path: Path):
    """The typed config a job was planned with."""
    from .compose import strip_hydra

    return strip_hydra(OmegaConf.load(Path(path) / CONFIG_FILE))

"""Shared helpers: compose configs, and run `launch.py` as a user would, in a subprocess."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def compose():
    from gridwright.compose import compose_config

    def _compose(*overrides):
        return compose_config(list(overrides))

    return _compose


def launch(args: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run `python launch.py ARGS` from `cwd`; output captured as text."""
    env = dict(os.environ)
    env.pop("MLFLOW_TRACKING_URI", None)
    env.pop("MLFLOW_RUN_ID", None)
    return subprocess.run(
        [sys.executable, str(REPO / "launch.py"), *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
    )


@pytest.fixture
def run_launch(tmp_path):
    """Launch with the job root and MLflow store inside this test's temporary directory."""

    def _run(*args, timeout=300):
        base = [f"job_root={tmp_path / 'jobs'}", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"]
        return launch(base + list(args), cwd=tmp_path, timeout=timeout)

    return _run


def only_job_dir(tmp_path: Path) -> Path:
    dirs = [p for p in (tmp_path / "jobs").glob("*/*") if p.is_dir()]
    assert len(dirs) == 1, dirs
    return dirs[0]

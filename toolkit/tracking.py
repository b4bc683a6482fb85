"""MLflow: every run is an MLflow run, in a local SQLite store unless told otherwise.

The launching process opens the run (params, tags, config and placement artifacts) and
hands its id to the workers through MLFLOW_RUN_ID; the one logging rank adds per-step
metrics. Jobs emitted for Slurm or multi-node torchrun have no launching process on the
cluster, so there the logging rank opens the run itself.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

from omegaconf import OmegaConf

from .jobdir import CONFIG_FILE, PLACEMENT_CSV, PLACEMENT_JSON

REPO_ROOT = Path(__file__).resolve().parents[1]


def tracking_uri(cfg) -> str:
    """MLFLOW_TRACKING_URI wins (a remote server); else the configured store, made absolute."""
    uri = os.environ.get("MLFLOW_TRACKING_URI") or cfg.tracking.uri
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri[len(prefix):].startswith("/"):
        uri = prefix + str(Path(uri[len(prefix):]).resolve())
    return uri


def _artifact_location(uri: str) -> str | None:
    """Keep artifacts beside a local SQLite store, not in whatever directory a worker runs in."""
    if uri.startswith("sqlite:///"):
        return (Path(uri[len("sqlite:///"):]).parent / "mlartifacts").resolve().as_uri()
    return None


def flatten(cfg) -> dict[str, str]:
    out = {}

    def walk(prefix, node):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out[prefix] = str(node)

    walk("", OmegaConf.to_container(cfg, resolve=True))
    return out


def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (sha + ("-dirty" if dirty else "")) if sha else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def open_run(cfg, job_dir: Path, layout) -> str:
    """Create the MLflow run of a job with its params, tags and artifacts; return its id."""
    import mlflow
    from mlflow.tracking import MlflowClient

    uri = tracking_uri(cfg)
    mlflow.set_tracking_uri(uri)
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    exp_id = exp.experiment_id if exp else client.create_experiment(
        cfg.tracking.experiment, artifact_location=_artifact_location(uri))
    tags = {
        "gridwright.experiment": cfg.name,
        "gridwright.engine": cfg.engine.name,
        "gridwright.layout": layout.describe(),
        "gridwright.world_size": str(layout.world_size),
        "gridwright.cluster": cfg.cluster.name,
        "gridwright.gpu": cfg.cluster.gpu.name,
        "gridwright.launcher": cfg.launcher.name,
        "gridwright.job_dir": str(job_dir),
        "mlflow.source.git.commit": git_commit(),
    }
    run = client.create_run(exp_id, run_name=job_dir.name, tags=tags)
    run_id = run.info.run_id
    from mlflow.entities import Param

    params = [Param(k, v[:6000]) for k, v in flatten(cfg).items()]
    for i in range(0, len(params), 100):
        client.log_batch(run_id, params=params[i:i + 100])
    for name in (CONFIG_FILE, PLACEMENT_JSON, PLACEMENT_CSV):
        client.log_artifact(run_id, str(job_dir / name))
    return run_id


class MetricsLogger:
    """Logs one step's metrics to an open MLflow run (used by the logging rank)."""

    def __init__(self, cfg, run_id: str):
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri(cfg))
        self.run_id = run_id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items() if v == v]  # drop NaN
        self.client.log_batch(self.run_id, metrics=batch)

    def log_artifact(self, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def set_tag(self, key: str, value: str) -> None:
        self.client.set_tag(self.run_id, key, value)


def close_run(cfg, run_id: str, ok: bool) -> None:
    from mlflow.tracking import MlflowClient

    MlflowClient(tracking_uri(cfg)).set_terminated(run_id, status="FINISHED" if ok else "FAILED")

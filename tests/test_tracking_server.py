"""A remote MLflow tracking server, reached through MLflow's usual MLFLOW_TRACKING_URI."""
import os
import subprocess
import sys

import pytest
from conftest import REPO, serving_mlflow


pytestmark = pytest.mark.slow  # every test here starts processes


@pytest.fixture
def mlflow_server(tmp_path):
    with serving_mlflow(f"sqlite:///{tmp_path / 'server.db'}", tmp_path,
                        "--artifacts-destination", str(tmp_path / "server_artifacts")) as url:
        yield url


def test_run_logs_to_remote_server(mlflow_server, tmp_path):
    from mlflow.tracking import MlflowClient

    env = dict(os.environ, MLFLOW_TRACKING_URI=mlflow_server)
    env.pop("MLFLOW_RUN_ID", None)
    result = subprocess.run(
        [sys.executable, str(REPO / "launch.py"), "train.steps=3", f"job_root={tmp_path / 'jobs'}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert not (tmp_path / "mlflow.db").exists()  # nothing went to the local default store
    client = MlflowClient(mlflow_server)
    (run,) = client.search_runs([client.get_experiment_by_name("gridwright").experiment_id])
    assert run.info.status == "FINISHED"
    assert len(client.get_metric_history(run.info.run_id, "loss")) == 3
    assert "placement.json" in {a.path for a in client.list_artifacts(run.info.run_id)}

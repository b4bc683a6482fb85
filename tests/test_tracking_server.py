"""A remote MLflow tracking server, reached through MLflow's usual MLFLOW_TRACKING_URI."""
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from conftest import REPO

from gridwright.launchers.local import free_port

pytestmark = pytest.mark.slow  # every test here starts processes


@pytest.fixture
def mlflow_server(tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
         "--artifacts-destination", str(tmp_path / "server_artifacts")],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 90
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            break
        except OSError:
            if time.time() > deadline or proc.poll() is not None:
                os.killpg(proc.pid, signal.SIGKILL)
                pytest.fail("mlflow server did not come up")
            time.sleep(1)
    yield url
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:  # a loaded machine: the server's workers are slow to stop
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


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

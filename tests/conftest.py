"""Shared helpers: compose configs, and run `launch.py` as a user would, in a subprocess."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def no_inherited_mlflow_run(monkeypatch):
    """A developer's MLFLOW_TRACKING_URI or MLFLOW_RUN_ID would send every launch of the
    tests into their store or run: each test starts without them."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)


@pytest.fixture(autouse=True)
def torch_readers_as_torch_defines_them():
    """A command's main called in-process (convert's, in test_convert) guards `torch.load`
    for the whole process: the tests after it in this worker start with torch's own readers."""
    yield
    if "gridwright.checkpoints.checkpoint_trust" in sys.modules:
        sys.modules["gridwright.checkpoints.checkpoint_trust"].unguard_process()


@pytest.fixture
def compose():
    from gridwright.config.compose import compose_config

    def _compose(*overrides):
        return compose_config(list(overrides))

    return _compose


def launch(args: list[str], cwd: Path, timeout: int = 300, **extra_env: str) -> subprocess.CompletedProcess:
    """Run `python launch.py ARGS` from `cwd`; output captured as text."""
    env = dict(os.environ, **extra_env)
    env.pop("MLFLOW_TRACKING_URI", None)
    env.pop("MLFLOW_RUN_ID", None)
    return subprocess.run(
        [sys.executable, str(REPO / "launch.py"), *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
    )


def run_torchrun_job(tmp: Path, *overrides: str, before_run=None, timeout: int = 300) -> subprocess.CompletedProcess:
    """Plan a torchrun job with `launch.py` (tracking off) and run the line it emits, as a
    node would; `before_run` changes the files between the two. A free port is free when
    chosen, not when torchrun binds it seconds later: on EADDRINUSE the job is planned again."""
    from gridwright.runtime.loopback import free_port
    from gridwright.runtime.process_tree import run_bounded

    for attempt in range(3):
        job = tmp / f"torchrun_job{attempt}"
        planned = launch(["tracking=off", f"job_root={tmp / 'jobs'}", "train.warmup_steps=1", *overrides,
                          "launcher=torchrun", "launcher.master_addr=127.0.0.1",
                          f"launcher.master_port={free_port()}", f"job_dir={job}"], tmp)
        assert planned.returncode == 0, planned.stderr[-2000:]
        if before_run is not None and attempt == 0:
            before_run()
        line = (job / "torchrun_commands.sh").read_text().strip().splitlines()[-1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
        result = run_bounded(["bash", "-c", line], timeout, grace_s=10, cwd=tmp, env=env)
        if "EADDRINUSE" not in result.stderr:
            break
    return result


@pytest.fixture
def run_launch(tmp_path):
    """Launch with the job root and MLflow store inside this test's temporary directory."""

    def _run(*args, timeout=300):
        base = [f"job_root={tmp_path / 'jobs'}", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"]
        return launch(base + list(args), cwd=tmp_path, timeout=timeout)

    return _run


def sigkill_after_save(cmd: list[str], cwd: Path, ck: Path, step: int, timeout: float = 300) -> int:
    """Start `cmd` (a launch saving every step into `ck`), SIGKILL its whole process tree
    at once when `ck/latest` reaches `step` (a save of the next step is then under way),
    and return the step `latest` names afterwards."""
    import time

    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    latest = ck / "latest"
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if latest.exists() and int(latest.read_text().strip()[5:]) >= step:
            break
        time.sleep(0.02)
    kill_process_tree(proc.pid)
    proc.wait()
    return int(latest.read_text().strip()[5:])


def kill_process_tree(pid: int) -> None:
    """SIGKILL `pid` and all its descendants at once (torchrun starts its workers in
    sessions of their own; a stopped process dies too), and wait for them. Nothing when
    `pid` has ended already."""
    import psutil

    try:
        tree = [psutil.Process(pid)] + psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for p in tree:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(tree, timeout=30)


def only_job_dir(tmp_path: Path) -> Path:
    dirs = [p for p in (tmp_path / "jobs").glob("*/*") if p.is_dir()]
    assert len(dirs) == 1, dirs
    return dirs[0]


@contextlib.contextmanager
def serving_mlflow(store_uri: str, cwd: Path, *extra: str, command: str = "server"):
    """`mlflow server` (or `mlflow ui`) on a free loopback port for a test, with one worker
    (2 cores); yields its address once `/health` answers, and stops it with its children."""
    import signal
    import time
    import urllib.request

    from gridwright.runtime.loopback import free_port

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", command, "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", store_uri, *extra],
        cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            break
        except OSError:
            if time.time() > deadline or proc.poll() is not None:
                os.killpg(proc.pid, signal.SIGKILL)
                pytest.fail(f"mlflow {command} did not come up")
            time.sleep(1)
    try:
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # a loaded machine: the server's workers are slow to stop
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)

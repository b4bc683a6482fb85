"""Stops, faults and restarts of the local launcher: whatever dies first, nothing of the
run is left after 10 s, and its MLflow run says what happened."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import REPO

pytestmark = pytest.mark.slow  # every test here starts processes


def start(tmp_path: Path, name: str, *overrides) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    cmd = [sys.executable, str(REPO / "launch.py"), f"job_dir={tmp_path / name}",
           f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}", "train.warmup_steps=1", *overrides]
    return subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_step(job: Path, step: int, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        path = job / "metrics.jsonl"
        if path.exists() and sum(1 for _ in path.open()) > step:
            return
        time.sleep(0.2)
    raise AssertionError(f"step {step} not reached")


def run_tree(proc: subprocess.Popen) -> list[psutil.Process]:
    """The launcher, its agent and the workers (two, on the laptop cluster)."""
    root = psutil.Process(proc.pid)
    tree = [root, *root.children(recursive=True)]
    assert len(workers_of(tree)) == 2, [cmdline(p) for p in tree]
    return tree


def cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:  # ended meanwhile (a checkpoint writer's short-lived child)
        return []


def workers_of(tree) -> list[psutil.Process]:
    """The worker processes, not their forked children (a checkpoint writer forked by a
    worker carries the worker's command line)."""
    named = [p for p in tree if "gridwright.launchers.worker" in cmdline(p)]
    pids = {p.pid for p in named}
    # a process gone meanwhile has no parent to ask: a short-lived writer's child, not a worker
    return [p for p in named if parent_pid(p) is not None and parent_pid(p) not in pids]


def parent_pid(proc: psutil.Process) -> int | None:
    try:
        return proc.ppid()
    except psutil.Error:
        return None


def running(proc: psutil.Process) -> bool:
    """Alive and not a zombie (an exited process whose parent died waits for pid 1 to reap it)."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def assert_all_gone(tree: list[psutil.Process], within: float = 10.0) -> None:
    deadline = time.time() + within
    while time.time() < deadline and any(running(p) for p in tree):
        time.sleep(0.2)
    alive = [p for p in tree if running(p)]
    assert not alive, [(p.pid, cmdline(p)) for p in alive]


def mlflow_run(tmp_path: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 1, runs
    return client, runs[0]


def role(tree, name: str) -> psutil.Process:
    return next(p for p in tree if name in cmdline(p))


@pytest.mark.parametrize("victim", ["launcher", "agent", "worker"])
def test_sigkill_leaves_no_process_and_a_closed_run(tmp_path, victim):
    proc = start(tmp_path, "job", "train.steps=2000")
    wait_for_step(tmp_path / "job", 3, proc)
    tree = run_tree(proc)
    target = {"launcher": tree[0], "agent": role(tree, "gridwright.launchers.agent"),
              "worker": workers_of(tree)[-1]}[victim]
    target.kill()
    started = time.time()
    # Seconds when the machine is idle; the bound leaves room for a loaded 2-core machine
    # running other tests (torchrun gives workers 30 s after its SIGTERM).
    assert_all_gone(tree, within=40)
    proc.communicate()
    _, run = mlflow_run(tmp_path)
    # The launcher or (when it is the one killed) the agent closes the run on its way out.
    expected = {"launcher": "KILLED", "agent": "KILLED", "worker": "FAILED"}[victim]
    assert run.info.status == expected, (run.info.status, run.data.tags)
    assert time.time() - started < 45


def test_sigterm_saves_a_checkpoint_and_stops_and_the_same_launch_resumes(tmp_path):
    ck = tmp_path / "ck"
    args = ("train.steps=100", f"checkpoint.save={ck}")
    proc = start(tmp_path, "job", *args)
    wait_for_step(tmp_path / "job", 3, proc)
    tree = run_tree(proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert_all_gone(tree, within=1)
    steps = [json.loads(l)["step"] for l in (tmp_path / "job" / "metrics.jsonl").read_text().splitlines()]
    last = steps[-1]
    assert (ck / "latest").read_text().strip() == f"iter_{last + 1:07d}", out[-2000:]
    assert f"stopped     by signal {int(signal.SIGTERM)} after step {last}" in out
    summary = json.loads((tmp_path / "job" / "summary.json").read_text())
    assert summary["stopped_by_signal"] == signal.SIGTERM and summary["stopped_after_step"] == last
    _, run = mlflow_run(tmp_path)
    assert run.info.status == "KILLED" and run.data.tags["gridwright.status"] == "killed"

    again = start(tmp_path, "job", *args)  # the same launch: a re-run of the job
    out, _ = again.communicate(timeout=300)
    assert again.returncode == 0, out[-3000:]
    assert f"rerun       {tmp_path / 'job'} holds this job already" in out
    assert f"checkpoint  loaded {ck / f'iter_{last + 1:07d}'} in " in out
    rows = [json.loads(l) for l in (tmp_path / "job" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(100))
    client, run = mlflow_run(tmp_path)  # the same run, reopened and finished
    assert run.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == list(range(100))


def test_a_stop_save_survives_signals_to_every_process_of_the_run(tmp_path):
    """Slurm's scancel and time limit signal every process of a job step, and more than
    once (slurmstepd, then srun forwarding its own). The stop's checkpoint is written while
    they keep coming, also to the helper processes the checkpoint writer starts."""
    ck = tmp_path / "ck"
    proc = start(tmp_path, "job", "train.steps=2000", f"checkpoint.save={ck}")
    wait_for_step(tmp_path / "job", 3, proc)
    agent = role(run_tree(proc), "gridwright.launchers.agent")
    deadline = time.time() + 120
    while proc.poll() is None and time.time() < deadline:
        try:
            for p in agent.children(recursive=True):
                p.send_signal(signal.SIGTERM)
        except psutil.Error:  # one ended meanwhile, or the agent did
            pass
        time.sleep(0.05)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    last = [json.loads(l)["step"] for l in (tmp_path / "job" / "metrics.jsonl").read_text().splitlines()][-1]
    assert (ck / "latest").read_text().strip() == f"iter_{last + 1:07d}", out[-3000:]
    assert "Traceback" not in out, out[-3000:]


def test_elastic_restart_after_a_lost_worker_ends_with_the_uninterrupted_losses(tmp_path):
    steps = 24
    reference = subprocess.run(
        [sys.executable, str(REPO / "launch.py"), f"job_dir={tmp_path / 'reference'}", "tracking=off",
         "train.warmup_steps=1", f"train.steps={steps}"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert reference.returncode == 0, reference.stderr[-3000:]
    ck = tmp_path / "ck"
    proc = start(tmp_path, "job", f"train.steps={steps}", f"checkpoint.save={ck}", "checkpoint.save_interval=4",
                 "launcher.max_restarts=1")
    job = tmp_path / "job"
    deadline = time.time() + 240
    while not (ck / "latest").exists() and time.time() < deadline:
        time.sleep(0.1)
    wait_for_step(job, 6, proc)
    tree = run_tree(proc)
    workers_of(tree)[0].kill()
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]
    assert "restart     this job ran before: resuming from the newest checkpoint" in out
    rows = [json.loads(l) for l in (job / "metrics.jsonl").read_text().splitlines()]
    expected = [json.loads(l) for l in (tmp_path / "reference" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(steps))
    for got, want in zip(rows, expected):
        assert got["loss"] == pytest.approx(want["loss"], abs=1e-6), (got["step"], got["loss"], want["loss"])
    client, run = mlflow_run(tmp_path)
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(steps))  # no step logged twice


def port_outside_the_ephemeral_range() -> int:
    """A free port that no process's outgoing connection can take before torchrun binds it
    (the emitted line names the port seconds before the agent listens on it; a port the
    kernel hands out, as free_port's are, may meanwhile carry another test's gloo traffic)."""
    import random
    import socket

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.sample(range(20000, min(low, 32768)), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port below the ephemeral range")


def torchrun_job(tmp_path: Path) -> tuple[Path, str]:
    """A one-node job emitted as a torchrun line: its (node-0) agent opens the MLflow run."""
    port = port_outside_the_ephemeral_range()
    result = subprocess.run(
        [sys.executable, str(REPO / "launch.py"), f"job_dir={tmp_path / 'job'}", "launcher=torchrun",
         "launcher.master_addr=127.0.0.1", f"launcher.master_port={port}", "train.steps=2000", "train.warmup_steps=1",
         f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    line = [l for l in (tmp_path / "job" / "torchrun_commands.sh").read_text().splitlines() if "agent" in l][0]
    return tmp_path / "job", line


def logging_rank(tree) -> psutil.Process:
    return next(p for p in workers_of(tree) if p.environ().get("RANK") == "0")


@pytest.mark.parametrize("what", ["logging rank", "agent", "everything at once"])
def test_a_dead_owner_is_found_and_its_run_closed(tmp_path, what):
    """Node 0's agent keeps the run open, on every launcher. The logging rank killed, the
    agent closes the run as failed; the agent killed (its workers die with it), or
    everything at once, the next look at the job directory (sync) closes it."""
    job, line = torchrun_job(tmp_path)
    proc = subprocess.Popen(["bash", "-c", line], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    wait_for_step(job, 3, proc)
    root = psutil.Process(proc.pid)
    tree = [root, *root.children(recursive=True)]
    owner = json.loads((job / "run_owner.json").read_text())
    agent = psutil.Process(owner["pid"])
    assert "gridwright.launchers.agent" in cmdline(agent)
    if what == "logging rank":
        logging_rank(tree).kill()
        out, _ = proc.communicate(timeout=120)
        assert_all_gone(tree, within=10)
        _, run = mlflow_run(tmp_path)
        assert run.info.status == "FAILED", run.data.tags
        assert "exit code" in run.data.tags["gridwright.error"], run.data.tags
        assert f"mlflow      run {run.info.run_id} (FAILED)" in out  # the agent said where to see it
        return
    for p in [agent] if what == "agent" else tree:
        p.kill()
    assert_all_gone(tree, within=10)
    proc.communicate()
    _, run = mlflow_run(tmp_path)
    assert run.info.status == "RUNNING"  # nobody was left to close it
    synced = subprocess.run([sys.executable, "-m", "gridwright.tracking.sync", str(job)], capture_output=True, text=True)
    assert synced.returncode == 0, synced.stderr[-2000:]
    _, run = mlflow_run(tmp_path)
    assert run.info.status == "KILLED" and run.data.tags["gridwright.status"] == "killed"
    assert f"pid {owner['pid']} on {owner['host']}, which kept this run open" in run.data.tags["gridwright.error"]

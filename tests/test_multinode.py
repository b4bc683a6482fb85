"""Multi-node launchers run for real on this host: the emitted torchrun lines as two agents,
and the sbatch script, unedited, on a local Slurm with two nodes, with a requeue."""
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, kill_process_tree
from local_slurm import running_cluster

from gridwright.launchers.local import free_port

pytestmark = pytest.mark.slow  # every test here starts processes

STEPS = 200  # long enough (about 10 s of steps) for the requeue to land mid-run
# Saves in the background (as on CUDA by default): a requeue lands while one may be written.
COMMON = [f"train.steps={STEPS}", "train.warmup_steps=1", "checkpoint.save_interval=10", "checkpoint.async_save=true"]


def plan(tmp_path: Path, name: str, *overrides) -> Path:
    job = tmp_path / name
    result = subprocess.run(
        [sys.executable, str(REPO / "launch.py"), f"job_dir={job}", f"tracking.uri=sqlite:///{tmp_path / 'ml.db'}",
         f"checkpoint.save={tmp_path / (name + '_ck')}", *COMMON, *overrides],
        cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return job


def losses(job: Path) -> list[float]:
    rows = [json.loads(l) for l in (job / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    return [r["loss"] for r in rows]


def the_run(tmp_path: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'ml.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 1, [r.info for r in runs]
    return client, runs[0]


@pytest.fixture(scope="module")
def single_node(tmp_path_factory) -> list[float]:
    """The same job (DP=2) on one node with the local launcher."""
    tmp = tmp_path_factory.mktemp("single")
    job = tmp / "job"
    result = subprocess.run([sys.executable, str(REPO / "launch.py"), f"job_dir={job}", "tracking=off", *COMMON],
                            cwd=tmp, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return losses(job)


def test_torchrun_lines_as_two_agents(tmp_path, single_node):
    job = plan(tmp_path, "job", "launcher=torchrun", "cluster.nodes=2", "cluster.gpus_per_node=1",
               "launcher.master_addr=127.0.0.1", f"launcher.master_port={free_port()}")
    lines = [l for l in (job / "torchrun_commands.sh").read_text().splitlines() if l and not l.startswith("#")]
    assert len(lines) == 2
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}  # the lines carry their interpreter
    nodes = [subprocess.Popen(["bash", "-c", line], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for line in lines]
    outs = [n.communicate(timeout=300)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    assert losses(job) == pytest.approx(single_node, abs=1e-6)
    client, run = the_run(tmp_path)
    assert run.info.status == "FINISHED"
    assert "OMP_NUM_THREADS=1" in lines[0]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    with running_cluster() as cluster:
        yield cluster


def test_slurm_two_nodes_with_a_requeue(tmp_path, slurm, single_node):
    job = plan(tmp_path, "job", "launcher=slurm", "cluster.nodes=2", "cluster.gpus_per_node=1",
               "launcher.partition=debug", "launcher.time_limit=00:20:00", f"launcher.master_port={free_port()}")
    job_id = slurm.sbatch(job / "job.sbatch")  # unedited, from a clean environment
    ck = tmp_path / "job_ck"
    deadline = time.time() + 300
    while time.time() < deadline and not ((ck / "latest").exists() and (ck / "latest").read_text() >= "iter_0000020"):
        assert slurm.state(job_id) in ("PENDING", "RUNNING", "CONFIGURING"), slurm.state(job_id)
        time.sleep(0.5)
    slurm.scontrol("requeue", job_id)
    # A requeued job waits out a begin-time delay; this test has no reason to.
    deadline = time.time() + 60
    while slurm.state(job_id) != "PENDING" and time.time() < deadline:
        time.sleep(0.5)
    slurm.scontrol("update", f"JobId={job_id}", "StartTime=now")
    state = slurm.wait(job_id, timeout=600)
    logs = "".join(p.read_text() for p in sorted(job.glob("slurm-*.out")))
    assert state == "COMPLETED", logs[-5000:]
    assert (job / f"slurm-{job_id}-node0.out").is_file() and (job / f"slurm-{job_id}-node1.out").is_file()
    assert "attempt 1" in (job / f"slurm-{job_id}.out").read_text()
    assert "0: restart     this job ran before: resuming from the newest checkpoint" in logs
    assert losses(job) == pytest.approx(single_node, abs=1e-6)
    client, run = the_run(tmp_path)
    assert run.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == list(range(STEPS))


def test_scancel_stops_every_process_and_closes_the_run(tmp_path, slurm):
    job = plan(tmp_path, "job", "launcher=slurm", "cluster.nodes=2", "cluster.gpus_per_node=1",
               "launcher.partition=debug", f"launcher.master_port={free_port()}", "train.steps=5000")
    job_id = slurm.sbatch(job / "job.sbatch")
    deadline = time.time() + 300
    while time.time() < deadline and not ((job / "metrics.jsonl").exists()
                                          and len((job / "metrics.jsonl").read_text().splitlines()) > 3):
        time.sleep(0.5)
    subprocess.run(["scancel", job_id], env=slurm.env, check=True)
    assert slurm.wait(job_id, timeout=120) == "CANCELLED"
    deadline = time.time() + 10
    while time.time() < deadline and processes_of(job):
        time.sleep(0.5)
    assert not processes_of(job)
    logs = "".join(p.read_text() for p in sorted(job.glob("slurm-*.out")))
    assert f"stopped     by signal {int(signal.SIGTERM)} after step" in logs, logs[-3000:]
    _, run = the_run(tmp_path)
    assert run.info.status == "KILLED", run.data.tags


def processes_of(job: Path) -> list:
    import psutil

    out = []
    for proc in psutil.process_iter():
        try:
            if str(job) in " ".join(proc.cmdline()):
                out.append(proc)
        except psutil.Error:
            continue
    return out


def test_a_stopped_agent_on_another_node_is_named_and_ends_the_job(tmp_path):
    """Node 1's agent SIGSTOPped: its workers go on, but node 0's agent no longer hears it
    (peer_agents), names it and ends the job; MLflow says FAILED."""
    import psutil

    from gridwright.launchers.peer_agents import BEAT_S, SILENT_S

    nodes, logs, job = _two_agents_training(tmp_path)
    try:
        agent = json.loads((job / "agents" / "node1.json").read_text())["pid"]
        assert "gridwright.launchers.agent" in " ".join(psutil.Process(agent).cmdline())
        psutil.Process(agent).suspend()  # SIGSTOP
        stopped = time.time()
        nodes[0].wait(timeout=SILENT_S + 90)
        took = time.time() - stopped
    finally:
        for node in nodes:  # node 1's bash still waits for its stopped agent
            kill_process_tree(node.pid)
        for log in logs:
            log.close()
    out = (tmp_path / "node0.out").read_text()
    assert nodes[0].returncode == 1, out[-3000:]
    # counted from the last beat node 0 heard, which came up to one beat before the stop
    assert SILENT_S - BEAT_S <= took <= SILENT_S + 60, took
    named = f"the agent on node 1 ({socket.gethostname()}, pid {agent})"
    assert f"agent       {named} has not been heard from for " in out, out[-3000:]
    assert f"failed      {named}" in out, out[-3000:]
    client, run = the_run(tmp_path)
    assert run.info.status == "FAILED"
    assert run.data.tags["gridwright.error"].startswith(named), run.data.tags


def _two_agents_training(tmp_path: Path, tries: int = 3):
    """A long two-node job's torchrun lines started as two agents, once node 0 has trained
    a step and node 1's agent has beaten: (processes, their log files, the job directory).
    A rendezvous port taken between free_port() and the agent's bind (another test's) is
    tried again with a new one."""
    for attempt in range(tries):
        job = tmp_path / f"job{attempt}"
        planned = subprocess.run(
            [sys.executable, str(REPO / "launch.py"), f"job_dir={job}", f"tracking.uri=sqlite:///{tmp_path / 'ml.db'}",
             "train.steps=100000", "train.warmup_steps=1", "launcher=torchrun", "cluster.nodes=2",
             "cluster.gpus_per_node=1", "launcher.master_addr=127.0.0.1", f"launcher.master_port={free_port()}"],
            cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert planned.returncode == 0, planned.stderr[-3000:]
        lines = [l for l in (job / "torchrun_commands.sh").read_text().splitlines() if l and not l.startswith("#")]
        env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
        logs = [open(tmp_path / f"node{i}.out", "w") for i in range(2)]
        nodes = [subprocess.Popen(["bash", "-c", line], cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True) for line, log in zip(lines, logs)]
        deadline = time.time() + 240
        while time.time() < deadline and nodes[0].poll() is None and not (
                (job / "metrics.jsonl").is_file() and (job / "agents" / "node1.json").is_file()):
            time.sleep(0.5)
        if nodes[0].poll() is None:
            return nodes, logs, job
        for node in nodes:
            kill_process_tree(node.pid)
        for log in logs:
            log.close()
        out = (tmp_path / "node0.out").read_text()
        assert "EADDRINUSE" in out, out[-3000:]
    raise AssertionError(f"no free rendezvous port in {tries} tries")


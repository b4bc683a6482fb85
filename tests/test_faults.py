"""Faults a run survives, and bad input that ends in one clear line and exit 2 before any
work starts (each case was a traceback or a silent failure once)."""
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import REPO

from gridwright.basics.atomic_io import remove_stale_stages


def launch(tmp_path: Path, *args, timeout=300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    return subprocess.run([sys.executable, str(REPO / "launch.py"), f"job_root={tmp_path / 'jobs'}",
                           f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}", "train.warmup_steps=1", *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


def one_error_line(result) -> str:
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    lines = [l for l in result.stderr.splitlines() if l.startswith("error") or l.startswith("  - ")]
    assert "Traceback" not in result.stderr and lines, result.stderr
    return result.stderr


@pytest.mark.slow
def test_local_rendezvous_and_gloo_listen_on_loopback_only(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    proc = subprocess.Popen([sys.executable, str(REPO / "launch.py"), f"job_dir={tmp_path / 'job'}", "tracking=off",
                             "train.steps=3000", "train.warmup_steps=1"], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 240
        while not (tmp_path / "job" / "metrics.jsonl").exists() and time.time() < deadline:
            time.sleep(0.2)
        root = psutil.Process(proc.pid)
        pids = {root.pid, *(p.pid for p in root.children(recursive=True))}
        listening = [c.laddr for c in psutil.net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN and c.pid in pids]
        assert len(listening) >= 3, listening  # the agent's store and each worker's gloo
        assert {addr.ip for addr in listening} == {"127.0.0.1"}, listening
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)


def train(tmp_path: Path, name: str, *args):
    result = launch(tmp_path, "tracking=off", f"job_dir={tmp_path / name}", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.slow
def test_a_damaged_latest_checkpoint_is_refused_or_skipped(tmp_path):
    ck = tmp_path / "ck"
    train(tmp_path, "first", "train.steps=4", f"checkpoint.save={ck}", "checkpoint.save_interval=2")
    latest = ck / "iter_0000004"
    shard = next(latest.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    refused = launch(tmp_path, "tracking=off", f"job_dir={tmp_path / 'second'}", "train.steps=6",
                     f"checkpoint.load={ck}")
    err = one_error_line(refused)
    assert f"the latest checkpoint {latest} is damaged: {shard} is cut short" in err
    assert "The newest intact checkpoint is iter_0000002: set checkpoint.fallback=true" in err
    assert not (tmp_path / "second").exists()

    resumed = train(tmp_path, "third", "train.steps=6", f"checkpoint.load={ck}", "checkpoint.fallback=true")
    assert f"checkpoint  loaded {ck / 'iter_0000002'} in " in resumed.stdout

    (ck / "iter_0000002" / ".metadata").write_bytes(b"\x80\x04truncated")
    (ck / "iter_0000004" / "metadata.json").write_text('{"sharded_backend": ')
    err = one_error_line(launch(tmp_path, "tracking=off", "train.steps=6", f"checkpoint.load={ck}",
                                "checkpoint.fallback=true"))
    assert "metadata.json is unreadable" in err and "No intact checkpoint is left beside it" in err


@pytest.mark.slow
def test_one_writer_per_checkpoint_directory(tmp_path):
    ck = tmp_path / "ck"
    # The holder forks a child that outlives it, as a killed worker's checkpoint helpers do.
    holder = subprocess.Popen([sys.executable, "-c", "import os, time; from gridwright.checkpoints.checkpoint_dir import "
                               f"hold_writer_lock; h = hold_writer_lock({str(ck)!r}); child = os.fork(); "
                               "child or time.sleep(600); print('held', child, flush=True); time.sleep(600)"],
                              stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = psutil.Process(int(holder.stdout.readline().split()[1]))
        err = one_error_line(launch(tmp_path, "tracking=off", "train.steps=2", f"checkpoint.save={ck}"))
        assert f"is being written by another run (host {os.uname().nodename} pid {holder.pid})" in err
    finally:
        holder.kill()
        holder.wait()
    # A dead holder holds nothing, though its child lives on: the lock file stays, the lock does not.
    try:
        assert child.is_running()
        train(tmp_path, "after", "train.steps=2", f"checkpoint.save={ck}")
        assert (ck / "latest").read_text().strip() == "iter_0000002"
    finally:
        child.kill()


def test_stale_conversion_stages_are_removed_and_a_moved_aside_output_restored(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = os.uname().nodename
    out = tmp_path / "out"
    stale = tmp_path / f".out.{host}-{dead.pid}.abcd1234.partial"
    (stale / "sub").mkdir(parents=True)
    live = tmp_path / f".out.{host}-{os.getpid()}.efgh5678.partial"
    live.mkdir()
    moved = tmp_path / f".out.{host}-{dead.pid}.ijkl9012.old"
    (moved / "previous").mkdir(parents=True)
    (moved / "previous" / "config.json").write_text("{}")
    removed = remove_stale_stages(out)
    assert sorted(removed) == sorted([stale, moved])
    assert not stale.exists() and live.exists()  # a running conversion's stage stays
    assert (out / "config.json").read_text() == "{}"  # killed between its two renames: put back


@contextlib.contextmanager
def read_only_mount(path: Path):
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a read-only file system here: {done.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


@pytest.mark.slow
def test_outputs_on_a_read_only_file_system_are_one_line(tmp_path):
    with read_only_mount(tmp_path / "ro") as ro:
        err = one_error_line(launch(tmp_path, "tracking=off", f"job_root={ro / 'jobs'}"))
        assert f"{ro} is on a read-only file system" in err
        err = one_error_line(launch(tmp_path, "tracking=off", f"checkpoint.save={ro / 'ck'}"))
        assert f"checkpoint.save={ro / 'ck'} cannot be written: {ro} is on a read-only file system" in err
        result = subprocess.run([sys.executable, "-m", "gridwright.adapters.convert", "hf-to-megatron", "--hf",
                                 str(tmp_path), "--out", str(ro / "ck")], capture_output=True, text=True)
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert result.stderr.strip() == f"error: cannot write --out {ro / 'ck'}: {ro} is on a read-only file system."


@pytest.mark.slow
def test_two_first_runs_at_once_share_a_fresh_store(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    cmd = [sys.executable, str(REPO / "launch.py"), f"tracking.uri=sqlite:///{tmp_path / 'fresh.db'}",
           "train.steps=2", "train.warmup_steps=1", "cluster.gpus_per_node=1"]
    procs = [subprocess.Popen([*cmd, f"job_dir={tmp_path / f'job{i}'}"], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'fresh.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert sorted(r.info.status for r in runs) == ["FINISHED", "FINISHED"]


@pytest.mark.parametrize("args, expected", [
    (["+train.stpes=5"], "error: train.stpes is not a key of the experiment's schema (gridwright.config.schema). "
                         "Did you mean train.steps?"),
    (["launcher=slurm", "cluster.gpus_per_node=0"], "  - cluster.gpus_per_node=0 must be at least 1."),
    (["launcher.max_restarts=-1"], "  - launcher.max_restarts=-1 must be 0 or more. Fix: launcher.max_restarts=0."),
    (["launcher=slurm", "launcher.gpu_request=gpus"], "  - launcher.gpu_request='gpus' is not one of auto, "
                                                       "gpus_per_node, gres, none. Fix: launcher.gpu_request=gpus_per_node."),
    (["--config-dir", "/nonexistent/conf"], "error: --config-dir /nonexistent/conf is not a directory."),
])
def test_bad_input_is_one_clear_line(tmp_path, args, expected):
    result = launch(tmp_path, *args)
    err = one_error_line(result)
    assert expected in err.splitlines(), err
    assert not (tmp_path / "jobs").exists()


@pytest.mark.slow
def test_a_config_dir_overrides_the_packaged_configs(tmp_path):
    (tmp_path / "conf" / "model").mkdir(parents=True)
    packaged = (REPO / "conf" / "model" / "tiny_llama.yaml").read_text()
    assert "num_layers: 4" in packaged
    (tmp_path / "conf" / "model" / "tiny_llama.yaml").write_text(packaged.replace("num_layers: 4", "num_layers: 3"))
    result = launch(tmp_path, "--config-dir", str(tmp_path / "conf"), "launcher=plan")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "tiny_llama: 0.17 M parameters, 3 layers" in result.stdout
    # Files the user did not copy still come from the package.
    result = launch(tmp_path, "--config-dir", str(tmp_path / "conf"), "launcher=plan", "+experiment=tiny_llama_tp2")
    assert result.returncode == 0 and "layout      TP=2 " in result.stdout, result.stdout[-2000:]

"""An unlucky user's battery: bad numbers and names, a damaged or unreachable MLflow store,
a store lost mid-run, a disk too small or filled mid-run. Each is one line and exit 2
before anything starts, or a run that ends the way it says."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest
from conftest import REPO

from gridwright.planning.disk_space import checkpoint_bytes, saves_kept
from gridwright.engines.checkpoint_publish import remove_older
from gridwright.tracking.store import PROBE_TIMEOUT_S, store_problem


def launch(tmp_path: Path, *args, env_extra=None, timeout=300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")} | (env_extra or {})
    return subprocess.run([sys.executable, str(REPO / "launch.py"), f"job_root={tmp_path / 'jobs'}",
                           "train.warmup_steps=1", *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=timeout)


def refused(result, expected: str) -> None:
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    problems = [line for line in result.stderr.splitlines() if line.startswith("  - ")]
    assert len(problems) == 1 and expected in problems[0], result.stderr


BATTERY = [
    ("train.lr=nan", "train.lr=nan must be a finite number above 0."),
    ("train.lr=inf", "train.lr=inf must be a finite number above 0."),
    ("train.lr=-1e-3", "train.lr=-0.001 must be a finite number above 0."),
    ("train.lr=0", "train.lr=0.0 must be a finite number above 0."),
    ("train.min_lr=nan", "train.min_lr=nan must be a finite number, 0 or more."),
    ("train.min_lr=1", "train.min_lr=1.0 must not exceed train.lr=0.01"),
    ("train.weight_decay=-inf", "train.weight_decay=-inf must be a finite number, 0 or more."),
    ("train.grad_clip=nan", "train.grad_clip=nan must be a finite number, 0 or more."),
    ("model.norm_epsilon=0", "model.norm_epsilon=0.0 must be a finite number above 0."),
    ("model.rotary_base=inf", "model.rotary_base=inf must be a finite number above 0."),
    ("model.vocab_size=0", "model.vocab_size=0 must be at least 1."),
    ("model.hidden_size=0", "model.hidden_size=0 must be at least 1."),
    ("model.num_layers=-2", "model.num_layers=-2 must be at least 1."),
    ("model.num_query_groups=0", "model.num_query_groups=0 must be at least 1."),
    ("model.head_dim=0", "model.head_dim=0 must be at least 1"),
    ("model.num_experts=-1", "model.num_experts=-1 must be 0 (dense) or more."),
    ("train.log_interval=0", "train.log_interval=0 must be at least 1."),
    ("model.hidden_size=1000000", "on 2 CPU processes"),
    ("watchdog.min_stall_s=0", "watchdog.min_stall_s=0.0 must be a finite number above 0."),
    ("watchdog.collective_timeout_s=-5", "watchdog.collective_timeout_s=-5.0 must be a finite number above 0."),
    ("checkpoint.keep_last=-1", "checkpoint.keep_last=-1 must be 0"),
    ("name=../../etc", "name='../../etc' must be one directory name"),
    ("name=a/b", "name='a/b' must be one directory name"),
    ("name=..", "name='..' must be one directory name"),
    ("+experiment=tiny_llama_tp2 name=.hidden", "name='.hidden' must be one directory name"),
]


@pytest.mark.parametrize("override, expected", BATTERY, ids=[b[0] for b in BATTERY])
def test_bad_numbers_and_names_are_one_line(override, expected, tmp_path):
    refused(launch(tmp_path, "tracking=off", *override.split()), expected)
    assert not (tmp_path / "jobs").exists()
    assert not (tmp_path.parent / "etc").exists()


@pytest.mark.slow
def test_a_damaged_store_is_one_line_before_any_job_directory(tmp_path):
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(os.urandom(4096))
    refused(launch(tmp_path, f"tracking.uri=sqlite:///{garbage}"), f"the MLflow store {garbage} cannot be opened")
    good = tmp_path / "good.db"
    done = launch(tmp_path, f"tracking.uri=sqlite:///{good}", "train.steps=2", "cluster.gpus_per_node=1")
    assert done.returncode == 0, done.stderr[-2000:]
    cut = tmp_path / "cut.db"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    jobs_before = sorted((tmp_path / "jobs").rglob("config.yaml"))
    refused(launch(tmp_path, f"tracking.uri=sqlite:///{cut}"), f"the MLflow store {cut}")
    assert sorted((tmp_path / "jobs").rglob("config.yaml")) == jobs_before


def test_an_unreachable_server_fails_within_the_stated_bound(tmp_path):
    started = time.time()
    result = launch(tmp_path, env_extra={"MLFLOW_TRACKING_URI": "http://127.0.0.1:9"})
    refused(result, "the tracking server http://127.0.0.1:9 did not answer within 5 s")
    assert time.time() - started < 30 + PROBE_TIMEOUT_S
    assert store_problem("http://10.255.255.1:5000") is not None  # a black hole: the probe's own timeout


@pytest.mark.slow
def test_a_store_removed_mid_run_leaves_training_finished_and_sync_catches_up(tmp_path):
    store, job = tmp_path / "store.db", tmp_path / "job"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    proc = subprocess.Popen([sys.executable, str(REPO / "launch.py"), f"job_dir={job}",
                             f"tracking.uri=sqlite:///{store}", "train.steps=150", "train.warmup_steps=1"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 240
    while time.time() < deadline and not (job / "metrics.jsonl").exists():
        time.sleep(0.1)
    store.unlink()
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    failures = [line for line in out.splitlines() if line.startswith("mlflow ") and "failed" in line]
    assert failures and "logs it later" in failures[0], out[-3000:]
    assert len([line for line in out.splitlines() if line.startswith("step ")]) == 150
    synced = subprocess.run([sys.executable, "-m", "gridwright.tracking.sync", str(job), "--tracking-uri",
                             f"sqlite:///{store}"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert synced.returncode == 0, synced.stderr[-2000:]
    client = mlflow.MlflowClient(f"sqlite:///{store}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "FINISHED"
    assert len(client.get_metric_history(run.info.run_id, "loss")) == 150


@contextlib.contextmanager
def small_file_system(path: Path, size: str):
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small file system here: {done.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


@pytest.mark.slow
def test_free_space_is_checked_before_start_and_retention_keeps_n(tmp_path, compose):
    cfg = compose("train.steps=6", "checkpoint.save=/x", "checkpoint.save_interval=1")
    assert saves_kept(cfg.checkpoint, cfg.train) == 6
    assert 2.6e6 < checkpoint_bytes(cfg.model, cfg.precision) < 3.4e6  # the tiny model's checkpoint: 2.8 MiB on disk
    with small_file_system(tmp_path / "small", "8m") as small:
        refused(launch(tmp_path, "tracking=off", "train.steps=6", f"checkpoint.save={small / 'ck'}",
                       "checkpoint.save_interval=1"), f"checkpoint.save={small / 'ck'} has 8.0 MiB free")
        done = launch(tmp_path, "tracking=off", "train.steps=6", f"checkpoint.save={small / 'ck'}",
                      "checkpoint.save_interval=1", "checkpoint.keep_last=1", f"job_dir={tmp_path / 'kept'}")
        assert done.returncode == 0, done.stderr[-3000:]
        assert sorted(p.name for p in (small / "ck").iterdir() if p.name.startswith("iter_")) == ["iter_0000006"]


def test_retention_never_removes_latest_nor_a_save_under_way(tmp_path):
    root = tmp_path / "ck"
    for step in (10, 20, 30, 35, 40, 50):
        (root / f"iter_{step:07d}").mkdir(parents=True)
    (root / "iter_0000060.partial").mkdir()
    (root / "latest").write_text("iter_0000035\n")  # rolled back to 30, then saved 35
    gone = remove_older(root, 2)
    assert sorted(p.name for p in gone) == ["iter_0000010", "iter_0000020"]
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000030", "iter_0000035", "iter_0000040", "iter_0000050",
                                                      "iter_0000060.partial", "latest"]
    assert remove_older(root, 1) == [root / "iter_0000030"]


@pytest.mark.slow
def test_a_disk_that_fills_at_a_save_says_so_and_keeps_the_previous_checkpoint(tmp_path):
    with small_file_system(tmp_path / "small", "8m") as small:
        ck = small / "ck"
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
        proc = subprocess.Popen([sys.executable, str(REPO / "launch.py"), "tracking=off", f"job_dir={tmp_path / 'j'}",
                                 "train.steps=400", "train.warmup_steps=1", f"checkpoint.save={ck}",
                                 "checkpoint.save_interval=100", "checkpoint.keep_last=1"],
                                cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 240
        while time.time() < deadline and not (ck / "latest").exists():
            time.sleep(0.05)
        first = (ck / "latest").read_text().strip()
        with open(small / "ballast", "wb") as f:  # fill what is left
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 1, err[-3000:]
        assert "Traceback" not in err, err[-3000:]
        lines = [line for line in err.splitlines() if "no space left on" in line]
        assert lines and lines[0].startswith("error: rank ") and f"no space left on {ck}: a checkpoint needs about " \
            in lines[0] and "The previous checkpoint is intact." in lines[0], err[-3000:]
        assert (ck / "latest").read_text().strip() == first
        assert (ck / first / "metadata.json").is_file()


def test_a_path_the_slurm_script_cannot_hold_is_refused_before_the_job_directory(tmp_path):
    job = tmp_path / "a\\b c"
    refused(launch(tmp_path, "tracking=off", "launcher=slurm", f"job_dir={job}"),
            "Slurm's --output drops backslashes from file names")
    assert not job.exists()

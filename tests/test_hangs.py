"""A hung rank is found: with one worker SIGSTOPped mid-run, the job stops within the
watchdog's bound, naming the rank, with the other ranks' stacks in the job directory,
the MLflow run FAILED and no process left."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import psutil
from conftest import REPO

from gridwright.engines.timeouts import collective_timeout
import pytest


def start_until_rank_1_beats(tmp_path: Path, job: Path, *overrides, stdout=subprocess.PIPE):
    """A long two-rank run into `job`; returns it, rank 1's heartbeat file and the deadline
    (240 s from the start) once that file exists."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    proc = subprocess.Popen([sys.executable, str(REPO / "launch.py"), f"job_dir={job}", "train.steps=100000",
                             "train.warmup_steps=1", *overrides],
                            cwd=tmp_path, env=env, stdout=stdout, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    try:
        while time.time() < deadline and not list((job / "heartbeats").glob("*/rank_00001.json")):
            time.sleep(0.2)
        (beat,) = (job / "heartbeats").glob("*/rank_00001.json")
    except BaseException:
        proc.kill()
        raise
    return proc, beat, deadline


@pytest.mark.slow
def test_a_stopped_rank_stops_the_job_within_the_bound(tmp_path):
    job, store = tmp_path / "job", f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc, beat, deadline = start_until_rank_1_beats(tmp_path, job, f"tracking.uri={store}", "watchdog.min_stall_s=15")
    try:
        while time.time() < deadline and json.loads(beat.read_text())["step"] is None:
            time.sleep(0.2)
        victim = json.loads(beat.read_text())["pid"]
        others = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        os.kill(victim, signal.SIGSTOP)
        stopped_at = time.time()
        out, err = proc.communicate(timeout=120)
        took = time.time() - stopped_at
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err[-3000:]
    # 15 s of silence, a poll, 3 s for the stack dumps, and torchrun's end of the group.
    assert took < 45, f"the job took {took:.0f} s to stop"
    block = [line for line in err.splitlines() if line.startswith("hang ")]
    assert len(block) == 1 and block[0].startswith("hang        rank 1 made no progress for "), err[-3000:]
    (found,) = (job / "hangs").glob("*.json")
    finding = json.loads(found.read_text())
    assert finding["rank"] == 1 and finding["ranks"]["1"]["state"] == "stopped"
    assert finding["ranks"]["0"]["dumped"] and not finding["ranks"]["1"]["dumped"]
    stacks = (job / "stacks" / "rank_00000.txt").read_text()
    # The live rank waits in the training loop at its next collective with the stopped one:
    # inside a step, or at the agreed-stop check after it.
    assert "training_loop.py" in stacks and ("train_step" in stacks or "in agreed" in stacks), stacks[-2000:]
    run = mlflow.MlflowClient(store).search_runs(["1"])[0]
    assert run.info.status == "FAILED"
    assert run.data.tags["gridwright.error"].startswith("hang: rank 1 on "), run.data.tags
    time.sleep(1)
    assert not [p for p in others if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


@pytest.mark.slow
def test_a_rank_stuck_in_a_save_is_named_within_the_saves_bound(tmp_path):
    """The save's bound comes from the previous save's time (with its floor), not the
    30-minute phase bound; the healthy rank waiting in the save's barrier is not blamed."""
    job, ck = tmp_path / "job", tmp_path / "ck"
    proc, beat, deadline = start_until_rank_1_beats(
        tmp_path, job, "tracking=off", f"checkpoint.save={ck}", "checkpoint.save_interval=1", "checkpoint.keep_last=2",
        "watchdog.save_floor_s=15", "watchdog.min_stall_s=900", stdout=subprocess.DEVNULL)
    try:
        while time.time() < deadline:  # stop rank 1 inside a save (after one was timed)
            rec = json.loads(beat.read_text())
            if rec["phase"] == "saving" and (ck / "latest").exists():
                os.kill(rec["pid"], signal.SIGSTOP)
                if json.loads(beat.read_text())["phase"] == "saving":
                    break
                os.kill(rec["pid"], signal.SIGCONT)  # it had left the save: try the next one
            time.sleep(0.01)
        stopped_at = time.time()
        _, err = proc.communicate(timeout=180)
        took = time.time() - stopped_at
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err[-3000:]
    assert took < 15 + 30, f"the job took {took:.0f} s to stop"
    block = [line for line in err.splitlines() if line.startswith("hang ")]
    assert len(block) == 1 and block[0].startswith("hang        rank 1 made no progress for "), err[-3000:]
    assert "saving" in block[0], block[0]


WATCHDOG_UNDER_CLOSED_FDS = """
import os, sys, time
from pathlib import Path
import gridwright.launchers.watchdog as wd
from gridwright.config.compose import compose_config
job = Path(sys.argv[1])
(job / "heartbeats").mkdir(parents=True)
wd._POLL_S = 0.0005  # thousands of polls in the 3 s below
watchdog = wd.Watchdog(job, compose_config([]), "token").start()
end = time.time() + 3
while time.time() < end:  # as a teardown does: every descriptor psutil and the reads open is closed under them
    os.closerange(3, 4096)
os.write(1, f"{watchdog._thread.is_alive()} {watchdog.polls_failed}".encode())
"""


@pytest.mark.slow  # a process of its own: it closes its descriptors
def test_the_watchdog_thread_survives_descriptors_closed_under_its_proc_reads(tmp_path):
    """psutil's /proc reads and the heartbeat reads meet EBADF when a process's descriptors
    are closed under them (an agent's teardown); the thread skips that poll and goes on."""
    done = subprocess.run([sys.executable, "-c", WATCHDOG_UNDER_CLOSED_FDS, str(tmp_path / "job")],
                          capture_output=True, text=True, timeout=120)
    alive, failed = done.stdout.split()
    assert alive == "True", done.stderr[-3000:]
    assert int(failed) > 0, "no poll met a closed descriptor: the test proves nothing"


def test_the_collective_timeout_outlasts_every_watchdog_bound(compose):
    """A minute above the longest bound, so that the watchdog names a stuck rank before a
    healthy peer's collective times out and takes the blame."""
    watchdog = compose().watchdog
    assert collective_timeout(watchdog, "nccl", longest_bound_s=5000).total_seconds() == 5060
    assert collective_timeout(watchdog, "nccl").total_seconds() == collective_timeout(watchdog, "gloo").total_seconds() == 1860
    assert collective_timeout(compose("watchdog.phase_timeout_s=2400").watchdog, "nccl").total_seconds() == 2460
    assert collective_timeout(compose("watchdog.collective_timeout_s=42").watchdog, "gloo").total_seconds() == 42


def test_a_saves_bound_comes_from_its_size_and_the_measured_speed(compose):
    from gridwright.engines.timeouts import first_save_bound_s
    from gridwright.launchers.watchdog import bound_s
    from gridwright.runtime.heartbeat import save_bound_s

    assert save_bound_s(110 * 10**9, None, 120.0) == 2200.0  # 110 GB at 50 MB/s, before any save was timed
    assert save_bound_s(110 * 10**9, 30.0, 120.0) == 150.0  # 5 x the previous save on this disk
    assert save_bound_s(10**6, 0.2, 120.0) == save_bound_s(10**6, None, 120.0) == 120.0  # the floor
    cfg = compose("checkpoint.save=/tmp/ck")
    assert bound_s({"phase": "saving", "bound_s": 150.0}, cfg.watchdog) == 150.0  # not phase_timeout_s's 1800
    assert first_save_bound_s(cfg) == 120.0 and first_save_bound_s(compose()) == 0.0


def test_a_background_write_is_bounded_as_a_save_while_the_rank_trains_on(compose):
    import time

    from gridwright.launchers.watchdog import WRITING, as_judged

    w = compose("watchdog.phase_timeout_s=1800").watchdog
    now = time.time()
    rec = {"phase": "training", "step": 41, "recent_step_s": 0.5, "time": now, "host": "h"}
    writes = {"step": 40, "pid": 7, "bound_s": 150.0}
    assert as_judged(rec | {"writing": writes | {"since": now - 100}}, w) == rec | {"writing": writes | {"since": now - 100}}
    stalled = as_judged(rec | {"writing": writes | {"since": now - 200}}, w)
    assert (stalled["phase"], stalled["step"], stalled["bound_s"], stalled["time"]) == (WRITING, 40, 150.0, now - 200)


def test_the_bound_follows_recent_step_times_and_phases(compose):
    from gridwright.launchers.watchdog import bound_s, finding_for, late_ranks

    cfg = compose("watchdog.min_stall_s=60", "watchdog.stall_factor=10", "watchdog.phase_timeout_s=1800")
    now = 10_000.0
    beats = {
        0: {"phase": "training", "step": 41, "recent_step_s": 20.0, "time": now - 150, "host": "h"},  # bound 200 s
        1: {"phase": "training", "step": 40, "recent_step_s": 0.5, "time": now - 61, "host": "h"},  # bound 60 s
        2: {"phase": "saving", "step": 40, "recent_step_s": 0.5, "time": now - 900, "host": "h"},  # bound 1800 s
    }
    assert [bound_s(beats[r], cfg.watchdog) for r in (0, 1, 2)] == [200.0, 60.0, 1800.0]
    late = late_ranks(beats, cfg.watchdog, now)
    assert set(late) == {1}
    ranks = {r: {"dumped": True} for r in beats}
    assert finding_for(beats, late, ranks, cfg.watchdog)["rank"] == 1  # furthest behind among the silent
    ranks[2]["dumped"] = False
    assert finding_for(beats, late, ranks, cfg.watchdog)["rank"] == 2  # the one that did not answer comes first

"""Background checkpoint saves (checkpoint.async_save) on both engines, with real kills and
signals at real moments of a write: nothing is lost, nothing half-written is published,
nothing is left running, and a resume continues exactly."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import REPO
from test_stops import assert_all_gone, role, run_tree, workers_of

pytestmark = pytest.mark.slow  # every test here starts processes

ENGINES = ["megatron", "deepspeed"]
# A model whose checkpoint (about 0.3 GB) takes longer to write than a step takes to run,
# so that a save is caught mid-write and the next save comes while one is written.
MEDIUM = ["model.hidden_size=256", "model.ffn_hidden_size=704", "model.vocab_size=32000", "model.name=medium_llama",
          "train.micro_batch_size=1", "train.global_batch_size=2", "checkpoint.async_save=true"]


def start(tmp_path: Path, name: str, *overrides) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    cmd = [sys.executable, str(REPO / "launch.py"), "tracking=off", f"job_dir={tmp_path / name}",
           "train.warmup_steps=1", *overrides]
    return subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def losses(job: Path) -> dict[int, float]:
    rows = [json.loads(l) for l in (job / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def latest(ck: Path) -> str | None:
    try:
        return (ck / "latest").read_text().strip()
    except FileNotFoundError:
        return None


def writing(job: Path, after: str | None) -> dict | None:
    """Rank 0's background write under way, of a step later than `after` (an iter_N name)."""
    for beat in job.glob("heartbeats/*/rank_00000.json"):
        try:
            rec = json.loads(beat.read_text())
        except (OSError, ValueError):
            continue
        w = rec.get("writing")
        if w and w.get("pid") and (after is None or w["step"] > int(after[5:])):
            return w
    return None


def wait_for_a_write(job: Path, ck: Path, proc: subprocess.Popen, timeout: float = 240) -> tuple[str, dict]:
    """Once a checkpoint is published, the next background write under way: (latest, write)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        before = latest(ck)
        if before is not None:
            w = writing(job, before)
            if w is not None and latest(ck) == before:
                return before, w
        time.sleep(0.005)
    raise AssertionError("no background write seen")


def complete(ck: Path, name: str, engine: str) -> bool:
    marker = "metadata.json" if engine == "megatron" else "gridwright_deepspeed.json"
    return (ck / name / marker).is_file()


# A lost agent and a lost launcher end alike (the workers are sent SIGTERM): the launcher is
# killed on one engine only.
@pytest.mark.parametrize("engine, victim", [("megatron", "worker"), ("megatron", "agent"), ("megatron", "launcher"),
                                            ("deepspeed", "worker"), ("deepspeed", "agent")])
def test_a_kill_mid_write_keeps_latest_and_publishes_nothing(tmp_path, engine, victim):
    """Whatever dies mid-write, `latest` names a complete checkpoint and no half-written one
    is ever published; no process is left."""
    ck = tmp_path / "ck"
    proc = start(tmp_path, "job", f"engine={engine}", *MEDIUM, "train.steps=400", f"checkpoint.save={ck}",
                 "checkpoint.save_interval=2", "checkpoint.keep_last=1")
    try:
        before, w = wait_for_a_write(tmp_path / "job", ck, proc)
        writer, tree = psutil.Process(w["pid"]), run_tree(proc)
        target = {"launcher": tree[0], "agent": role(tree, "gridwright.launchers.agent"),
                  "worker": workers_of(tree)[0]}[victim]
        target.kill()
        assert_all_gone(tree + [writer], within=40)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    partial, pending = ck / f"iter_{w['step']:07d}.partial", f"iter_{w['step']:07d}"
    published = sorted(p.name for p in ck.iterdir() if p.name.startswith("iter_") and "." not in p.name)
    assert all(complete(ck, name, engine) for name in published) and latest(ck) in published
    if victim == "worker":  # the other rank cannot finish the write: it stays a .partial, never published
        assert latest(ck) == before and partial.is_dir() and pending not in published
        assert published == [before]  # keep_last=1 never took the one being written for an old one
    else:
        # Without its agent a worker is sent SIGTERM (process_tree.die_with_parent): both ranks
        # then finish the write under way, publish it, and save the step they are at.
        assert latest(ck) > pending and pending not in published and not partial.exists()

    if victim == "worker":  # the same launch resumes from `before` and removes the leftover
        job = tmp_path / "resumed"
        done = subprocess.run([sys.executable, str(REPO / "launch.py"), "tracking=off", f"job_dir={job}",
                               "train.warmup_steps=1", f"engine={engine}", *MEDIUM, f"train.steps={int(before[5:]) + 2}",
                               f"checkpoint.load={ck}", f"checkpoint.save={ck}"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert f"checkpoint  loaded {ck / before} in " in done.stdout


@pytest.mark.parametrize("engine", ENGINES)
def test_sigterm_waits_for_the_write_then_saves_and_stops(tmp_path, engine):
    ck = tmp_path / "ck"
    proc = start(tmp_path, "job", f"engine={engine}", *MEDIUM, "train.steps=400", f"checkpoint.save={ck}",
                 "checkpoint.save_interval=4", "checkpoint.keep_last=2")
    try:
        _, w = wait_for_a_write(tmp_path / "job", ck, proc)
        tree = run_tree(proc)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert_all_gone(tree, within=10)
    last, pending = max(losses(tmp_path / "job")), f"iter_{w['step']:07d}"
    assert f"checkpoint  saved {ck / pending} in the background" in out, out[-3000:]
    assert latest(ck) == f"iter_{last + 1:07d}" and complete(ck, latest(ck), engine)
    assert complete(ck, pending, engine)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_stop_abandons_a_write_past_its_bound_and_keeps_latest(tmp_path, engine):
    """A writer that cannot finish (stopped here) holds a stop for the save's bound only."""
    ck = tmp_path / "ck"
    proc = start(tmp_path, "job", f"engine={engine}", *MEDIUM, "train.steps=400", f"checkpoint.save={ck}", "checkpoint.save_interval=2",
                 "checkpoint.keep_last=2", "watchdog.save_floor_s=5")
    try:
        before, w = wait_for_a_write(tmp_path / "job", ck, proc)
        writer, tree = psutil.Process(w["pid"]), run_tree(proc)
        writer.suspend()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert_all_gone(tree + [writer], within=10)
    said = re.search(rf"checkpoint  the step-{w['step']} checkpoint's background write did not end within (\d+) s "
                     rf"of signal {int(signal.SIGTERM)}: abandoned; latest still names the previous checkpoint", out)
    assert said and int(said[1]) < 30, out[-3000:]  # the save's bound: 5 x the last write, at least 5 s
    last = max(losses(tmp_path / "job"))
    assert latest(ck) == f"iter_{last + 1:07d}" and complete(ck, latest(ck), engine)  # the stop's own save
    assert not (ck / f"iter_{w['step']:07d}.partial").exists() and not (ck / f"iter_{w['step']:07d}").exists()


@pytest.mark.parametrize("engine", ENGINES)
def test_saves_during_a_write_wait_or_skip(tmp_path, engine):
    """Saving every step, each save comes while the previous is written: `wait` saves them
    all, `skip` skips and says so. (That a background checkpoint resumes with the
    uninterrupted run's losses is the layout tests' below: the writer is the same.)"""
    # ten saves each, so that one comes during a write even on a loaded machine (whose
    # writes may keep pace with its steps for a while: 5 saves once met no write in CI)
    base = [f"engine={engine}", *MEDIUM, "train.steps=10", "checkpoint.save_interval=1"]
    out = {}
    for busy in ("wait", "skip"):
        done = subprocess.run([sys.executable, str(REPO / "launch.py"), "tracking=off", f"job_dir={tmp_path / busy}",
                               "train.warmup_steps=1", *base, f"checkpoint.save={tmp_path / (busy + '_ck')}",
                               f"checkpoint.async_busy={busy}"], cwd=tmp_path, capture_output=True, text=True,
                              timeout=400)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        out[busy] = done.stdout
    waited = [l for l in out["wait"].splitlines() if "checkpoint's background write (checkpoint.async_busy=wait)" in l]
    skipped = [l for l in out["skip"].splitlines() if "not saved: the step-" in l]
    assert waited and not [l for l in out["wait"].splitlines() if "not saved" in l], out["wait"][-3000:]
    assert skipped and all(l.endswith("is still being written (checkpoint.async_busy=skip)") for l in skipped)
    kept = sorted(p.name for p in (tmp_path / "wait_ck").iterdir() if p.name.startswith("iter_"))
    assert kept == [f"iter_{s:07d}" for s in range(1, 11)]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_stalled_writer_is_found_by_the_watchdog(tmp_path, engine):
    ck = tmp_path / "ck"
    proc = start(tmp_path, "job", f"engine={engine}", *MEDIUM, "train.steps=4000", f"checkpoint.save={ck}",
                 "checkpoint.save_interval=3", "checkpoint.async_busy=skip", "checkpoint.keep_last=2",
                 "watchdog.save_floor_s=8")  # a write's bound; starting keeps its own (a loaded machine is slow)
    try:
        _, w = wait_for_a_write(tmp_path / "job", ck, proc)
        writer, tree = psutil.Process(w["pid"]), run_tree(proc)
        writer.suspend()
        stopped = time.time()
        out, _ = proc.communicate(timeout=120)
        took = time.time() - stopped
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out[-3000:]
    assert took < 8 + 30, f"the job took {took:.0f} s to stop"
    hang = [l for l in out.splitlines() if l.startswith("hang        rank ")]
    assert len(hang) == 1 and f"in its background write of the step-{w['step']} checkpoint" in hang[0], out[-3000:]
    assert "while writing a checkpoint in the background" in hang[0]
    assert_all_gone(tree + [writer], within=10)
    assert (tmp_path / "job" / "stacks" / "rank_00000.txt").stat().st_size > 0


# Every layout and ZeRO form a background save writes: saved mid-run, resumed in a new
# launch at the same layout, the losses equal the uninterrupted run's at every step.
# (DP=2 at ZeRO 0 resumes in the wait-or-skip test, at ZeRO-1 on another layout below.)
LAYOUTS = {
    "megatron_tp2_sp": ["+experiment=tiny_llama_tp2", "parallel.sp=true"],
    "megatron_pp2_vpp2": ["+experiment=tiny_llama_pp2", "parallel.vpp=2"],
    "megatron_ep2": ["+experiment=tiny_mixtral_cpu"],
    "deepspeed_zero3": ["engine=deepspeed", "zero=stage3"],
    "deepspeed_zero2_offload": ["engine=deepspeed", "zero=stage2", "zero.offload_optimizer=true"],
}


def launch_ok(tmp_path: Path, name: str, *overrides) -> dict[int, float]:
    done = subprocess.run([sys.executable, str(REPO / "launch.py"), "tracking=off", f"job_dir={tmp_path / name}",
                           "train.warmup_steps=1", *overrides], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return losses(tmp_path / name)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_a_background_checkpoint_resumes_exactly_at_every_layout(tmp_path, name):
    ck, layout = tmp_path / "ck", LAYOUTS[name]
    whole = launch_ok(tmp_path, "whole", *layout, "train.steps=6", f"checkpoint.save={ck}",
                      "checkpoint.save_interval=2", "checkpoint.async_save=true")
    (ck / "latest").write_text("iter_0000002\n")
    resumed = launch_ok(tmp_path, "resumed", *layout, "train.steps=6", f"checkpoint.load={ck}")
    assert sorted(resumed) == [2, 3, 4, 5] and all(resumed[s] == whole[s] for s in resumed), (resumed, whole)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_background_checkpoint_resumes_at_another_layout(tmp_path, engine):
    """Resharding: a background save of a 2-process run resumes on one process (DeepSpeed:
    through its universal form) and follows the uninterrupted run."""
    ck = tmp_path / "ck"
    layout = ["zero=stage1"] + (["engine=deepspeed"] if engine == "deepspeed" else [])
    whole = launch_ok(tmp_path, "whole", *layout, "train.steps=8", f"checkpoint.save={ck}",
                      "checkpoint.save_interval=4", "checkpoint.async_save=true")
    (ck / "latest").write_text("iter_0000004\n")
    resumed = launch_ok(tmp_path, "resumed", *layout, "cluster.gpus_per_node=1", "train.steps=8",
                        f"checkpoint.load={ck}")
    assert sorted(resumed) == [4, 5, 6, 7]
    assert [resumed[s] for s in resumed] == pytest.approx([whole[s] for s in resumed], rel=2e-6)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_disk_that_fills_during_a_background_write_says_so_and_keeps_latest(tmp_path, engine):
    from test_reliability import small_file_system

    with small_file_system(tmp_path / "small", "8m") as small:
        ck = small / "ck"
        proc = start(tmp_path, "job", f"engine={engine}", "train.steps=400", f"checkpoint.save={ck}",
                     "checkpoint.save_interval=100", "checkpoint.keep_last=1", "checkpoint.async_save=true")
        deadline = time.time() + 240
        while time.time() < deadline and latest(ck) is None:
            time.sleep(0.05)
        first = latest(ck)
        with open(small / "ballast", "wb") as f:  # fill what is left
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError:
                pass
        out, _ = proc.communicate(timeout=300)
        assert latest(ck) == first and complete(ck, first, engine)
    assert proc.returncode == 1, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    lines = [line for line in out.splitlines() if "no space left on" in line]
    assert lines and f"no space left on {ck}: a checkpoint needs about " in lines[0] \
        and "The previous checkpoint is intact." in lines[0], out[-3000:]

"""Hostile paths and stuck agents, tried with real files: symlinks out of a checkpoint root,
FIFOs, devices, /proc, index entries outside a Hugging Face folder, sizes a config.json
invents, overrides that make no sense, and a SIGSTOPped agent. Each is refused in one line
with exit 2 before anything starts, or, for the stopped agent, ends within its bound,
naming the node. Files outside the test's own folders are checksummed before and after:
none is written, truncated or deleted."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from checkpoint_payloads import Payload, env_without_mlflow, latest
from conftest import REPO, kill_process_tree, run_torchrun_job

pytestmark = pytest.mark.slow  # trains one checkpoint, converts, and runs a job to stop its agent


def run(args: list[str], cwd: Path, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, env=env_without_mlflow(), capture_output=True, text=True, timeout=timeout)


def launch(tmp: Path, *args, timeout=120) -> subprocess.CompletedProcess:
    return run([sys.executable, str(REPO / "launch.py"), "tracking=off", f"job_root={tmp / 'jobs'}",
                "train.warmup_steps=1", *args], tmp, timeout)


def convert(tmp: Path, *args) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "gridwright.adapters.convert", *args], tmp)


def fingerprint(*roots: Path) -> dict[str, str]:
    """sha256 of every file under `roots` (regular files only; links are not followed)."""
    out = {}
    for root in roots:
        for path in sorted([root] if root.is_file() else root.rglob("*")):
            if path.is_file() and not path.is_symlink():
                out[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def refused_before_start(result, *parts: str) -> str:
    """Exit 2, no traceback, one refusal line naming `parts`; returns that line."""
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [l for l in result.stderr.splitlines() if all(p in l for p in parts)]
    assert len(lines) == 1, result.stderr[-3000:]
    assert len(result.stderr.splitlines()) <= 3, result.stderr  # the header, the line, nothing else
    return lines[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A real Megatron-Core checkpoint root with two iterations (steps 1 and 2)."""
    tmp = tmp_path_factory.mktemp("saved")
    result = launch(tmp, "train.steps=2", "checkpoint.save_interval=1", f"checkpoint.save={tmp / 'ck'}",
                    timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp / "ck"


@pytest.fixture
def victim(tmp_path) -> Path:
    """A directory outside every job folder, with a file and a sub-directory a link may point at."""
    v = tmp_path / "outside"
    (v / "dir").mkdir(parents=True)
    (v / "file.txt").write_text("not gridwright's\n")
    (v / "dir" / "keep.bin").write_bytes(os.urandom(64))
    return v


def _lock_link(ck, v):
    (ck / ".writer.lock").unlink(missing_ok=True)
    (ck / ".writer.lock").symlink_to(v / "file.txt")


def _lock_fifo(ck, v):
    (ck / ".writer.lock").unlink(missing_ok=True)
    os.mkfifo(ck / ".writer.lock")


def _latest_fifo(ck, v):
    (ck / "latest").unlink()
    os.mkfifo(ck / "latest")


def _latest_passwd(ck, v):
    (ck / "latest").unlink()
    (ck / "latest").symlink_to("/etc/passwd")


def _latest_zero(ck, v):
    (ck / "latest").unlink()
    (ck / "latest").symlink_to("/dev/zero")


def _old_iteration_link(ck, v):
    shutil.rmtree(ck / "iter_0000001")
    (ck / "iter_0000001").symlink_to(v / "dir")


def _partial_link(ck, v):
    (ck / "iter_0000003.partial").symlink_to(v / "dir")


def _metadata_fifo(ck, v):
    (ck / "iter_0000002" / ".metadata").unlink()
    os.mkfifo(ck / "iter_0000002" / ".metadata")


# name -> (how to plant it, what the refusal names, whether a conversion reads the root)
PLANTS = {
    "symlinked .writer.lock": (_lock_link, [".writer.lock", "symbolic link"], False),
    "FIFO .writer.lock": (_lock_fifo, [".writer.lock", "FIFO"], False),
    "FIFO latest": (_latest_fifo, ["latest", "FIFO"], True),
    "latest -> /etc/passwd": (_latest_passwd, ["latest", "/etc/passwd"], True),
    "latest -> /dev/zero": (_latest_zero, ["latest", "/dev/zero"], True),
    "symlinked old iteration": (_old_iteration_link, ["iter_0000001", "symbolic link"], False),
    "symlinked .partial": (_partial_link, ["iter_0000003.partial", "symbolic link"], False),
    "FIFO .metadata": (_metadata_fifo, [".metadata", "FIFO"], True),
}


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_a_checkpoint_root_entry_that_is_not_a_plain_file_is_refused_before_start(plant, saved, victim, tmp_path):
    put, parts, converts = PLANTS[plant]
    ck = tmp_path / "ck"
    shutil.copytree(saved, ck, symlinks=True)
    put(ck, victim)
    before = fingerprint(victim, Path("/etc/passwd"))
    # A resume that saves into the same root (retention on): refused before anything starts.
    result = launch(tmp_path, "train.steps=4", f"checkpoint.load={ck}", f"checkpoint.save={ck}",
                    "checkpoint.keep_last=1", timeout=60)
    line = refused_before_start(result, *parts)
    assert "root:" not in result.stdout + result.stderr  # no file's content is echoed
    assert not (tmp_path / "jobs").exists()
    if converts:
        out = tmp_path / "hf"
        converted = convert(tmp_path, "megatron-to-hf", "--megatron", str(ck), "--out", str(out))
        assert converted.returncode == 2, converted.stderr[-3000:]
        assert "Traceback" not in converted.stderr and len(converted.stderr.splitlines()) == 1, converted.stderr
        assert not out.exists()
    assert fingerprint(victim, Path("/etc/passwd")) == before, line
    assert (victim / "file.txt").read_text() == "not gridwright's\n"


def test_a_pickle_under_any_name_is_scanned_before_start(saved, tmp_path):
    """A later reader may open a file whatever its name: the pre-start scan reads them all."""
    import torch

    ck, marker = tmp_path / "ck", tmp_path / "marker"
    shutil.copytree(saved, ck)
    torch.save({"planted": Payload(marker, 0)}, latest(ck) / "common.pt.orig")
    result = launch(tmp_path, "train.steps=4", f"checkpoint.load={ck}", timeout=60)
    refused_before_start(result, "common.pt.orig", "could run code: refused")
    assert not marker.exists()


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("hf")
    made = run([sys.executable, "-m", "gridwright.adapters.tiny_models", "llama", str(tmp / "tiny")], tmp)
    assert made.returncode == 0, made.stderr[-2000:]
    return tmp / "tiny"


def _index(folder: Path, shard: str) -> None:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: shard for n in names}}))


def _dotdot(folder, v):
    _index(folder, "../outside/model.safetensors")
    shutil.move(folder / "model.safetensors", v / "model.safetensors")


def _absolute(folder, v):
    _index(folder, "/etc/passwd")


def _proc(folder, v):
    _index(folder, "/proc/self/environ")


def _link_out(folder, v):
    _index(folder, "model.safetensors")
    shutil.move(folder / "model.safetensors", v / "model.safetensors")
    (folder / "model.safetensors").symlink_to(v / "model.safetensors")


def _fifo_shard(folder, v):
    (folder / "model.safetensors").unlink()
    os.mkfifo(folder / "model.safetensors")


HF_PLANTS = {"../ entry": (_dotdot, "../outside"), "absolute entry": (_absolute, "/etc/passwd"),
             "/proc entry": (_proc, "/proc/self/environ"), "link out of the folder": (_link_out, "symbolic link"),
             "FIFO shard": (_fifo_shard, "FIFO")}


@pytest.mark.parametrize("plant", sorted(HF_PLANTS))
def test_a_hugging_face_folder_is_read_only_inside_itself(plant, tiny_hf, tmp_path):
    put, named = HF_PLANTS[plant]
    folder = tmp_path / "hf"  # beside `outside`, which the plants point into
    shutil.copytree(tiny_hf, folder)
    (tmp_path / "outside").mkdir()
    put(folder, tmp_path / "outside")
    before = fingerprint(tmp_path / "outside", Path("/etc/passwd"))
    out = tmp_path / "ck"
    result = convert(tmp_path, "hf-to-megatron", "--hf", str(folder), "--out", str(out))
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(result.stderr.splitlines()) == 1 and named in result.stderr, result.stderr
    assert "refused" in result.stderr and "root:" not in result.stderr
    assert not out.exists()
    assert fingerprint(tmp_path / "outside", Path("/etc/passwd")) == before


def test_a_hugging_face_cache_snapshot_still_converts(tiny_hf, tmp_path):
    """The Hub's cache links each snapshot file to its blob store: those links are the
    folder's own files."""
    repo = tmp_path / "models--tiny--llama"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for f in tiny_hf.iterdir():
        shutil.copy(f, blobs / f.name)
        (snapshot / f.name).symlink_to(Path("../../blobs") / f.name)
    result = convert(tmp_path, "hf-to-megatron", "--hf", str(snapshot), "--out", str(tmp_path / "ck"))
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("field, value", [("num_hidden_layers", 10**6), ("hidden_size", 10**9),
                                          ("num_attention_heads", 10**7)])
def test_sizes_a_config_json_invents_are_refused_from_the_file_headers(field, value, tiny_hf, tmp_path):
    folder = tmp_path / "hf"
    shutil.copytree(tiny_hf, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, **{field: value})))
    started = time.monotonic()
    result = convert(tmp_path, "hf-to-megatron", "--hf", str(folder), "--out", str(tmp_path / "ck"))
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(result.stderr.splitlines()) == 1 and f"{field}={value}" in result.stderr, result.stderr
    assert "does not match its safetensors files" in result.stderr
    assert time.monotonic() - started < 60  # a process start and the headers, not 10^6 layers of work


@pytest.mark.parametrize("override, named", [
    ("train.warmup_steps=-3", "train.warmup_steps=-3"),
    ("job_root=", "job_root=''"),
    ("checkpoint.save=/", "checkpoint.save=/"),
    ("job_dir=/etc", "job_dir=/etc"),
    ("tracking.uri=sqlite:///{tmp}/missing/mlflow.db", "does not exist"),
])
def test_overrides_that_make_no_sense_are_refused_in_one_line(override, named, tmp_path):
    override = override.format(tmp=tmp_path)
    cmd = [sys.executable, str(REPO / "launch.py"), override]
    if not override.startswith("job_root"):
        cmd.append(f"job_root={tmp_path / 'jobs'}")
    if not override.startswith("tracking"):
        cmd.append("tracking=off")
    before = sorted(os.listdir("/"))
    result = run(cmd, tmp_path, timeout=60)
    line = refused_before_start(result, named)
    assert "Fix:" in line, line
    assert sorted(os.listdir("/")) == before
    assert not (tmp_path / "jobs").exists() and not (tmp_path / "missing").exists()
    assert sorted(os.listdir(tmp_path)) == []  # job_root='' put nothing in the launch directory either



def test_a_stopped_agent_ends_the_job_within_its_bound_naming_the_node(tmp_path):
    from gridwright.launchers.local import AGENT_STOPPED_BOUND_S

    db = tmp_path / "mlflow.db"
    cmd = [sys.executable, str(REPO / "launch.py"), f"job_root={tmp_path / 'jobs'}", f"tracking.uri=sqlite:///{db}",
           "train.steps=100000", "train.warmup_steps=1"]
    with open(tmp_path / "out.txt", "w") as out, open(tmp_path / "err.txt", "w") as err:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env_without_mlflow(), stdout=out, stderr=err,
                                start_new_session=True)
    try:
        agent = _agent_once_training(proc, tmp_path / "jobs")
        agent.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        proc.wait(timeout=AGENT_STOPPED_BOUND_S + 60)
        took = time.monotonic() - stopped
    finally:
        if proc.poll() is None:
            kill_process_tree(proc.pid)
    err = (tmp_path / "err.txt").read_text()
    assert proc.returncode == 1, err[-3000:]
    assert AGENT_STOPPED_BOUND_S <= took <= AGENT_STOPPED_BOUND_S + 45, took
    assert f"the agent on node 0 ({os.uname().nodename}, pid {agent.pid}) has been stopped" in err, err[-2000:]
    assert not psutil.pid_exists(agent.pid) or psutil.Process(agent.pid).status() == psutil.STATUS_ZOMBIE
    with sqlite3.connect(db) as con:
        assert con.execute("SELECT status FROM runs").fetchall() == [("FAILED",)]


def _agent_once_training(proc: subprocess.Popen, jobs: Path, timeout: float = 240) -> psutil.Process:
    """The launcher's agent, once the job's metrics show a step."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the job ended before its agent was stopped"
        metrics = list(jobs.rglob("metrics.jsonl"))
        if metrics and metrics[0].stat().st_size > 0:
            agents = [p for p in psutil.Process(proc.pid).children(recursive=True) if _is_agent(p)]
            if agents:
                return agents[0]
        time.sleep(0.5)
    raise AssertionError("the job never trained a step")


def _is_agent(p: psutil.Process) -> bool:
    try:
        return "gridwright.launchers.agent" in " ".join(p.cmdline())
    except psutil.Error:  # a short-lived child, gone already
        return False


def test_a_link_planted_as_a_coming_save_is_unlinked_and_training_goes_on(victim, tmp_path):
    """Planted after the pre-start check, where a later save will stage its files: the save
    removes the link (never what it points to) and the run finishes with every step."""
    ck = tmp_path / "ck"
    cmd = [sys.executable, str(REPO / "launch.py"), "tracking=off", f"job_root={tmp_path / 'jobs'}",
           "train.warmup_steps=1", "train.steps=40", "checkpoint.save_interval=1", "checkpoint.keep_last=1",
           f"checkpoint.save={ck}"]
    before = fingerprint(victim)
    with open(tmp_path / "out.txt", "w") as out:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env_without_mlflow(), stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not (ck / "latest").exists():
        assert proc.poll() is None, (tmp_path / "out.txt").read_text()[-3000:]
        time.sleep(0.05)
    (ck / "iter_0000040.partial").symlink_to(victim / "dir")
    (ck / "iter_0000040").symlink_to(victim / "dir")
    assert proc.wait(timeout=240) == 0, (tmp_path / "out.txt").read_text()[-3000:]
    assert (ck / "latest").read_text().strip() == "iter_0000040"
    assert not (ck / "iter_0000040").is_symlink() and (ck / "iter_0000040" / "metadata.json").is_file()
    assert fingerprint(victim) == before and sorted(os.listdir(victim / "dir")) == ["keep.bin"]


def test_the_workers_own_resume_refuses_a_fifo_latest_in_one_line(saved, tmp_path):
    """A torchrun job has no pre-start check on the launching machine: the workers read
    `latest` themselves, and refuse it without blocking."""
    ck = tmp_path / "ck"
    shutil.copytree(saved, ck)
    result = run_torchrun_job(tmp_path, "train.steps=4", f"checkpoint.load={ck}",
                              before_run=lambda: _latest_fifo(ck, None), timeout=120)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    refusals = [l for l in result.stderr.splitlines() if l.startswith("error: ")]
    assert refusals == [f"error: {ck / 'latest'} is a FIFO, not a regular file: refused. "
                        "Fix: point checkpoint.load at an intact checkpoint directory."], result.stderr[-3000:]
    assert "Traceback" not in result.stderr

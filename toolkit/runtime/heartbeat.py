"""Each rank's sign of life, in the job directory: what a node's agent watches for hangs.

A rank writes `heartbeats/<its agent's token>/rank_NNNNN.json` (atomically) as it moves between phases
(starting, training, evaluating, saving, finishing), when a background checkpoint write begins
and ends, and after its steps, at most once a second:
its step, the time, and the median of its recent step times. It also arms faulthandler
so that SIGUSR1 dumps every thread's Python stack into `stacks/rank_NNNNN.txt` without
the interpreter's help (a rank blocked inside a collective still answers). The agent
(`launchers.watchdog`) reads these files; torch-free, so the agent need not import torch.
"""
from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import statistics
import time
from pathlib import Path

from ..basics.atomic_io import write_text_atomic

HEARTBEAT_DIR = "heartbeats"
STACKS_DIR = "stacks"
STACK_SIGNAL = signal.SIGUSR1
_RECENT = 8  # step times the median is taken over
_EVERY_S = 1.0  # the most often a rank writes while training


def heartbeat_file(job_dir: Path, rank: int, token: str | None) -> Path:
    """One folder per node agent (its run token): an agent reads its own ranks' files only,
    not every node's on a shared file system."""
    return Path(job_dir) / HEARTBEAT_DIR / (token or "local")[:12] / f"rank_{rank:05d}.json"


def stacks_file(job_dir: Path, rank: int) -> Path:
    return Path(job_dir) / STACKS_DIR / f"rank_{rank:05d}.txt"


class Heartbeat:
    """One rank's heartbeat file, and its stack dump on SIGUSR1."""

    def __init__(self, job_dir: Path, rank: int, token: str | None):
        self.path = heartbeat_file(job_dir, rank, token)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.record = {"rank": rank, "pid": os.getpid(), "host": socket.gethostname(), "token": token,
                       "phase": "starting", "step": None, "recent_step_s": None, "time": time.time()}
        self._times: list[float] = []
        self._written = 0.0
        stacks = stacks_file(job_dir, rank)
        stacks.parent.mkdir(parents=True, exist_ok=True)
        self._stacks = open(stacks, "w")  # kept open: faulthandler writes to its descriptor
        faulthandler.register(STACK_SIGNAL, file=self._stacks, all_threads=True)
        self._write()

    def phase(self, name: str, bound_s: float | None = None) -> None:
        """Enter phase `name`; `bound_s`: how long it may take (else the watchdog's own)."""
        self.record.update(phase=name, bound_s=bound_s)
        self._write()

    def writing(self, step: int, pid: int | None, bound_s: float) -> None:
        """A background write of the checkpoint of `step` began, in process `pid` (None: this
        rank has nothing to write); the rank trains on meanwhile, and the watchdog calls the
        write stalled after `bound_s` (a stalled writer never stops the steps)."""
        self.record["writing"] = {"step": step, "pid": pid, "since": time.time(), "bound_s": bound_s}
        self._write()

    def written(self) -> None:
        """The background write was published, failed or abandoned."""
        self.record.pop("writing", None)
        self._write()

    def step_done(self, step: int, step_time_s: float) -> None:
        self._times = (self._times + [step_time_s])[-_RECENT:]
        self.record.update(phase="training", step=step, recent_step_s=statistics.median(self._times))
        if time.time() - self._written >= _EVERY_S:
            self._write()

    def _write(self) -> None:
        self.record["time"] = self._written = time.time()
        write_text_atomic(self.path, json.dumps(self.record))


FIRST_SAVE_BYTES_PER_S = 50e6  # a slow network file system: the first save's assumed speed
SAVE_SLACK = 5.0  # a save may take this many times the previous one before it is stuck


def save_bound_s(checkpoint_bytes: int, previous_save_s: float | None, floor_s: float) -> float:
    """How long a save may take before the watchdog calls the rank stuck: from the
    previous save's time (same size, this disk's speed), else from the checkpoint's size
    at a slow disk's speed, never below `floor_s`."""
    if previous_save_s is not None:
        return max(floor_s, SAVE_SLACK * previous_save_s)
    return max(floor_s, checkpoint_bytes / FIRST_SAVE_BYTES_PER_S)


class _NoProgress:
    """What an engine's loop reports to when nobody listens (tests, tools)."""

    def phase(self, name: str, bound_s: float | None = None) -> None:
        pass

    def writing(self, step: int, pid: int | None, bound_s: float) -> None:
        pass

    def written(self) -> None:
        pass

    def step_done(self, step: int, step_time_s: float) -> None:
        pass


NO_PROGRESS = _NoProgress()


def read_heartbeats(job_dir: Path, token: str | None) -> dict[int, dict]:
    """The last heartbeat of each rank of one node agent (a file caught mid-replace is
    skipped: the next poll has it)."""
    out = {}
    for file in sorted(heartbeat_file(job_dir, 0, token).parent.glob("rank_*.json")):
        try:
            rec = json.loads(file.read_text())
        except (OSError, ValueError):
            continue
        out[rec["rank"]] = rec
    return out

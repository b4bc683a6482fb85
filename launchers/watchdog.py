"""The agent's hang finder: a rank whose step stops advancing stops the job, with its stacks.

A collective timeout alone lets a stopped rank hold a job for its whole length (torch's
default is 30 minutes on gloo) and says nothing of who stopped. Here a thread of each
node's agent reads its ranks' heartbeats (`gridwright.runtime.heartbeat`) once a second. A rank
is hung when its heartbeat is older than its bound:

* while training: `watchdog.stall_factor` x the median of its recent step times, and at
  least `watchdog.min_stall_s` (a profiled or evaluating step is slower, not stopped);
* while starting (building, compiling, loading a checkpoint), evaluating, writing a
  profiler trace or finishing: `watchdog.phase_timeout_s`, as those take minutes
  on large models;
* while saving, or writing a checkpoint in the background as it trains on: the rank's own
  bound, from the checkpoint's size or the previous save's time (`heartbeat.save_bound_s`).

Then every rank of this node is asked for its Python stacks (SIGUSR1, faulthandler), the
finding is written to `hangs/<host>-<token>.json` and printed as one block naming the rank
and the step, and this node's workers are killed: torchrun sees them fail and the job
ends, FAILED in MLflow (or, with `launcher.max_restarts`, restarts from its checkpoint). A rank that did not dump its stacks (stopped, or stuck outside Python) is named
as such. Anchors: torch's NCCL watchdog and flight recorder, NVIDIA's resiliency
extension (its in-job heartbeat monitor); this one needs neither NCCL nor a CUDA device.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import psutil

from gridwright.basics.atomic_io import write_text_atomic
from gridwright.runtime.heartbeat import STACK_SIGNAL, read_heartbeats, stacks_file

from .peer_agents import PeerAgents

HANGS_DIR = "hangs"  # one finding per node agent: hangs/<host>-<token>.json
_POLL_S = 1.0
_DUMP_WAIT_S = 3.0


def bound_s(rec: dict, w) -> float:
    """How long this rank may go without a heartbeat, under the `watchdog` config `w`."""
    if rec.get("bound_s") is not None:  # the rank's own, for this phase (a save's: heartbeat.save_bound_s)
        return rec["bound_s"]
    if rec["phase"] == "training" and rec.get("recent_step_s") is not None:
        return max(w.min_stall_s, w.stall_factor * rec["recent_step_s"])
    return w.phase_timeout_s


def _alive(rec: dict) -> psutil.Process | None:
    try:
        proc = psutil.Process(rec["pid"])
        return proc if proc.status() != psutil.STATUS_ZOMBIE else None
    except psutil.Error:
        return None


def _status(rec: dict) -> str:
    try:
        return psutil.Process(rec["pid"]).status()
    except psutil.Error:
        return "gone"


WRITING = "writing a checkpoint in the background"


def as_judged(rec: dict, w) -> dict:
    """The heartbeat as the watchdog judges it: a background checkpoint write older than
    its bound (the rank's, as for a save: `heartbeat.save_bound_s`) counts as a phase of its
    own that made no progress since it began, whatever the rank's steps do meanwhile (a
    stalled writer never stops them)."""
    writing = rec.get("writing")
    bound = (writing or {}).get("bound_s", w.phase_timeout_s)
    if writing and time.time() - writing["since"] > bound:
        return rec | {"phase": WRITING, "time": writing["since"], "bound_s": bound, "step": writing["step"]}
    return rec


def late_ranks(beats: dict[int, dict], watchdog, now: float) -> dict[int, float]:
    """The live ranks whose heartbeat (or background write) is older than its bound, with its age."""
    judged = {r: as_judged(rec, watchdog) for r, rec in beats.items()}
    return {r: now - rec["time"] for r, rec in judged.items() if now - rec["time"] > bound_s(rec, watchdog)}


def finding_for(beats: dict[int, dict], late: dict[int, float], ranks: dict[int, dict], watchdog) -> dict:
    """Who is to blame. A rank blocked in a collective waits for the one that stopped, and
    both stopped advancing at the same step; the one that did not answer the stack dump
    (stopped, or stuck outside Python) is the suspect first, then the rank furthest
    behind, then the one silent longest."""
    def behind(r: int):
        step = beats[r]["step"] if beats[r]["step"] is not None else -1
        return (ranks[r]["dumped"], step, -late.get(r, 0.0))

    suspect = min(beats, key=behind)
    rec = as_judged(beats[suspect], watchdog)
    silent = max(late.get(suspect, 0.0), time.time() - rec["time"] - _DUMP_WAIT_S)
    return {"rank": suspect, "step": rec["step"], "phase": rec["phase"], "host": rec["host"],
            "silent_s": round(silent, 1), "bound_s": round(bound_s(rec, watchdog), 1),
            "recent_step_s": rec.get("recent_step_s"), "factor": watchdog.stall_factor,
            "min_stall_s": watchdog.min_stall_s, "ranks": {str(r): info for r, info in ranks.items()}}


def describe(finding: dict, ranks: dict[int, dict], job_dir: Path) -> list[str]:
    """The block printed when a hang stops the job."""
    step = "before its first step" if finding["step"] is None else f"after step {finding['step']}"
    if finding["phase"] == WRITING:
        step = f"in its background write of the step-{finding['step']} checkpoint"
    if finding["phase"] == "training":
        why = (f"{finding['bound_s']:g} s: {finding['factor']:g} x its recent step of {finding['recent_step_s']:.3g} s,"
               f" at least {finding['min_stall_s']:g} s")
    else:
        why = f"{finding['bound_s']:g} s while {finding['phase']}"
    lines = [f"hang        rank {finding['rank']} made no progress for {finding['silent_s']:g} s {step} "
             f"(bound {why}); stopping the job"]
    for rank, info in sorted(ranks.items()):
        stacks = f"stacks in {info['stacks']}" if info["dumped"] else "no stack dump (it did not answer SIGUSR1)"
        at = "-" if info["step"] is None else info["step"]
        lines.append(f"            rank {rank}: step {at}, {info['phase']}, process {info['state']}; {stacks}")
    lines.append(f"            the finding is in {job_dir / HANGS_DIR}")
    return lines


def _dump_stacks(job_dir: Path, beats: dict[int, dict]) -> dict[int, dict]:
    sizes = {}
    for rank, rec in beats.items():
        file = stacks_file(job_dir, rank)
        sizes[rank] = file.stat().st_size if file.exists() else 0
        writer = (rec.get("writing") or {}).get("pid")
        for pid in (rec["pid"], writer) if writer else (rec["pid"],):  # the writer shares the rank's stacks file
            try:
                os.kill(pid, STACK_SIGNAL)
            except OSError:
                pass
    time.sleep(_DUMP_WAIT_S)
    out = {}
    for rank, rec in beats.items():
        file = stacks_file(job_dir, rank)
        out[rank] = {"step": rec["step"], "phase": rec["phase"], "pid": rec["pid"], "state": _status(rec),
                     "stacks": str(file), "dumped": file.exists() and file.stat().st_size > sizes[rank]}
    return out


class Watchdog:
    """Started by the agent; `finding` is set once it has stopped this node's workers for a
    hang. It goes on watching: with `launcher.max_restarts`, torchrun starts new workers."""

    def __init__(self, job_dir: Path, cfg, token: str, node: int = 0, watch_peers: bool = False):
        self.job_dir, self.cfg, self.token = Path(job_dir), cfg, token
        self.finding: dict | None = None
        self.peers = PeerAgents(self.job_dir, node) if watch_peers else None
        self.lost_peer: dict | None = None
        self.polls_failed = 0  # polls that met an OSError or psutil.Error and were skipped
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="gridwright-watchdog", daemon=True)
    def start(self) -> "Watchdog":
        if self.cfg.watchdog.enabled:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self.peers is not None and self._thread.is_alive():
            self._thread.join(timeout=5)
            self.peers.beat(ended=True)  # this agent's end is no loss to its peers

    def _mine(self) -> dict[int, dict]:
        """This node's live workers: heartbeats under this agent's token whose process is
        one of this agent's descendants (a dead rank is torchrun's to report, and a pid
        written in a file is never signalled unless it is ours)."""
        try:
            ours = {p.pid for p in psutil.Process().children(recursive=True)}
        except psutil.Error:
            return {}
        return {r: rec for r, rec in read_heartbeats(self.job_dir, self.token).items()
                if rec.get("pid") in ours and _alive(rec) is not None}

    def _watch(self) -> None:
        while not self._stop.wait(_POLL_S):
            try:
                beats = self._mine()
                late = late_ranks(beats, self.cfg.watchdog, time.time())
                if late:
                    self._stop_for(beats, late)
                if self.peers is not None:
                    self._watch_peers(beats)
            except (OSError, psutil.Error):  # /proc read while processes end (EBADF at a teardown): next poll
                self.polls_failed += 1

    def _watch_peers(self, beats: dict[int, dict]) -> None:
        self.peers.beat()
        lost = self.peers.lost_peer() if self.lost_peer is None else None
        if lost is None:
            return
        self.lost_peer = lost
        print(f"agent       {self.peers.record_loss(lost)}: ending this node's workers", file=sys.stderr, flush=True)
        for rec in beats.values():  # their collectives would wait for the lost node's ranks
            try:
                os.kill(rec["pid"], signal.SIGKILL)
            except OSError:
                pass

    def _stop_for(self, beats: dict[int, dict], late: dict[int, float]) -> None:
        ranks = _dump_stacks(self.job_dir, beats)
        finding = finding_for(beats, late, ranks, self.cfg.watchdog) | {"token": self.token, "detected_at": time.time()}
        write_text_atomic(self.job_dir / HANGS_DIR / f"{socket.gethostname()}-{self.token[:12]}.json",
                          json.dumps(finding, indent=1))
        self.finding = finding
        print("\n".join(describe(finding, ranks, self.job_dir)), file=sys.stderr, flush=True)
        for rec in beats.values():  # a stopped rank cannot be asked: the job has failed, end it now
            try:
                os.kill(rec["pid"], signal.SIGKILL)
            except OSError:
                pass


def findings(job_dir: Path, since: float = 0.0) -> list[dict]:
    """The watchdogs' findings in this job directory detected after `since`, earliest first."""
    out = []
    for path in sorted((Path(job_dir) / HANGS_DIR).glob("*.json")):
        try:
            found = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if found.get("detected_at", 0) >= since:
            out.append(found | {"file": str(path)})
    return sorted(out, key=lambda f: f["detected_at"])


def hang_summary(job_dir: Path, since: float = 0.0) -> str | None:
    """One line for the run's record (MLflow's error), when a watchdog stopped this job's
    workers after `since` (the first finding: on other nodes, ranks then wait for it)."""
    found = findings(job_dir, since)
    if not found:
        return None
    f = found[0]
    step = "before its first step" if f["step"] is None else f"after step {f['step']}"
    if f["phase"] == WRITING:
        step = f"in its background write of the step-{f['step']} checkpoint"
    return (f"hang: rank {f['rank']} on {f['host']} made no progress for {f['silent_s']:g} s {step} "
            f"(bound {f['bound_s']:g} s)")

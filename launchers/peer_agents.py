"""The agents of a multi-node job watch each other through the job directory.

A stopped (SIGSTOP, a debugger) or killed agent is not seen by its own watchdog, and its
workers may go on, finish and then wait for it as zombies: on Slurm the job step never
ends. So every agent of a job with more than one node writes `agents/node<K>.json` every
BEAT_S from its watchdog thread, and reads its peers'. A peer whose record has not changed
for SILENT_S (by this node's clock: no clock skew enters) and that did not say it ended is
lost: this agent names it, records it in `agents/lost.json`, and ends its own workers, so
that its torchrun fails and srun (`--kill-on-bad-exit=1`) ends the lost node's task too.

Only peers of this attempt are watched (a record started before this agent, minus
START_SLACK_S, is a previous attempt's, left by a requeue). A job directory that the nodes
do not share shows each agent only itself: nothing is watched, nothing is misread.
"""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from gridwright.basics.atomic_io import write_text_atomic

AGENTS_DIR = "agents"
LOST_FILE = "lost.json"
BEAT_S = 2.0
SILENT_S = 30.0  # 15 missed beats: far above a loaded node's scheduling delays
START_SLACK_S = 120.0  # agents of one attempt start within this of each other


class PeerAgents:
    def __init__(self, job_dir: Path, node: int):
        self.dir = Path(job_dir) / AGENTS_DIR
        self.node, self.count, self.started = node, 0, time.time()
        self._last_beat = float("-inf")
        self._seen: dict[int, tuple[int, float]] = {}  # node -> (its count, when it last changed here)

    def beat(self, ended: bool = False) -> None:
        now = time.monotonic()
        if not ended and now - self._last_beat < BEAT_S:
            return
        self._last_beat, self.count = now, self.count + 1
        record = {"node": self.node, "host": socket.gethostname(), "pid": os.getpid(), "count": self.count,
                  "started": self.started, "ended": ended}
        write_text_atomic(self.dir / f"node{self.node}.json", json.dumps(record))

    def lost_peer(self) -> dict | None:
        """The first peer silent for SILENT_S, as its last record plus `silent_s`, or None."""
        now = time.monotonic()
        for file in sorted(self.dir.glob("node*.json")):
            try:
                rec = json.loads(file.read_text())
                node, count = int(rec["node"]), int(rec["count"])
            except (OSError, ValueError, KeyError, TypeError):
                continue  # caught mid-replace: the next poll has it
            if node == self.node or rec.get("ended") or rec.get("started", 0) < self.started - START_SLACK_S:
                continue
            seen = self._seen.get(node)
            if seen is None or seen[0] != count:
                self._seen[node] = (count, now)
            elif now - seen[1] >= SILENT_S:
                return rec | {"silent_s": round(now - seen[1], 1)}
        return None

    def record_loss(self, peer: dict) -> str:
        """Write `agents/lost.json` and return the line that names the lost agent."""
        line = describe_loss(peer)
        write_text_atomic(self.dir / LOST_FILE, json.dumps(peer | {"seen_by": self.node, "line": line,
                                                                   "detected_at": time.time()}))
        return line


def describe_loss(peer: dict) -> str:
    return (f"the agent on node {peer['node']} ({peer['host']}, pid {peer['pid']}) has not been heard from for "
            f"{peer['silent_s']:g} s (stopped or dead)")


def loss_after(job_dir: Path, since: float = 0.0) -> str | None:
    """The recorded loss of an agent after `since`, as its line, or None."""
    try:
        rec = json.loads((Path(job_dir) / AGENTS_DIR / LOST_FILE).read_text())
    except (OSError, ValueError):
        return None
    return rec.get("line") if rec.get("detected_at", 0) >= since else None

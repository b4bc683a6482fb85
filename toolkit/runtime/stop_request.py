"""A stop asked for by SIGTERM or SIGINT, agreed by every rank at a step boundary.

A signal may reach one rank (`kill PID`), all of them (torchrun forwarding the launcher's
stop, Slurm's scancel or time limit) or reach them at different steps. Each rank only
records it; after every step the ranks take the maximum over the world, so all of them
stop after the same step and can save one checkpoint together.
"""
from __future__ import annotations

import signal

import torch
import torch.distributed as dist


class StopRequest:
    def __init__(self):
        self.signal: int | None = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._record)

    def _record(self, signum, frame) -> None:
        self.signal = self.signal or signum

    def agreed(self, device) -> int | None:
        """The signal any rank received (collective: every rank calls it after each step)."""
        flag = torch.tensor([self.signal or 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        value = int(flag.item())
        if value and self.signal is None:
            self.signal = value
        return value or None

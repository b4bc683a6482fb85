"""How long a collective may wait for its peers before torch.distributed raises."""
from __future__ import annotations

from datetime import timedelta


def collective_timeout(watchdog, backend: str) -> timedelta:
    """`watchdog.collective_timeout_s`, or by default `watchdog.phase_timeout_s` on every
    backend (torch's own: 10 minutes on NCCL, 30 on gloo). The agent's watchdog finds a
    stopped rank within a minute or so; the timeout is the backstop for what it cannot see
    (a rank on another node), and must not cut a save, load or compile the watchdog allows
    (ranks wait for the slowest in the collective after it)."""
    seconds = watchdog.collective_timeout_s
    return timedelta(seconds=watchdog.phase_timeout_s if seconds is None else seconds)
